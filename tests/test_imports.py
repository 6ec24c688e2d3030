"""The package's modules import each other without a cycle, counting imports inside functions
(a lazy import hides a cycle from Python, not from a reader): what two modules share lives in a
module below both (e.g. gears/train/saved_model.py below gears/compat/api.py and
gears/eval/predicted_cells.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its text (AST, not executed)."""
    files = {}
    for path in (root / "gears").rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        files[name] = path
    graph = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [m for m in submodules if m in files] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package():
    graph = import_graph(ROOT)
    assert "gears.compat.api" in graph and "gears.eval.predicted_cells" in graph
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_cycle(tmp_path):
    """A cycle through an import inside a function is found (as gears.compat.api <->
    gears.eval.predicted_cells
    was, before gears/train/saved_model.py)."""
    (tmp_path / "gears").mkdir()
    (tmp_path / "gears" / "__init__.py").write_text("")
    (tmp_path / "gears" / "a.py").write_text("from gears.b import f\n")
    (tmp_path / "gears" / "b.py").write_text("def f():\n    from gears import a\n")
    assert cycles(import_graph(tmp_path)) == [["gears.a", "gears.b"]]


def test_the_data_layer_imports_nothing_above_it():
    """gears/data/ sits below the configuration: a data module may import only modules that
    never lead back into gears/data (the shared text choices come from gears/choices.py, so
    gears.config imports the data layer and never the reverse)."""
    graph = import_graph(ROOT)

    def reaches_data(module: str, seen: set[str]) -> bool:
        for t in graph[module] - seen:
            seen.add(t)
            if t.startswith("gears.data.") or reaches_data(t, seen):
                return True
        return False

    upward = {
        (m, t)
        for m in graph
        if m.startswith("gears.data.")
        for t in graph[m]
        if not t.startswith("gears.data") and reaches_data(t, set())
    }
    assert upward == set(), upward


def function_lengths(path: Path) -> dict[str, int]:
    """qualified name -> lines (def line to last line) of every function in a module."""
    lengths = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")

    visit(ast.parse(path.read_text()), "")
    return lengths


def test_the_run_trains_and_scores_without_the_facade():
    """gears/cli/job.py builds the network and the Trainer (gears/train/build.py) and scores
    through one
    module (gears/eval/scoring.py), not through the GEARS facade, which is cell-gears's API for
    notebooks; and reads top to bottom in functions of at most 60 lines. (Seen failing when
    _run was 155 lines and made a GEARS: it imported gears.compat.api.)"""
    graph = import_graph(ROOT)
    assert "gears.compat.api" not in graph["gears.cli.job"]
    assert {"gears.train.build", "gears.eval.scoring"} <= graph["gears.cli.job"]
    assert "gears.compat.api" not in graph["gears.eval.scoring"] | graph["gears.train.build"]
    assert {"gears.train.build", "gears.eval.predictor"} <= graph["gears.compat.api"]
    long = {n: k for n, k in function_lengths(ROOT / "gears" / "cli" / "job.py").items() if k > 60}
    assert long == {}, long


# The package's floors, bottom to top (docs/tour.md): a module imports, anywhere in its text,
# only modules on its own floor or below. gears/config.py checks data.synthetic's keys against
# gears/data/synthetic.py, so the configuration stands on the data layer; gears/__init__.py
# hands the cell-gears names (PertData, GEARS) on from the top and is on no floor.
LAYERS = (
    ("gears.errors", "gears.choices", "gears.device", "gears.io", "gears.torch_compat"),
    ("gears.data",),
    ("gears.config",),
    ("gears.model",),
    ("gears.train",),
    ("gears.eval",),
    ("gears.compat",),
    ("gears.cli",),
)


def layer_of(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(module, imported) pairs where the imported module stands on a higher floor."""
    return {
        (m, t)
        for m in graph
        if m != "gears"
        for t in graph[m]
        if layer_of(t) is not None and layer_of(t) > layer_of(m)
    }


def test_every_module_stands_on_a_floor():
    graph = import_graph(ROOT)
    assert {m for m in graph if m != "gears" and layer_of(m) is None} == set()


def test_no_module_imports_a_higher_floor():
    """(Seen failing with gears/data/de.py importing gears.train.runtime for the thread-count
    guard it now holds itself: [('gears.data.de', 'gears.train.runtime')].)"""
    assert upward_imports(import_graph(ROOT)) == set()


def test_the_floor_check_finds_an_upward_import(tmp_path):
    (tmp_path / "gears" / "data").mkdir(parents=True)
    (tmp_path / "gears" / "train").mkdir()
    (tmp_path / "gears" / "data" / "a.py").write_text("def f():\n    from gears.train import b\n")
    (tmp_path / "gears" / "train" / "b.py").write_text("")
    assert upward_imports(import_graph(tmp_path)) == {("gears.data.a", "gears.train.b")}


def test_no_two_modules_share_a_file_name():
    """`python predict.py` and gears/predict.py, train_distributed.py and
    gears/train_distributed.py were two files of one name: a traceback or a grep named either."""
    names: dict[str, list[str]] = {}
    for folder, dirs, files in os.walk(ROOT):
        # the project's own files: not tests/, hidden folders or a virtual environment of any
        # name (CI's .venv313 holds packages whose modules share names)
        here = Path(folder)
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and d != "tests" and not (here / d / "pyvenv.cfg").exists()
        ]
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                names.setdefault(name, []).append(str((here / name).relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}


def test_the_default_config_path_survives_a_move():
    """The job's DEFAULT_CONFIG is configs/default.yaml. (Seen failing when gears/run.py moved to
    gears/cli/job.py with its ROOT still parents[1]: it named gears/configs/default.yaml, which
    train_single.py skips silently and python -m gears.cli.check_model refuses.)"""
    from gears.cli.job import DEFAULT_CONFIG

    assert DEFAULT_CONFIG == ROOT / "configs" / "default.yaml" and DEFAULT_CONFIG.exists()


def local_imports_without_reason(root: Path) -> list[str]:
    """`file:line` of every import of a package module inside a function (or class body) with no
    comment on its line or the line above: an import goes to the module's top unless a cycle or
    the start-up time forces otherwise, and then the comment says which."""
    found = []
    for path in sorted((root / "gears").rglob("*.py")):
        text = path.read_text()
        lines = ["", *text.splitlines()]  # 1-based
        nested = [
            node
            for scope in ast.walk(ast.parse(text))
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for node in ast.walk(scope)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        ]
        for node in nested:
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = [alias.name for alias in node.names]
            if not any(n == "gears" or n.startswith("gears.") for n in names):
                continue
            here, above = lines[node.lineno], lines[node.lineno - 1]
            if not (_reason(here) or above.strip().startswith("#") and _reason(above)):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(set(found))


def _reason(line: str) -> bool:
    """A comment on the line that is more than a linter's noqa."""
    comment = line.partition("#")[2].strip()
    return bool(comment) and not comment.startswith("noqa")


def test_package_imports_stand_at_the_top_or_say_why_not():
    assert local_imports_without_reason(ROOT) == []


def test_the_local_import_finder_finds_one_without_a_reason(tmp_path):
    (tmp_path / "gears").mkdir()
    (tmp_path / "gears" / "a.py").write_text(
        "import os\n\n\ndef f():\n    from gears import b\n\n\n"
        "def g():\n    # local: a cycle with gears.b\n    from gears import b\n\n\n"
        "def h():\n    import numpy\n"
    )
    assert local_imports_without_reason(tmp_path) == ["gears/a.py:5"]
