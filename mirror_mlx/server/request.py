"""Requests: an OpenAI body read field by field into what to run and how to answer (one 400 per fault)."""

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from .. import validate

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MAX_BODY = 16 << 20  # bytes; a prompt this long is far beyond any context anyway
ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_MODEL = "default_model"  # what mlx_lm.server calls the model it was started with
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # --allowed-origins' default: pages served from this machine
OPTIONS = ("temperature", "top_p", "min_p", "top_k", "repetition_penalty", "seed", "kappa", "gamma", "exit_layer",
           "branches", "mode", "lookup", "ngram_max", "ngram_min")  # the request's decode fields: DecodeOptions'
# what a request may hold; a field outside these gets a 400 naming it (nothing is ignored in silence)
COMMON = ("model", "stream", "stream_options", "n", "stop", "max_tokens", "max_completion_tokens", "logprobs",
          "top_logprobs", "user", "x_timeline") + OPTIONS
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


@dataclass
class Request:
    """One validated request: what to run and how to answer it."""

    endpoint: str
    messages: Optional[list[dict]] = None  # chat
    prompt: Union[str, list[int], None] = None  # completion
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    max_tokens: Any = None  # None: the server's default, capped at what the context leaves
    max_tokens_field: str = "max_tokens"  # or "max_completion_tokens": the field that gave it
    tools: Optional[list[dict]] = None  # chat: the functions the model may call (given to the chat template)
    template_kwargs: dict = field(default_factory=dict)  # chat: the request's chat_template_kwargs
    logprobs: bool = False  # answer each token's log-probability under the target
    top_logprobs: int = 0  # and this many of the likeliest tokens at each position
    timeline: bool = False  # x_timeline: each step's record (timeline.py) in the reply's `x_mirror_steps`
    options: dict = field(default_factory=dict)  # Pipeline.stream / chat_stream keyword arguments


def _integer(body: dict, name: str) -> Optional[int]:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise APIError(400, f"'{name}' must be an integer, got {value!r:.40}", name)
    return value


def _text(value: str) -> str:
    """Text as valid UTF-8: a lone surrogate (JSON allows "\\ud800") becomes U+FFFD, as the API does."""
    return validate.clean_text(value)[0]


def _check(ok: bool, name: str, rule: str, value: object) -> None:
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


def _message(m: object, i: int) -> dict:
    """One chat message as the chat template takes it: "developer" is "system" (as OpenAI treats it); an
    assistant's tool_calls keep their arguments as objects (templates iterate them, as mlx_lm.server)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise APIError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}",
                       f"messages[{i}]")
    role = "system" if m["role"] == "developer" else m["role"]
    calls = m.get("tool_calls")
    if role == "assistant" and calls is not None:
        _check(isinstance(calls, list), f"messages[{i}].tool_calls", "a list of tool calls", calls)
        tool_calls: list[dict] = []
        out = {"role": role, "content": "" if m.get("content") is None else _content(m, i), "tool_calls": tool_calls}
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
            tool_calls.append(dict(call, function=dict(fn, arguments=args)))
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
    wanted, top = body.get("logprobs"), _integer(body, "top_logprobs")
    if endpoint == COMPLETION and isinstance(wanted, int) and not isinstance(wanted, bool):
        _check(0 <= wanted <= 5, "logprobs", "true, false or a count of alternatives in [0, 5]", wanted)
        wanted, top = True, wanted if top is None else top
    _check(wanted is None or isinstance(wanted, bool), "logprobs", "true or false", wanted)
    _check(top is None or 0 <= top <= MAX_TOP_LOGPROBS, "top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]",
           top)
    if top and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return bool(wanted), int(top or 0)


def parse_request(raw: bytes, endpoint: str, model_ids: tuple[str, ...], defaults: dict,
                  max_prompt_bytes: Optional[int] = None) -> Request:
    """Read a request body: its shape (each fault an APIError naming the field and the fix). `defaults` are the
    server's decode settings (the `serve` flags); request fields override them, checked with the prompt's ids by
    the pipeline's one check (`RequestDecode.start`). A text prompt longer than `max_prompt_bytes` cannot fit the
    context: it is refused here, before it is tokenized."""
    body = _body(raw, endpoint, model_ids)
    req = Request(endpoint)
    if endpoint == CHAT:
        _chat_input(req, body, max_prompt_bytes)
    else:
        req.prompt = _prompt(body, max_prompt_bytes)
    _reply_shape(req, body, endpoint)
    req.options = dict(defaults, **{k: body[k] for k in OPTIONS if body.get(k) is not None})
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


def _prompt(body: dict, max_prompt_bytes: Optional[int]) -> Union[str, list]:
    """A completion's prompt: text, or token ids (checked with the options: validate.request)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise APIError(400, "'prompt' is required: a non-empty string or a list of token ids (one prompt "
                            "per request)", "prompt")
    if isinstance(prompt, str):
        prompt = _text(prompt)
        _fits(len(prompt.encode()), max_prompt_bytes, "prompt")
        return prompt
    assert isinstance(prompt, list)  # (ids, checked above)
    return prompt


def _reply_shape(req: Request, body: dict, endpoint: str) -> None:
    """How the reply is sent: stream, usage, n, stop strings, tool calls, logprobs, max_tokens."""
    req.stream = body.get("stream", False)
    _check(isinstance(req.stream, bool), "stream", "true or false", req.stream)
    stream_options = body.get("stream_options") or {}
    _check(isinstance(stream_options, dict), "stream_options", "an object", stream_options)
    req.include_usage = stream_options.get("include_usage", False)
    _check(isinstance(req.include_usage, bool), "stream_options.include_usage", "true or false", req.include_usage)
    n = _integer(body, "n")
    _check(n in (None, 1), "n", "1 (one choice per request)", n)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    _check(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop), "stop",
           "a non-empty string or a list of them", body.get("stop"))
    req.stop = [_text(s) for s in stop]

    parallel = body.get("parallel_tool_calls")
    _check(parallel in (None, True), "parallel_tool_calls", "true (a reply may hold several calls)", parallel)
    req.logprobs, req.top_logprobs = _logprobs(body, endpoint)
    req.timeline = body.get("x_timeline", False)
    _check(isinstance(req.timeline, bool), "x_timeline", "true or false", req.timeline)
    if body.get("max_completion_tokens") is not None:  # (checked with the options, named as sent)
        req.max_tokens, req.max_tokens_field = body["max_completion_tokens"], "max_completion_tokens"
    else:
        req.max_tokens = body.get("max_tokens")


def _fits(n_bytes: int, limit: Optional[int], param: str) -> None:
    if limit and n_bytes > limit:
        raise APIError(413, f"the prompt is {n_bytes} bytes; no prompt over {limit} bytes fits the model's "
                            "context: shorten it", param, "context_length_exceeded")


def max_prompt_bytes(tokenizer: "TokenizerWrapper", context: Optional[int]) -> Optional[int]:
    """An upper bound on the UTF-8 bytes of a prompt that fits `context` tokens: context × the longest
    token's bytes (each token covers at most that much text), doubled for normalization's slack."""
    if not context:
        return None
    longest = max((len(str(k).encode("utf-8", "replace")) for k in tokenizer.get_vocab()), default=16)
    return 2 * context * max(longest, 4)
