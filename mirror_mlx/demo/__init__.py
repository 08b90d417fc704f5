"""The embedded demo pair shipped in this folder (see ATTRIBUTION.md): every path written once.

A TinyStories target (Karpathy's stories260K), a separately trained draft with the same 512-token
tokenizer (llama2xs), a Speculative-Streaming draft distilled from the target, and the target's
layer-2 early-exit adapter. `load()` with no model uses them, so a fresh install works offline.
"""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
TARGET = DEMO_DIR / "stories260K"
DRAFT = DEMO_DIR / "llama2xs"
SS_DRAFT = DEMO_DIR / "ss_draft"  # mirror-mlx train-draft, see its training.json
EXIT_ADAPTER = DEMO_DIR / "stories260K_exit2.safetensors"  # mirror-mlx train-exit --exit-layer 2
