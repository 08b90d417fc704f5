"""A real `mirror-mlx serve` of the demo pair in a subprocess (its own session, so a teardown ends all it
started), or the same Server on a thread of this process; the client side's small helpers."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import openai

from mirror_mlx.server import Server
from tests import leaks

SPECULATE = ("--mode", "mirror", "--kappa", "4", "--gamma", "4")  # (knobs given: no calibration at start)


class Served(NamedTuple):
    """A running server: its /v1 base URL, its log, its process."""

    url: str
    log: Path
    proc: subprocess.Popen

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")


def start_server(log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`python -m mirror_mlx serve --port 0` with the demo pair; returns it and its base URL. The log
    names each shared-memory segment the server makes (`leaks.made_in`)."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mirror_mlx", "serve", "--port", "0", *args],
                            stdout=out, stderr=out, start_new_session=True,
                            env=dict(os.environ, **{leaks.TRACE_ENV: "1"}))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " on http://" in line:
                return proc, line.split(" on ")[1].split()[0]
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {log.read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"the server did not start: {log.read_text()}")


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise


def kill_group(proc: subprocess.Popen) -> None:
    """The server and what it started (its draft host, the resource tracker: its session), whatever a test
    did: a teardown always leaves nothing running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # (start_new_session: the group is the server's pid)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@contextlib.contextmanager
def running(log: Path, *args: str):
    """A server for the block; stopped (and its whole session killed) however the block ends."""
    proc, url = start_server(log, *args)
    try:
        yield proc, url
    finally:
        kill_group(proc)


def health(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def in_process(pipe, mode: str = "mirror"):
    """The same Server on a thread of this process (to reach inside the engine); yields (server, client)."""
    defaults = {"mode": mode, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "kappa": 8, "gamma": 7}
    server = Server(("127.0.0.1", 0), pipe, "stories260K", defaults, log=io.StringIO())
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield server, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    finally:
        server.stop()
        thread.join(10)
        server.server_close()


def client(url: str, timeout: float = 60) -> openai.OpenAI:
    """The real `openai` client of a server at `url` (its /v1 base), no retries."""
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout)


def wait_for(predicate, log, timeout: float = 30.0) -> None:
    """Polls until `predicate` holds; on a timeout the server's log says what its scheduler decided instead."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out; the server's log ends:\n" + log.read_text()[-3000:]
        time.sleep(0.02)


def stream_first(client, prompt: str, max_tokens: int, **extra):
    """A streamed completion that has started decoding: (the stream, the text of its first event)."""
    stream = client.completions.create(model="stories260K", prompt=prompt, max_tokens=max_tokens, stream=True, **extra)
    return stream, next(iter(stream)).choices[0].text


def rest(events, parts: list[str]) -> tuple[str, dict]:
    last = None
    for e in events:
        parts.append(e.choices[0].text if e.choices else "")
        last = e
    return "".join(parts), last.model_extra["x_mirror"]

