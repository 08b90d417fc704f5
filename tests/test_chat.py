"""Chat: earlier turns stay cached (only the new turn is prefilled), replies stay lossless across
turns, and the `mirror-mlx chat` loop behaves through a pipe and through a pseudo-terminal."""

import io
import os
import re
import signal
import subprocess
import warnings

import pytest

from mirror_mlx.cli import chat as chat_mod
from mirror_mlx.cli.chat import run_chat
from mirror_mlx.engine.stats import Stats
from mirror_mlx.options import DecodeOptions
from mirror_mlx.pipeline import Pipeline, load
from tests.models import templated_target
from tests.support import assert_lossless, reference_greedy
from tests.support.chat import ROOT, TURNS, Terminal, cli

SHORT = dict(max_tokens=16, kappa=4, gamma=4)  # short replies keep mirror mode quick on a busy CPU
SHORT_FLAGS = ["--max-tokens", "16", "--kappa", "4", "--gamma", "4"]
PREFILL = re.compile(r"prefill (\d+)/(\d+) tokens")


def converse(pipe, mode, turns=TURNS):
    """A conversation through `Pipeline.chat`: (prompt ids, reply ids incl. stop, stats) per turn."""
    pipe.reset()
    messages, log = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the demo target has no chat template
        for text in turns:
            messages.append({"role": "user", "content": text})
            result = pipe.chat(messages, mode=mode, **SHORT)
            ids = pipe.conversation.tokens
            log.append((ids[: result.stats.prompt_tokens], ids[result.stats.prompt_tokens :], result.stats))
            messages.append({"role": "assistant", "content": result.text})
    return log


@pytest.mark.parametrize("mode", ["mirror", "ar"])
def test_turns_reuse_the_cache_and_stay_lossless(pipe, mode):
    log = converse(pipe, mode)
    assert log[0][2].prefill_tokens == len(log[0][0]) - 1  # reset() emptied the caches
    for i, (prompt, reply, stats) in enumerate(log):
        want = reference_greedy(pipe.model, prompt, SHORT["max_tokens"], eos=pipe.tokenizer.eos_token_ids)
        assert_lossless(reply, want, f"turn {i} is not the target's own text")
        if i:  # the previous prompt and reply are a prefix; only the new turn runs (its last token is pending)
            prev_prompt, prev_reply, _ = log[i - 1]
            assert prompt[: len(prev_prompt) + len(prev_reply)] == prev_prompt + prev_reply
            new = len(prompt) - len(prev_prompt) - len(prev_reply)
            if mode == "ar":
                assert stats.prefill_tokens == new
            else:  # the cache may also hold verified tokens past max_tokens that happen to match the new turn
                assert 1 <= stats.prefill_tokens <= new
            assert stats.prefill_tokens < stats.prompt_tokens // 2


def test_plain_continuation_is_said_once(pipe):
    plain = Pipeline(pipe.model, pipe.tokenizer)  # a fresh pipeline: it has said nothing yet
    try:
        with pytest.warns(UserWarning, match="no chat template"):
            plain.chat([{"role": "user", "content": "Hi"}], max_tokens=2, mode="ar")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plain.chat([{"role": "user", "content": "Hi"}], max_tokens=2, mode="ar")
    finally:
        plain.close()


def test_chat_template_keeps_the_reply_ids_as_prefix(tmp_path):
    """With a template, turn 2's ids are turn 1's prompt, its generated reply, then the new turn."""
    folder = templated_target(tmp_path / "templated")
    p = load(folder)
    try:
        messages = [{"role": "user", "content": "Tell me a story"}]
        first = p.chat(messages, max_tokens=12, mode="ar")
        before = list(p.conversation.tokens)
        assert before[: first.stats.prompt_tokens] == p.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "More"}]
        ids = p.chat_ids(messages)
        closing = "" if first.finish_reason == "stop" else "</s>"  # a reply cut short gets the template's end
        tail = p.tokenizer.encode(closing + "\nuser: More\nassistant: ", add_special_tokens=False)
        assert ids == before + tail
        second = p.chat(messages, max_tokens=12, mode="ar")
        assert second.stats.prefill_tokens == len(tail)
        assert_lossless(p.conversation.tokens[len(ids) :],
                        reference_greedy(p.model, ids, 12, eos=p.tokenizer.eos_token_ids))
        # a reply that ended on </s>: the next turn's ids follow it as if encoded in one piece
        conv = p.conversation
        conv.tokens, conv.stop_token = conv.tokens + [2], 2
        messages = conv.messages + [{"role": "user", "content": "Again"}]
        one_piece = p.tokenizer.encode("</s>\nuser: Again\nassistant: ", add_special_tokens=False)
        alone = p.tokenizer.encode("\nuser: Again\nassistant: ", add_special_tokens=False)
        assert one_piece[0] == 2 and one_piece[1:] != alone  # alone, SentencePiece adds a leading "▁"
        assert p.chat_ids(messages) == conv.tokens + one_piece[1:]
    finally:
        p.close()


def run_lines(pipe, lines, **kwargs):
    """The chat loop in process, fed `lines` as a pipe would; returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    pipe.reset()
    code = run_chat(pipe, dict(SHORT, **kwargs), stdin=io.StringIO("".join(f"{x}\n" for x in lines)),
                    out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_commands_and_bad_input(pipe):
    code, out, err = run_lines(pipe, ["/help", "", "/bogus", TURNS[0], "x " * 600, TURNS[1], "/stats", "/reset",
                                      TURNS[0], "/quit", "never read"], mode="ar")
    assert code == 0
    replies = out.splitlines()
    assert len(replies) == 3 and replies[2] == replies[0]  # the turn after /reset starts over
    assert "/reset" in err and "unknown command /bogus" in err
    assert "turn refused: the conversation would be" in err  # the 600-word turn, nothing generated
    prefill = [tuple(map(int, m)) for m in PREFILL.findall(err)]
    (p1, n1), (p2, n2), total, (p3, n3) = prefill
    assert n2 == n1 + 16 + len(pipe.tokenizer.encode(TURNS[1], add_special_tokens=False))  # refused turn left out
    assert p2 == n2 - n1 - 16  # only the new turn ran: the conversation stayed cached
    assert "replies: 2, tokens: 32" in err and total == (p1 + p2, n1 + n2)
    assert (p3, n3) == (p1, n1)


def test_mlx_lm_chat_short_commands_quit_reset_and_help(pipe):
    code, out, err = run_lines(pipe, ["h", TURNS[0], " r ", TURNS[0], "q", "never read"], mode="ar")
    assert code == 0
    replies = out.splitlines()
    assert len(replies) == 2 and replies[1] == replies[0]  # `r` started over; `q` quit before "never read"
    assert chat_mod.HELP in err and "conversation and caches cleared" in err


def test_interrupt_keeps_what_was_committed(pipe, monkeypatch):
    """Ctrl-C (SIGINT) after the second chunk: the reply stops there, the next turn continues after it."""
    real = pipe.chat_stream
    calls = []

    def interrupted_once(*args, **kwargs):
        chunks = real(*args, **kwargs)
        calls.append(1)

        def gen():
            try:
                for i, c in enumerate(chunks):
                    if i == 1 and len(calls) == 1:
                        signal.raise_signal(signal.SIGINT)
                    yield c
            finally:
                chunks.close()

        return gen()

    monkeypatch.setattr(pipe, "chat_stream", interrupted_once)
    code, out, err = run_lines(pipe, TURNS[:2], mode="mirror")
    assert code == 0
    kept = int(re.search(r"\[interrupted: kept (\d+) tokens", err).group(1))
    assert 0 < kept < 16
    (_, n1), (p2, n2) = [tuple(map(int, m)) for m in PREFILL.findall(err)]
    new = len(pipe.tokenizer.encode(TURNS[1], add_special_tokens=False))
    assert n2 == n1 + kept + new and 1 <= p2 <= new
    ids = pipe.conversation.tokens
    # lossless after the interrupt too
    assert_lossless(ids[n2:], reference_greedy(pipe.model, ids[:n2], 16, eos=pipe.tokenizer.eos_token_ids))


def test_piped_stdin_mirror_equals_ar(pipe):
    lines = [TURNS[0], TURNS[1], "/stats", "/reset", TURNS[0]]
    proc = subprocess.run(cli("chat", *SHORT_FLAGS), input="".join(f"{x}\n" for x in lines), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "embedded demo pair" in proc.stderr and proc.stderr.count("no chat template") == 1
    _, ar_out, _ = run_lines(pipe, lines, mode="ar")
    assert proc.stdout == ar_out and len(ar_out.splitlines()) == 3  # greedy: mirror's replies are ar's
    (p1, n1), (p2, n2), _, (p3, n3) = [tuple(map(int, m)) for m in PREFILL.findall(proc.stderr)]
    assert p2 < n2 // 2 and (p3, n3) == (p1, n1)


def test_missing_model_offline_is_one_sentence():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(cli("chat", "--model", "nobody/no-such-model"), cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "'nobody/no-such-model' is not a local folder" in proc.stderr and "download" in proc.stderr


def test_terminal_ctrl_c_mid_reply_then_ctrl_d():
    term = Terminal("chat", "--max-tokens", "400", "--kappa", "4", "--gamma", "4")  # long replies: time to stop them
    try:
        term.expect(r"Ctrl-D quits")
        term.expect(r">> ")
        term.type("abc")
        term.expect(r"abc")
        term.wait_for_keys()
        term.type("\x03")  # Ctrl-C at the prompt drops the line: a fresh prompt, at the first press
        assert term.expect(r">> ", timeout=30, required=False), f"Ctrl-C at the prompt gave no fresh prompt: {term.log[-500:]!r}"
        term.type(TURNS[0] + "\r")
        term.expect(re.escape(TURNS[0]) + r"\r?\n\W*\w")  # the reply has started streaming
        term.type("\x03")
        kept = int(term.expect(r"\[interrupted: kept (\d+) tokens").group(1))
        assert 0 < kept < 400
        _, prompt = map(int, term.expect(PREFILL.pattern).groups())
        term.expect(r">> ")
        term.type(TURNS[1] + "\r")
        term.expect(re.escape(TURNS[1]) + r"\r?\n\W*\w")
        term.type("\x03")  # stop this one too: its stats line comes either way
        prefill2, prompt2 = map(int, term.expect(PREFILL.pattern).groups())
        new = 7  # "The dog barked." in the demo tokenizer
        assert prompt2 == prompt + kept + new and 1 <= prefill2 <= new  # the interrupted reply stayed
        term.expect(r">> ")
        term.type("/stats\r")
        term.expect(r"replies: 2")
        term.expect(r">> ")
        term.type("\x04")  # Ctrl-D quits
        code = term.proc.wait(timeout=60)
        assert code == 0, f"exit code {code} after {term.log[-500:]!r}"
    finally:
        term.kill()


def test_a_second_ctrl_c_after_the_reply_stopped_is_spent_on_the_turn(pipe, monkeypatch):
    """A second Ctrl-C that lands while the stopped reply is being closed does not cut the turn short:
    the interruption is noted and the reply is kept in the conversation."""
    real = pipe.chat_stream

    def stream(messages, **kwargs):
        chunks = real(messages, **kwargs)

        def ctrl_c_twice():
            try:
                for i, chunk in enumerate(chunks):
                    if i == 1:
                        os.kill(os.getpid(), signal.SIGINT)  # the first: stop after this step
                    yield chunk
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # the second, as the reply closes
                chunks.close()

        return ctrl_c_twice()

    monkeypatch.setattr(pipe, "chat_stream", stream)
    pipe.reset()
    out, err = io.StringIO(), io.StringIO()
    session = chat_mod.ChatSession(pipe, dict(SHORT, mode="mirror"), out=out, err=err)
    try:
        session.turn(TURNS[0])
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C cut the closing of a reply that had already stopped")
    assert re.search(r"\[interrupted: kept \d+ tokens", err.getvalue()) and session.turns == 1
    assert [m["role"] for m in session.messages] == ["user", "assistant"]


def test_options_are_the_decode_options_fields_with_their_defaults(pipe):
    assert pipe.options() == DecodeOptions(stop_tokens=tuple(pipe.tokenizer.eos_token_ids))
    assert pipe.options(kappa=3, stop=False).kappa == 3 and pipe.options(stop=False).stop_tokens == ()
    with pytest.raises(TypeError, match="unknown option 'kapa'"):
        pipe.generate("Hi", kapa=3)


def test_stats_add_up_over_generations():
    a = Stats(mode="mirror", steps=2, reuses=1, decode_seconds=0.5, peak_memory_gb=0.2, timeline=[{"step": 0}])
    b = Stats(mode="ar", steps=3, fallbacks=1, decode_seconds=0.25, peak_memory_gb=0.1, draft_failure="stalled")
    t = a + b
    assert (t.steps, t.reuses, t.fallbacks, t.decode_seconds, t.peak_memory_gb) == (5, 1, 1, 0.75, 0.2)
    assert t.mode == "ar" and t.draft_failure == "stalled" and t.timeline == [{"step": 0}]
    assert sum([a, b], Stats()).as_dict() == t.as_dict() and a.steps == 2  # the operands stay as they were
