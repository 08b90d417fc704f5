"""Throw hostile requests at a live `mirror-mlx serve` (the demo pair, loopback) and check it stays whole.

Sends the known faults (huge κ·γ, lone surrogates, deep nesting, chunked bodies, a bad Content-Length,
non-finite numbers, a non-boolean include_usage, a 10 MB prompt, too many token ids, a burst of 50
connections) and then N seeded random bodies, bounded in count and time. Checks:
  - every answer is 2xx, or 4xx with a one-line JSON error; never a 500, a reset or no answer;
  - a stream that answered 200 carries no error event;
  - afterwards the server still speculates: a mode=mirror request's x_mirror stats show mode mirror
    and no draft_failure, and /health counts no engine error;
  - SIGTERM with an idle connection open stops it at once (exit 0), leaving no child process and no
    /dev/shm segment it had mapped.
Prints one line per check and exits 1 if any failed.

    python scripts/hostile_server.py [--random 200] [--seed 0] [--budget 300]
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATHS = ("/v1/completions", "/v1/chat/completions")
FAILURES: list[str] = []


def check(ok: bool, what: str) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILURES.append(what)
    return ok


def start(log: Path) -> tuple[subprocess.Popen, str, int]:
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mirror_mlx", "serve", "--port", "0", "--mode", "mirror",
                             "--max-queue", "8"], stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " on http://" in line:
                host, port = line.split("http://")[1].split("/")[0].split(":")
                return proc, host, int(port)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"the server did not start:\n{log.read_text()}")


def raw(host: str, port: int, data: bytes, timeout: float = 120) -> tuple[int, bytes]:
    """Send bytes as they are; (status, body). Status 0: no answer (reset or closed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(data)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
    except OSError as e:
        return 0, repr(e).encode()
    head, _, body = got.partition(b"\r\n\r\n")
    try:
        return int(head.split()[1]), body
    except (IndexError, ValueError):
        return 0, got[:200]


def post(host: str, port: int, body: bytes, path: str = "/v1/completions", headers: str = "") -> tuple[int, bytes]:
    if "Content-Length" not in headers and "Transfer-Encoding" not in headers:
        headers += f"Content-Length: {len(body)}\r\n"
    return raw(host, port, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                           f"Connection: close\r\n\r\n".encode() + body)


def verdict(status: int, body: bytes) -> str:
    """'' when the answer is acceptable, else why not."""
    if status == 0:
        return f"no answer ({body[:120]!r})"
    if status >= 500:
        return f"status {status}: {body[:300]!r}"
    if 200 <= status < 300:
        if body.startswith(b"data:"):
            events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
            if events[-1:] != [b"[DONE]"]:
                return f"a stream that does not end with [DONE]: {body[-200:]!r}"
            errors = [e for e in events if e.startswith(b'{"error"')]
            return f"an error event in a 200 stream: {errors[0][:200]!r}" if errors else ""
        return ""
    if 400 <= status < 500:
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"status {status} without a JSON error body: {body[:200]!r}"
        return "" if isinstance(message, str) and message and "\n" not in message else f"not one line: {message!r}"
    return f"status {status}"


def known_faults(host: str, port: int) -> None:
    def body(**fields) -> bytes:
        return json.dumps({"prompt": "Once upon a time", "max_tokens": 8, **fields}).encode()

    cases = [
        ("kappa 512, gamma 16", post(host, port, body(mode="mirror", kappa=512, gamma=16)), 400),
        ("lone surrogate in a prompt", post(host, port, b'{"prompt": "Once \\ud800", "max_tokens": 4}'), 200),
        ("lone surrogate in a message", post(host, port, b'{"messages": [{"role": "user", "content": "Hi \\udfff"}],'
                                                         b' "max_tokens": 4}', PATHS[1]), 200),
        ("[ x 100000", post(host, port, b"[" * 100000), 400),
        ("chunked body", post(host, port, b"9\r\n{\"a\": 1}\r\n0\r\n\r\n", headers="Transfer-Encoding: chunked\r\n"),
         411),
        ("Content-Length: -5", post(host, port, body(), headers="Content-Length: -5\r\n"), 400),
        ("temperature Infinity", post(host, port, b'{"prompt": "x", "temperature": Infinity}'), 400),
        ("include_usage \"yes\"", post(host, port, body(stream=True, stream_options={"include_usage": "yes"})), 400),
        ("10 MB prompt", post(host, port, body(prompt="Once upon a time " * 600_000)), 413),
        ("5000 token ids", post(host, port, json.dumps({"prompt": [1] * 5000}).encode()), 400),
    ]
    for name, (status, answer), expected in cases:
        why = verdict(status, answer)
        detail = json.loads(answer)["error"]["message"] if 400 <= status < 500 and not why else why
        check(status == expected and not why, f"{name}: {status} (expected {expected}) {detail[:110]}")

    data = body(max_tokens=1)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
               "Connection: close\r\n\r\n").encode() + data
    socks = []
    for _ in range(50):
        s = socket.create_connection((host, port), timeout=120)
        s.sendall(request)
        socks.append(s)
    statuses = []
    for s in socks:
        with s:
            try:
                statuses.append(int(s.recv(64).split()[1]))
            except (OSError, IndexError, ValueError):
                statuses.append(0)
    counts = {k: statuses.count(k) for k in sorted(set(statuses))}
    check(set(statuses) <= {200, 429}, f"50 connections at once: {counts} (200 or 429 each, no reset)")


POOL = [None, True, False, 0, -1, 1, 7, 2**70, 10**400, 1.5, -0.0, float("inf"), float("nan"), "x", "", "\ud800", "auto",
        "mirror", "sd", "ar", [], {}, [1, 2], {"a": 1}, ["x"], [{"type": "text", "text": "hi"}]]
FIELDS = ["model", "prompt", "messages", "stream", "stream_options", "n", "stop", "max_tokens",
          "max_completion_tokens", "temperature", "top_p", "min_p", "top_k", "repetition_penalty", "seed", "kappa",
          "gamma", "exit_layer", "mode"]


def random_body(rng: random.Random) -> tuple[str, bytes, dict]:
    path = rng.choice(PATHS + ("/v1/nowhere",) if rng.random() < 0.05 else PATHS)
    if rng.random() < 0.1:  # bytes that are not JSON, or JSON cut short
        data = json.dumps({"prompt": "Once upon a time", "max_tokens": 4}).encode()
        kind = rng.choice(["cut", "garbage", "utf8"])
        return path, (data[: rng.randrange(len(data))] if kind == "cut" else bytes(rng.randrange(256) for _ in
                      range(rng.randrange(1, 64))) if kind == "garbage" else b'{"prompt": "\xff\xfe"}'), {}
    body: dict = {"max_tokens": rng.choice([1, 2, 4, 8])}
    if rng.random() < 0.7:
        if path == PATHS[1]:
            body["messages"] = [{"role": rng.choice(["user", "system", "assistant", "tool"]),
                                 "content": rng.choice(["Once upon a time", "", "\ud800 x", [{"type": "text",
                                                                                               "text": "hi"}]])}]
        else:
            body["prompt"] = rng.choice(["Once upon a time", "The dog", [1, 2, 3], [600], "\udfff"])
    for key in rng.sample(FIELDS, rng.randrange(0, 5)):
        body[key] = rng.choice(POOL + ([rng.randrange(-3, 40)] * 5 if key in ("kappa", "gamma", "exit_layer")
                                       else []))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 16)  # bounded in time: 2**70 is refused anyway
    if isinstance(body.get("max_completion_tokens"), int):
        body["max_completion_tokens"] = min(body["max_completion_tokens"], 16)
    return path, json.dumps(body).encode(), body


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", type=int, default=200, help="random bodies to send")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=300, help="seconds for the random bodies")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="hostile-")) / "server.log"
    proc, host, port = start(log)
    print(f"server pid {proc.pid} on {host}:{port}, log {log}", flush=True)
    try:
        known_faults(host, port)
        rng = random.Random(args.seed)
        deadline = time.monotonic() + args.budget
        statuses: dict[int, int] = {}
        sent = 0
        for i in range(args.random):
            if time.monotonic() > deadline:
                break
            path, data, body = random_body(rng)
            status, answer = post(host, port, data, path)
            sent += 1
            statuses[status] = statuses.get(status, 0) + 1
            why = verdict(status, answer)
            if why:
                check(False, f"random body {i} to {path} ({data[:160]!r}): {why}")
        check(sent == args.random, f"random bodies sent: {sent} of {args.random} within {args.budget:g} s "
                                   f"(seed {args.seed}); statuses {dict(sorted(statuses.items()))}")

        status, answer = post(host, port, json.dumps({"prompt": "Once upon a time", "max_tokens": 24,
                                                      "mode": "mirror"}).encode())
        stats = json.loads(answer).get("x_mirror", {}) if status == 200 else {}
        check(stats.get("mode") == "mirror" and stats.get("draft_failure") is None and stats.get("mean_accepted", 0) > 1,
              f"still speculates: status {status}, mode {stats.get('mode')}, draft_failure "
              f"{stats.get('draft_failure')}, mean accepted {stats.get('mean_accepted', 0):.2f}")
        status, answer = raw(host, port, b"GET /health HTTP/1.0\r\n\r\n")
        health = json.loads(answer) if status == 200 else {}
        check(health.get("errors") == 0 and health.get("status") == "ok", f"/health: {health}")
        kids = children(proc.pid)
        shm = {line.split()[-1] for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines()
               if "/dev/shm/" in line}
    finally:
        idle = socket.create_connection((host, port))  # a browser's preconnect: sends nothing
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        took = time.monotonic() - t0
        idle.close()
    check(code == 0 and took < 10, f"SIGTERM with an idle connection open: exit {code} after {took:.1f} s")
    deadline = time.monotonic() + 10
    while [p for p in kids if Path(f"/proc/{p}").exists()] and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in kids if Path(f"/proc/{p}").exists()]
    check(not left, f"no orphan process (children were {kids}; left {left})")
    left_shm = [name for name in shm if os.path.exists(name)]
    check(bool(shm) and not left_shm, f"no /dev/shm segment left (mapped {len(shm)}; left {left_shm})")
    text = log.read_text()
    check("Traceback" not in text and "leaked" not in text, "server log: no traceback, no leaked resource")
    print(f"{len(FAILURES)} check(s) failed" if FAILURES else "all checks passed", flush=True)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
