"""One place that checks every option and prompt before any work starts (API, CLI and server).

Each check returns the value the engine will use or raises one sentence naming the argument and the fix:
`BadType` (a TypeError: a float token id, a bool knob), `BadValue` (a ValueError: out of range),
`ContextError` (a BadValue: more than the context holds). Each carries `param`, the option at fault, so the
server answers it as its JSON field and the command line as its flag. Nothing is cast silently (`True` is
not a token id, 2.5 not a κ), and nothing here allocates, so a refused call leaves nothing behind.
"""

import json
import math
import numbers
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from .options import DecodeOptions, Plan

from .options import CHOICES, MODES, PAPER_KNOBS, Plan
from .proposers.lookup import NGRAM_LIMIT, NGRAM_MIN, NGRAM_MIN_BESIDE

SEED_RANGE = 2**64  # mx.random.seed takes a uint64; any Python int is mapped into it
# Mirror-SD rolls out κ(γ+1) branches a step, each a row of the draft's cache in the draft host, and
# sends back κ(γ+1)·γ tokens in one ring message (docs/design.md §4). 256 rows keeps the host's memory
# bounded and the reply (at most 256·511 ints for γ < 512) within a ring slot; tune searches at most 8·8.
MAX_BRANCHES = 256


class PairFacts(Protocol):
    """What the check reads of a loaded pair (an Engine is one; nothing here imports it)."""

    @property
    def draft(self) -> object: ...
    @property
    def draftless(self) -> Optional[str]: ...
    @property
    def has_draft(self) -> bool: ...
    @property
    def draft_failure(self) -> Optional[str]: ...
    @property
    def vocab_size(self) -> Optional[int]: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def context_length(self) -> Optional[int]: ...
    @property
    def draft_context(self) -> Optional[int]: ...
    @property
    def exit_adapter(self) -> object: ...

    def exit_layer(self, opts: "DecodeOptions") -> int: ...


class CachedPrefix(Protocol):
    """What the check reads of a prompt cache (prompt_cache.PromptCache)."""

    @property
    def opaque(self) -> int: ...

    def check(self, mode: str, n_layers: int) -> None: ...

    def prompt(self, ids: Sequence[int]) -> list[int]: ...


class _Spelling(dict):
    def __missing__(self, name: str) -> str:
        return name  # an option's API name, as the caller wrote it


class BadOption(Exception):
    """A refused option: `param` names it. The sentence names options as `{name}` in `template` (values are
    given apart), so `spelled` can write them as each front end calls them (the command line: its flags)."""

    def __init__(self, param: str, template: str, **values: object):
        self.param, self.template, self.values = param, template, values
        super().__init__(self.spelled())

    def spelled(self, names: Mapping[str, str] = {}) -> str:
        return self.template.format_map(_Spelling(names, **self.values))


class BadValue(BadOption, ValueError):
    """An option out of range."""


class BadType(BadOption, TypeError):
    """An option of the wrong kind."""


class ContextError(BadValue):
    """A prompt (param "prompt") or max_tokens (param "max_tokens") the target's context cannot hold."""


def _kind(value: object) -> str:
    return type(value).__name__


def _fix(fix: str) -> str:
    return fix and ": " + fix


def as_int(name: str, value: object, lo: int, hi: Optional[int] = None, fix: str = "") -> int:
    """An int (not a bool, not a float that happens to be whole) within lo..hi. `fix` may name options as {name}."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadType(name, "{" + name + "} must be an int, not {kind} ({value!r})" + _fix(fix), kind=_kind(value),
                      value=value)
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if value < lo else f"at most {hi}"
        raise BadValue(name, "{" + name + "} must be {bound} (got {value})" + _fix(fix), bound=bound, value=value)
    return value


def as_float(name: str, value: object, lo: float, hi: float = math.inf, lo_open: bool = False,
             fix: str = "") -> float:
    """A finite real number within [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadType(name, "{" + name + "} must be a number, not {kind} ({value!r})" + _fix(fix), kind=_kind(value),
                      value=value)
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float (JSON's 1e400 written out)
        value = math.inf
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else (
            f"{'above' if lo_open else 'at least'} {lo:g} and finite")
        raise BadValue(name, "{" + name + "} must be {span} (got {value})" + _fix(fix), span=span, value=value)
    return value


def branches(kappa: int, gamma: int, param: str = "kappa") -> int:
    """κ(γ+1), Mirror-SD's branches a step; BadValue naming the limit when the draft host cannot hold them."""
    n = kappa * (gamma + 1)
    if n > MAX_BRANCHES or gamma >= 512:
        raise BadValue(param, "{kappa}={k}, {gamma}={g} asks for {kappa}*({gamma}+1) = {n} draft branches a step; "
                       "the draft host's limit is {limit} (its memory budget and ring slot): lower {kappa} or "
                       "{gamma} (e.g. {kappa}=8, {gamma}=7)", k=kappa, g=gamma, n=n, limit=MAX_BRANCHES)
    return n


def generator_seed(seed: object) -> Optional[int]:
    """Any int seed, mapped into the generator's uint64 range (-1 and 2**64 are fine); None stays None."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise BadType("seed", "{seed} must be an int or None, not {kind} ({value!r})", kind=_kind(seed), value=seed)
    return int(seed) % SEED_RANGE


def prompt_tokens(prompt: object, vocab_size: Optional[int]) -> list[int]:
    """Token ids as a list of ints in [0, vocab_size): no bools, floats or bytes cast silently."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise BadType("prompt", "the prompt is bytes: pass text as str (e.g. data.decode('utf-8', 'replace')) "
                      "or token ids as a list of ints")
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # numpy / mx arrays
        prompt = prompt.tolist()
        prompt = prompt if isinstance(prompt, list) else [prompt]
    if isinstance(prompt, (str, numbers.Number)) or not isinstance(prompt, Sequence):
        raise BadType("prompt", "the prompt must be a str or a sequence of int token ids, not {kind}",
                      kind=_kind(prompt))
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise BadType("prompt", "prompt token {i} is {t!r} ({kind}): token ids must be ints", i=i, t=t,
                          kind=_kind(t))
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            span = f"0..{vocab_size - 1}" if vocab_size else "of non-negative ids"
            raise BadValue("prompt", "prompt token {i} is id {t}, outside the vocabulary {span}: use ids from this "
                           "model's tokenizer", i=i, t=t, span=span)
        ids.append(t)
    if not ids:
        raise BadValue("prompt", "the prompt is empty: give at least one token")
    return ids


def fit(length: int, max_tokens: int, context: Optional[int], cap: bool = False) -> int:
    """The context rule, written once: a prompt of `length` tokens and max_tokens more must fit the target's
    `context`. Returns max_tokens as it runs (`cap`: a ceiling, lowered to what fits: a server's default)."""
    if not context or length + max_tokens <= context:
        return max_tokens
    if length >= context:
        raise ContextError("prompt", "the prompt is {length} tokens but the model's context is {context} tokens: "
                           "shorten the prompt", length=length, context=context)
    if cap:
        return context - length
    raise ContextError("max_tokens", "prompt ({length} tokens) plus {max_tokens} ({n}) exceeds the target's context "
                       "of {context} tokens: shorten the prompt or lower {max_tokens}", length=length, n=max_tokens,
                       context=context)


def clean_text(text: object) -> tuple[str, bool]:
    """(text as valid UTF-8, whether anything was replaced): undecodable bytes (surrogate-escaped, or lone
    surrogates) become U+FFFD; the caller says so once."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {_kind(text)}")
    with suppress(UnicodeEncodeError):
        text.encode("utf-8")
        return text, False
    try:
        raw = text.encode("utf-8", "surrogateescape")  # bytes that came in through sys.argv / stdin
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogatepass")  # lone surrogates from elsewhere
    return raw.decode("utf-8", "replace"), True


def exit_layer(value: object, n_layers: int) -> int:
    """ℓ_e: an int in 1..N-1."""
    from .engine.target import check_exit_layer  # (MLX: the command line's --help imports this module)

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadType("exit_layer", "{exit_layer} must be an int or None, not {kind} ({value!r})", kind=_kind(value),
                      value=value)
    try:
        check_exit_layer(int(value), n_layers)
    except ValueError as e:
        raise BadValue("exit_layer", "{why}", why=str(e)) from None
    return int(value)


def check_layer(adapter: object, exit_layer: int, path: object = "the exit adapter") -> None:
    """Refuse an adapter trained at another exit layer (its state space is another layer's); a widened one
    (convert/widen.py) is exact at every layer of its `exit_layers`."""
    trained = getattr(adapter, "exit_layer", None)
    if trained is not None and exit_layer not in getattr(adapter, "exit_layers", (trained,)):
        raise BadValue("exit_layer", "{path} was trained for exit layer {trained}, not {layer} (use {exit_layer} "
                       "{trained} or train one with `mirror-mlx train-exit --exit-layer {layer}`)", path=path,
                       trained=trained, layer=exit_layer)


REPLACED = "the text was not valid UTF-8: undecodable bytes were replaced with U+FFFD"


def decode_options(opts: "DecodeOptions", modes: Sequence[str], vocab_size: Optional[int], n_layers: int,
                   draft_context: Optional[int] = None) -> "DecodeOptions":
    """The DecodeOptions with every knob checked (κ, γ left out: the paper's) and the seed mapped into the
    generator's range."""
    if not isinstance(opts.mode, str) or opts.mode not in modes:
        raise BadValue("mode", "unknown mode {mode_given!r}: choose one of {modes}", mode_given=opts.mode,
                       modes=", ".join(modes))
    asked = "kappa" if opts.kappa is not None else "gamma"  # the knob to name when κ(γ+1) is too many
    vocab_hint = f"at most the vocabulary size {vocab_size}" if vocab_size else ""
    gamma_hint = f"the draft's context is {draft_context} tokens" if draft_context else ""
    max_tokens = as_int("max_tokens", opts.max_tokens, 1)  # checked in this order: the first bad one is named
    kappa = as_int("kappa", PAPER_KNOBS["kappa"] if opts.kappa is None else opts.kappa, 1, vocab_size,
                   vocab_hint and f"use a width {vocab_hint}")
    gamma = as_int("gamma", PAPER_KNOBS["gamma"] if opts.gamma is None else opts.gamma, 1, draft_context,
                   gamma_hint and f"use a window within it ({gamma_hint})")
    opts = replace(
        opts,
        max_tokens=max_tokens,
        kappa=kappa,
        gamma=gamma,
        exit_layer=None if opts.exit_layer is None else exit_layer(opts.exit_layer, n_layers),
        temperature=as_float("temperature", opts.temperature, 0.0, fix="use 0 for greedy decoding"),
        top_p=as_float("top_p", opts.top_p, 0.0, 1.0, lo_open=True, fix="use 1.0 to turn top-p off"),
        top_k=as_int("top_k", opts.top_k, 0, vocab_size, "use 0 to turn top-k off"),
        min_p=as_float("min_p", opts.min_p, 0.0, 1.0, fix="use 0 to turn min-p off"),
        repetition_penalty=None if opts.repetition_penalty is None else as_float(
            "repetition_penalty", opts.repetition_penalty, 0.0, lo_open=True, fix="use None (or 1.0) to turn it off"),
        seed=generator_seed(opts.seed),
        draft_timeout=as_float("draft_timeout", opts.draft_timeout, 0.0, lo_open=True),
        prefill_step_size=as_int("prefill_step_size", opts.prefill_step_size, 1),
    )
    if opts.mode == "mirror":
        branches(kappa, gamma, asked)
    if opts.branches is not None:
        opts = replace(opts, branches=branch_budget(opts.branches, kappa, gamma))
    return lookup_options(opts)


def lookup_options(opts: "DecodeOptions") -> "DecodeOptions":
    """The prompt lookup's settings (lookup None: off here; the check resolves it first): its n-gram bounds
    within 1..NGRAM_LIMIT, and a mode that takes it (sd or mirror: ar is the target alone)."""
    if opts.lookup is not None and not isinstance(opts.lookup, bool):
        raise BadType("lookup", "{lookup} must be True, False or None, not {kind} ({value!r})",
                      kind=_kind(opts.lookup), value=opts.lookup)
    n_max = as_int("ngram_max", opts.ngram_max, 1, NGRAM_LIMIT, "the lookup's longest n-gram")
    n_min = NGRAM_MIN if opts.ngram_min is None else as_int("ngram_min", opts.ngram_min, 1, n_max,
                                                            "the lookup's shortest n-gram, at most {ngram_max}")
    cost = None if opts.row_cost is None else as_float(
        "row_cost", opts.row_cost, 0.0, 10.0, fix="a verify's cost per row past the first, in one-row forwards; 0 "
        "takes each lookup proposal whole, None the pair's measured one")
    if opts.lookup and opts.mode == "ar":
        raise BadValue("mode", "{mode='ar'} is the target alone and takes no lookup: use {mode='sd'} with "
                       "{lookup=True}, or leave {lookup=True} out")
    return replace(opts, ngram_max=n_max, ngram_min=n_min, row_cost=cost)


def request(engine: PairFacts, tokens: object, asked: "DecodeOptions", prompt_cache: Optional[CachedPrefix] = None,
            cap: bool = False) -> "Plan":
    """The one check of a call against the pair (`engine`'s facts), before any work starts: the options, the
    prompt ids and the context fit, as a `Plan`. Mode auto is checked as its stand-in (mirror; without a draft
    model sd with the lookup, else ar). With a `prompt_cache`, `tokens` follow its prefix."""
    if not isinstance(asked.mode, str) or asked.mode not in CHOICES:
        raise BadValue("mode", "unknown mode {given!r}: choose one of {modes}", given=asked.mode,
                       modes=", ".join(CHOICES))
    mode = asked.mode
    if mode == "auto":
        wants = asked.lookup or (asked.lookup is None and engine.draftless is not None)
        mode = "mirror" if engine.draft is not None else "sd" if wants or engine.draftless == "recycle" else "ar"
    lookup = engine.draftless is not None and mode == "sd" if asked.lookup is None else asked.lookup
    n_min = asked.ngram_min
    if n_min is None:  # 1 for the lookup alone, NGRAM_MIN_BESIDE beside a draft model (measured: docs/design.md)
        n_min = NGRAM_MIN if not engine.has_draft else NGRAM_MIN_BESIDE
        if isinstance(asked.ngram_max, int) and asked.ngram_max >= 1:  # (a bad ngram_max is refused as such)
            n_min = min(n_min, asked.ngram_max)
    opts = decode_options(replace(asked, mode=mode, lookup=lookup, ngram_min=n_min), MODES, engine.vocab_size,
                          engine.n_layers, engine.draft_context)
    if opts.mode != "ar" and not engine.has_draft and engine.draft_failure is None and not (
            opts.mode == "sd" and (opts.lookup or engine.draftless == "recycle")):
        also = f"; the {engine.draftless} draft runs in {{mode='sd'}}" if engine.draftless else ""
        raise BadValue("mode", "mode {given!r} needs a draft model: pass {draft_model} (a model, or \"lookup\" for "
                       "sd), or use {mode='ar'}" + also, given=opts.mode)
    layer = exit_layer(engine.exit_layer(opts), engine.n_layers)
    if engine.exit_adapter is not None and opts.mode == "mirror":
        check_layer(engine.exit_adapter, layer)
    ids = prompt_tokens(tokens, engine.vocab_size)
    length = len(ids)
    if prompt_cache is not None:
        prompt_cache.check(opts.mode, engine.n_layers)
        ids = prompt_cache.prompt(ids)
        length = len(ids) + prompt_cache.opaque
    if opts.max_kv_size is not None and length + opts.max_tokens > opts.max_kv_size:
        raise BadValue("max_kv_size", "{max_kv_size} {size} is smaller than the prompt ({length} tokens) plus "
                       "{max_tokens} ({n}): a rotating cache cannot roll back rejected draft tokens, so only a size "
                       "the whole generation fits in is taken (then it equals mlx-lm's); raise it or lower "
                       "{max_tokens}", size=opts.max_kv_size, length=length, n=opts.max_tokens)
    n = fit(length, opts.max_tokens, engine.context_length, cap)
    return Plan(ids, replace(opts, max_tokens=n), replace(asked, max_tokens=n), prompt_cache)


def branch_budget(value: object, kappa: int, gamma: int) -> int:
    """B, the branches a mirror step rolls out: an int within 1..κ(γ+1) (None, every branch, is not checked)."""
    n = kappa * (gamma + 1)
    return as_int("branches", value, 1, n, f"a step has {{kappa}}*({{gamma}}+1) = {kappa}*({gamma}+1) = {n} to "
                  f"choose from, so give a budget from 1 to {n}, or leave it unset (None) to roll out all of them")


def draft_vocab(value: object, has_draft: bool, vocab_size: Optional[int] = None) -> Optional[int]:
    """V, the ids a trimmed draft head scores (drafts/vocab.py): None (the whole head), or an int within 1..the draft's
    vocabulary (`vocab_size`, once known); V equal to it keeps the whole head. Only with a draft model."""
    if value is None:
        return None
    if not has_draft:
        raise BadValue("draft_vocab", "{draft_vocab} trims a draft model's head, and there is no draft model: give "
                       "{draft_model} (a model folder), or leave {draft_vocab} out")
    ids = f"of its {vocab_size} ids " if vocab_size else "ids "
    return as_int("draft_vocab", value, 1, vocab_size, f"give how many {ids}the draft scores, or leave {{draft_vocab}} "
                  "out for the whole head")


def model_folder(path: Path) -> Path:
    """A local model folder that mlx-lm can load, or one sentence naming the file at fault and the fix (what
    mlx-lm would report without a file name, or with a traceback)."""
    if not path.is_dir():
        raise ValueError(f"model path {path} is a file, not a folder: give the model's folder "
                         "(the one holding config.json and the *.safetensors weights)")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"{path} has no config.json: give an mlx-lm model folder (config.json + *.safetensors, "
                         "e.g. written by mlx_lm.convert)")
    _json_object(config, "re-download or re-convert the model")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{path} has no *.safetensors weights: re-download or re-convert the model")
    for w in weights:
        _check_safetensors(w)
    tokenizer = path / "tokenizer.json"
    if tokenizer.is_file():
        _check_merges(tokenizer, _json_object(tokenizer, "re-download or re-export the tokenizer"))
    return path


def _json_object(file: Path, fix: str) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{file} is not UTF-8 text: {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object: {fix}")
    return data


def _check_safetensors(file: Path) -> None:
    """A safetensors file starts with an 8-byte header length; the header must fit in the file."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
    header = int.from_bytes(head, "little") if len(head) == 8 else None
    if size == 0 or header is None or header + 8 > size:
        what = "empty" if size == 0 else f"truncated or not a safetensors file ({size} bytes)"
        raise ValueError(f"weights file {file} is {what}: re-download or re-convert the model")


def _check_merges(file: Path, data: dict) -> None:
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return
    vocab = model["vocab"]
    for merge in model.get("merges") or ():
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        for token in pair:
            if token not in vocab:
                raise ValueError(f"{file}: the merge {' '.join(map(str, pair))!r} names the token {token!r}, which "
                                 "is not in its vocabulary: re-download or re-export the tokenizer")
