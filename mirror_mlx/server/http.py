"""HTTP: the server, origins, and each connection's handler (the scheduler decodes: scheduler.py)."""

import json
import logging
import select
import signal
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit
from types import FrameType
from typing import Any, Callable, Optional, TextIO, Union, cast

from ..pipeline import Pipeline
from .request import (CHAT, COMPLETION, DEFAULT_MODEL, LOCAL_HOSTS, MAX_BODY, APIError, Request, max_prompt_bytes,
                      parse_request)
from . import page
from .prefix_cache import PrefixCache
from .reply import Reply, RequestDecode, ToolText
from .scheduler import DECODE_CONCURRENCY, PROMPT_CONCURRENCY, Scheduler


def origin_allowed(origin: str, allowed: Optional[tuple[str, ...]]) -> bool:
    """Whether a page from `origin` may use the server: listed in `allowed` ("*": any), or with
    `allowed` None, served from this machine (http(s)://localhost, 127.0.0.1 or [::1], any port)."""
    if allowed is not None:
        return "*" in allowed or origin.rstrip("/") in allowed
    try:
        parts = urlsplit(origin)
        host = parts.hostname
        parts.port  # noqa: B018 (raises ValueError for a port that is no number)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and host is not None and \
        (host if ":" not in host else f"[{host}]") in LOCAL_HOSTS


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
                 max_tokens: int = 512, max_queue: int = 32, log: TextIO = sys.stderr,
                 allowed_origins: Optional[tuple[str, ...]] = None, log_level: int = logging.INFO,
                 prompt_cache_size: int = 10, prompt_cache_bytes: Optional[int] = None,
                 decode_concurrency: int = DECODE_CONCURRENCY, prompt_concurrency: int = PROMPT_CONCURRENCY,
                 across: Optional[dict] = None, batch_speculation: bool = True):
        self.across = across or {}  # across ranks (mlx.launch): {"ranks": N, what runs differently and why}
        self.request_queue_size = max(64, 2 * max_queue + 8)  # listen backlog: a burst is queued or 429, not reset
        self.reading: set = set()  # connections still sending their request: closed at once on shutdown
        self._reading_lock = threading.Lock()
        super().__init__(address, Handler)
        self.pipe, self.model_id, self.defaults, self.max_tokens = pipe, model_id, defaults, max_tokens
        self.model_ids = tuple(dict.fromkeys([model_id, pipe.name]))
        self.allowed_origins = allowed_origins  # None: local pages only (origin_allowed)
        self.log_level = log_level  # above INFO: no access log, only failures and the start/stop lines
        # the target's caches of recent prompts
        self.prefixes = PrefixCache(pipe.engine, prompt_cache_size, prompt_cache_bytes)
        self.scheduler = Scheduler(pipe, self.prefixes, self.note, max_queue, decode_concurrency, prompt_concurrency,
                                   defaults.get("prefill_step_size") or 2048, batch_speculation)
        self.stopping = threading.Event()
        self.counts = {"requests": 0, "completed": 0, "rejected": 0, "disconnected": 0, "errors": 0}
        self.log = log
        self._count_lock = threading.Lock()
        self.max_prompt_bytes = max_prompt_bytes(pipe.tokenizer, pipe.context_length)

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

    def server_close(self) -> None:
        """Join the handlers, then stop the scheduler (before the caller closes the pipeline)."""
        super().server_close()
        self.scheduler.close()

    def handle_error(self, request: object, client_address: tuple) -> None:
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

    def log_message(self, format: str, *args: object) -> None:
        """One line per request (the access log): at --log-level INFO or DEBUG only."""
        if self.server.log_level > logging.INFO:
            return
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
            origin = self.headers.get("Origin") if self.headers else None
            if origin and origin_allowed(origin, self.server.allowed_origins):  # a browser page it may serve
                allowed = self.server.allowed_origins
                self.send_header("Access-Control-Allow-Origin", "*" if allowed and "*" in allowed else origin)
                self.send_header("Vary", "Origin")
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

    def foreign(self) -> bool:
        """A browser page from an origin not allowed (--allowed-origins) gets 403, its request not run."""
        origin = self.headers.get("Origin")
        if not origin or origin_allowed(origin, self.server.allowed_origins):
            return False
        self.send_api_error(APIError(403, f"requests from pages at {origin!r} are not allowed: start the server "
                                          f"with --allowed-origins {origin} to allow them", code="origin_not_allowed",
                                     kind="permission_error"))
        return True

    def do_OPTIONS(self) -> None:
        """CORS preflight, as mlx_lm.server answers it (for the allowed origins only)."""
        if self.foreign():
            return
        self.send_head(204, {"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                             "Access-Control-Allow-Headers": "Content-Type, Authorization"})

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if self.foreign():
            return
        model = {"id": self.server.model_id, "object": "model", "created": 0, "owned_by": "mirror-mlx"}
        if path == "/health":
            s = self.server
            self.send_json(200, {"status": "stopping" if s.stopping.is_set() else "ok", "model": s.model_id,
                                 "waiting": s.scheduler.queued, **s.counts, **s.scheduler.health(),
                                 "prefix_cache": s.prefixes.health(), **s.across})
        elif path in page.FILES:
            self.send_page(path)
        elif path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [model]})
        elif path.startswith("/v1/models/"):
            name = unquote(path[len("/v1/models/"):])
            if name in self.server.model_ids + (DEFAULT_MODEL,):
                self.send_json(200, model)
            else:
                self.send_api_error(APIError(404, f"model {name!r} is not served here: GET /v1/models lists "
                                                  f"{self.server.model_id!r}", "model", "model_not_found"))
        else:
            self.send_api_error(APIError(404, f"no route GET {path}: try / (the chat page), /v1/models or /health",
                                         code="not_found"))

    def send_page(self, path: str) -> None:
        """A file of the chat page (page.py), or 403 where the page would not be allowed to use the API."""
        h = self.headers
        why = page.refusal(h.get("Host"), h.get("Sec-Fetch-Site"), h.get("Sec-Fetch-Dest"),
                           lambda origin: origin_allowed(origin, self.server.allowed_origins))
        if why is not None:
            self.send_api_error(APIError(403, why, code="origin_not_allowed", kind="permission_error"))
            return
        found = page.read(path)
        assert found is not None, "the caller checked page.FILES"
        data, kind = found
        self.send_head(200, {"Content-Type": kind, "Content-Length": str(len(data)), **page.HEADERS})
        try:
            self.wfile.write(data)
        except OSError as e:
            raise ClientGone(repr(e)) from None

    def do_POST(self) -> None:
        s = self.server
        path = self.path.split("?")[0].rstrip("/")
        if self.foreign():
            return
        if path not in (CHAT, COMPLETION):
            self.send_api_error(APIError(404, f"no route POST {path}: use {CHAT} or {COMPLETION}", code="not_found"))
            return
        s.count("requests")
        gen: Optional[RequestDecode] = None
        try:
            raw = self.read_body()
            s.reading_done(self.connection, False)  # the request is in: shutdown now ends it after a step
            req = parse_request(raw, path, s.model_ids, s.defaults, s.max_prompt_bytes)
            gen = RequestDecode(s.pipe, req, s.max_tokens)
            s.scheduler.submit(gen.start())
        except APIError as e:
            s.count("rejected")
            self.send_api_error(e)
            return
        except ClientGone:
            s.count("disconnected")
            return
        except Exception as e:  # tokenizing or checking failed in a way no field explains: a 500, not a hang-up
            self.engine_failed(e, gen, sent=False)
            return
        try:
            self.serve_one(req, gen)
        finally:
            gen.close()

    def serve_one(self, req: Request, gen: RequestDecode) -> None:
        """Answer one admitted request as the scheduler decodes it."""
        s = self.server
        reply = Reply(req, s.model_id)
        tools = ToolText(s.pipe.tokenizer, req.tools, s.note)
        text: list[str] = []
        calls: list[dict] = []
        try:
            if req.stream:
                self.send_head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                if req.messages is not None:
                    self.send_event(reply.chunk({"role": "assistant", "content": ""}))
            for piece in gen:
                piece, made = tools.feed(piece)
                if req.stream and (piece or made):
                    self.send_event(dict(reply.chunk(reply.delta(piece, made), logprobs=gen.take_logprobs()),
                                         **gen.take_steps()))
                else:
                    text.append(piece)
                    calls += made
                if peer_gone(self.connection):
                    raise ClientGone("closed")
                if s.stopping.is_set():
                    raise Shutdown
            piece, made = tools.flush()
            text.append(piece)
            calls += made
        except ClientGone:
            gen.close()
            s.count("disconnected")
            s.note(f"client went away after {gen.completion_tokens} tokens: generation stopped (its slot is freed "
                   "at the next step)")
            return
        except Shutdown:
            gen.close()
            self.cut_short(req, APIError(503, f"the server is shutting down: the reply was cut after "
                                              f"{gen.completion_tokens} tokens", kind="server_error",
                                         code="shutting_down"))
            return
        except APIError as e:  # the scheduler's: shutting down before it ran
            s.count("rejected")
            self.cut_short(req, e) if req.stream else self.send_api_error(e)
            return
        except Exception as e:
            self.engine_failed(e, gen, sent=req.stream)
            return
        s.count("completed")
        restored = gen.submitted.restored
        if restored:
            s.note(f"prefix cache: the target started from a stored cache of {restored} prompt tokens "
                   "(the draft re-syncs from its own cache)")
        finish = "tool_calls" if tools.made and gen.finish_reason == "stop" else gen.finish_reason  # as mlx-lm
        extra = {"usage": gen.usage(), "x_mirror": dict(gen.submitted.x_stats(), prefix_cache_tokens=restored),
                 **gen.take_steps()}
        try:
            if not req.stream:
                self.send_json(200, reply.whole("".join(text), finish, extra, calls, gen.take_logprobs()))
                return
            rest = "".join(text)
            final = reply.chunk(reply.delta(rest, calls) if rest or calls else
                                ({} if req.messages is not None else ""), finish, gen.take_logprobs())
            final.update({k: v for k, v in extra.items() if k != "usage"})
            self.send_event(final)
            if req.include_usage:
                self.send_event(dict(reply.chunk(None), choices=[], usage=extra["usage"]))
            self.send_event("[DONE]")
        except (ClientGone, OSError):
            s.count("disconnected")

    def cut_short(self, req: Request, error: APIError) -> None:
        try:
            if req.stream:
                self.send_event(error.body())
                self.send_event("[DONE]")
            else:
                self.send_api_error(error)
        except (ClientGone, OSError):
            pass

    def engine_failed(self, e: Exception, gen: Optional[RequestDecode], sent: bool) -> None:
        """500 with a one-line error (the scheduler cleared the caches: a step may have been cut); keep serving."""
        s = self.server
        s.count("errors")
        s.note(f"request failed inside the engine: {type(e).__name__}: {e}\n"
               f"{''.join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()}")
        if gen is not None:
            gen.close()
        line = " ".join(f"{type(e).__name__}: {e}".split())
        error = APIError(500, f"generation failed: {line}", kind="server_error", code="engine_error")
        if sent:
            assert gen is not None, "a reply was sent: its generation began"
            self.cut_short(gen.req, error)
        else:
            try:
                self.send_api_error(error)
            except OSError:
                pass


class Shutdown(Exception):
    """SIGINT/SIGTERM arrived while a request was decoding."""


class ClientGone(Exception):
    """The client closed the connection, reset it, or stopped reading for `Handler.timeout` seconds."""


# --- the command ----------------------------------------------------------------------------------


def serve(pipe: Pipeline, host: str = "127.0.0.1", port: int = 8080, defaults: Optional[dict] = None,
          on_signal: Optional[Callable[[int], None]] = None, **settings: Any) -> None:
    """Serve until SIGINT/SIGTERM; in-flight streams end after their current step, then the engine closes.
    `settings` go to Server; `on_signal` is called first on each of those signals (across ranks: it bounds
    the stop)."""
    defaults = defaults or {}
    name = Path(pipe.name).name if Path(pipe.name).exists() else pipe.name  # /v1/models': a folder's name, or the id
    server = Server((host, port), pipe, name, defaults, **settings)
    signals = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())

    def stop(signum: int, frame: Optional[FrameType]) -> None:
        if on_signal is not None:
            on_signal(signum)
        server.stop()

    previous = {sig: signal.signal(sig, stop) for sig in signals}  # SIGHUP: the terminal closed
    host_, port_ = cast(tuple[str, int], server.server_address[:2])  # (AF_INET: typeshed's union has AF_UNIX's)
    across, scheduler = server.across, server.scheduler
    page_host = "localhost" if host_ in ("0.0.0.0", "") else host_  # (the page's origin must be one allowed)
    if across:
        server.note(f"across {across['ranks']} ranks: batching {across['batching']}; prefix cache "
                    f"{across['prefix_cache_across_requests']}")
    server.note(f"serving {server.model_id} (mode {defaults.get('mode', 'mirror')}) on http://{host_}:{port_}/v1 "
                f"(queue {scheduler.max_queue}, decode concurrency {scheduler.decode_concurrency}, prompt concurrency "
                f"{scheduler.prompt_concurrency}); the chat page at http://{page_host}:{port_}/; Ctrl-C stops")
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.stopping.set()
        server.server_close()  # joins the handler threads, then the scheduler
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.note("stopped")
