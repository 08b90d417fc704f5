"""Ranks of a command on this machine, set up as `mlx.launch --backend ring` sets them up (a hostfile of
loopback ports in MLX_HOSTFILE, MLX_RANK), without the launcher process.

mlx.launch relays each rank's stdin and output through select loops that never block while a rank's
stdin pipe is open (a pipe is always writable), so the launcher keeps about a core busy for the whole
run: `mlx.launch -n 2 --backend ring -- sleep 5` takes 6-8 s of CPU. On a 2-core box that is half the
machine, taken from the ranks and the draft, so the measurements and the lossless tests start the ranks
directly. Users launch with mlx.launch (docs/across-macs.md); the tests of its signals still do.
"""

import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


def _ephemeral_ports() -> range:
    """The ports the system hands out for port 0 and outgoing connections (Linux's range, else IANA's)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(49152, 65536)


def free_ports(n: int) -> list[int]:
    """n consecutive free loopback ports (one per rank), from below the ephemeral range: a port the system hands
    out for another socket's outgoing connection cannot take one between this check and the ranks' bind."""
    eph = _ephemeral_ports()
    low, high = (10000, eph.start) if eph.start > 10000 + 2 * n else (eph.stop, 65536)
    rng = random.Random()
    while True:
        base = rng.randrange(low, high - n)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return [base + i for i in range(n)]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


@dataclass
class RankResult:
    returncode: int
    stdout: str
    stderr: str


def run_ranks(command: Sequence[str], n: int = 2, timeout: float = 600, env: Optional[dict] = None,
              cwd: Optional[Path] = None) -> list[RankResult]:
    """Run `command` as ranks 0..n-1 of one ring group on loopback and wait for all of them. A rank that
    fails stops the others (SIGTERM, as mlx.launch does); past `timeout` every rank is killed and
    TimeoutError raised. Returns each rank's exit status and output."""
    with tempfile.TemporaryDirectory(prefix="mirror-ranks-") as tmp:
        hostfile = Path(tmp, "hosts.json")
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        outs = [(open(Path(tmp, f"{r}.out"), "w+"), open(Path(tmp, f"{r}.err"), "w+")) for r in range(n)]
        base = dict(os.environ if env is None else env, MLX_HOSTFILE=str(hostfile))
        procs = [subprocess.Popen(list(command), env=dict(base, MLX_RANK=str(r)), cwd=cwd, stdin=subprocess.DEVNULL,
                                  stdout=o, stderr=e) for r, (o, e) in enumerate(outs)]
        deadline, stopping = time.monotonic() + timeout, False
        try:
            while any(p.poll() is None for p in procs):
                if not stopping and any(p.returncode not in (None, 0) for p in procs):
                    stopping = True
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGTERM)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{' '.join(command)} ran past {timeout:g} s on {n} ranks")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        results = []
        for p, (o, e) in zip(procs, outs):
            o.seek(0)
            e.seek(0)
            results.append(RankResult(p.returncode, o.read(), e.read()))
            o.close()
            e.close()
        return results


def rank0_json(command: Sequence[str], n: int = 2, timeout: float = 3000) -> dict:
    """Run `command` on n ranks (`run_ranks`) and return the JSON object rank 0 printed on a line of its own:
    how a benchmark script gets its 2-rank half. Any rank that failed, or no such line, is a RuntimeError
    with the ranks' stderr."""
    ranks = run_ranks(command, n, timeout)
    line = next((ln for ln in ranks[0].stdout.splitlines() if ln.startswith("{")), None)
    if line is None or any(r.returncode for r in ranks):
        tails = "\n".join(f"rank {i}: {r.stderr[-2000:]}" for i, r in enumerate(ranks))
        raise RuntimeError(f"the {n}-rank run printed no result:\n{tails}")
    return json.loads(line)
