"""CPU an idle server across ranks takes: `mirror-mlx serve` of the demo pair on 2 ranks of the ring backend on
loopback (mlx.launch), each process's CPU seconds over a wait with no request, then one request.

    .venv/bin/python scripts/benchmarks/idle_ranks.py [SECONDS]

A rank waiting in a collective keeps a core busy (MLX's ring backend polls its sockets); rank 0 of an idle
server tells the other ranks IDLE every 0.25 s and they sleep 0.2 s after each, so rank 1 should show about a
fifth of a core, rank 0 next to none. mlx.launch's own relay threads are listed apart (they never block).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            kids = [int(c) for c in (task / "children").read_text().split()]
            out += kids
            todo += kids
    return out


def main() -> None:
    wait = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    log = Path("/tmp/idle_ranks.log")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    keyboard, stdin = os.pipe()  # a stdin that stays open: at /dev/null mlx.launch spins harder
    with open(log, "w") as out:
        proc = subprocess.Popen([launcher, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "mirror_mlx",
                                 "serve", "--port", "0", "--mode", "mirror", "--kappa", "4", "--gamma", "3"],
                                stdin=keyboard, stdout=out, stderr=out, env=env, start_new_session=True)
    try:
        url = None
        while url is None:
            if proc.poll() is not None:
                raise SystemExit(log.read_text())
            url = next((line.split(" on ")[1].split()[0] for line in log.read_text().splitlines()
                        if " on http://" in line), None)
            time.sleep(0.2)
        ranks = {}
        for pid in tree(proc.pid):
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            for r in (0, 1):
                if f"MLX_RANK={r}".encode() in environ.split(b"\0") and b"mirror_mlx\0serve" in \
                        Path(f"/proc/{pid}/cmdline").read_bytes():
                    ranks[f"rank {r}"] = pid
        ranks["mlx.launch"] = proc.pid
        time.sleep(2.0)  # past the first request's settling
        before = {k: cpu_s(p) for k, p in ranks.items()}
        time.sleep(wait)
        used = {k: cpu_s(p) - before[k] for k, p in ranks.items()}
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        print(f"idle {wait:g} s: " + ", ".join(f"{k} {s:.2f} CPU s ({s / wait:.0%} of a core)" for k, s in used.items()))
        print(f"then one request: {time.perf_counter() - t0:.2f} s, {text!r}")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        os.close(stdin)


if __name__ == "__main__":
    main()
