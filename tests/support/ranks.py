"""mlx.launch of 2 ranks on loopback, as a terminal runs it (its own process group, SIGINT on, stdin open)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mirror_mlx.bench.ranks import free_ports
from tests.support.processes import descendants

ROOT = Path(__file__).resolve().parents[2]


def launcher() -> list[str]:
    """mlx.launch for 2 ranks on loopback, from a free port pair of its own (tests run side by side)."""
    return [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
            "--starting-port", str(free_ports(2)[0])]


def launched(command: list[str], **kwargs) -> subprocess.Popen:
    """mlx.launch running `command`, in a process group of its own as a terminal runs it, SIGINT on.

    Its stdin is a pipe that stays open with nothing written, as a terminal where no one types: mlx.launch
    polls stdin and hands what it reads to each rank's queue, so at /dev/null (or any stdin at its end) it
    spins through `Queue.put`, and a SIGINT that lands inside one leaves that queue's lock held: the
    launcher's thread for that rank blocks on it, and the launcher never exits."""
    keyboard, kwargs["stdin"] = os.pipe()[::-1]
    try:
        proc = subprocess.Popen(launcher() + ["--"] + command, start_new_session=True,
                                # a runner that started us in the background ignores SIGINT; Ctrl-C needs it back
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)
    finally:
        os.close(kwargs["stdin"])
    proc.keyboard = os.fdopen(keyboard, "wb")  # (closed with the Popen object)
    yield_the_core(proc.pid)
    return proc


def yield_the_core(launcher_pid: int, ranks: int = 2, within: float = 30.0) -> None:
    """Once mlx.launch has started its ranks, its own threads (the relay loops that never block) run at the
    lowest priority: they keep spinning, but only on time no rank and no other test wants. The ranks,
    started before, keep theirs."""
    deadline = time.monotonic() + within
    while len(descendants(launcher_pid)) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)
    renice(launcher_pid, 19)


def renice(pid: int, niceness: int) -> None:
    """Every thread of `pid` at `niceness` (Linux's priority is a thread's)."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)
        except OSError:  # a thread that just ended
            pass
