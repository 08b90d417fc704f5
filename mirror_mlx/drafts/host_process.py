"""The draft host's process:
`python -m mirror_mlx.drafts.host_process [--weights-only] REQ_RING REQ_FD REP_RING REP_FD SPEC`.

`--weights-only` is for mirror-mlx's own builders (host.WEIGHTS_ONLY), which load weights from a local folder
and never a tokenizer (the engine checked it). mlx-lm's `__init__` and `mlx_lm.utils` import transformers and
huggingface_hub: about a second of CPU, two thirds of a host's start, on a core the target's own load wants.
With the flag, `mlx_lm` is registered as a bare package (its `__init__` does not run), and
`mlx_lm.tokenizer_utils` and `huggingface_hub` as modules that refuse to load a tokenizer or download. A
builder of your own gets the plain interpreter.
"""

import importlib.util
import sys
import types


def without_tokenizers() -> None:
    """Make `import mlx_lm.models.*` and `import mlx_lm.utils` skip transformers and huggingface_hub in this
    process."""
    if "mlx_lm" in sys.modules:
        raise RuntimeError("mlx_lm is already imported: without_tokenizers() must come first")
    spec = importlib.util.find_spec("mlx_lm")
    assert spec is not None, "mlx-lm is installed"
    sys.modules["mlx_lm"] = importlib.util.module_from_spec(spec)

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"a draft host started --weights-only {what}")
        return refused

    tokenizers = types.ModuleType("mlx_lm.tokenizer_utils", "mlx-lm's tokenizer module, refused in a weights-only host")
    vars(tokenizers).update(TokenizerWrapper=type("TokenizerWrapper", (), {"__init__": refuse("loads no tokenizer")}),
                            load=refuse("loads no tokenizer"))
    sys.modules["mlx_lm.tokenizer_utils"] = tokenizers
    hub = types.ModuleType("huggingface_hub", "the Hub client, refused in a weights-only host (its folder is local)")
    vars(hub).update(snapshot_download=refuse("downloads nothing (the engine passes a local folder)"))
    sys.modules.setdefault("huggingface_hub", hub)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--weights-only"]:
        without_tokenizers()
        args = args[1:]
    from mirror_mlx.drafts.host import main

    main(args)
