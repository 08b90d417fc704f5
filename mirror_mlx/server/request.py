"""Requests: an OpenAI body checked field by field into the generation's settings (one 400 per fault)."""

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union


from .. import validate
from ..options import CHOICES, PAPER_KNOBS


CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_BODY = 16 << 20  # bytes; a prompt this long is far beyond any context anyway
ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_MODEL = "default_model"  # what mlx_lm.server calls the model it was started with
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # --allowed-origins' default: pages served from this machine
# what a request may hold; a field outside these gets a 400 naming it (nothing is ignored in silence)
COMMON = ("model", "stream", "stream_options", "n", "stop", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "min_p", "top_k", "repetition_penalty", "seed", "kappa", "gamma", "exit_layer", "branches",
          "mode", "lookup", "ngram_max", "ngram_min", "logprobs", "top_logprobs", "user")
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
    body = _body(raw, endpoint, model_ids)
    req = Request(endpoint)
    if endpoint == CHAT:
        _chat_input(req, body, max_prompt_bytes)
    else:
        req.prompt = _prompt(body, vocab_size, max_prompt_bytes, context)
    _reply_shape(req, body, endpoint)
    req.options = _decode_options(body, defaults, vocab_size)
    return req


def _body(raw: bytes, endpoint: str, model_ids: tuple[str, ...]) -> dict:
    """The body as a JSON object whose every field this endpoint serves, naming a model served here."""
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
    return body


def _chat_input(req: Request, body: dict, max_prompt_bytes: Optional[int]) -> None:
    """A chat's messages, tools and template arguments."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' is required: a non-empty list of {role, content} objects", "messages")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    req.tools, req.template_kwargs = _tools(body)
    _fits(sum(len(m["content"].encode()) + len(json.dumps(m.get("tool_calls", ""))) for m in req.messages)
          + len(json.dumps(req.tools or "")), max_prompt_bytes, "messages")


def _prompt(body: dict, vocab_size: int, max_prompt_bytes: Optional[int], context: Optional[int]) -> Union[str, list]:
    """A completion's prompt: text, or token ids in the vocabulary that fit the context."""
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
    return prompt


def _reply_shape(req: Request, body: dict, endpoint: str) -> None:
    """How the reply is sent: stream, usage, n, stop strings, tool calls, logprobs, max_tokens."""
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


def _decode_options(body: dict, defaults: dict, vocab_size: int) -> dict:
    """The decode settings: the server's defaults, overridden by the request's fields, each checked."""
    opts = dict(defaults)
    for key, option in (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                        ("repetition_penalty", "repetition_penalty")):
        value = _number(body, key)
        if value is not None:
            opts[option] = float(value)
    lookup = body.get("lookup")
    _check(lookup is None or isinstance(lookup, bool), "lookup", "true or false (the prompt lookup, in mode sd or mirror)",
           lookup)
    if lookup is not None:
        opts["lookup"] = lookup
    for key in ("top_k", "seed", "kappa", "gamma", "exit_layer", "branches", "ngram_max", "ngram_min"):
        value = _number(body, key, integer=True)
        if value is not None:
            opts[key] = value
    _check(opts["temperature"] >= 0, "temperature", "at least 0", opts["temperature"])
    _check(0 < opts["top_p"] <= 1, "top_p", "in (0, 1]", opts["top_p"])
    _check(0 <= opts.get("min_p", 0.0) <= 1, "min_p", "in [0, 1]", opts.get("min_p"))
    _check(opts["top_k"] >= 0, "top_k", "at least 0 (0 turns it off)", opts["top_k"])
    rp = opts.get("repetition_penalty")
    _check(rp is None or rp > 0, "repetition_penalty", "greater than 0", rp)
    _mode_and_knobs(body, opts, vocab_size)
    return opts


def _mode_and_knobs(body: dict, opts: dict, vocab_size: int) -> None:
    """The mode, κ, γ and the branch budget, refused before the request queues where the draft host could not
    hold them."""
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
    if opts.get("branches") is not None:
        try:  # B within 1..κ(γ+1), of the κ and γ this request asks for (the paper's where left out)
            validate.branch_budget(opts["branches"], kappa or PAPER_KNOBS["kappa"], gamma or PAPER_KNOBS["gamma"])
        except ValueError as e:
            raise APIError(400, str(e), "branches") from None


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
