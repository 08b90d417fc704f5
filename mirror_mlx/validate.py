"""One place that checks every option and prompt before any work starts (API, CLI and server).

Each check either returns the value the engine will use or raises one sentence that names the
argument and the fix: TypeError for the wrong kind of value (a float token id, a bool knob), ValueError
for a value out of range. Nothing is cast silently: `True` is not a token id and 2.5 is not a κ.
Nothing here allocates (no shared memory, no model work), so a refused call leaves nothing behind.
"""

import json
import math
import numbers
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

SEED_RANGE = 2**64  # mx.random.seed takes a uint64; any Python int is mapped into it
# Mirror-SD rolls out κ(γ+1) branches a step, each a row of the draft's cache in the draft host, and
# sends back κ(γ+1)·γ tokens in one ring message (docs/design.md §4). 256 rows keeps the host's memory
# bounded and the reply (at most 256·511 ints for γ < 512) within a ring slot; tune searches at most 8·8.
MAX_BRANCHES = 256


def _kind(value: Any) -> str:
    return type(value).__name__


def as_int(name: str, value: Any, lo: int, hi: Optional[int] = None, fix: str = "") -> int:
    """An int (not a bool, not a float that happens to be whole) within lo..hi."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {_kind(value)} ({value!r}){fix and ': ' + fix}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if value < lo else f"at most {hi}"
        raise ValueError(f"{name} must be {bound} (got {value}){fix and ': ' + fix}")
    return value


def as_float(name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False,
             fix: str = "") -> float:
    """A finite real number within [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {_kind(value)} ({value!r}){fix and ': ' + fix}")
    value = float(value)
    low_ok = value > lo if lo_open else value >= lo
    if not (math.isfinite(value) and low_ok and value <= hi):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else (
            f"{'above' if lo_open else 'at least'} {lo:g} and finite")
        raise ValueError(f"{name} must be {span} (got {value}){fix and ': ' + fix}")
    return value


def branches(kappa: int, gamma: int) -> int:
    """κ(γ+1), Mirror-SD's branches a step; ValueError naming the limit when the draft host cannot hold them."""
    n = kappa * (gamma + 1)
    if n > MAX_BRANCHES or gamma >= 512:
        raise ValueError(f"kappa={kappa}, gamma={gamma} asks for kappa*(gamma+1) = {n} draft branches a step; "
                         f"the draft host's limit is {MAX_BRANCHES} (its memory budget and ring slot): "
                         f"lower kappa or gamma (e.g. kappa=8, gamma=7)")
    return n


def generator_seed(seed: Any) -> Optional[int]:
    """Any int seed, mapped into the generator's uint64 range (-1 and 2**64 are fine); None stays None."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None, not {_kind(seed)} ({seed!r})")
    return int(seed) % SEED_RANGE


def prompt_tokens(prompt: Any, vocab_size: Optional[int]) -> list[int]:
    """Token ids as a list of ints in [0, vocab_size): no bools, floats or bytes cast silently."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError("the prompt is bytes: pass text as str (e.g. data.decode('utf-8', 'replace')) "
                        "or token ids as a list of ints")
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # numpy / mx arrays
        prompt = prompt.tolist()
        prompt = prompt if isinstance(prompt, list) else [prompt]
    if isinstance(prompt, (str, numbers.Number)) or not isinstance(prompt, Sequence):
        raise TypeError(f"the prompt must be a str or a sequence of int token ids, not {_kind(prompt)}")
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt token {i} is {t!r} ({_kind(t)}): token ids must be ints")
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            span = f"0..{vocab_size - 1}" if vocab_size else "of non-negative ids"
            raise ValueError(f"prompt token {i} is id {t}, outside the vocabulary {span}: "
                             "use ids from this model's tokenizer")
        ids.append(t)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    return ids


def clean_text(text: Any) -> tuple[str, bool]:
    """Text as valid UTF-8: undecodable bytes (surrogate-escaped, or lone surrogates) become U+FFFD.

    Returns (text, replaced); the caller says once that something was replaced.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {_kind(text)}")
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")  # bytes that came in through sys.argv / stdin
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogatepass")  # lone surrogates from elsewhere
    return raw.decode("utf-8", "replace"), True


def exit_layer(value: Any, n_layers: int) -> int:
    """ℓ_e as asked: an int in 1..N-1."""
    from .target import check_exit_layer

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"exit_layer must be an int or None, not {_kind(value)} ({value!r})")
    check_exit_layer(int(value), n_layers)
    return int(value)


REPLACED = "the text was not valid UTF-8: undecodable bytes were replaced with U+FFFD"


def decode_options(opts: Any, modes: Sequence[str], vocab_size: Optional[int], n_layers: int,
                   draft_context: Optional[int] = None) -> Any:
    """The DecodeOptions with every knob checked and the seed mapped into the generator's range."""
    from .options import PAPER_KNOBS

    if opts.mode == "auto" and "auto" not in modes:
        raise ValueError("mode 'auto' is resolved by the Pipeline (Pipeline.resolve) before the engine runs: "
                         "give the engine a concrete mode, one of " + ", ".join(modes))
    if not isinstance(opts.mode, str) or opts.mode not in modes:
        raise ValueError(f"unknown mode {opts.mode!r}: choose one of {', '.join(modes)}")
    opts = replace(opts, kappa=PAPER_KNOBS["kappa"] if opts.kappa is None else opts.kappa,
                   gamma=PAPER_KNOBS["gamma"] if opts.gamma is None else opts.gamma)
    vocab_hint = f"at most the vocabulary size {vocab_size}" if vocab_size else ""
    gamma_hint = f"the draft's context is {draft_context} tokens" if draft_context else ""
    opts = replace(
        opts,
        max_tokens=as_int("max_tokens", opts.max_tokens, 1),
        kappa=as_int("kappa", opts.kappa, 1, vocab_size, vocab_hint and f"use a width {vocab_hint}"),
        gamma=as_int("gamma", opts.gamma, 1, draft_context, gamma_hint and f"use a window within it ({gamma_hint})"),
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
        branches(opts.kappa, opts.gamma)
    if opts.branches is not None:
        opts = replace(opts, branches=branch_budget(opts.branches, opts.kappa, opts.gamma))
    return lookup_options(opts)


def lookup_options(opts: Any) -> Any:
    """The prompt lookup's settings (lookup None: off here; the engine resolves it first): its n-gram bounds
    within 1..NGRAM_LIMIT, and a mode that takes it (sd or mirror: ar is the target alone)."""
    from .lookup import NGRAM_LIMIT, NGRAM_MIN

    if opts.lookup is not None and not isinstance(opts.lookup, bool):
        raise TypeError(f"lookup must be True, False or None, not {_kind(opts.lookup)} ({opts.lookup!r})")
    n_max = as_int("ngram_max", opts.ngram_max, 1, NGRAM_LIMIT, "the lookup's longest n-gram")
    n_min = NGRAM_MIN if opts.ngram_min is None else as_int("ngram_min", opts.ngram_min, 1, n_max,
                                                            "the lookup's shortest n-gram, at most ngram_max")
    cost = None if opts.row_cost is None else as_float(
        "row_cost", opts.row_cost, 0.0, 10.0, fix="a verify's cost per row past the first, in one-row forwards; 0 "
        "takes each lookup proposal whole, None the pair's measured one")
    if opts.lookup and opts.mode == "ar":
        raise ValueError("mode='ar' is the target alone and takes no lookup: use mode='sd' with lookup=True, "
                         "or leave lookup=True out")
    return replace(opts, ngram_max=n_max, ngram_min=n_min, row_cost=cost)


def branch_budget(value: Any, kappa: int, gamma: int) -> int:
    """B, the branches a mirror step rolls out: an int within 1..κ(γ+1) (None, every branch, is not checked)."""
    n = kappa * (gamma + 1)
    return as_int("branches", value, 1, n, f"a step has kappa*(gamma+1) = {kappa}*({gamma}+1) = {n} to choose "
                  f"from, so give a budget from 1 to {n}, or leave it unset (None) to roll out all of them")


def model_folder(path: Path) -> Path:
    """A local model folder that mlx-lm can load, or one sentence naming the file at fault and the fix.

    Checks what mlx-lm would otherwise report without a file name (or with a traceback): the path is a
    folder, config.json exists and is a JSON object, no weights file is empty or truncated, and the
    merges of a BPE tokenizer.json name only tokens of its vocabulary.
    """
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
