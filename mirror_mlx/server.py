"""`mirror-mlx serve`: an OpenAI-compatible local server with Mirror-SD behind it.

The standard library's ThreadingHTTPServer (as mlx_lm.server) parses HTTP; each connection gets a
thread. One engine decodes one request at a time: the others wait their turn in a bounded FIFO
(`Gate`), and a request that finds it full gets 429 with Retry-After. Between two decode steps the
handler looks at its socket and at the shutdown flag, so a client that went away, or SIGINT/SIGTERM,
stops the generation after the step in flight, when the engine's caches are consistent.

Chat requests go through `Pipeline.chat_stream`, which remembers the token ids of the last
conversation: a request that extends it prefills only the new turn (`cached_tokens` in `usage`).
"""

import json
import math
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from . import text, validate
from .stats import Stats
from .options import CHOICES, PAPER_KNOBS
from .pipeline import Pipeline

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_BODY = 16 << 20  # bytes; a prompt this long is far beyond any context anyway
ROLES = ("system", "user", "assistant")


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error", retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# --- request → generation settings ---------------------------------------------------------------


@dataclass
class Request:
    """One validated request: what to run and how to answer it."""

    endpoint: str
    messages: Optional[list[dict]] = None  # chat
    prompt: Union[str, list[int], None] = None  # completion
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    max_tokens: Optional[int] = None  # None: the server's default, capped at what the context leaves
    options: dict = field(default_factory=dict)  # Pipeline.stream / chat_stream keyword arguments


def _number(body: dict, name: str, integer: bool = False) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    try:
        finite = integer or math.isfinite(value)  # JSON's Infinity / NaN, which Python's parser accepts
    except OverflowError:  # an integer beyond any float
        finite = False
    if not finite:
        raise APIError(400, f"'{name}' must be a finite number, got {value!r:.40}", name)
    return value


def _text(value: str) -> str:
    """Text as valid UTF-8: a lone surrogate (JSON allows "\\ud800") becomes U+FFFD, as the API does."""
    return validate.clean_text(value)[0]


def _check(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise APIError(400, f"'{name}' must be {rule} (got {value!r})", name)


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts (as OpenAI sends)."""
    content = message.get("content")
    if isinstance(content, str):
        return _text(content)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return _text("".join(p["text"] for p in content))
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_request(raw: bytes, endpoint: str, model_ids: tuple[str, ...], vocab_size: int,
                  defaults: dict, max_prompt_bytes: Optional[int] = None, context: Optional[int] = None) -> Request:
    """Validate a request body; every problem is an APIError naming the field and the fix.

    `defaults` are the server's decode settings (the `serve` flags); request fields override them.
    A prompt longer than `max_prompt_bytes` (text) or `context` (token ids) cannot fit the context:
    it is refused here, before it queues, rather than tokenized while the engine waits on it.
    """
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}): send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply to parse: send a flat JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model not in model_ids:
        raise APIError(404, f"model {model!r} is not served here: use {model_ids[0]!r} (GET /v1/models lists it)",
                       "model", "model_not_found")
    req = Request(endpoint)
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' is required: a non-empty list of {role, content} objects", "messages")
        req.messages = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise APIError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}",
                               f"messages[{i}]")
            req.messages.append({"role": m["role"], "content": _content(m, i)})
        _fits(sum(len(m["content"].encode()) for m in req.messages), max_prompt_bytes, "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise APIError(400, "'prompt' is required: a non-empty string or a list of token ids (one prompt "
                                "per request)", "prompt")
        if ids and not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"'prompt' holds a token id outside the vocabulary [0, {vocab_size})", "prompt")
        if ids and context and len(prompt) >= context:
            raise APIError(400, f"the prompt is {len(prompt)} tokens but the model's context is {context} tokens: "
                                "shorten the prompt", "prompt", "context_length_exceeded")
        if isinstance(prompt, str):
            prompt = _text(prompt)
            _fits(len(prompt.encode()), max_prompt_bytes, "prompt")
        req.prompt = prompt
    stream = body.get("stream", False)
    _check(isinstance(stream, bool), "stream", "true or false", stream)
    req.stream = stream
    stream_options = body.get("stream_options") or {}
    _check(isinstance(stream_options, dict), "stream_options", "an object", stream_options)
    include_usage = stream_options.get("include_usage", False)
    _check(isinstance(include_usage, bool), "stream_options.include_usage", "true or false", include_usage)
    req.include_usage = include_usage
    n = _number(body, "n", integer=True)
    _check(n in (None, 1), "n", "1 (one choice per request)", n)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    _check(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop), "stop",
           "a non-empty string or a list of them", body.get("stop"))
    req.stop = [_text(s) for s in stop]

    max_tokens = _number(body, "max_completion_tokens", integer=True)
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _number(body, "max_tokens", integer=True), "max_tokens"
    _check(max_tokens is None or max_tokens >= 1, name, "at least 1", max_tokens)
    req.max_tokens = max_tokens
    opts = dict(defaults)
    for key, option in (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                        ("repetition_penalty", "repetition_penalty")):
        value = _number(body, key)
        if value is not None:
            opts[option] = float(value)
    for key in ("top_k", "seed", "kappa", "gamma", "exit_layer"):
        value = _number(body, key, integer=True)
        if value is not None:
            opts[key] = value
    _check(opts["temperature"] >= 0, "temperature", "at least 0", opts["temperature"])
    _check(0 < opts["top_p"] <= 1, "top_p", "in (0, 1]", opts["top_p"])
    _check(0 <= opts.get("min_p", 0.0) <= 1, "min_p", "in [0, 1]", opts.get("min_p"))
    _check(opts["top_k"] >= 0, "top_k", "at least 0 (0 turns it off)", opts["top_k"])
    rp = opts.get("repetition_penalty")
    _check(rp is None or rp > 0, "repetition_penalty", "greater than 0", rp)
    kappa, gamma = opts.get("kappa"), opts.get("gamma")  # None: mode auto's (or the paper's)
    _check(kappa is None or kappa >= 1, "kappa", "at least 1", kappa)
    _check(kappa is None or kappa <= vocab_size, "kappa", f"at most the vocabulary size {vocab_size}", kappa)
    _check(gamma is None or gamma >= 1, "gamma", "at least 1", gamma)
    seed = opts.get("seed")
    _check(seed is None or 0 <= seed < 2**63, "seed", "an integer in [0, 2**63)", seed)
    mode = body.get("mode", opts["mode"])
    _check(isinstance(mode, str) and mode in CHOICES, "mode", f"one of {', '.join(CHOICES)}", mode)
    opts["mode"] = mode
    if mode == "mirror" or (mode == "auto" and kappa is not None and gamma is not None):
        try:  # refused here, before it queues: the draft host could not hold it (validate.MAX_BRANCHES)
            validate.branches(kappa or PAPER_KNOBS["kappa"], gamma or PAPER_KNOBS["gamma"])
        except ValueError as e:
            raise APIError(400, str(e), "kappa" if "kappa" in body else "gamma") from None
    req.options = opts
    return req


def _fits(n_bytes: int, limit: Optional[int], param: str) -> None:
    if limit and n_bytes > limit:
        raise APIError(413, f"the prompt is {n_bytes} bytes; no prompt over {limit} bytes fits the model's "
                            "context: shorten it", param, "context_length_exceeded")


def max_prompt_bytes(tokenizer: Any, context: Optional[int]) -> Optional[int]:
    """An upper bound on the UTF-8 bytes of a prompt that fits `context` tokens: context × the longest
    token's bytes (each token covers at most that much text), doubled for normalization's slack."""
    if not context:
        return None
    longest = max((len(str(k).encode("utf-8", "replace")) for k in tokenizer.get_vocab()), default=16)
    return 2 * context * max(longest, 4)


# --- stop strings ---------------------------------------------------------------------------------


class StopText:
    """Cut the text at the first stop string; hold back a tail that could be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops, self.held = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string was found)."""
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-k:])), default=0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


@dataclass
class Generation:
    """One request's decode: iterate for the text of each step ("" when a step shows nothing yet)."""

    pipe: Pipeline
    req: Request
    default_max_tokens: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    _chunks: Any = None

    def start(self) -> None:
        """Tokenize and check (ValueError → 400) before anything is sent."""
        pipe, req = self.pipe, self.req
        if req.messages is not None:
            try:
                ids = pipe.chat_ids(req.messages)
            except ValueError as e:  # the chat template refused the conversation
                raise APIError(400, str(e), "messages") from None
        elif isinstance(req.prompt, str):
            ids = text.plain(pipe.tokenizer, req.prompt)
        else:
            ids = list(req.prompt)
        self.prompt_tokens = len(ids)
        context = pipe.context_length
        param = "messages" if req.messages is not None else "prompt"
        if context and len(ids) >= context:
            raise APIError(400, f"the prompt is {len(ids)} tokens but the model's context is {context} tokens: "
                                "shorten the prompt", param, "context_length_exceeded")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, context - len(ids)) if context else self.default_max_tokens
        kwargs = dict(req.options, max_tokens=max_tokens)
        try:
            if req.messages is not None:
                self._chunks = pipe.chat_stream(req.messages, ids=ids, **kwargs)
            else:
                self._chunks = pipe.stream(ids, **kwargs)
        except ValueError as e:  # the engine's own check: context, exit layer, a mode without a draft
            message = str(e)
            code = "context_length_exceeded" if "context" in message else None
            param = "exit_layer" if "exit layer" in message else "mode" if "draft model" in message else None
            raise APIError(400, message, param, code) from None

    def __iter__(self) -> Iterator[str]:
        stop = StopText(self.req.stop)
        shown = 0
        for chunk in self._chunks:
            shown += len(chunk.tokens)
            self.completion_tokens = self.pipe.stats.generation_tokens
            text, hit = stop.feed(chunk.text)
            yield text
            if hit:
                self.finish_reason = "stop"
                return
        yield stop.flush()
        self.completion_tokens = self.pipe.stats.generation_tokens
        self.finish_reason = "stop" if self.completion_tokens > shown else "length"

    def close(self) -> None:
        """Stop decoding after the step in flight (the engine's caches stay consistent)."""
        if self._chunks is not None:
            self._chunks.close()

    @property
    def stats(self) -> Stats:
        return self.pipe.stats

    def usage(self) -> dict:
        s = self.stats
        cached = max(0, s.prompt_tokens - 1 - s.prefill_tokens)  # the last prompt token runs in the first step
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


# --- the queue ------------------------------------------------------------------------------------


class Gate:
    """One request decodes at a time; up to `max_queue` more wait in arrival order; more get 429."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._next = self._serving = 0
        self._closed = False
        self._seconds = 1.0  # running mean of a request's decode time, for Retry-After

    @property
    def waiting(self) -> int:
        return max(0, self._next - self._serving - 1)

    def enter(self) -> None:
        with self._cond:
            if self._closed:
                raise APIError(503, "the server is shutting down", kind="server_error", code="shutting_down")
            if self._next - self._serving > self.max_queue:
                retry = max(1, math.ceil(self._seconds * (self.waiting + 1)))
                raise APIError(429, f"the queue is full ({self.max_queue} requests waiting): retry in {retry} s",
                               kind="rate_limit_error", code="queue_full", retry_after=retry)
            ticket, self._next = self._next, self._next + 1
            while ticket != self._serving and not self._closed:
                self._cond.wait()
            if self._closed and ticket != self._serving:
                raise APIError(503, "the server is shutting down", kind="server_error", code="shutting_down")

    def leave(self, seconds: float) -> None:
        with self._cond:
            self._seconds = 0.8 * self._seconds + 0.2 * seconds
            self._serving += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# --- HTTP -----------------------------------------------------------------------------------------


def peer_gone(sock: socket.socket) -> bool:
    """True when the client closed its end (readable with nothing to read) or reset it."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class Server(ThreadingHTTPServer):
    """The HTTP server plus what its handlers share: the pipeline, the queue and the counters."""

    daemon_threads = False  # server_close() joins the handlers, so in-flight streams end first
    block_on_close = True

    def __init__(self, address: tuple[str, int], pipe: Pipeline, model_id: str, defaults: dict,
                 max_tokens: int = 256, max_queue: int = 32, log: Any = sys.stderr):
        self.request_queue_size = max(64, 2 * max_queue + 8)  # listen backlog: a burst is queued or 429, not reset
        self.reading: set = set()  # connections still sending their request: closed at once on shutdown
        self._reading_lock = threading.Lock()
        super().__init__(address, Handler)
        self.pipe, self.model_id, self.defaults, self.max_tokens = pipe, model_id, defaults, max_tokens
        self.model_ids = tuple(dict.fromkeys([model_id, pipe.name]))
        self.gate = Gate(max_queue)
        self.stopping = threading.Event()
        self.counts = {"requests": 0, "completed": 0, "rejected": 0, "disconnected": 0, "errors": 0}
        self.log = log
        self._count_lock = threading.Lock()
        self.context = pipe.engine.context_length
        self.max_prompt_bytes = max_prompt_bytes(pipe.tokenizer, self.context)

    def reading_done(self, sock: socket.socket, reading: bool) -> None:
        with self._reading_lock:
            if reading and self.stopping.is_set():
                raise ClientGone("the server is shutting down")
            (self.reading.add if reading else self.reading.discard)(sock)

    def drop_idle(self) -> None:
        """Shut the connections still sending a request (a browser's preconnect, a slow client): their
        handler threads wake at once, so shutdown never waits out Handler.timeout on them."""
        with self._reading_lock:
            for sock in self.reading:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.reading.clear()

    def count(self, name: str) -> None:
        with self._count_lock:
            self.counts[name] += 1

    def note(self, text: str) -> None:
        print(f"mirror-mlx serve: {text}", file=self.log, flush=True)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line for a client that went away; the traceback only for a bug of ours."""
        error = sys.exc_info()[1]
        if isinstance(error, (ClientGone, OSError)):
            self.note(f"{client_address[0]}: connection lost ({error})")
        else:
            self.note(f"{client_address[0]}: {traceback.format_exc().rstrip()}")

    def stop(self) -> None:
        """Refuse new work, end in-flight streams after their current step, stop accepting."""
        again = self.stopping.is_set()
        with self._reading_lock:
            self.stopping.set()
        self.gate.close()
        self.drop_idle()
        if again:
            self.note("already stopping: waiting for the step in flight, then the engine closes")
            return
        threading.Thread(target=self.shutdown, name="serve-shutdown").start()  # not on serve_forever's thread


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.0"  # one request per connection: shutdown never waits on an idle keep-alive
    timeout = 30  # seconds to send a request
    error_content_type = "application/json"
    error_message_format = ('{"error": {"message": "%(message)s: %(explain)s", "type": "invalid_request_error", '
                            '"param": null, "code": "%(code)d"}}')

    def log_message(self, format: str, *args: Any) -> None:
        self.server.note(f"{self.address_string()} {format % args}")

    def handle(self) -> None:
        """One request; while it is being sent the server may shut the socket (Server.drop_idle)."""
        try:
            self.server.reading_done(self.connection, True)
        except ClientGone:
            return
        try:
            super().handle()
        finally:
            self.server.reading_done(self.connection, False)

    # --- responses

    def send_head(self, status: int, headers: dict) -> None:
        try:
            self.send_response(status)
            self.send_header("Access-Control-Allow-Origin", "*")  # browser front-ends on another port
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
        except OSError as e:
            raise ClientGone(repr(e)) from None

    def send_json(self, status: int, body: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(body).encode()
        self.send_head(status, {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                **(headers or {})})
        try:
            self.wfile.write(data)
        except OSError as e:
            raise ClientGone(repr(e)) from None

    def send_api_error(self, e: APIError) -> None:
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
        self.send_json(e.status, e.body(), headers)

    def send_event(self, body: Union[dict, str]) -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        try:
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()
        except OSError as e:
            raise ClientGone(repr(e)) from None

    def read_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise APIError(411, "Transfer-Encoding: chunked request bodies are not supported: send the body "
                                "with a Content-Length header", code="length_required")
        header = self.headers.get("Content-Length")
        try:
            length = int(header or 0)
        except ValueError:
            length = -1
        if length < 0:
            raise APIError(400, f"the Content-Length header is invalid ({header!r}): give the body's size in "
                                "bytes, a non-negative integer", code="invalid_content_length")
        if length > MAX_BODY:
            raise APIError(413, f"the request body is {length} bytes; the limit is {MAX_BODY}", code="too_large")
        try:
            return self.rfile.read(length)
        except OSError as e:
            raise ClientGone(repr(e)) from None

    # --- routes

    def do_OPTIONS(self) -> None:
        """CORS preflight, as mlx_lm.server answers it."""
        self.send_head(204, {"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                             "Access-Control-Allow-Headers": "Content-Type, Authorization"})

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            s = self.server
            self.send_json(200, {"status": "stopping" if s.stopping.is_set() else "ok", "model": s.model_id,
                                 "waiting": s.gate.waiting, **s.counts})
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [
                {"id": self.server.model_id, "object": "model", "created": 0, "owned_by": "mirror-mlx"}]})
        else:
            self.send_api_error(APIError(404, f"no route GET {path}: try /v1/models or /health", code="not_found"))

    def do_POST(self) -> None:
        s = self.server
        path = self.path.split("?")[0].rstrip("/")
        if path not in (CHAT, COMPLETION):
            self.send_api_error(APIError(404, f"no route POST {path}: use {CHAT} or {COMPLETION}", code="not_found"))
            return
        s.count("requests")
        try:
            raw = self.read_body()
            s.reading_done(self.connection, False)  # the request is in: shutdown now ends it after a step
            req = parse_request(raw, path, s.model_ids, s.pipe.tokenizer.vocab_size, s.defaults,
                                s.max_prompt_bytes, s.context)
            s.gate.enter()
        except APIError as e:
            s.count("rejected")
            self.send_api_error(e)
            return
        except ClientGone:
            s.count("disconnected")
            return
        t0 = time.perf_counter()
        try:
            self.serve_one(req)
        finally:
            s.gate.leave(time.perf_counter() - t0)

    def serve_one(self, req: Request) -> None:
        """Run one admitted request; holds the engine until it returns."""
        s = self.server
        gen = Generation(s.pipe, req, s.max_tokens)
        if peer_gone(self.connection):  # went away while it waited in the queue
            s.count("disconnected")
            return
        try:
            gen.start()
        except APIError as e:
            s.count("rejected")
            self.send_api_error(e)
            return
        except Exception as e:
            self.engine_failed(e, gen, sent=False)
            return
        reply = Reply(req, s.model_id)
        try:
            if req.stream:
                self.send_head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                if req.messages is not None:
                    self.send_event(reply.chunk({"role": "assistant", "content": ""}))
            text = []
            for piece in gen:
                if req.stream and piece:
                    self.send_event(reply.chunk({"content": piece} if req.messages is not None else piece))
                else:
                    text.append(piece)
                if peer_gone(self.connection):
                    raise ClientGone("closed")
                if s.stopping.is_set():
                    raise Shutdown
        except ClientGone:
            gen.close()
            s.count("disconnected")
            s.note(f"client went away after {gen.stats.generation_tokens} tokens: generation stopped")
            return
        except Shutdown:
            gen.close()
            self.cut_short(req, gen, APIError(503, f"the server is shutting down: the reply was cut after "
                                                   f"{gen.stats.generation_tokens} tokens",
                                              kind="server_error", code="shutting_down"))
            return
        except Exception as e:
            self.engine_failed(e, gen, sent=req.stream)
            return
        finally:
            gen.close()
        s.count("completed")
        extra = {"usage": gen.usage(), "x_mirror": gen.stats.as_dict()}
        try:
            if not req.stream:
                self.send_json(200, reply.whole("".join(text), gen.finish_reason, extra))
                return
            final = reply.chunk({} if req.messages is not None else "", gen.finish_reason)
            final["x_mirror"] = extra["x_mirror"]
            self.send_event(final)
            if req.include_usage:
                self.send_event(dict(reply.chunk(None), choices=[], usage=extra["usage"]))
            self.send_event("[DONE]")
        except (ClientGone, OSError):
            s.count("disconnected")

    def cut_short(self, req: Request, gen: Generation, error: APIError) -> None:
        try:
            if req.stream:
                self.send_event(error.body())
                self.send_event("[DONE]")
            else:
                self.send_api_error(error)
        except (ClientGone, OSError):
            pass

    def engine_failed(self, e: Exception, gen: Generation, sent: bool) -> None:
        """500 with a one-line error; clear the caches (a step may have been cut) and keep serving."""
        s = self.server
        s.count("errors")
        s.note(f"request failed inside the engine: {type(e).__name__}: {e}\n{traceback.format_exc().rstrip()}")
        gen.close()
        try:
            s.pipe.reset()
        except Exception as e2:  # the next request will show it too; the server stays up
            s.note(f"could not clear the caches after the failure: {e2!r}")
        line = " ".join(f"{type(e).__name__}: {e}".split())
        error = APIError(500, f"generation failed: {line}", kind="server_error", code="engine_error")
        if sent:
            self.cut_short(gen.req, gen, error)
        else:
            try:
                self.send_api_error(error)
            except OSError:
                pass


class Shutdown(Exception):
    """SIGINT/SIGTERM arrived while a request was decoding."""


class ClientGone(Exception):
    """The client closed the connection, reset it, or stopped reading for `Handler.timeout` seconds."""


@dataclass
class Reply:
    """The response bodies of one request, in the OpenAI shapes."""

    req: Request
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.req.messages is not None

    def head(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model, "system_fingerprint": "mirror-mlx"}

    def chunk(self, delta: Union[dict, str, None], finish_reason: Optional[str] = None) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = delta or ""
        return dict(self.head(stream=True), choices=[choice])

    def whole(self, text: str, finish_reason: Optional[str], extra: dict) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return dict(self.head(stream=False), choices=[choice], **extra)


# --- the command ----------------------------------------------------------------------------------


def model_id(name: str) -> str:
    """What /v1/models calls the target: a local folder's name, or the Hugging Face id as given."""
    path = Path(name)
    return path.name if path.exists() else name


def serve(pipe: Pipeline, host: str = "127.0.0.1", port: int = 8080, defaults: Optional[dict] = None,
          max_tokens: int = 256, max_queue: int = 32) -> None:
    """Serve until SIGINT/SIGTERM; in-flight streams end after their current step, then the engine closes."""
    defaults = defaults or {}
    server = Server((host, port), pipe, model_id(pipe.name), defaults, max_tokens, max_queue)
    signals = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
    previous = {sig: signal.signal(sig, lambda *_: server.stop()) for sig in signals}  # SIGHUP: the terminal closed
    host_, port_ = server.server_address[:2]
    server.note(f"serving {server.model_id} (mode {defaults.get('mode', 'mirror')}) on http://{host_}:{port_}/v1 "
                f"(queue {max_queue}); Ctrl-C stops")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.stopping.set()
        server.gate.close()
        server.server_close()  # joins the handler threads
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.note("stopped")
