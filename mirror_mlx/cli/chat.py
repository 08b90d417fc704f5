"""`mirror-mlx chat`: the interactive loop over `Pipeline.chat_stream` (a pipe works too: each line is a turn)."""

import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Callable, Optional, TextIO, Union

import click

from mirror_mlx import validate
from mirror_mlx.cli import (decode_options, draft_vocab_option, exit_on_terminate, generation_kwargs, load_pipeline,
                            mlx_lm_load_options, model_options, pipeline_option, template_config, usage_error,
                            xtc_options, xtc_sampler)
from mirror_mlx.cli.refused import refused_options
from mirror_mlx.engine.stats import Stats
from mirror_mlx.options import DecodeOptions
from mirror_mlx.pipeline import NO_TEMPLATE, Pipeline
from mirror_mlx.text import ChatMessage, has_chat_template

HELP = """\
/reset  forget the conversation and clear the caches
/stats  totals since the chat started
/help   this list
/quit   quit (Ctrl-D too); Ctrl-C stops a reply and keeps what it wrote
q, r, h  alone on a line: /quit, /reset, /help, as in mlx_lm.chat"""

SHORT_COMMANDS = {"q": "/quit", "r": "/reset", "h": "/help"}  # mlx_lm.chat's, so its users' habits work


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
        self._old: Union[Callable[[int, Optional[FrameType]], object], int, None] = None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.requested and not self.ended:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
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
    messages: list[ChatMessage] = field(default_factory=list)
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
        click.secho(text, dim=True, file=self.err)

    def command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        name = line.split()[0].lower()
        if name in ("/quit", "/exit", "/q"):
            return False
        if name == "/reset":
            self.pipe.reset()
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
            ids = self.pipe.chat_ids(messages)
            plan = self.pipe.check(ids, cap=True, **kwargs)  # the turn's max_tokens lowered to what the context leaves
            chunks = self.pipe.chat_stream(messages, plan=plan)
        except validate.ContextError as e:
            self.note(f"turn refused: the conversation would be {len(ids)} tokens and the model's context is "
                      f"{e.values['context']}; the conversation is kept (/reset starts over)")
            return
        except ValueError as e:
            self.note(f"turn refused: {e}")
            return
        capped = plan.opts.max_tokens < kwargs.get("max_tokens", DecodeOptions.max_tokens)
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
        self.messages = list(self.pipe.conversation.messages)
        s = self.pipe.stats
        self.total = self.total + s
        self.turns += 1
        if interrupted:
            self.note(f"[interrupted: kept {s.generation_tokens} tokens of the reply]")
        elif capped and s.generation_tokens >= plan.opts.max_tokens:
            self.note(f"[the context ({self.pipe.context_length} tokens) is full: /reset starts over]")
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


@click.command("chat")
@model_options
@draft_vocab_option
@mlx_lm_load_options
@click.option("--system-prompt", default=None, help="A system message that opens the conversation.")
@click.option("--chat-template-config", default=None,
              help='Extra template variables, JSON: \'{"enable_thinking": false}\'.')
@decode_options(max_tokens=256, seed=0)
@xtc_options(min_tokens_to_keep=False)
@pipeline_option
@refused_options("chat")
def chat_cmd(model, draft_model, draft_vocab, exit_adapter, adapter_path, trust_remote_code, pipeline, system_prompt,
             chat_template_config, xtc_probability, xtc_threshold, **decode) -> None:
    """Chat: replies stream as they are committed, earlier turns stay cached; /help lists the commands.

    Every flag of mlx_lm.chat is taken (docs/mlx-lm-flags.md).
    """
    template_kwargs = template_config(chat_template_config)
    exit_on_terminate()
    pipe = load_pipeline(model, draft_model, exit_adapter, decode["mode"], adapter_path, trust_remote_code,
                         pipeline=pipeline, draft_vocab=draft_vocab)
    pipe.chat_template_kwargs = template_kwargs
    kwargs = generation_kwargs(**decode)
    try:
        xtc_sampler(pipe.tokenizer, kwargs, xtc_probability, xtc_threshold)
        pipe.check([0], **dict(kwargs, max_tokens=min(kwargs["max_tokens"], 1)))  # a turn's length is capped
        code = run_chat(pipe, kwargs, system_prompt)
    except (ValueError, TypeError) as e:
        raise usage_error(e)
    finally:
        pipe.close()
    sys.exit(code)
