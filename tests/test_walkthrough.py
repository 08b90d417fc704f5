"""docs/real-models.md, command by command, on a tiny random 4-bit Qwen3 pair.

The commands are read from the page itself (its bash blocks and its Python block), so the page
cannot drift from what the tools accept. The Hugging Face ids become two tiny qwen3 models with
the demo's 512-token tokenizer and a Qwen3-style chat template (enable_thinking included),
quantized by mlx-lm's converter; budgets (--tokens, --steps, sizes, tune's grid) shrink to seconds.
Only what needs a Mac (a .mlpackage draft at generation time) is left out.
"""

import contextlib
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlx_lm import convert
from mlx_lm.utils import save_config, save_model

from mirror_mlx.cli import main
from tests.models import DATA, TARGET_PATH, tiny_model

PAGE = Path(__file__).resolve().parents[1] / "docs" / "real-models.md"
QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")
SHRINK = {"--tokens": "640", "--steps": "8", "--layers": "2", "--hidden": "64", "--max-tokens": "12"}
EXTRA = {"train-draft": ["--samples", "16", "--seq-len", "40", "--batch-size", "8", "--holdout", "10"],
         "convert": ["--context", "64", "--kappa", "2", "--gamma", "2"], "generate": ["--max-tokens", "12"],
         "tune": ["--quick"]}  # the few-second one; the whole grid: test_distributed_tune.py, test_progress.py


def tiny_qwen3(folder: Path, layers: int, seed: int) -> Path:
    """A random qwen3 with the demo tokenizer, 4-bit (group 32) as `mlx_lm.convert -q` writes it."""
    config = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=512,
                  max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True)
    fp = folder.with_name(folder.name + "-fp32")
    fp.mkdir()
    save_model(fp, tiny_model("qwen3", seed=seed, **config))
    save_config(config, fp / "config.json")
    for name in ("tokenizer.json", "tokenizer.model"):
        shutil.copy(TARGET_PATH / name, fp / name)
    tok = json.loads((TARGET_PATH / "tokenizer_config.json").read_text())
    (fp / "tokenizer_config.json").write_text(json.dumps(dict(tok, chat_template=QWEN3_TEMPLATE)))
    convert(str(fp), str(folder), quantize=True, q_bits=4, q_group_size=32)
    return folder


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("walkthrough")
    ids = {"mlx-community/Qwen3-8B-4bit": tiny_qwen3(root / "Qwen3-8B-4bit", 4, 1),
           "mlx-community/Qwen3-0.6B-4bit": tiny_qwen3(root / "Qwen3-0.6B-4bit", 2, 2)}
    paragraphs = (DATA / "tinystories_train.txt").read_text(encoding="utf-8").split("\n\n")[:200]
    (root / "my-text.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    return root, ids


GGUF_SECTION = "\n## GGUF import and the real pair\n"  # the page's last section: a pair of its own (below)


def page_commands(section: int = 0) -> list[str]:
    """Each `mirror-mlx ...` command of the page's bash blocks, continuation lines joined, comments cut:
    section 0 is the Qwen3 walkthrough, 1 the GGUF section."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text().split(GGUF_SECTION)[section], re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.strip().startswith("mirror-mlx")]


def shrunk(argv: list[str]) -> list[str]:
    """The command with its budgets shrunk (SHRINK) and small sizes added where the page uses defaults (EXTRA)."""
    out = [SHRINK[argv[i - 1]] if i and argv[i - 1] in SHRINK else a for i, a in enumerate(argv)]
    extra = EXTRA.get(out[0], [])
    for i, flag in enumerate(extra):
        if flag.startswith("--") and flag not in out:  # with its value, where one follows it
            out += [flag] + [v for v in extra[i + 1:i + 2] if not v.startswith("--")]
    return out


def test_every_command_on_the_page_runs(workdir, monkeypatch):
    root, ids = workdir
    monkeypatch.chdir(root)
    monkeypatch.setenv("MIRROR_MLX_QUICK_BUDGET", "600")  # tune --quick fails past its cap: none on a loaded machine
    commands = page_commands()
    assert [c.split()[1] for c in commands] == ["generate", "cache-prompt", "generate", "tune", "train-exit",
                                                "generate", "train-draft", "generate", "convert", "convert", "generate"]
    ran = []
    for command in commands:
        for hf_id, folder in ids.items():
            command = command.replace(hf_id, str(folder))
        argv = shrunk(shlex.split(command)[1:])
        if argv[0] == "generate" and argv[argv.index("--draft-model") + 1].endswith(".mlpackage"):
            continue  # the Neural Engine draft runs on macOS only
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 0, (command, result.output)
        if argv[0] == "tune":  # it measured the pair and saved the profile auto uses
            assert "chose " in result.output and "wrote " in result.output
        if argv[0] == "train-exit":  # --tokens bounds the text phase: at most 640 target-written rows
            assert 0 < int(re.search(r"\((\d+) training rows", result.output).group(1)) <= 640
        ran.append(argv[0])
    assert (root / "qwen3-8b-exit.safetensors").is_file() and (root / "qwen3-8b-ss-draft" / "config.json").is_file()
    assert (root / "qwen3-8b-ss-draft.mlpackage").is_dir()
    assert ran.count("generate") == 4 and ran.count("convert") == 2 and ran.count("tune") == 1


def test_the_first_command_prints_the_same_text_in_every_mode(workdir):
    """What the page promises after step 1: ar, sd and mirror agree at --temp 0 and with a seed above it."""
    _, ids = workdir
    first = shlex.split(page_commands()[0])[1:]
    argv = [str(ids.get(a, a)) for a in first] + ["--quiet", "--max-tokens", "24"]
    for extra in ([], ["--temp", "0.7", "--seed", "3"]):
        knobs = ["--kappa", "2", "--gamma", "3"]  # (this test is about the text: no calibration)
        texts = {mode: CliRunner().invoke(main, argv + extra + ["--mode", mode] + knobs).stdout
                 for mode in ("ar", "sd", "mirror")}
        assert texts["ar"] == texts["sd"] == texts["mirror"] and texts["ar"].strip(), extra


def test_the_python_block_runs(workdir):
    _, ids = workdir
    code = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    for hf_id, folder in ids.items():
        code = code.replace(f'"{hf_id}"', repr(str(folder)))
    code = code.replace("max_tokens=256", "max_tokens=16")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    assert "accepted/forward" in out.getvalue() and "length" in out.getvalue()


def test_the_gguf_section_runs_on_the_real_pair(smollm2, tmp_path, monkeypatch):
    """The GGUF section's commands: `real-pair` reuses the session's SmolLM2 pair (so it fetches nothing),
    generate runs it, and import-gguf takes a tiny GGUF in place of the real one (tests/test_gguf.py)."""
    from tests.gguf_files import write_tiny_gguf

    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").symlink_to(smollm2.parent, target_is_directory=True)
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny)
    commands = page_commands(1)
    assert [c.split()[1] for c in commands] == ["real-pair", "generate", "import-gguf"]
    for command in commands:
        argv = shrunk(shlex.split(command.replace("~/.cache/mirror-mlx/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                                                  str(tiny)))[1:])
        result = CliRunner().invoke(main, argv + (["--kappa", "1", "--gamma", "2"] if argv[0] == "generate" else []))
        assert result.exit_code == 0, (command, result.output)
        if argv[0] == "real-pair":
            assert "gguf" not in result.output.split("\n")[0] and "reused" in result.output
    assert (tmp_path / "smollm2-again" / "config.json").is_file()
