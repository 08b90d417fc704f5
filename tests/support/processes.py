"""Which processes a test left: a server's children, a launcher's descendants, those still running (Linux
/proc; pgrep on macOS)."""

import os
import subprocess
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process under `pid` now (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    if not Path("/proc").is_dir():  # macOS
        ps = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return [int(p) for p in ps.stdout.split()]
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def still_running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie counts as ended)."""
    out = []
    for p in pids:
        try:
            os.kill(p, 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{p}/stat")
        try:
            if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:
            continue
        out.append(p)
    return out


def orphans(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Those of `pids` still running after up to `timeout` s (multiprocessing's resource tracker exits once
    it sees its parent go)."""
    deadline = time.monotonic() + timeout
    while still_running(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return still_running(pids)

