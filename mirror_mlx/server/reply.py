"""Replies: stop strings, tool calls, the target's logprobs and the OpenAI records of one generation."""

import json
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import mlx.core as mx

from .. import text, validate
from ..engine.readback import floats, ints, scalar
from ..pipeline import Pipeline
from ..timeline import Steps
from .request import APIError, Request
from .scheduler import Job

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

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
        keep = max((held_prefix(text, s) for s in self.stops), default=0)
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

    def __init__(self, tokenizer: "TokenizerWrapper", tools: Optional[list[dict]], note: Callable[[str], None]):
        self.on = bool(tools) and tokenizer.has_tool_calling
        self.start: str = tokenizer.tool_call_start if self.on else ""
        self.end: str = tokenizer.tool_call_end if self.on else ""
        self.parser: Optional[Callable] = tokenizer.tool_parser if self.on else None
        self.tools, self.note = tools, note
        self.held, self.inside, self.made = "", False, 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(plain text safe to send, the tool calls completed by this text)."""
        if not self.on:
            return text, []
        self.held += text
        plain, calls = "", list[dict]()
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
        assert self.parser is not None, "parsed only when on"
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
class RequestDecode:
    """One request's decode: iterate for the text of each step ("" when a step shows nothing yet, or while
    it waits its turn: the handler then looks at its socket). The scheduler runs it (`Job`)."""

    pipe: Pipeline
    req: Request
    default_max_tokens: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    job: Optional[Job] = None
    scored: list = field(default_factory=list)  # scored tokens (`score`), not yet answered
    steps: Steps = field(default_factory=Steps)  # x_timeline: the reply's step records so far
    drawn: list = field(default_factory=list)  # of them, those not yet answered

    def start(self) -> Job:
        """Tokenize and check (ValueError → 400) before anything is sent; the job to submit."""
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
            assert req.prompt is not None, "a request without messages has its prompt"
            ids = list(req.prompt)
        self.prompt_tokens = len(ids)
        options = dict(req.options, max_tokens=self.default_max_tokens if req.max_tokens is None else req.max_tokens)
        try:  # the one check of every option and the context fit (a default max_tokens is lowered to fit)
            plan = pipe.check(ids, cap=req.max_tokens is None, **options)
        except validate.BadOption as e:
            raise APIError(400, str(e), self.field(e.param),
                           "context_length_exceeded" if isinstance(e, validate.ContextError) else None) from None
        except ValueError as e:  # a chat template's or a prompt cache's own sentence
            raise APIError(400, str(e)) from None
        messages = [text.clean_message(m) for m in req.messages] if req.messages is not None else None
        self.job = Job(plan, messages, logprobs=req.logprobs)
        return self.job

    @property
    def submitted(self) -> Job:
        """The job `start` made (read only after it)."""
        assert self.job is not None, "start first"
        return self.job

    def field(self, param: str) -> str:
        """The request's field for an option: the prompt of a chat is its messages, max_tokens as it was sent."""
        if param == "prompt" and self.req.messages is not None:
            return "messages"
        return self.req.max_tokens_field if param == "max_tokens" else param

    def __iter__(self) -> Iterator[str]:
        stop = StopText(self.req.stop)
        while True:
            try:
                chunk = self.submitted.events.get(timeout=0.2)
            except queue.Empty:
                yield ""
                continue
            if chunk is None:
                break
            if isinstance(chunk, BaseException):
                raise chunk
            if self.req.logprobs:  # (the end-of-sequence token too, as mlx_lm.server reports it); scored now,
                # so no vocabulary-sized row is kept per token
                self.scored += [score(self.pipe.tokenizer, t, r, self.req.top_logprobs)
                                for t, r in zip(chunk.committed, chunk.committed_logprobs)]
            if self.req.timeline and chunk.step is not None:
                self.drawn.append(self.steps.add(chunk.step, chunk.tokens, chunk.token_texts, chunk.from_draft))
            self.completion_tokens = chunk.generation_tokens
            text, hit = stop.feed(chunk.text)
            yield text
            if hit:
                self.finish_reason = "stop"
                self.close()
                return
        yield stop.flush()
        self.finish_reason = self.submitted.finish_reason or "length"

    def close(self) -> None:
        """Stop decoding at the next step boundary (the scheduler frees its slot)."""
        if self.job is not None:
            self.job.cancelled.set()

    def take_logprobs(self) -> Optional[list[dict]]:
        """The scored tokens not yet answered, as [{id, token, logprob, top_logprobs}] (None: not asked)."""
        if not self.req.logprobs:
            return None
        out, self.scored = self.scored, []
        return out

    def take_steps(self) -> dict:
        """{"x_mirror_steps": the step records not yet answered} when the request asked for them (x_timeline)."""
        if not self.req.timeline:
            return {}
        out, self.drawn = self.drawn, []
        return {"x_mirror_steps": out}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.submitted.cached}}


def score(tokenizer: "TokenizerWrapper", token: int, row: mx.array, top: int) -> dict:
    """One token's log-probability and the `top` likeliest at its position (as mlx_lm.server, sorted)."""
    names = tokenizer.convert_ids_to_tokens
    entry = {"id": token, "token": names(token), "logprob": scalar(row[token]), "top_logprobs": []}
    if top:
        ids = mx.argpartition(-row, kth=top - 1)[:top]
        values = row[ids]
        order = mx.argsort(-values)
        top_ids, top_values = ints(ids[order]), floats(values[order])
        entry["top_logprobs"] = [{"id": i, "token": n, "logprob": v}
                                 for i, n, v in zip(top_ids, names(top_ids), top_values)]
    return entry


def openai_logprobs(scored: Optional[list[dict]], chat: bool) -> Optional[dict]:
    """Scored tokens in OpenAI's shape: chat {"content": [...]}, completions {tokens, token_logprobs, top_logprobs}."""
    if scored is None:
        return None
    if chat:
        return {"content": scored}
    return {"tokens": [e["token"] for e in scored], "token_logprobs": [e["logprob"] for e in scored],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in scored]}


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
