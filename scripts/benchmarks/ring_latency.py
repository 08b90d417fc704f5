"""Round-trip latency of one request/reply over the TokenRing, by how the reader waits.

    .venv/bin/python scripts/benchmarks/ring_latency.py [N]

Echo host in another process (spawn) and on a thread; the reader waits either by polling the ring
(spin 1 ms, then sleeps backing off to 1 ms: what ane_draft/coreml_draft.py did) or on a pipe (one
byte per message: what mirror_mlx/drafts/host.py does). Last: the real DraftHost with a draft that does no
work, waited on synchronously and through the engine's asyncio path. Prints median and p90 in µs
and the load average (the machine is shared: compare rows of one run, not runs).
"""

import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

from mirror_mlx.drafts.host import DraftHost

from mirror_mlx.drafts.recipes import DraftRecipe
from mirror_mlx.drafts.api import Rollout
from mirror_mlx.drafts.ring import TokenRing

KW = dict(capacity=4, max_ints=256, max_floats=2)


def poll(ring: TokenRing, seq: int):
    start, delay = time.perf_counter(), 0.0
    while (msg := ring.get(seq)) is None:
        if time.perf_counter() - start > 1e-3:
            delay = min(1e-3, delay * 2 or 5e-6)
            time.sleep(delay)
    return msg


def echo(req_name, rep_name, how, rfd, wfd, n):
    req = TokenRing(name=req_name, create=False, track=False, **KW)
    rep = TokenRing(name=rep_name, create=False, track=False, **KW)
    for seq in range(1, n + 1):
        if how == "pipe":
            os.read(rfd, 1)
        msg = req.get(seq) if how == "pipe" else poll(req, seq)
        rep.put(2, msg.step, msg.ints)
        if how == "pipe":
            os.write(wfd, b"\1")


def round_trips(how: str, where: str, n: int) -> list[float]:
    req, rep = TokenRing(**KW), TokenRing(**KW)
    (a_r, a_w), (b_r, b_w) = os.pipe(), os.pipe()
    args = (req.name, rep.name, how, a_r, b_w, n)
    if where == "process":
        ctx = mp.get_context("spawn")
        os.set_inheritable(a_r, True), os.set_inheritable(b_w, True)
        peer = ctx.Process(target=_echo_fds, args=args)
    else:
        peer = threading.Thread(target=echo, args=args)
    peer.start()
    times = []
    for seq in range(1, n + 1):
        t0 = time.perf_counter()
        req.put(1, seq, [seq] * 64)
        if how == "pipe":
            os.write(a_w, b"\1")
            os.read(b_r, 1)
            rep.get(seq)
        else:
            poll(rep, seq)
        times.append(time.perf_counter() - t0)
    peer.join()
    req.close(), rep.close()
    return times[n // 10 :]  # drop warm-up


def _echo_fds(req_name, rep_name, how, rfd, wfd, n):  # spawn passes fd numbers; dup them in via /proc
    rfd2 = os.open(f"/proc/{os.getppid()}/fd/{rfd}", os.O_RDONLY)
    wfd2 = os.open(f"/proc/{os.getppid()}/fd/{wfd}", os.O_WRONLY)
    echo(req_name, rep_name, how, rfd2, wfd2, n)


class _Idle:
    vocab_size = 0

    def reset(self):
        pass

    def rollout(self, context, stems, gamma):
        return Rollout(windows=[[0] * gamma for _ in stems], forwards=0, tokens=0)


def idle_draft():
    return _Idle()


def host_round_trips(process: bool, asynchronous: bool, n: int) -> list[float]:
    import ring_latency  # the host imports the builder by module name (this file's folder is on its path)

    host = DraftHost(DraftRecipe(ring_latency.idle_draft), process=process)
    ctx, times = list(range(100)), []
    loop = asyncio.new_event_loop()
    for i in range(n):
        t0 = time.perf_counter()
        if asynchronous:
            host.post_rollout(ctx, [[1]], 7)
            loop.run_until_complete(host.windows(7))
        else:
            host.rollout(ctx, [[1]], 7)
        times.append(time.perf_counter() - t0)
    host.close()
    loop.close()
    return times[n // 10 :]


def show(name: str, times: list[float]) -> None:
    q = statistics.quantiles(times, n=10)
    print(f"{name:44s} median {1e6 * statistics.median(times):8.1f} µs   p90 {1e6 * q[-1]:8.1f} µs")


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print("load average:", open("/proc/loadavg").read().split()[:3])
    for where in ("process", "thread"):
        for how in ("poll", "pipe"):
            show(f"ring, {how} wait, echo {where}", round_trips(how, where, n))
    for process in (True, False):
        for asynchronous in (False, True):
            show(f"DraftHost {'process' if process else 'thread'}, {'asyncio' if asynchronous else 'sync'} wait",
                 host_round_trips(process, asynchronous, n))
    print("load average:", open("/proc/loadavg").read().split()[:3])
