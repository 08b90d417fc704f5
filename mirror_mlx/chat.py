"""Multi-turn chat: `Pipeline.chat` / `Pipeline.chat_stream` and the `mirror-mlx chat` loop.

The engine reuses the target's and the draft's caches by longest common prefix, so a turn is cheap
only if the token ids of the earlier turns stay exactly as the engine saw them. Re-encoding the whole
conversation would not guarantee that (a reply's generated ids need not be how the tokenizer would
encode its text), so the pipeline remembers the ids it ran (prompt + every committed reply token)
and a new turn appends the new messages' ids to them.
"""

import signal
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, TextIO

from . import validate
from .engine import DecodeOptions, Stats
from .pipeline import Chunk, Pipeline, Result, chunks

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

NO_TEMPLATE = "the model has no chat template: each turn continues the text (plain continuation)"

HELP = """\
/reset  forget the conversation and clear the caches
/stats  totals since the chat started
/help   this list
/quit   quit (Ctrl-D too); Ctrl-C stops a reply and keeps what it wrote
q, r, h  alone on a line: /quit, /reset, /help, as in mlx_lm.chat"""

SHORT_COMMANDS = {"q": "/quit", "r": "/reset", "h": "/help"}  # mlx_lm.chat's, so its users' habits work


@dataclass
class Conversation:
    """The messages the engine has seen and the exact ids it ran for them."""

    messages: list[Message] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stop_token: Optional[int] = None  # the end-of-sequence token that ended the last reply, if any


def state(pipe: Pipeline) -> Conversation:
    if pipe.conversation is None:
        pipe.conversation = Conversation()
    return pipe.conversation


def reset(pipe: Pipeline) -> None:
    """Forget the conversation and clear both caches (the next turn prefills from scratch)."""
    pipe.conversation = Conversation()
    pipe.engine.reset()


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def _same(a: Sequence[Message], b: Sequence[Message]) -> bool:
    return len(a) == len(b) and all(x.get("role") == y.get("role") and x.get("content") == y.get("content")
                                    for x, y in zip(a, b))


def _render(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool, **template_kwargs: Any) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                             tokenize=False, **template_kwargs)
    except Exception as e:  # templates raise for roles or orders they do not support
        raise ValueError(f"the model's chat template refused the conversation: {e}") from None


def _plain(tokenizer: Any, messages: Sequence[Message], first: bool) -> list[int]:
    """Plain continuation: the turns' texts one after another (a BOS only at the very start)."""
    ids: list[int] = []
    for i, m in enumerate(messages):
        ids += tokenizer.encode(m["content"], add_special_tokens=first and i == 0)
    return ids


def _template_tail(tokenizer: Any, conv: Conversation, full: str, **template_kwargs: Any) -> Optional[list[int]]:
    """The ids that follow `conv.tokens` in the rendered `full` text, or None when it cannot tell.

    The text so far is rendered without a generation prompt; it must end with the last reply plus the
    template's closing text (say "<|im_end|>\\n"), and what follows the reply in `full` is encoded.
    When the reply ended on a stop token, that token's text is encoded along and its id dropped, so
    the boundary tokenizes as it would in one piece (SentencePiece would add a space otherwise).
    """
    reply = conv.messages[-1]["content"]
    prev = _render(tokenizer, conv.messages, False, **template_kwargs)
    at = prev.rfind(reply) if reply else -1
    if at < 0 or not full.startswith(prev[: at + len(reply)]):
        return None
    rest = full[at + len(reply) :]
    if conv.stop_token is not None:
        ids = tokenizer.encode(rest, add_special_tokens=False)
        if ids[:1] == [conv.stop_token]:
            return ids[1:]
    return tokenizer.encode(rest, add_special_tokens=False)


def prompt_ids(pipe: Pipeline, messages: Sequence[Message]) -> list[int]:
    """The ids to run for `messages` plus the assistant's turn; the remembered ids stay a prefix
    whenever `messages` extend the remembered conversation (its last reply included)."""
    tokenizer, conv = pipe.tokenizer, state(pipe)
    n = len(conv.messages)
    extends = n > 0 and len(messages) > n and _same(messages[:n], conv.messages)
    if not has_chat_template(tokenizer):
        return conv.tokens + _plain(tokenizer, messages[n:], False) if extends else _plain(tokenizer, messages, True)
    full = _render(tokenizer, messages, True, **pipe.chat_template_kwargs)
    ids = list(tokenizer.encode(full, add_special_tokens=False))
    if not extends or ids[: len(conv.tokens)] == conv.tokens:
        return ids
    tail = _template_tail(tokenizer, conv, full, **pipe.chat_template_kwargs)
    return ids if tail is None else conv.tokens + tail


def stream_reply(pipe: Pipeline, messages: Sequence[Message], **kwargs: Any) -> Iterator[Chunk]:
    """Check the turn now (ValueError, conversation untouched), then yield the reply as it is committed.

    Whatever was committed is remembered, also when the caller stops early (Ctrl-C).
    """
    pipe._check_open()
    messages = [clean_message(m) for m in messages]
    if not messages:
        raise ValueError("the conversation is empty: give at least one message")
    prompt, opts = pipe.prepare(prompt_ids(pipe, messages), **kwargs)  # checked, then auto resolved
    return _reply(pipe, messages, prompt, opts)


def clean_message(m: Any) -> Message:
    """A copy of one message whose text is valid UTF-8 (undecodable bytes replaced, with one warning)."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
        raise TypeError(f"each message must be a dict with a str 'content', not {m!r:.60}")
    content, replaced = validate.clean_text(m["content"])
    if replaced:
        warnings.warn(validate.REPLACED, stacklevel=4)
    return dict(m, content=content)


def _reply(pipe: Pipeline, messages: list[Message], prompt: list[int], opts: DecodeOptions) -> Iterator[Chunk]:
    with pipe._turn():  # the pipeline is held for the whole reply (see Pipeline)
        yield from _reply_held(pipe, messages, prompt, opts)


def _reply_held(pipe: Pipeline, messages: list[Message], prompt: list[int], opts: DecodeOptions) -> Iterator[Chunk]:
    committed: list[int] = []
    text: list[str] = []
    stop: Optional[int] = None
    steps = pipe.engine.generate(prompt, opts)
    try:
        for chunk in chunks(steps, opts, pipe.tokenizer, lambda: pipe.stats):
            committed += chunk.tokens + ([chunk.stop_token] if chunk.stop_token is not None else [])
            stop = chunk.stop_token
            text.append(chunk.text)
            yield chunk
    finally:
        steps.close()
        reply = {"role": "assistant", "content": "".join(text)}
        pipe.conversation = Conversation(messages + [reply], prompt + committed, stop)


def chat(pipe: Pipeline, messages: Sequence[Message], **kwargs: Any) -> Result:
    """`Pipeline.chat`: the whole reply as a Result."""
    if not has_chat_template(pipe.tokenizer) and not pipe.told_plain:
        pipe.told_plain = True
        warnings.warn(NO_TEMPLATE, stacklevel=3)
    parts = list(stream_reply(pipe, messages, **kwargs))
    tokens = [t for c in parts for t in c.tokens]
    stopped = state(pipe).stop_token is not None
    return Result("".join(c.text for c in parts), tokens, pipe.stats, "stop" if stopped else "length")


# --- the `mirror-mlx chat` loop ------------------------------------------------------------------


def stats_line(s: Stats) -> str:
    return s.summary() + f" | prefill {s.prefill_tokens}/{s.prompt_tokens} tokens"


class CtrlC:
    """During a turn, the first Ctrl-C asks the reply to stop after the step in flight (so the engine is
    never cut mid-step and its caches stay consistent); a second one raises KeyboardInterrupt at once,
    unless the reply has already stopped (`ended`): then it is spent on the turn, whose closing
    (the note, the conversation kept) runs whole."""

    def __init__(self) -> None:
        self.requested = False
        self.ended = False
        self._old: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and not self.ended:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


@dataclass
class ChatSession:
    """One `mirror-mlx chat`: the pipeline, the decode settings and the running conversation."""

    pipe: Pipeline
    kwargs: dict
    system_prompt: Optional[str] = None
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    messages: list[Message] = field(default_factory=list)
    total: Stats = field(default_factory=Stats)
    turns: int = 0
    seeded: bool = False
    told_utf8: bool = False  # said once that undecodable input bytes were replaced

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.seeded = False

    def note(self, text: str) -> None:
        """A dim line on stderr (plain when stderr is not a terminal)."""
        import click

        click.secho(text, dim=True, file=self.err)

    def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        name = line.split()[0].lower()
        if name in ("/quit", "/exit", "/q"):
            return False
        if name == "/reset":
            reset(self.pipe)
            self.restart()
            self.note("conversation and caches cleared")
        elif name == "/stats":
            self.note(f"replies: {self.turns}, tokens: {self.total.generation_tokens} | {stats_line(self.total)}"
                      if self.turns else "no replies yet")
        elif name == "/help":
            self.note(HELP)
        else:
            self.note(f"unknown command {name}: /help lists the commands")
        return True

    def turn(self, text: str) -> None:
        """One user turn. Ctrl-C at any point of it stops the reply after the step in flight (a Ctrl-C that
        lands just after the reply ended is spent on it, not on the prompt that follows)."""
        with CtrlC() as ctrl_c:
            self._turn(text, ctrl_c)

    def _turn(self, text: str, ctrl_c: CtrlC) -> None:
        """Refuse the turn if it cannot fit in the context, else stream the reply."""
        text, replaced = validate.clean_text(text)
        if replaced and not self.told_utf8:
            self.told_utf8 = True
            self.note(validate.REPLACED)
        messages = self.messages + [{"role": "user", "content": text}]
        kwargs = dict(self.kwargs)
        if self.seeded:
            kwargs["seed"] = None  # seed once per conversation, not every turn
        try:
            ids = prompt_ids(self.pipe, messages)
        except ValueError as e:
            self.note(f"turn refused: {e}")
            return
        context = self.pipe.engine.context_length
        if context and len(ids) >= context:
            self.note(f"turn refused: the conversation would be {len(ids)} tokens and the model's context is "
                      f"{context}; the conversation is kept (/reset starts over)")
            return
        capped = bool(context) and len(ids) + kwargs.get("max_tokens", DecodeOptions.max_tokens) > context
        if capped:
            kwargs["max_tokens"] = context - len(ids)
        try:
            chunks = stream_reply(self.pipe, messages, **kwargs)
        except ValueError as e:
            self.note(f"turn refused: {e}")
            return
        self.seeded = True
        interrupted = False
        try:
            for chunk in chunks:
                self.out.write(chunk.text)
                self.out.flush()
                if ctrl_c.requested:
                    interrupted = True
                    break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            ctrl_c.ended = True
            chunks.close()
        self.out.write("\n")
        self.out.flush()
        self.messages = list(state(self.pipe).messages)
        s = self.pipe.stats
        self.total = self.total + s
        self.turns += 1
        if interrupted:
            self.note(f"[interrupted: kept {s.generation_tokens} tokens of the reply]")
        elif capped and s.generation_tokens >= kwargs["max_tokens"]:
            self.note(f"[the context ({context} tokens) is full: /reset starts over]")
        self.note(stats_line(s))


def read_line(interactive: bool, stdin: TextIO) -> Optional[str]:
    """The next line, None at end of input (Ctrl-D)."""
    if interactive:
        try:
            return input(">> ")
        except EOFError:
            print()
            return None
    line = stdin.readline()
    return line.rstrip("\r\n") if line else None


def run_chat(pipe: Pipeline, kwargs: dict, system_prompt: Optional[str] = None, stdin: Optional[TextIO] = None,
             out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    """The interactive loop (a pipe works too: each line is a turn). Returns the exit code."""
    stdin = stdin or sys.stdin
    if hasattr(stdin, "reconfigure"):  # undecodable bytes reach the turn as surrogates, replaced there
        stdin.reconfigure(errors="surrogateescape")
    interactive = stdin is sys.stdin and stdin.isatty()
    session = ChatSession(pipe, kwargs, system_prompt, out or sys.stdout, err or sys.stderr)
    if not has_chat_template(pipe.tokenizer):
        session.note(NO_TEMPLATE)
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        name = Path(pipe.name).name if pipe.name else "the model"
        session.note(f"chatting with {name} (mode {kwargs.get('mode', 'mirror')}): "
                     "/help lists the commands, Ctrl-D quits")
    while True:
        try:
            line = read_line(interactive, stdin)
            if line is None:
                return 0
            line = SHORT_COMMANDS.get(line.strip(), line.strip())
            if line.startswith("/"):
                if not session.command(line):
                    return 0
            elif line:
                session.turn(line)
        except KeyboardInterrupt:  # at the prompt (or a second Ctrl-C): a fresh prompt; from a pipe, quit
            if not interactive:
                return 130
            print()
