"""Text → token ids, every way a prompt comes in (API, command line, server, chat), written once. Nothing here
validates ids or options: the Pipeline does that once per call."""

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from . import validate

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

ChatMessage = dict  # {"role": "system" | "user" | "assistant", "content": str}


def has_chat_template(tokenizer: object) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def plain(tokenizer: "TokenizerWrapper", text: str) -> list[int]:
    """The tokenizer's own encoding (mlx_lm.generate without a template, /v1/completions)."""
    return list(tokenizer.encode(text))


def as_is(tokenizer: "TokenizerWrapper", text: str) -> list[int]:
    """Text as is (no template), as mlx-lm's stream_generate encodes it: a BOS unless the text has one."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def after_cache(tokenizer: "TokenizerWrapper", text: str) -> list[int]:
    """Text that continues a cached prefix: no template, no BOS."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def template_opening(tokenizer: "TokenizerWrapper", **template_kwargs: object) -> str:
    """What the chat template puts before a user message's content ("" without a template)."""
    if not has_chat_template(tokenizer):
        return ""
    marker = "\x00mirror-mlx\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                         tokenize=False, **template_kwargs)
    return text[: text.index(marker)] if marker in text else ""


def api_prompt(tokenizer: "TokenizerWrapper", text: str, template_kwargs: Optional[dict] = None) -> list[int]:
    """Text goes through the chat template as one user message when the tokenizer has one, unless the text
    already starts with the template's own opening (templated by the caller, as mlx-lm's README does): then
    it is encoded as is, never templated twice."""
    template_kwargs = template_kwargs or {}
    opening = template_opening(tokenizer, **template_kwargs)  # "" without a template
    if not has_chat_template(tokenizer) or (opening and text.startswith(opening)):  # (or templated already)
        return as_is(tokenizer, text)
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              **template_kwargs))


def cli_prompt(tokenizer: "TokenizerWrapper", prompt: str, system_prompt: Optional[str], use_template: bool,
               template_kwargs: dict, cached: bool = False, prefill_response: Optional[str] = None) -> list[int]:
    """The prompt as mlx_lm.generate builds it: through the chat template if `use_template`, else plain.
    `prefill_response`: an open assistant message the model continues. `cached` (--prompt-cache-file): only
    the templated text from the last message's content on (the cached prefix holds what precedes it)."""
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if not use_template:
        return plain(tokenizer, prompt)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    prefill = prefill_response is not None
    if prefill_response is not None:
        messages.append({"role": "assistant", "content": prefill_response})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not prefill,
                                             continue_final_message=prefill, **template_kwargs)
    except Exception as e:  # a template raises for roles it does not know (say, no system role)
        raise ValueError(f"the model's chat template refused the prompt ({e}): drop --system-prompt or "
                         "--prefill-response, or use --ignore-chat-template") from None
    if cached:  # mlx-lm's rule, template variables left out of the probe as mlx-lm leaves them
        probe = tokenizer.apply_chat_template(messages[:-1] + [dict(messages[-1], content="<query>")],
                                              tokenize=False, add_generation_prompt=not prefill,
                                              continue_final_message=prefill)
        text = text[probe.index("<query>"):]
    return after_cache(tokenizer, text)


def cache_prefix(tokenizer: "TokenizerWrapper", prompt: str) -> list[int]:
    """The prefix as mlx_lm.cache_prompt encodes it: an open user message of the chat template (the
    generate prompt continues it), else the plain text."""
    if has_chat_template(tokenizer):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=False,
                                                  continue_final_message=True))
    return plain(tokenizer, prompt)


# --- conversations: the caches are reused by longest common prefix, so a turn is cheap only if the earlier
# turns keep the ids the engine ran (a reply's ids need not be how its text re-encodes): a new turn appends
# the new messages' ids to the remembered ones.


@dataclass
class Conversation:
    """The messages the engine has seen and the exact ids it ran for them."""

    messages: list[ChatMessage] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stop_token: Optional[int] = None  # the end-of-sequence token that ended the last reply, if any


def clean_message(m: object) -> ChatMessage:
    """A copy of one message whose text is valid UTF-8 (undecodable bytes replaced, with one warning)."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
        raise TypeError(f"each message must be a dict with a str 'content', not {m!r:.60}")
    content, replaced = validate.clean_text(m["content"])
    if replaced:
        warnings.warn(validate.REPLACED, stacklevel=3)
    return dict(m, content=content)


def _same(a: Sequence[ChatMessage], b: Sequence[ChatMessage]) -> bool:
    return len(a) == len(b) and all(x.get("role") == y.get("role") and x.get("content") == y.get("content")
                                    for x, y in zip(a, b))


def _render(tokenizer: "TokenizerWrapper", messages: Sequence[ChatMessage], generation_prompt: bool,
            **template_kwargs: object) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                             tokenize=False, **template_kwargs)
    except Exception as e:  # templates raise for roles or orders they do not support
        raise ValueError(f"the model's chat template refused the conversation: {e}") from None


def _turns(tokenizer: "TokenizerWrapper", messages: Sequence[ChatMessage], first: bool) -> list[int]:
    """Plain continuation: the turns' texts one after another (a BOS only at the very start)."""
    return [t for i, m in enumerate(messages)
            for t in tokenizer.encode(m["content"], add_special_tokens=first and i == 0)]


def _template_tail(tokenizer: "TokenizerWrapper", conv: Conversation, full: str,
                   **template_kwargs: object) -> Optional[list[int]]:
    """The ids that follow `conv.tokens` in the rendered `full` text (what follows the last reply), or None when
    it cannot tell. A stop token that ended the reply is encoded along and its id dropped, so the boundary
    tokenizes as it would in one piece (SentencePiece would add a space otherwise)."""
    reply = conv.messages[-1]["content"]
    prev = _render(tokenizer, conv.messages, False, **template_kwargs)
    at = prev.rfind(reply) if reply else -1
    if at < 0 or not full.startswith(prev[: at + len(reply)]):
        return None
    ids = after_cache(tokenizer, full[at + len(reply):])
    return ids[1:] if conv.stop_token is not None and ids[:1] == [conv.stop_token] else ids


def conversation(tokenizer: "TokenizerWrapper", conv: Conversation, messages: Sequence[ChatMessage],
                 template_kwargs: Optional[dict] = None) -> list[int]:
    """The ids to run for `messages` plus the assistant's turn; the remembered ids (`conv`) stay a prefix
    whenever `messages` extend the remembered conversation (its last reply included)."""
    template_kwargs = template_kwargs or {}
    n = len(conv.messages)
    extends = n > 0 and len(messages) > n and _same(messages[:n], conv.messages)
    if not has_chat_template(tokenizer):
        return conv.tokens + _turns(tokenizer, messages[n:], False) if extends else _turns(tokenizer, messages, True)
    full = _render(tokenizer, messages, True, **template_kwargs)
    ids = after_cache(tokenizer, full)
    if not extends or ids[: len(conv.tokens)] == conv.tokens:
        return ids
    tail = _template_tail(tokenizer, conv, full, **template_kwargs)
    return ids if tail is None else conv.tokens + tail
