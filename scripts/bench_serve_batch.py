"""Concurrent clients against real servers: `mirror-mlx serve` with speculation in the batch on and off, and
mlx_lm.server, on the same target; two prompt mixes (copy-heavy: Spec-Bench summarization and RAG, code edits;
not copy-heavy: GSM8K, QA, writing). For each server, mix and client count: aggregate tokens/s (all completion
tokens over the wall time from the first request to the last reply), per-request latency p50/p95, time to first
token p95, and (our server) tokens accepted per row-step in the batch, from /health. Every client streams one
greedy chat completion (temperature 0), so the texts of the servers are compared too (ours on and off must agree).

    .venv/bin/python scripts/bench_serve_batch.py --model build/real-pair/target --clients 1 2 4 8 --tokens 48
    (--pin: the Mac analog, each server on one core, the clients on the other)
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai

DATA = Path(__file__).resolve().parent.parent / "mirror_mlx" / "data"
MIXES = {"copy": ["summarization", "rag", "code_edit"], "nocopy": ["math_reasoning", "qa", "writing"]}


def prompts(mix: str, n: int) -> list[str]:
    """n prompts of the mix, its categories taken in turn (the shortest of each first: prefill on a CPU is slow)."""
    pools = []
    for category in MIXES[mix]:
        if category == "code_edit":
            pool = [json.loads(line)["prompt"] for line in open(DATA / "code_edit.jsonl")]
        else:
            rows = [json.loads(line) for line in open(DATA / "spec_bench_question.jsonl")]
            pool = [r["turns"][0] for r in rows if r["category"] == category]
        pools.append(sorted(pool, key=len))
    return [pools[i % len(pools)][i // len(pools)] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: str, pin: bool, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "mlx_lm":
        cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "mirror_mlx", "serve", "--model", model, "--draft-model", "recycle",
               "--port", str(port), "--log-level", os.environ.get("LOG_LEVEL", "WARNING"),
               "--batch-speculation", "on" if kind == "spec" else "off"]
    if pin:
        cmd = ["taskset", "-c", "0"] + cmd
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)


def health(url: str) -> dict:
    try:
        return json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
    except OSError:
        return {}


def one(client: openai.OpenAI, model: str, prompt: str, tokens: int, t0: float, out: list, i: int) -> None:
    sent = time.perf_counter()
    first, text, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=tokens, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text.append(event.choices[0].delta.content)
        if event.usage is not None:
            usage = event.usage.completion_tokens
    done = time.perf_counter()
    out[i] = {"text": "".join(text), "tokens": usage, "latency": done - sent,
              "ttft": (first or done) - sent, "done": done - t0}


def run(url: str, model: str, texts: list[str], tokens: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    before = health(url).get("scheduler", {}).get("batch_speculation", {})
    out: list = [None] * len(texts)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(client, model, p, tokens, t0, out, i)) for i, p in enumerate(texts)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = max(o["done"] for o in out)
    after = health(url).get("scheduler", {}).get("batch_speculation", {})
    steps = after.get("row_steps", 0) - before.get("row_steps", 0)
    accepted = after.get("accepted", 0) - before.get("accepted", 0)
    lat, ttft = sorted(o["latency"] for o in out), sorted(o["ttft"] for o in out)
    q = lambda xs, p: xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]  # noqa: E731
    return {"tokens": sum(o["tokens"] or 0 for o in out), "tok_s": sum(o["tokens"] or 0 for o in out) / wall,
            "p50": statistics.median(lat), "p95": q(lat, 0.95), "ttft_p95": q(ttft, 0.95),
            "accepted_per_row_step": accepted / steps if steps else None, "texts": [o["text"] for o in out]}


def table(results: list[dict]) -> str:
    """The markdown table BENCHMARKS.md shows: per client count and mix, each server's numbers (the median over
    repeats) and our speculating batch's ratio to each other server's tokens/s."""
    cell: dict = {}
    for r in results:
        cell.setdefault((r["clients"], r["mix"], r["server"]), []).append(r)
    kinds = list(dict.fromkeys(r["server"] for r in results))
    out = ["| clients | mix | server | tok/s | p50 s | p95 s | TTFT p95 s | accepted / row-step | spec × this |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    for n, mix in dict.fromkeys((r["clients"], r["mix"]) for r in results):
        for kind in kinds:
            rs = cell.get((n, mix, kind))
            if not rs:
                continue
            acc = [r["accepted_per_row_step"] for r in rs if r["accepted_per_row_step"] is not None]
            spec = cell.get((n, mix, "spec"))
            ratio = f"{med(spec, 'tok_s') / med(rs, 'tok_s'):.2f}" if spec and kind != "spec" else ""
            out.append(f"| {n} | {mix} | {kind} | {med(rs, 'tok_s'):.1f} | {med(rs, 'p50'):.1f} | {med(rs, 'p95'):.1f} | "
                       f"{med(rs, 'ttft_p95'):.1f} | {statistics.median(acc):.2f} | {ratio} |" if acc else
                       f"| {n} | {mix} | {kind} | {med(rs, 'tok_s'):.1f} | {med(rs, 'p50'):.1f} | {med(rs, 'p95'):.1f} | "
                       f"{med(rs, 'ttft_p95'):.1f} | | {ratio} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="build/real-pair/target")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--servers", nargs="+", default=["spec", "plain", "mlx_lm"])
    ap.add_argument("--mixes", nargs="+", default=["copy", "nocopy"])
    ap.add_argument("--repeats", type=int, default=1, help="each run this many times, the servers' order reversed")
    ap.add_argument("--pin", action="store_true", help="the Mac analog: each server on core 0")
    ap.add_argument("--out", default=None, help="a JSON file for every number")
    ap.add_argument("--table", default=None, help="print the markdown table of a JSON file written by --out, and stop")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    if args.pin:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # (one core: one BLAS thread)
    servers = {}  # all started first, then the runs interleaved: the machine's load moves between runs
    for kind in args.servers:
        try:
            servers[kind] = start(kind, args.model, args.pin, Path(f"/tmp/bench_serve_{kind}.log"))
        except RuntimeError as e:  # (mlx_lm.server may not run here: said, and the others still run)
            print(e, flush=True)
    results = []
    try:
        models = {}
        for kind, (_, url) in servers.items():
            try:
                models[kind] = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
            except ValueError:  # (mlx_lm.server answers the loaded model as "default_model")
                models[kind] = "default_model"
            run(url, models[kind], prompts("nocopy", 1), 8)  # warm
        for rep in range(args.repeats):
            for n in args.clients:  # (in the order given: the sizes that matter most first)
                for mix in args.mixes:
                    order = list(servers) if rep % 2 == 0 else list(servers)[::-1]
                    for kind in order:
                        url = servers[kind][1]
                        r = dict(run(url, models[kind], prompts(mix, n), args.tokens), server=kind, mix=mix, clients=n,
                                 repeat=rep, load=os.getloadavg()[0])
                        results.append(r)
                        if args.out:
                            Path(args.out).write_text(json.dumps(results, indent=1))
                        print(f"{kind:7s} {mix:7s} {n} clients: {r['tok_s']:6.1f} tok/s  p50 {r['p50']:6.2f} s  "
                              f"p95 {r['p95']:6.2f} s  ttft p95 {r['ttft_p95']:5.2f} s  accepted/row-step "
                              f"{r['accepted_per_row_step']}  load {r['load']:.1f}", flush=True)
        for kind, (_, url) in servers.items():
            print(kind, json.dumps(health(url).get("scheduler", {})), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    same = {}
    for r in results:  # greedy: our server with and without speculation in the batch answer the same texts
        same.setdefault((r["mix"], r["clients"], r["repeat"]), {})[r["server"]] = r["texts"]
    for key, by in same.items():
        if "spec" in by and "plain" in by and by["spec"] != by["plain"]:
            print(f"texts differ between spec and plain at {key}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
