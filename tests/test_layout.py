"""The package's shape: a folder per concern, no import circle between its modules, and the engine knows
nothing of what sits above it (mode auto, benchmarks, the server, the command line, chat)."""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"mirror_mlx": ROOT / "mirror_mlx", "mirror_mlx.convert": ROOT / "convert",
           "mirror_mlx.ane_draft": ROOT / "ane_draft"}  # as pyproject.toml installs them


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            if package == "mirror_mlx" and path.parts[len(folder.parts)] == "data":
                continue
            rel = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package,) + rel)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports, at the top, inside a function or under `if TYPE_CHECKING:` (a
    type that names a layer above is an arrow up too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import module` names the module; `from m import f`, m
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # (a module's own packages are imported anyway)
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_module_imports_itself_through_others():
    g = graph()
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            cycle = stack[stack.index(m):] + [m]
            if not all(a.startswith(b + ".") for a, b in zip(cycle[1:], cycle)):  # a package's own __init__
                raise AssertionError("import circle: " + " -> ".join(cycle))
            return
        if m in done:
            return
        for n in sorted(g[m]):
            visit(n, stack + [m])
        done.add(m)

    for m in sorted(g):
        visit(m, [])


def reach(g: dict[str, set[str]], start: list[str]) -> set[str]:
    """Everything the modules in `start` import, directly or not."""
    reached, todo = set(), list(start)
    while todo:
        for n in g[todo.pop()] - reached:
            reached.add(n)
            todo.append(n)
    return reached


def inside(g: dict[str, set[str]], *packages: str) -> list[str]:
    return [m for m in g if m.startswith(tuple(p + "." for p in packages)) or m in packages]


def test_the_engine_imports_nothing_from_the_layers_above_it():
    g = graph()
    above = ("mirror_mlx.tune", "mirror_mlx.bench", "mirror_mlx.server", "mirror_mlx.cli", "mirror_mlx.train",
             "mirror_mlx.pipeline", "mirror_mlx.mlx_lm_api", "mirror_mlx.convert")
    reached = reach(g, inside(g, "mirror_mlx.engine"))
    assert not [m for m in reached if m.startswith(above)], sorted(reached)


def test_the_drafts_and_proposers_import_nothing_of_the_loop_or_above():
    """A draft or a proposer is a part the loop drives: it reads the engine's parts (model_parts, recurrent,
    tree, workers), never the loop, the server, mode auto, the command line or training."""
    g = graph()
    above = ("mirror_mlx.engine.loop", "mirror_mlx.server", "mirror_mlx.tune", "mirror_mlx.cli", "mirror_mlx.train",
             "mirror_mlx.pipeline")
    reached = reach(g, inside(g, "mirror_mlx.drafts", "mirror_mlx.proposers"))
    assert "mirror_mlx.engine" not in reached  # (the package's names are the loop's)
    assert not [m for m in reached if m.startswith(above)], sorted(reached)


def test_nothing_at_run_time_imports_training():
    g = graph()
    runtime = inside(g, "mirror_mlx.engine", "mirror_mlx.drafts", "mirror_mlx.proposers", "mirror_mlx.server")
    assert not [m for m in reach(g, runtime) if m.startswith("mirror_mlx.train")]


def test_the_top_of_the_package_is_the_api_and_the_request_path():
    """At most 15 modules at the top of mirror_mlx/; each draft kind, the engine, training, ... in its folder."""
    top = sorted(p.name for p in (ROOT / "mirror_mlx").glob("*.py"))
    assert len(top) <= 15, top


def test_tune_imports_nothing_of_the_pipeline():
    """tune reads a loaded pair through its own narrow view (tune.profile.PairView), never the Pipeline."""
    g = graph()
    reached = reach(g, inside(g, "mirror_mlx.tune"))
    assert not [m for m in reached if m.startswith(("mirror_mlx.pipeline", "mirror_mlx.server", "mirror_mlx.cli"))], \
        sorted(reached)


def test_the_runtime_never_imports_the_builders_or_the_command_line():
    g = graph()
    runtime = ["mirror_mlx.pipeline", "mirror_mlx.server", "mirror_mlx.mlx_lm_api"]
    for m in runtime:
        top = {n for n in g[m]}
        assert not [n for n in top if n.startswith(("mirror_mlx.convert", "mirror_mlx.cli"))], (m, top)


TRAINING = ("mlx.optimizers", "tqdm", "mirror_mlx.train")  # (every trainer: exit adapters, distill, the SS draft)


@pytest.mark.parametrize("module", ["mirror_mlx.engine.loop", "mirror_mlx.server", "mirror_mlx.pipeline"])
def test_the_runtime_loads_no_optimizer_trainer_or_progress_bar(module):
    """What a generation or a server imports, beyond what mlx-lm's own loading and generation import (mlx-lm
    brings tqdm through huggingface_hub), holds no optimizer, no training module and no progress bar."""
    code = (f"import sys, mlx_lm.utils, mlx_lm.generate; before = set(sys.modules); import {module}; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert module in loaded  # (the check sees what the import brought)
    assert not [m for m in loaded if m.startswith(TRAINING)], [m for m in loaded if m.startswith(TRAINING)]


def test_the_graph_sees_the_imports_it_checks():
    """(The tests above can fail: the graph finds the engine's real imports, relative and absolute.)"""
    g = graph()
    assert g["mirror_mlx.engine"] == {"mirror_mlx.engine.loop"}
    assert {"mirror_mlx.engine.target", "mirror_mlx.engine.workers", "mirror_mlx.drafts.host"} <= \
        g["mirror_mlx.engine.loop"]
    assert "mirror_mlx.drafts.ring" in g["mirror_mlx.drafts.host"]
    assert "mirror_mlx.tune.policy" in g["mirror_mlx.pipeline"]


def test_the_draft_host_process_imports_no_target_side():
    """The draft host's process loads the drafts and what they read of a model (model_parts), never the target
    side, sampling or the options: less to import on a core the target's own load wants at the same moment."""
    g = graph()
    reached = reach(g, ["mirror_mlx.drafts.host_process", "mirror_mlx.drafts.mlx_draft", "mirror_mlx.drafts.ss.draft"])
    assert "mirror_mlx.engine.model_parts" in reached
    assert not reached & {"mirror_mlx.engine.target", "mirror_mlx.engine.sampling", "mirror_mlx.options",
                          "mirror_mlx.engine", "mirror_mlx.engine.loop"}, sorted(reached)



def test_the_engines_parts_load_without_its_loop():
    """mirror_mlx.engine gives the loop's names on first use: the parts a draft host imports (model_parts,
    recurrent, workers) run the package's __init__.py, which must not bring the loop and the target side."""
    code = ("import sys, mirror_mlx.engine.model_parts, mirror_mlx.engine.recurrent, mirror_mlx.engine.workers; "
            "print('\\n'.join(m for m in sys.modules if m.startswith('mirror_mlx.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "mirror_mlx.engine.workers" in loaded  # (the check sees what the import brought)
    assert not {"mirror_mlx.engine.loop", "mirror_mlx.engine.target", "mirror_mlx.drafts.host"} & set(loaded), loaded


ENGINE_PARTS = {"target", "target_worker", "target_model", "host", "loop", "local_build", "local_draft", "draft"}
INSIDE = ("mirror_mlx/engine/loop.py", "mirror_mlx/pipeline.py")  # the engine, and the one that builds it


def reaches() -> tuple[list[str], list[str]]:
    """Outside the engine and the pipeline: (`engine.<part>` attribute chains into the engine's parts,
    names of `.target_worker`, `.target.cache` or `.host.<anything>`), each as 'path:line name'."""
    into, named = [], []
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel in INSIDE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            owner = v.attr if isinstance(v, ast.Attribute) else v.id if isinstance(v, ast.Name) else None
            if owner == "engine" and node.attr in ENGINE_PARTS:
                into.append(f"{rel}:{node.lineno} engine.{node.attr}")
            if node.attr == "target_worker" or (owner == "target" and node.attr == "cache" and
                                                isinstance(v, ast.Attribute)) or owner == "host" and \
                    isinstance(v, ast.Attribute):
                named.append(f"{rel}:{node.lineno} .{owner}.{node.attr}")
    return into, named


def test_the_layers_above_use_the_engines_doors_not_its_parts():
    """The server, tune, bench and the doctor go through Engine's doors (on_target, with_target, draft_pid,
    ...) and TargetSide's (own_tokens, give, take, copy), not into the engine's worker, cache or draft host."""
    into, named = reaches()
    assert len(into) <= 6, into
    assert not named, named


def sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(lines of each module over 450, lines of each function over 80) in the installed package."""
    long_modules, long_functions = {}, {}
    for name, path in modules().items():
        src = path.read_text()
        if len(src.splitlines()) > 450:
            long_modules[name] = len(src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_functions[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    return long_modules, long_functions


def test_modules_and_functions_stay_small():
    """Each module and function does one job: at most 2 modules over 450 lines, no function over 80."""
    long_modules, long_functions = sizes()
    assert len(long_modules) <= 2, long_modules
    assert not long_functions, long_functions


def test_the_generation_loop_reads_in_one_screen():
    """Engine.generate, the loop a reader follows top to bottom, fits in 60 lines (each mode's step is its own)."""
    tree = ast.parse((ROOT / "mirror_mlx" / "engine" / "loop.py").read_text())
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "generate")
    assert loop.end_lineno - loop.lineno + 1 <= 60


def compared(tree: ast.AST) -> list[tuple[int, set[str]]]:
    """(line, the names compared directly or in a sum) of each order comparison in `tree`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for o in node.ops):
            sides = [node.left, *node.comparators]
            sides += [part for side in sides if isinstance(side, ast.BinOp) for part in (side.left, side.right)]
            out.append((node.lineno, {s.id if isinstance(s, ast.Name) else s.attr for s in sides
                                      if isinstance(s, (ast.Name, ast.Attribute))}))
    return out


RANGED = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "kappa", "gamma", "branches",
          "ngram_max", "ngram_min", "row_cost", "draft_timeout", "prefill_step_size")


def test_the_context_rule_and_the_range_checks_are_written_once():
    """validate.fit is the one comparison of a prompt with the target's context; each option's range is one
    validate.as_int / as_float call; the server compares none of the options (it answers the check's errors)."""
    ranged: dict[str, list[str]] = {name: [] for name in RANGED}
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        if name.startswith("mirror_mlx.") and name.count(".") >= 1 and not name.startswith(("mirror_mlx.convert",
                                                                                             "mirror_mlx.ane_draft")):
            fits = [line for line, names in compared(tree) if names & {"context", "context_length"}]
            assert name == "mirror_mlx.validate" or not fits, (name, fits)
        if name.startswith("mirror_mlx.server"):
            assert not [line for line, names in compared(tree) if names & set(RANGED)], name
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("as_int", "as_float") and \
                    isinstance(node.args[0], ast.Constant) and node.args[0].value in ranged:
                ranged[node.args[0].value].append(name)
    assert all(where == ["mirror_mlx.validate"] for where in ranged.values()), ranged
    assert [line for line, names in compared(ast.parse(modules()["mirror_mlx.validate"].read_text()))
            if names & {"context"}], "the rule is not where this test looks for it"


def any_annotations() -> list[str]:
    """'path:line' of each parameter, return or variable annotation that names typing's Any (a string annotation
    read as one too): a layer's real type, or a small Protocol where it would be an import up, says more."""
    def names_any(node: ast.AST | None) -> bool:
        for sub in ast.walk(node) if node is not None else ():
            if isinstance(sub, ast.Name) and sub.id == "Any" or isinstance(sub, ast.Attribute) and sub.attr == "Any":
                return True
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                try:
                    if names_any(ast.parse(sub.value, mode="eval")):
                        return True
                except SyntaxError:
                    pass
        return False

    found = []
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                annotations = [x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                               if x is not None] + [node.returns]
            elif isinstance(node, ast.AnnAssign):
                annotations = [node.annotation]
            else:
                continue
            found += [f"{rel}:{node.lineno}" for t in annotations if names_any(t)]
    return found


def test_few_annotations_say_any():
    """Types say what a value is; `Any` is kept for what really is anything (a JSON body's value, say)."""
    found = any_annotations()
    assert len(found) <= 36, found


def imports_in_functions() -> list[tuple[str, int, bool]]:
    """(path, line, whether a comment on its lines says why) of each import statement inside a function body."""
    found = []
    for path in modules().values():
        src = path.read_text()
        comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(src).readline)
                    if tok.type == tokenize.COMMENT}
        seen = set()
        for fn in ast.walk(ast.parse(src)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in seen:
                        seen.add(node.lineno)
                        said = any(line in comments for line in range(node.lineno, node.end_lineno + 1))
                        found.append((path.relative_to(ROOT).as_posix(), node.lineno, said))
    return found


def test_imports_sit_at_the_top_unless_a_comment_says_why():
    """An import inside a function hides what a module needs: each one left is an optional dependency, a module
    only one command or one path loads (the command line's --help, a draft host), and says so on its line."""
    found = imports_in_functions()
    assert len(found) <= 110, len(found)
    assert not [f"{path}:{line}" for path, line, said in found if not said]
