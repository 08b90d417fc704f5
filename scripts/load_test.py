"""Load test for `mirror-mlx serve`: N concurrent streaming clients × M requests each, greedy.

Starts a server (the demo pair, or --serve's arguments) on a free loopback port (or uses --url),
runs every distinct request once from a single client (the reference, and the single-client
throughput), then all clients at once. Every concurrent reply must complete and equal its
single-client text (nothing lost, garbled or mixed between clients). Prints p50/p95 time to first
token and tokens/s, and exits non-zero on any mismatch or when the run outlives --deadline seconds.
With --baseline TREE it first runs the same test against the server of another source tree (an
older checkout) and prints the ratios, so both sides are measured back to back on one machine.

    .venv/bin/python scripts/load_test.py                # 16 clients × 4 requests
    .venv/bin/python scripts/load_test.py --baseline ../old --serve "--model build/stories-98M ..."
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import openai

OPENINGS = ["Once upon a time", "The little dog", "One day, Tom and his mom", "Lily found a shiny"]


@dataclass
class Outcome:
    text: str
    tokens: int
    ttft: float  # seconds from sending to the first non-empty text (queue wait included)
    seconds: float  # sending to the end of the stream
    decode_rate: float  # the engine's tokens/s for this request (x_mirror), queue and HTTP left out


def request(client: openai.OpenAI, model: str, i: int, max_tokens: int) -> Outcome:
    """Request i: opening i mod 4, a streamed chat reply or completion in turn (both share the engine)."""
    prompt = OPENINGS[i % len(OPENINGS)]
    chat = (i // len(OPENINGS)) % 2 == 0
    t0 = time.perf_counter()
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        stream = client.completions.create(prompt=prompt, **common)
    text, first, tokens, rate = [], None, 0, 0.0
    for chunk in stream:
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        if (chunk.model_extra or {}).get("x_mirror"):
            rate = chunk.model_extra["x_mirror"]["tokens_per_second"]
        piece = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) or ""
        if piece and first is None:
            first = time.perf_counter() - t0
        text.append(piece)
    return Outcome("".join(text), tokens, first or 0.0, time.perf_counter() - t0, rate)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def staged(tree: Path, into: Path) -> Path:
    """A copy of `tree`'s package laid out as an install lays it out (ane_draft, convert inside mirror_mlx)."""
    shutil.copytree(tree / "mirror_mlx", into / "mirror_mlx", symlinks=True)
    for sub in ("ane_draft", "convert"):
        if (tree / sub).is_dir() and not (into / "mirror_mlx" / sub).exists():
            (into / "mirror_mlx" / sub).symlink_to(tree / sub)
    return into


def start_server(max_queue: int, serve_args: list[str], tree: Path | None) -> tuple[subprocess.Popen, str, Path]:
    """`mirror-mlx serve` of this checkout, or of source tree `tree` (run from there, paths made absolute)."""
    log = Path(tempfile.mkdtemp(prefix="mirror-load-")) / "server.log"
    root = staged(tree, log.parent) if tree else None  # `-m` puts the working folder first on the path
    env = dict(os.environ, PYTHONPATH=str(root)) if tree else None
    args = [str(Path(a).resolve()) if Path(a).exists() else a for a in serve_args]
    args = [",".join(str(Path(p).resolve()) if Path(p).exists() else p for p in a.split(",")) for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "mirror_mlx", "serve", "--port", "0", "--max-queue",
                             str(max_queue), *args], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            cwd=root, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r" on (http://\S+/v1)", log.read_text())
        if found:
            return proc, found.group(1), log
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"load_test: the server did not start:\n{log.read_text()}")


@dataclass
class Summary:
    ok: bool
    ttft_p50: float
    ttft_p95: float
    aggregate: float  # tokens/s of all clients together
    single: float  # tokens/s of the sequential single-client pass


def run_test(args: argparse.Namespace, tree: Path | None) -> Summary:
    """One server, one single-client pass, then all clients at once; prints what it saw."""
    t_start = time.monotonic()
    proc, url, log = (None, args.url, None) if args.url else start_server(args.clients, shlex.split(args.serve), tree)
    stop = threading.Event()
    timer = threading.Timer(args.deadline, lambda: (stop.set(), proc and proc.send_signal(signal.SIGTERM)))
    timer.start()  # a hung server ends the run: its streams get an error, the script exits 1
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=args.deadline)
        model = client.models.list().data[0].id
        print(f"server: {tree or 'this checkout'} {args.serve}")
        print(f"load before: {open('/proc/loadavg').read().split()[:3]}")
        distinct = min(2 * len(OPENINGS), args.clients * args.requests)  # (endpoint, opening) pairs
        for i in range(distinct if args.warm else 0):  # mode auto's first call may calibrate: not timed
            request(client, model, i, args.max_tokens)
        t0 = time.perf_counter()
        single = {i: request(client, model, i, args.max_tokens) for i in range(distinct)}
        single_wall = time.perf_counter() - t0

        def run_client(c: int) -> list[tuple[int, Outcome]]:
            return [(c * args.requests + r, request(client, model, c * args.requests + r, args.max_tokens))
                    for r in range(args.requests) if not stop.is_set()]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            futures = [pool.submit(run_client, c) for c in range(args.clients)]
            wait(futures, timeout=max(1.0, args.deadline - (time.monotonic() - t_start)))
        wall = time.perf_counter() - t0
        results, failures = [], []
        for f in futures:
            try:
                results += f.result(timeout=0)
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}")
        wrong = [i for i, o in results if o.text != single[i % distinct].text]
        expected = args.clients * args.requests
        ttft = [o.ttft for _, o in results]
        rate = [o.decode_rate for _, o in results]
        single_rates = [o.decode_rate for o in single.values()]
        tokens = sum(o.tokens for _, o in results)
        single_rate = sum(o.tokens for o in single.values()) / single_wall
        print(f"{len(results)}/{expected} responses complete, {len(wrong)} differ from the single-client text, "
              f"{len(failures)} clients failed" + (f": {failures[0]}" if failures else ""))
        print(f"time to first token: p50 {pct(ttft, 0.5):.2f} s, p95 {pct(ttft, 0.95):.2f} s "
              f"(single client: p50 {pct([o.ttft for o in single.values()], 0.5):.2f} s)")
        print(f"per-request decode (engine, x_mirror): p50 {pct(rate, 0.5):.1f} tok/s, p95 slow tail "
              f"{pct(rate, 0.05):.1f} tok/s (single client: p50 {pct(single_rates, 0.5):.1f} tok/s)")
        print(f"aggregate: {tokens / wall:.1f} tok/s over {wall:.1f} s with {args.clients} clients; "
              f"single client {single_rate:.1f} tok/s (ratio {tokens / wall / single_rate:.2f})")
        print(f"load after: {open('/proc/loadavg').read().split()[:3]}", flush=True)
        ok = len(results) == expected and not wrong and not failures and not stop.is_set()
        return Summary(ok, pct(ttft, 0.5), pct(ttft, 0.95), tokens / wall, single_rate)
    finally:
        timer.cancel()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.returncode:
                print(f"server exited with {proc.returncode}:\n{log.read_text()[-2000:]}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="Requests per client.")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=900, help="Give up (exit 1) after this many seconds.")
    ap.add_argument("--url", default=None, help="A running server's base URL (…/v1) instead of starting one.")
    ap.add_argument("--serve", default="", help="More arguments for `mirror-mlx serve`, e.g. --model/--draft-model.")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="A source tree (an older checkout) whose server runs the same test first, for ratios.")
    ap.add_argument("--warm", action="store_true",
                    help="Send each distinct request once, untimed, before the single-client pass.")
    args = ap.parse_args()
    if args.baseline and args.url:
        ap.error("--baseline starts both servers itself; leave out --url")
    before = run_test(args, args.baseline.resolve()) if args.baseline else None
    after = run_test(args, None)
    if before:
        print(f"after / before: TTFT p50 {after.ttft_p50 / before.ttft_p50:.3f}x, "
              f"aggregate {after.aggregate / before.aggregate:.2f}x, single client {after.single / before.single:.2f}x")
    return 0 if after.ok and (before is None or before.ok) else 1


if __name__ == "__main__":
    sys.exit(main())
