"""Load test for `mirror-mlx serve`: N concurrent streaming clients × M requests each, greedy.

Starts a server with the demo pair on a free loopback port (or uses --url), runs every distinct
request once from a single client (the reference, and the single-client throughput), then all
clients at once. Every concurrent reply must complete and equal its single-client text (nothing
lost, garbled or mixed between clients). Prints p50/p95 time to first token and tokens/s, and
exits non-zero on any mismatch or when the run outlives --deadline seconds.

    .venv/bin/python scripts/load_test.py                # 16 clients × 4 requests
"""

import argparse
import re
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


def start_server(max_queue: int) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkdtemp(prefix="mirror-load-")) / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "mirror_mlx", "serve", "--port", "0", "--max-queue",
                             str(max_queue)], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r" on (http://\S+/v1)", log.read_text())
        if found:
            return proc, found.group(1), log
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"load_test: the server did not start:\n{log.read_text()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="Requests per client.")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=900, help="Give up (exit 1) after this many seconds.")
    ap.add_argument("--url", default=None, help="A running server's base URL (…/v1) instead of starting one.")
    args = ap.parse_args()
    t_start = time.monotonic()
    proc, url, log = (None, args.url, None) if args.url else start_server(args.clients)
    stop = threading.Event()
    timer = threading.Timer(args.deadline, lambda: (stop.set(), proc and proc.send_signal(signal.SIGTERM)))
    timer.start()  # a hung server ends the run: its streams get an error, the script exits 1
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=args.deadline)
        model = client.models.list().data[0].id
        print(f"load before: {open('/proc/loadavg').read().split()[:3]}")
        distinct = min(2 * len(OPENINGS), args.clients * args.requests)  # (endpoint, opening) pairs
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
        print(f"load after: {open('/proc/loadavg').read().split()[:3]}")
        return 0 if len(results) == expected and not wrong and not failures and not stop.is_set() else 1
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


if __name__ == "__main__":
    sys.exit(main())
