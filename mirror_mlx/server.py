"""`mirror-mlx serve`: an OpenAI-compatible local server with Mirror-SD behind it.

The standard library's ThreadingHTTPServer (as mlx_lm.server) parses HTTP; each connection gets a
thread. One engine decodes one request at a time: the others wait their turn in a bounded FIFO
(`Gate`), and a request that finds it full gets 429 with Retry-After. Between two decode steps the
handler looks at its socket and at the shutdown flag, so a client that went away, or SIGINT/SIGTERM,
stops the generation after the step in flight, when the engine's caches are consistent.

Chat requests go through `Pipeline.chat_stream`, which remembers the token ids of the last
conversation: a request that extends it prefills only the new turn (`cached_tokens` in `usage`).
Across conversations, `PrefixCache` keeps the target's caches of recent requests (mlx-lm's
LRUPromptCache). As in mlx_lm.server: tools go to the chat template and tool calls are parsed with the
tokenizer's own tool parser (`ToolText`); `logprobs` are the target's (Step.logprobs); browser pages
from other origins than the allowed ones (`--allowed-origins`, by default this machine's) get 403.
"""

import copy
import json
import logging
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
from urllib.parse import unquote, urlsplit
from typing import Any, Iterator, Optional, Union

import mlx.core as mx

from . import text, validate
from .stats import Stats
from .options import CHOICES, PAPER_KNOBS
from .pipeline import Pipeline

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_BODY = 16 << 20  # bytes; a prompt this long is far beyond any context anyway
ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_MODEL = "default_model"  # what mlx_lm.server calls the model it was started with
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # --allowed-origins' default: pages served from this machine
# what a request may hold; a field outside these gets a 400 naming it (nothing is ignored in silence)
COMMON = ("model", "stream", "stream_options", "n", "stop", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "min_p", "top_k", "repetition_penalty", "seed", "kappa", "gamma", "exit_layer", "mode",
          "logprobs", "top_logprobs", "user")
FIELDS = {"/v1/chat/completions": COMMON + ("messages", "tools", "tool_choice", "parallel_tool_calls",
                                            "chat_template_kwargs"),
          "/v1/completions": COMMON + ("prompt",)}
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "xtc_probability": 0, "logit_bias": {}}  # off: accepted


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
    tools: Optional[list[dict]] = None  # chat: the functions the model may call (given to the chat template)
    template_kwargs: dict = field(default_factory=dict)  # chat: the request's chat_template_kwargs
    logprobs: bool = False  # answer each token's log-probability under the target
    top_logprobs: int = 0  # and this many of the likeliest tokens at each position
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


def _message(m: Any, i: int) -> dict:
    """One chat message as the chat template takes it: "developer" is "system" (as OpenAI treats it); an
    assistant's tool_calls keep their arguments as objects (templates iterate them, as mlx_lm.server)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise APIError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}",
                       f"messages[{i}]")
    role = "system" if m["role"] == "developer" else m["role"]
    calls = m.get("tool_calls")
    if role == "assistant" and calls is not None:
        _check(isinstance(calls, list), f"messages[{i}].tool_calls", "a list of tool calls", calls)
        out = {"role": role, "content": "" if m.get("content") is None else _content(m, i), "tool_calls": []}
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", "
                                    f"\"arguments\"}}}}", where)
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError as e:
                    raise APIError(400, f"{where}.function.arguments is not valid JSON ({e})",
                                   f"{where}.function.arguments") from None
            out["tool_calls"].append(dict(call, function=dict(fn, arguments=args)))
        return out
    extra = {k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)}
    return {"role": role, "content": _content(m, i), **extra}


def _tools(body: dict) -> tuple[Optional[list[dict]], dict]:
    """The request's tools (or None: none, or tool_choice "none") and its chat template arguments."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    _check(tools is None or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)), "tools",
           "a list of tool objects ({\"type\": \"function\", \"function\": {...}})", tools)
    _check(choice in (None, "auto", "none"), "tool_choice", "\"auto\" or \"none\" (this server cannot force "
           "a call: the model decides)", choice)
    kwargs = body.get("chat_template_kwargs") or {}
    _check(isinstance(kwargs, dict), "chat_template_kwargs", "an object", kwargs)
    return (tools or None) if choice != "none" else None, kwargs


MAX_TOP_LOGPROBS = 20  # as OpenAI's API


def _logprobs(body: dict, endpoint: str) -> tuple[bool, int]:
    """(logprobs wanted, how many top alternatives): chat's `logprobs` is true/false with `top_logprobs`;
    completions' `logprobs` may also be the legacy count of alternatives (0..5)."""
    wanted, top = body.get("logprobs"), _number(body, "top_logprobs", integer=True)
    if endpoint == COMPLETION and isinstance(wanted, int) and not isinstance(wanted, bool):
        _check(0 <= wanted <= 5, "logprobs", "true, false or a count of alternatives in [0, 5]", wanted)
        wanted, top = True, wanted if top is None else top
    _check(wanted is None or isinstance(wanted, bool), "logprobs", "true or false", wanted)
    _check(top is None or 0 <= top <= MAX_TOP_LOGPROBS, "top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]",
           top)
    if top and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return bool(wanted), int(top or 0)


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
    for key, value in body.items():
        if key not in FIELDS[endpoint] and value is not None and not (key in NEUTRAL and value == NEUTRAL[key]):
            raise APIError(400, f"'{key}' is not supported by this server: leave it out (supported: "
                                f"{', '.join(sorted(FIELDS[endpoint]))})", key, "unsupported_parameter")
    model = body.get("model")
    if model is not None and model not in model_ids + (DEFAULT_MODEL,):
        raise APIError(404, f"model {model!r} is not served here: use {model_ids[0]!r} (GET /v1/models lists it)",
                       "model", "model_not_found")
    req = Request(endpoint)
    if endpoint == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' is required: a non-empty list of {role, content} objects", "messages")
        req.messages = [_message(m, i) for i, m in enumerate(messages)]
        req.tools, req.template_kwargs = _tools(body)
        _fits(sum(len(m["content"].encode()) + len(json.dumps(m.get("tool_calls", ""))) for m in req.messages)
              + len(json.dumps(req.tools or "")), max_prompt_bytes, "messages")
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

    parallel = body.get("parallel_tool_calls")
    _check(parallel in (None, True), "parallel_tool_calls", "true (a reply may hold several calls)", parallel)
    req.logprobs, req.top_logprobs = _logprobs(body, endpoint)
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


def held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (held back until the next text)."""
    return max((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), default=0)


class ToolText:
    """Generated text split into plain text and tool calls, between the tokenizer's markers
    (TokenizerWrapper.tool_call_start / tool_call_end, as mlx_lm.server); each call's text goes through
    the tokenizer's own `tool_parser`. A call whose text does not parse stays in the text, with a note."""

    def __init__(self, tokenizer: Any, tools: Optional[list[dict]], note: Any):
        self.on = bool(tools) and tokenizer.has_tool_calling
        self.start, self.end = (tokenizer.tool_call_start, tokenizer.tool_call_end) if self.on else ("", "")
        self.parser, self.tools, self.note = tokenizer.tool_parser if self.on else None, tools, note
        self.held, self.inside, self.made = "", False, 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(plain text safe to send, the tool calls completed by this text)."""
        if not self.on:
            return text, []
        self.held += text
        plain, calls = "", []
        while True:
            if self.inside:
                at = self.held.find(self.end) if self.end else -1
                if at < 0:
                    return plain, calls
                body, self.held, self.inside = self.held[:at], self.held[at + len(self.end):], False
                parsed = self.parse(body)
                plain += self.start + body + self.end if parsed is None else ""
                calls += parsed or []
            else:
                at = self.held.find(self.start)
                if at < 0:
                    keep = held_prefix(self.held, self.start)
                    plain, self.held = plain + self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
                    return plain, calls
                plain, self.held, self.inside = plain + self.held[:at], self.held[at + len(self.start):], True

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: a call still open is parsed as it stands (a format with no end marker ends here)."""
        held, inside, self.held, self.inside = self.held, self.inside, "", False
        if not inside:
            return held, []
        parsed = self.parse(held)
        return (self.start + held, []) if parsed is None else ("", parsed)

    def parse(self, body: str) -> Optional[list[dict]]:
        try:
            parsed = self.parser(body, self.tools)
        except Exception as e:  # (mlx_lm.server drops such a call; here it stays visible in the text)
            self.note(f"a tool call did not parse ({type(e).__name__}: {e}): it is answered as text")
            return None
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            call = dict(call)
            arguments = call.get("arguments", {})
            calls.append({"index": self.made, "id": call.pop("id", None) or f"call_{uuid.uuid4().hex[:24]}",
                          "type": "function", "function": {"name": call.get("name"), "arguments": arguments
                                                           if isinstance(arguments, str) else
                                                           json.dumps(arguments, ensure_ascii=False)}})
            self.made += 1
        return calls


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
    scored: list = field(default_factory=list)  # scored tokens (`score`), not yet answered
    prefixes: Optional["PrefixCache"] = None
    restored: int = 0  # prompt tokens the target started with from the prefix cache (PrefixCache.restore)

    def start(self) -> None:
        """Tokenize and check (ValueError → 400) before anything is sent."""
        pipe, req = self.pipe, self.req
        if req.messages is not None:
            if req.tools and not pipe.tokenizer.has_tool_calling:
                raise APIError(400, "this model's tokenizer has no tool-call format mlx-lm recognizes (its chat "
                                    "template names no tool-call markers): leave out 'tools'", "tools")
            kwargs = dict(pipe.chat_template_kwargs, **req.template_kwargs)
            if req.tools:
                kwargs["tools"] = req.tools
            try:
                ids = text.conversation(pipe.tokenizer, pipe.conversation, req.messages, kwargs)
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
        if self.prefixes is not None:
            self.restored = self.prefixes.restore(ids)
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
            if self.req.logprobs:  # (the end-of-sequence token too, as mlx_lm.server reports it); scored now,
                # so no vocabulary-sized row is kept per token
                ids = chunk.tokens + ([chunk.stop_token] if chunk.stop_token is not None else [])
                rows = chunk.logprobs + ([chunk.stop_logprobs] if chunk.stop_token is not None else [])
                self.scored += [score(self.pipe.tokenizer, t, r, self.req.top_logprobs) for t, r in zip(ids, rows)]
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

    def take_logprobs(self) -> Optional[list[dict]]:
        """The scored tokens not yet answered, as [{id, token, logprob, top_logprobs}] (None: not asked)."""
        if not self.req.logprobs:
            return None
        out, self.scored = self.scored, []
        return out

    def usage(self) -> dict:
        s = self.stats
        cached = max(0, s.prompt_tokens - 1 - s.prefill_tokens)  # the last prompt token runs in the first step
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}


def score(tokenizer: Any, token: int, row: Any, top: int) -> dict:
    """One token's log-probability and the `top` likeliest at its position (as mlx_lm.server, sorted)."""
    names = tokenizer.convert_ids_to_tokens
    entry = {"id": token, "token": names(token), "logprob": row[token].item()}
    if top:
        ids = mx.argpartition(-row, kth=top - 1)[:top]
        values = row[ids]
        order = mx.argsort(-values)
        ids, values = ids[order].tolist(), values[order].tolist()
        entry["top_logprobs"] = [{"id": i, "token": n, "logprob": v} for i, n, v in zip(ids, names(ids), values)]
    else:
        entry["top_logprobs"] = []
    return entry


def openai_logprobs(scored: Optional[list[dict]], chat: bool) -> Optional[dict]:
    """Scored tokens in OpenAI's shape: chat {"content": [...]}, completions {tokens, token_logprobs, top_logprobs}."""
    if scored is None:
        return None
    if chat:
        return {"content": scored}
    return {"tokens": [e["token"] for e in scored], "token_logprobs": [e["logprob"] for e in scored],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in scored]}


# --- the prefix cache across requests ---------------------------------------------------------------


class PrefixCache:
    """The target's caches of recent requests, in mlx-lm's LRUPromptCache (mlx_lm.server's
    --prompt-cache-size): a prompt that shares a longer prefix with one of them than with the engine's
    own cache (the last request's) starts from a copy of it, so a system prompt or a document sent
    again is not prefilled again. Only the target's cache is stored: the draft keeps its one cache and
    re-prefills from its common prefix with the prompt (a small model: cheap). Entries are exact (the
    target's own keys and values for those tokens), so the output is what a fresh run gives."""

    KEY = "target"

    def __init__(self, engine: Any, size: int, max_bytes: Optional[int] = None):
        from mlx_lm.models.cache import LRUPromptCache

        self.engine = engine
        self.lru = LRUPromptCache(size, max_bytes if max_bytes is not None else 1 << 63) if size > 0 else None

    def restore(self, ids: list[int]) -> int:
        """Before a request: start the target from the stored cache nearest `ids`; how many tokens it holds
        (0: the engine's own cache was as good)."""
        if self.lru is None:
            return 0
        return self.engine.target_worker.call(self._restore, ids[:-1])  # (the last token runs in the first step)

    def _restore(self, ids: list[int]) -> int:
        from .draft import common_prefix

        target = self.engine.target
        if target.adopted or target.base:
            return 0
        cache, rest = self.lru.fetch_nearest_cache(self.KEY, ids)
        held = len(ids) - len(rest)
        if cache is None or held <= common_prefix(target.cached, ids):
            return 0
        target.cache, target.cached = cache, list(ids[:held])
        return held

    def store(self) -> None:
        """After a request: keep a copy of the target's cache, keyed by the tokens it holds."""
        if self.lru is not None:
            self.engine.target_worker.call(self._store)

    def _store(self) -> None:
        target = self.engine.target
        if target.cached and not target.adopted and not target.base:
            self.lru.insert_cache(self.KEY, list(target.cached), copy.deepcopy(target.cache))


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
                 max_tokens: int = 512, max_queue: int = 32, log: Any = sys.stderr,
                 allowed_origins: Optional[tuple[str, ...]] = None, log_level: int = logging.INFO,
                 prompt_cache_size: int = 10, prompt_cache_bytes: Optional[int] = None):
        self.request_queue_size = max(64, 2 * max_queue + 8)  # listen backlog: a burst is queued or 429, not reset
        self.reading: set = set()  # connections still sending their request: closed at once on shutdown
        self._reading_lock = threading.Lock()
        super().__init__(address, Handler)
        self.pipe, self.model_id, self.defaults, self.max_tokens = pipe, model_id, defaults, max_tokens
        self.model_ids = tuple(dict.fromkeys([model_id, pipe.name]))
        self.gate = Gate(max_queue)
        self.allowed_origins = allowed_origins  # None: local pages only (origin_allowed)
        self.log_level = log_level  # above INFO: no access log, only failures and the start/stop lines
        self.prefixes = PrefixCache(pipe.engine, prompt_cache_size, prompt_cache_bytes)  # the target's caches of recent prompts
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
                                 "waiting": s.gate.waiting, **s.counts})
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
            self.send_api_error(APIError(404, f"no route GET {path}: try /v1/models or /health", code="not_found"))

    def do_POST(self) -> None:
        s = self.server
        path = self.path.split("?")[0].rstrip("/")
        if self.foreign():
            return
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
        gen = Generation(s.pipe, req, s.max_tokens, prefixes=s.prefixes)
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
                    self.send_event(reply.chunk(reply.delta(piece, made), logprobs=gen.take_logprobs()))
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
        if s.prefixes is not None:
            s.prefixes.store()
        if gen.restored:
            s.note(f"prefix cache: the target started from a stored cache of {gen.restored} prompt tokens "
                   "(the draft re-syncs from its own cache)")
        finish = "tool_calls" if tools.made and gen.finish_reason == "stop" else gen.finish_reason  # as mlx-lm
        extra = {"usage": gen.usage(), "x_mirror": dict(gen.stats.as_dict(), prefix_cache_tokens=gen.restored)}
        try:
            if not req.stream:
                self.send_json(200, reply.whole("".join(text), finish, extra, calls, gen.take_logprobs()))
                return
            rest = "".join(text)
            final = reply.chunk(reply.delta(rest, calls) if rest or calls else
                                ({} if req.messages is not None else ""), finish, gen.take_logprobs())
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

    def delta(self, text: str, calls: list[dict]) -> Union[dict, str]:
        """A stream event's new text (and, in a chat, the tool calls it completed)."""
        if not self.chat:
            return text
        out: dict = {"content": text} if text else {}
        if calls:
            out["tool_calls"] = calls
        return out

    def chunk(self, delta: Union[dict, str, None], finish_reason: Optional[str] = None,
              logprobs: Optional[list[dict]] = None) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": openai_logprobs(logprobs, self.chat)}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = delta or ""
        return dict(self.head(stream=True), choices=[choice])

    def whole(self, text: str, finish_reason: Optional[str], extra: dict, calls: Optional[list[dict]] = None,
              logprobs: Optional[list[dict]] = None) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": openai_logprobs(logprobs, self.chat)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:  # (a whole reply's calls carry no stream index)
                choice["message"]["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        else:
            choice["text"] = text
        return dict(self.head(stream=False), choices=[choice], **extra)


# --- the command ----------------------------------------------------------------------------------


def model_id(name: str) -> str:
    """What /v1/models calls the target: a local folder's name, or the Hugging Face id as given."""
    path = Path(name)
    return path.name if path.exists() else name


def serve(pipe: Pipeline, host: str = "127.0.0.1", port: int = 8080, defaults: Optional[dict] = None,
          max_tokens: int = 512, max_queue: int = 32, allowed_origins: Optional[tuple[str, ...]] = None,
          log_level: int = logging.INFO, prompt_cache_size: int = 10,
          prompt_cache_bytes: Optional[int] = None) -> None:
    """Serve until SIGINT/SIGTERM; in-flight streams end after their current step, then the engine closes.
    `allowed_origins`: the browser origins that may use it (None: pages on this machine only)."""
    defaults = defaults or {}
    server = Server((host, port), pipe, model_id(pipe.name), defaults, max_tokens, max_queue,
                    allowed_origins=allowed_origins, log_level=log_level, prompt_cache_size=prompt_cache_size,
                    prompt_cache_bytes=prompt_cache_bytes)
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
