"""The documentation holds when checked: every shell and Python block of README.md and docs/*.md
runs as written (reduced where a comment above it says how), configuration.md matches
gears/config.py, links and named files resolve, and every measured figure in docs/ names a
command and a commit. The rules are in docs/testing.md, "Docs that execute"."""

from __future__ import annotations

import ast
import dataclasses
import functools
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import yaml
from helpers import TINY_CLI

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GEARS_SHARED_DATA", ROOT.parent / "shared" / "data"))
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]

# Pages not yet held to the block and number checks, and why. Remove a page's entry once it
# settles: its blocks then run here and its figures need a command and a commit beside them.
PENDING_PAGES: dict[str, str] = {}

# Fenced block languages: shell and python blocks run, yaml blocks are config files that must
# load, text blocks (output, layouts) are only read.
LANGS = {"bash": "shell", "sh": "shell", "python": "python", "yaml": "config", "text": "text"}
# Commands that take config overrides: `doc-run: quick` and `doc-run: + k=v` append to them.
OVERRIDE_COMMANDS = (
    "train_single.py",
    "train_distributed.py",
    "-m gears.cli.seeds",
    "gears.cli.check_model",
)
# `doc-run: quick`: one epoch on the tests' tiny synthetic screen, one perturbation plot, no wandb.
QUICK = (
    "train.epochs=1",
    f"data.synthetic={TINY_CLI}",
    "train.plot_conditions=1",
    "wandb.mode=disabled",
)
OUTPUT_FLAGS = ("--out", "--json")  # a run command's output file, checked after it ran
NEEDS_SHARED_DATA = ("../shared/data", "perturbench_norman")
COMMAND_TIMEOUT_S = 600

FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*(doc-[a-z-]+)(.*?)-->\s*$")
KINDS = ("doc-run", "doc-skip", "doc-covered", "doc-check")


# ------------------------------------------------------------------------------ the blocks
@dataclasses.dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directives: list[tuple[str, str]]  # (kind, the rest of the comment)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: str) -> list[Block]:
    """The fenced blocks of a page with the doc-* comments directly above each."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        directives, k = [], i - 1
        while k >= 0 and (d := DIRECTIVE.match(lines[k])):
            directives.insert(0, (d.group(1), d.group(2).strip()))
            k -= 1
        indent = len(m.group(1))
        text = "\n".join(line[indent:] for line in lines[i + 1 : end])
        found.append(Block(page, i + 1, m.group(2), text, directives))
        i = end + 1
    return found


def stray_directives(page: str) -> list[str]:
    """doc-* comments that no fenced block follows (they would silently apply to nothing)."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    stray = []
    for i, line in enumerate(lines):
        if DIRECTIVE.match(line):
            k = i + 1
            while k < len(lines) and DIRECTIVE.match(lines[k]):
                k += 1
            if k >= len(lines) or not FENCE.match(lines[k]):
                stray.append(f"{page}:{i + 1}")
    return stray


@dataclasses.dataclass
class Step:
    """One thing a block asks the reader to run: a shell command or a Python block."""

    block: Block
    shown: str  # as the page shows it
    run: str  # as run: reductions applied
    skip: str | None = None  # why it is not run
    covered: str | None = None  # the test that runs it instead

    @property
    def needs_shared_data(self) -> bool:
        return any(s in self.run for s in NEEDS_SHARED_DATA)


def _quoted_rest(kind: str, rest: str, where: str) -> tuple[str | None, str]:
    """'"TEXT": REST' -> (TEXT, REST); ': REST' -> (None, REST)."""
    m = re.fullmatch(r'"([^"]+)"\s*:\s*(.+)', rest) or re.fullmatch(r":\s*(.+)", rest)
    if not m:
        raise AssertionError(f'{where}: {kind} must read `{kind}: ...` or `{kind} "TEXT": ...`')
    return (m.group(1), m.group(2).strip()) if m.lastindex == 2 else (None, m.group(1).strip())


def strip_comment(command: str) -> str:
    """A shell command without its trailing `# comment` (quotes respected)."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command.rstrip()


def shell_commands(text: str) -> list[str]:
    """A shell block's commands: continuations joined, comments dropped, `a && b` split."""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        code = strip_comment(line.strip())
        if code:
            commands += [part.strip() for part in re.split(r"\s+&&\s+", code)]
    return commands


def plan(block: Block) -> list[Step]:
    """What a shell or Python block runs, after its doc-run reductions, with its skips."""
    text, append, skips, covers, whole = block.text, [], [], [], None
    for kind, rest in block.directives:
        if kind not in KINDS:
            raise AssertionError(f"{block.where}: unknown directive {kind} (known: {KINDS})")
        if kind == "doc-run":
            for item in _quoted_rest(kind, rest, block.where)[1].split(";"):
                item = item.strip()
                if item == "quick":
                    append += QUICK
                elif item.startswith("+ "):
                    append += shlex.split(item[2:])
                elif m := re.fullmatch(r'"([^"]*)"\s*->\s*"([^"]*)"', item):
                    old, new = m.groups()
                    assert old in text, f"{block.where}: doc-run replaces {old!r}, not in block"
                    text = text.replace(old, new)
                else:
                    raise AssertionError(f"{block.where}: doc-run item {item!r} not understood")
        elif kind == "doc-skip":
            match, reason = _quoted_rest(kind, rest, block.where)
            if match is None:
                whole = reason
            else:
                skips.append((match, reason))
        elif kind == "doc-covered":
            match, test_id = _quoted_rest(kind, rest, block.where)
            covers.append((match, test_id))
    if LANGS.get(block.lang) == "python":
        shown = [block.text]
        run = [text]
    else:
        shown, run = shell_commands(block.text), shell_commands(text)
        assert len(shown) == len(run), f"{block.where}: a doc-run replacement split a command"
    steps = []
    for seen, command in zip(shown, run):
        if (
            append
            and LANGS.get(block.lang) == "shell"
            and any(c in command for c in OVERRIDE_COMMANDS)
        ):
            command = command + " " + shlex.join(append)
        step = Step(block, seen, command, skip=whole)
        for match, reason in skips:
            if match in seen:
                step.skip = reason
        for match, test_id in covers:
            if match in seen:
                step.covered = test_id
        steps.append(step)
    for match, _ in [*skips, *covers]:
        assert any(match in s.shown for s in steps), f"{block.where}: no command has {match!r}"
    return steps


def checks(block: Block) -> tuple[list[str], list[str]]:
    """doc-check: the files (workspace paths) and output texts the block must produce."""
    files, texts = [], []
    for kind, rest in block.directives:
        if kind == "doc-check":
            for quoted, path in re.findall(r'"([^"]+)"|(\S+)', _quoted_rest(kind, rest, "")[1]):
                (texts if quoted else files).append(quoted or path)
    return files, texts


def checked_pages() -> list[str]:
    return [p for p in PAGES if p not in PENDING_PAGES]


def all_steps() -> list[Step]:
    return [
        s
        for page in checked_pages()
        for b in page_blocks(page)
        if LANGS.get(b.lang) in ("shell", "python")
        for s in plan(b)
    ]


def _step_id(step: Step) -> str:
    return f"{step.block.where}:{step.shown.splitlines()[0][:60]}"


# ------------------------------------------------------------------------- structure (fast)
def test_every_block_has_a_known_language_and_every_directive_applies():
    """An untagged block, an unknown language or a directive that applies to nothing would let a
    command escape both the run and the list of what is not run."""
    problems = []
    for page in checked_pages():
        problems += [f"{s}: a doc-* comment with no block below it" for s in stray_directives(page)]
        for block in page_blocks(page):
            if block.lang not in LANGS:
                problems.append(
                    f"{block.where}: fenced block tagged {block.lang!r}; tag it one of "
                    f"{sorted(LANGS)} (text for output and layouts)"
                )
            elif LANGS[block.lang] in ("shell", "python"):
                try:
                    plan(block)
                except AssertionError as e:
                    problems.append(str(e))
            elif block.directives and LANGS[block.lang] == "text":
                problems.append(f"{block.where}: a text block is never run; drop its doc-*")
    assert not problems, "\n".join(problems)


def test_pending_pages_exist():
    assert set(PENDING_PAGES) <= set(PAGES), set(PENDING_PAGES) - set(PAGES)


@pytest.mark.parametrize("page", sorted(PENDING_PAGES))
def test_pending_page(page):
    pytest.skip(f"pending: {page} ({PENDING_PAGES[page]})")


@pytest.mark.parametrize("step", [s for s in all_steps() if s.skip or s.covered], ids=_step_id)
def test_not_run_here(step):
    """Each command a page shows but this file does not run, listed with its reason (pytest -ra
    prints them); a command another test runs names that test, which must exist."""
    if step.covered:
        path, _, name = step.covered.partition("::")
        source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        assert re.search(rf"^def {re.escape(name)}\b", source, re.M), (
            f"{step.block.where}: doc-covered names {step.covered}, which does not exist"
        )
        pytest.skip(f"{step.block.where} `{step.shown}`: run by {step.covered}")
    pytest.skip(f"{step.block.where} `{step.shown}`: {step.skip}")


def test_yaml_blocks_are_config_files_that_load(tmp_path):
    from gears.config import load_config

    blocks = [b for p in checked_pages() for b in page_blocks(p) if LANGS.get(b.lang) == "config"]
    assert blocks, "no yaml block found: the check would be vacuous"
    for block in blocks:
        path = tmp_path / "block.yaml"
        path.write_text(block.text)
        load_config(path, base=ROOT / "configs" / "default.yaml")  # raises naming a bad key


# ---------------------------------------------------------------------------- runs (slow)
class Workspace:
    """A copy of the repository (no .git, no data or runs) beside a `shared/data` link, so the
    pages' relative paths work and nothing is written into the checkout."""

    # command -> (workspace it ran in, files it wrote, output): a command shown on two pages
    # runs once per session; the second page gets its files copied.
    done: dict[str, tuple[Path, list[str], str]] = {}

    def __init__(self, base: Path):
        self.root = base / "repo"
        top = {".git", ".venv", "data", "runs", "wandb", ".pytest_cache", ".ruff_cache"}
        shutil.copytree(
            ROOT,
            self.root,
            ignore=lambda d, names: [
                n
                for n in names
                if n == "__pycache__" or n.endswith(".egg-info") or (d == str(ROOT) and n in top)
            ],
        )
        if SHARED_DATA.is_dir():
            (base / "shared").mkdir()
            (base / "shared" / "data").symlink_to(SHARED_DATA)
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "WANDB_MODE": "disabled",
        }
        self.env.pop("PYTHONPATH", None)  # the copy's own gears, as a reader's checkout

    def files(self) -> dict[str, tuple[int, int]]:
        out = {}
        for path in self.root.rglob("*"):
            if path.is_file():
                stat = path.stat()
                out[str(path.relative_to(self.root))] = (stat.st_mtime_ns, stat.st_size)
        return out

    def run(self, step: Step) -> str:
        """Run one step (a shell command, or a Python block as a script); its output."""
        key = f"{step.block.lang}\n{step.run}"
        if key in self.done:
            source, written, output = self.done[key]
            for rel in written:
                (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source / rel, self.root / rel)
            return output
        before = self.files()
        if LANGS[step.block.lang] == "python":
            script = self.root / f"_doc_block_{step.block.line}.py"
            script.write_text(step.run)
            argv = [sys.executable, script.name]
        else:
            argv = ["bash", "-c", step.run]
        proc = subprocess.run(
            argv,
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (
            f"{step.block.where}: `{step.run}` exited {proc.returncode}:\n{output[-3000:]}"
        )
        if LANGS[step.block.lang] == "shell":
            tokens = shlex.split(step.run)
            for flag, value in zip(tokens, tokens[1:]):
                if flag in OUTPUT_FLAGS:
                    out = self.root / value
                    # predict.py given a run with contexts writes <stem>_<context><suffix> each
                    per_context = list(out.parent.glob(f"{out.stem}_*{out.suffix}"))
                    assert out.exists() or per_context, (
                        f"{step.block.where}: `{step.run}` did not write {value} ({flag})"
                    )
        after = self.files()
        written = [rel for rel, stat in after.items() if before.get(rel) != stat]
        self.done[key] = (self.root, written, output)
        return output


def _run_page(page: str, base: Path) -> list[str]:
    """Run every block of a page in order in a fresh workspace; the steps left out because
    ../shared/data is absent."""
    workspace = Workspace(base)
    absent = []
    for block in page_blocks(page):
        kind = LANGS.get(block.lang)
        if kind not in ("shell", "python"):
            continue
        output, ran = "", False
        for step in plan(block):
            if step.skip or step.covered:
                continue
            if step.needs_shared_data and not SHARED_DATA.is_dir():
                absent.append(_step_id(step))
                continue
            output += workspace.run(step)
            ran = True
        files, texts = checks(block)
        if not ran:
            continue
        for rel in files:
            assert (workspace.root / rel).exists(), f"{block.where}: the page says it writes {rel}"
        for text in texts:
            assert text in output, f"{block.where}: output lacks {text!r}:\n{output[-3000:]}"
    return absent


RUN_PAGES = sorted({s.block.page for s in all_steps() if not (s.skip or s.covered)})


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs_as_written(page, tmp_path):
    """Each shell command and Python block of the page, in order, in a copy of the repository:
    exit status 0, no traceback, and the files and output the page names."""
    absent = _run_page(page, tmp_path)
    if absent:
        pytest.skip(f"{SHARED_DATA} is absent; not run: {absent}")


# ------------------------------------------------------------------ configuration.md (fast)
def _config_rows() -> dict[str, dict[str, str]]:
    """configuration.md's key tables: key -> {type, default, accepts, meaning} as written."""
    rows = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 5 or not cells[0].startswith("`") or cells[0] == "key":
            continue
        key = cells[0].strip("`")
        assert key not in rows, f"configuration.md: {key} has two rows"
        rows[key] = dict(zip(("type", "default", "accepts", "meaning"), cells[1:]))
    return rows


def _type_text(annotation: str) -> str:
    """The page's spelling of a config.py annotation: 'str | None' -> 'str or null'."""
    text = str(annotation).replace(" | None", " or null")
    return re.sub(r"list\[(\w+)\]", r"list of \1", text)


def _accepts_text(key: str) -> str:
    from gears.config import CHOICES, DOMAIN, INT64

    if key in CHOICES:
        return ", ".join(f"`{c}`" for c in CHOICES[key])
    if key not in DOMAIN:
        return "-"
    low, high, open_low = DOMAIN[key]
    if high is None or high == INT64 - 1:  # every int must fit int64 anyway
        return f"{'>' if open_low else '>='} {low:g}"
    return f"{'(' if open_low else '['}{low:g}, {high:g}]"


def test_configuration_md_has_every_key_with_its_type_default_and_range():
    """Every key of gears/config.py, its type, its default (with configs/default.yaml), its range
    (DOMAIN) and choices (CHOICES), as the page writes them; a key added to config.py without a
    row fails here."""
    from gears.config import _annotation, load_config, valid_keys

    rows = _config_rows()
    keys = valid_keys()
    missing = [k for k in keys if k not in rows]
    assert not missing, f"docs/configuration.md has no row for {missing}: add one per key"
    extra = [k for k in rows if k not in keys]
    assert not extra, f"docs/configuration.md documents keys config.py lacks: {extra}"
    cfg = load_config(base=ROOT / "configs" / "default.yaml")
    wrong = []
    for key in keys:
        row = rows[key]
        default = cfg
        for part in key.split("."):
            default = getattr(default, part)
        written = yaml.safe_load(row["default"].strip("`"))
        if written != default:
            wrong.append(f"{key}: default {row['default']}, config.py has {default!r}")
        if row["type"] != _type_text(_annotation(key)):
            wrong.append(f"{key}: type {row['type']}, config.py has {_type_text(_annotation(key))}")
        if row["accepts"] != _accepts_text(key):
            wrong.append(f"{key}: accepts {row['accepts']!r}, config.py: {_accepts_text(key)!r}")
        if not row["meaning"]:
            wrong.append(f"{key}: no meaning given")
    assert not wrong, "docs/configuration.md differs from gears/config.py:\n" + "\n".join(wrong)


# ------------------------------------------------------------ links and named files (fast)
def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    anchors = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"#+\s+(.*)", line):
            text = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def _prose(page: str) -> str:
    """A page without its fenced blocks and HTML comments."""
    text = (ROOT / page).read_text()
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not followed (no network in tests)
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            if not file.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


# Repository paths a page may name that need not exist in a checkout: a run's outputs, files
# a reader makes or downloads.
NOT_IN_CHECKOUT = re.compile(
    r"^(runs|data|my_|pred|gpu_check|vs\.json|norman\.json|vcc\.json|replogle\.json|wandb)|"
    r"\.(h5ad|csv)$|<"
)


def test_repository_paths_named_in_the_docs_exist():
    """Files and folders a page names in code spans, such as
    `tests/test_x.py`, `docs/x.md`, `benchmarks/...`, `configs/...`, `gears/...`, exist."""
    pattern = re.compile(r"`((?:gears|tests|benchmarks|configs|docs|examples)/[\w./-]+)`")
    texts = {page: _prose(page) for page in PAGES}
    missing = []
    for page, text in texts.items():
        for name in pattern.findall(text):
            name = name.rstrip(".")
            if NOT_IN_CHECKOUT.search(name.split("/", 1)[-1]) or "*" in name:
                continue
            if not (ROOT / name).exists() and not list(ROOT.glob(name + ".*")):
                missing.append(f"{page}: {name}")
    assert not missing, "\n".join(missing)


def test_requirements_txt_points_at_the_page_with_the_cuda_step():
    """requirements.txt sent a GPU user to the README for the CUDA build of torch; the step is
    in docs/training_at_scale.md."""
    header = (ROOT / "requirements.txt").read_text().split("torch==")[0]
    named = re.findall(r"docs/[\w.]+\.md", header)
    assert named, "requirements.txt's comment names no page for the CUDA step"
    for page in named:
        text = " ".join((ROOT / page).read_text().split())
        assert "--index-url https://download.pytorch.org/whl/cu" in text, page


# -------------------------------------------------------------------------- metrics.md (fast)
def test_metrics_md_defines_every_metric_key():
    """Every per-perturbation key gears.train.metrics writes (the ~55 of each predictor in
    metrics.json) has a row in docs/metrics.md, and metrics.md names no key the code lacks."""
    import numpy as np

    from gears.train.metrics import condition_metrics, top_variable_genes

    rng = np.random.default_rng(0)
    cells = rng.random((12, 30))
    de = np.argsort(-rng.random((2, 30)), axis=1)
    keys = condition_metrics(
        cells[:2],
        cells,
        np.repeat([0, 1], 6),
        cells.mean(0),
        de,
        de[:, :20],
        top_variable_genes(cells[:2]),
    )
    keys = {*keys, "n_conditions"}
    text = (ROOT / "docs" / "metrics.md").read_text()
    table = text.split("## Every metric")[1].split("\n## ")[0]
    documented = set(
        re.findall(
            r"`([\w./]+)`",
            "\n".join(line.split("|")[1] for line in table.splitlines() if line.startswith("| `")),
        )
    )
    assert keys - documented == set(), f"metrics.md lacks {sorted(keys - documented)}"
    assert documented - keys == set(), f"metrics.md names unknown {sorted(documented - keys)}"


# ------------------------------------------------------------- numbers that reproduce (fast)
# A measured figure in docs/ needs a command and a commit beside it (docs/testing.md, "Numbers
# that reproduce"). Figures: a table cell that is a decimal number (0.054 ± 0.003, 4.41 GB); in
# prose a number with a unit of time, rate or size (s, ms, us, min, h, cells/s, batches/s, GB,
# MB), a ratio written 4.9x, or a decimal with 3 or more places (0.8676). Not figures: code
# spans, GiB/MiB (the code's thresholds), sizes such as 500 x 2k, versions, dates.
_NUMBER = r"(?<![\w.^/-])~?\d[\d,]*(?:\.\d+)?(?:\s?-\s?\d[\d,]*(?:\.\d+)?)?"
PROSE_FIGURE = re.compile(
    _NUMBER + r"(?:\s?(?:s|ms|us|µs|min|h|cells/s|batches/s|steps/s|GB|MB)(?![\w/])|x(?!\w))"
    r"|(?<![\w.^/-])\d+\.\d{3,}(?![\d.])"  # a metric's value, as 0.8676 or 0.054
)
CELL_FIGURE = re.compile(r"^~?[-+]?\d[\d,]*\.\d+")
COMMIT = re.compile(r"(?<![\w/])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/])")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python|bash|torchrun)\s")
# Figures that are not measurements, with why.
NOT_MEASURED = {
    ("docs/troubleshooting.md", "1800 s"): "the default of distributed.timeout_s",
    ("docs/troubleshooting.md", "30 s"): "Slurm's usual KillWait, not ours",
    ("docs/gpus_and_clusters.md", "1-2 min"): "the lent machine's start, as its provider states",
    ("docs/gpus_and_clusters.md", "300 s"): "gpu_check's limit per stage, a setting",
    ("docs/gpus_and_clusters.md", "240 s"): "the CPU twin's limit per check, a setting",
    ("docs/gpus_and_clusters.md", "4 h"): "the default of distributed.data_wait_s",
    ("docs/gpus_and_clusters.md", "30 min"): "the default of distributed.timeout_s",
    ("docs/changing_the_model.md", "1.001"): "the factor the oracle tests' mutation check scales "
    "a hand-written backward by, a setting",
    ("docs/predictions.md", "4.3 GB"): "60,000 x 18,080 x 4 bytes, computed, not measured",
    ("docs/predictions.md", "~64 MB"): "CHUNK_BYTES in gears/eval/predicted_cells.py, a setting",
}


def _items(page: str, text: str | None = None) -> list[tuple[str, int, str]]:
    """A page (or TEXT given for it) as (kind, first line, text) items: heading, code, table,
    prose (paragraphs)."""
    lines = ((ROOT / page).read_text() if text is None else text).splitlines()
    items, i = [], 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or DIRECTIVE.match(line):
            i += 1
        elif line.startswith("#"):
            items.append(("heading", i + 1, line))
            i += 1
        elif FENCE.match(line):
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            items.append(("code", i + 1, "\n".join(lines[i + 1 : end])))
            i = end + 1
        else:
            kind = "table" if line.lstrip().startswith("|") else "prose"
            end = i
            while end < len(lines) and lines[end].strip() and not lines[end].startswith("#"):
                if FENCE.match(lines[end]) or (lines[end].lstrip().startswith("|")) != (
                    kind == "table"
                ):
                    break
                end += 1
            items.append((kind, i + 1, "\n".join(lines[i:end])))
            i = end
    return items


def _figures(kind: str, text: str) -> list[str]:
    plain = re.sub(r"`[^`]*`", "", re.sub(r"\]\([^)]*\)", "]", text))
    if kind == "prose":
        return [m.group(0) for m in PROSE_FIGURE.finditer(plain)]
    if kind == "table":
        rows = plain.splitlines()[2:]  # below the header and its rule
        cells = [c.strip() for row in rows for c in row.strip().strip("|").split("|")]
        return [c for c in cells if CELL_FIGURE.match(c)]
    return []


def _context(items: list, index: int) -> str:
    """An item, the tables and the one other item just before it (a table's caption), and the
    opening item of its section (with the code block right after it)."""
    picked = [index]
    k = index - 1
    while k >= 0 and items[k][0] == "table":
        picked.append(k)
        k -= 1
    if k >= 0 and items[k][0] != "heading":
        picked.append(k)
    start = index
    while start > 0 and items[start - 1][0] != "heading":
        start -= 1
    while start < index and not re.search(
        r"[a-z]", re.sub(r"\[[^]]*\]\([^)]*\)", "", items[start][2])
    ):
        start += 1  # the page's navigation line ([README](...) · ...) opens no section
    picked.append(start)
    if start + 1 < len(items) and items[start + 1][0] == "code":
        picked.append(start + 1)
    return "\n".join(items[j][2] for j in sorted(set(picked)))


def _has_command(text: str) -> bool:
    spans = re.findall(r"`([^`]+)`", text)
    return any(COMMAND.match(s.strip()) for s in [*spans, *text.splitlines()])


@functools.cache
def _full_history() -> bool:
    """Whether git holds this clone's whole history (not a shallow clone, not without git)."""
    shallow = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
    )
    return shallow.stdout.strip() == "false"


def _known_commit(name: str, cache: dict = {}) -> bool:  # noqa: B006 - a per-process cache
    if name not in cache:
        # An ancestor of HEAD, not merely an object in this clone: a clone of main holds only
        # main's history, so a commit left on a rebased branch names code no one can check out.
        git = subprocess.run(
            ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", name, "HEAD"],
            capture_output=True,
        )
        # Without git, or in a shallow clone, the history cannot say: any hash passes.
        cache[name] = git.returncode == 0 or not _full_history()
    return cache[name]


def unsourced_figures(page: str, text: str | None = None) -> list[str]:
    """'page:line: figures (what is missing)' for each item whose figures lack a command or a
    commit of HEAD's history (of the page, or of TEXT given for it)."""
    items, found = _items(page, text), []
    for index, (kind, line, text) in enumerate(items):
        figures = [f for f in _figures(kind, text) if (page, f) not in NOT_MEASURED]
        if not figures:
            continue
        context = _context(items, index)
        lacks = []
        if not any(_known_commit(c) for c in COMMIT.findall(context)):
            lacks.append("a commit")
        if not _has_command(context):
            lacks.append("a command")
        if lacks:
            found.append(f"{page}:{line}: {figures[:4]} (lacks {' and '.join(lacks)} beside it)")
    return found


def test_every_figure_in_docs_names_its_command_and_commit():
    pages = [p for p in checked_pages() if p.startswith("docs/")]
    found = [problem for page in pages for problem in unsourced_figures(page)]
    assert not found, "figures without provenance:\n" + "\n".join(found)
    used = {
        (page, f) for page in pages for kind, _, text in _items(page) for f in _figures(kind, text)
    }
    assert set(NOT_MEASURED) <= used, f"stale NOT_MEASURED entries: {set(NOT_MEASURED) - used}"


@pytest.mark.parametrize("page", ["docs/changing_the_model.md", "docs/predictions.md"])
def test_a_results_table_without_its_commit_is_caught(page):
    """These pages' result tables named no commit until they were regenerated at one; with the
    commits taken out of the page again, the rule catches them."""
    assert not unsourced_figures(page)
    without_commits = unsourced_figures(page, COMMIT.sub("", (ROOT / page).read_text()))
    assert any("lacks a commit" in problem for problem in without_commits), without_commits


# ----------------------------------------------------------- statements the pages make (fast)
def _n_range(summary: dict, group: str, model: str) -> tuple[int, int]:
    values = summary["test"].get(group, {}).get(model, {}).get("n_conditions", {}).get("values")
    counts = [0 if v is None else int(v) for v in values or []]
    return min(counts), max(counts)


def test_perturbation_counts_quoted_in_faithfulness_md_match_the_results_files():
    """faithfulness.md said additive covered 6-7 test perturbations per seed (the results hold
    5-7, and 0-2 on the Norman subset) and 3-17 per subgroup (combo_seen0 has 1-3)."""
    import json

    text = " ".join((ROOT / "docs" / "faithfulness.md").read_text().split())
    results = ROOT / "benchmarks" / "results"
    default = json.loads((results / "seeds_default.json").read_text())
    norman = json.loads((results / "seeds_norman.json").read_text())
    subgroups = [g for g in default["test"] if g != "overall"]

    def span(pair):
        return f"{pair[0]}-{pair[1]}"

    lows, highs = zip(*(_n_range(default, g, "gears") for g in subgroups))
    norman_groups = [_n_range(norman, g, "gears") for g in norman["test"] if g != "overall"]
    quoted = {
        "additive, default screen": f"{span(_n_range(default, 'overall', 'additive'))} test "
        "perturbations per seed on the default screen",
        "additive, Norman subset": f"{span(_n_range(norman, 'overall', 'additive'))} on the Norman",
        "default screen": f"default screen has {span(_n_range(default, 'overall', 'gears'))} test "
        f"perturbations, {min(lows)}-{max(highs)} per subgroup (`combo_seen0` "
        f"{span(_n_range(default, 'combo_seen0', 'gears'))})",
        "Norman subset": f"Norman subset {span(_n_range(norman, 'overall', 'gears'))}, "
        f"{min(a for a, _ in norman_groups)}-{max(b for _, b in norman_groups)} per subgroup",
    }
    wrong = {k: v for k, v in quoted.items() if v not in text}
    assert not wrong, f"faithfulness.md should say, from benchmarks/results: {wrong}"


def test_load_writes_no_processed_h5ad_and_new_data_process_does(tmp_path):
    """data.md named a `<data_dir>/<name>/perturb_processed.h5ad` that runs never write: `load`
    (the runs' path) writes none, `new_data_process` does."""
    from helpers import tiny_gene2go, tiny_screen, write_gene2go

    from gears.data.pertdata import PertData

    adata = tiny_screen()
    gene2go = write_gene2go(tmp_path / "go.tsv", tiny_gene2go())
    adata.write_h5ad(tmp_path / "screen.h5ad")
    PertData(tmp_path / "loaded", gene2go=str(gene2go)).load(data_path=tmp_path / "screen.h5ad")
    assert not list((tmp_path / "loaded").rglob("*.h5ad"))
    PertData(tmp_path / "made", gene2go=str(gene2go)).new_data_process("screen", adata)
    assert (tmp_path / "made" / "screen" / "perturb_processed.h5ad").is_file()
    data_md = " ".join((ROOT / "docs" / "data.md").read_text().split())
    assert (
        "`load` (what `train_single.py` runs) processes a file in memory and writes no" in data_md
    )


def test_every_results_file_the_docs_name_is_regenerated_by_reproduce_tables_sh():
    """benchmarks/reproduce_tables.sh writes each benchmarks/results/ file a page points at (by
    an entry of its own or a command it runs), and each entry a page names (TABLES=...) exists."""
    script = (ROOT / "benchmarks" / "reproduce_tables.sh").read_text()
    assert (
        subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "reproduce_tables.sh")]).returncode
        == 0
    )
    entries = set(re.findall(r"^\s+([a-z_]+)\)", script, re.M))
    listed = set(re.search(r'ALL_TABLES="\$RESULTS_TABLES ([^"]+)"', script).group(1).split())
    listed.discard("\\")  # a line continuation inside the quotes
    listed |= set(re.search(r'RESULTS_TABLES="([^"]+)"', script).group(1).split())
    assert listed == entries, f"ALL_TABLES and the case entries differ: {listed ^ entries}"
    missing = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for name in re.findall(r"benchmarks/results/([\w-]+)", text):
            stem = re.sub(r"_\d{4}-\d\d-\d\d$", "", name)  # a dated file: its entry's older run
            if stem not in script:
                missing.append(f"{page}: benchmarks/results/{name}")
        for quoted, single in re.findall(r'TABLES=(?:"([\w ]+)"|(\w+))', text):
            names = (quoted or single).split()
            missing += [f"{page}: TABLES={n}" for n in names if n not in entries | {"all"}]
    assert not missing, "not regenerated by benchmarks/reproduce_tables.sh:\n" + "\n".join(missing)


# ------------------------------------------------------------------ README: --nproc (fast)
def test_readme_says_nproc_multiplies_the_effective_batch():
    """`--nproc 2` doubled the effective batch (train.batch_size is per process) and the README
    said neither that, nor how to keep the batch, nor how far results move with it."""
    text = " ".join((ROOT / "README.md").read_text().split())
    start = text.find("**`--nproc N` multiplies the batch.**")
    assert start >= 0, "README.md has no paragraph on what --nproc N does to the batch"
    para = text[start : text.find("- **", start + 5)]
    for needed in (
        "`train.batch_size` is per process",
        "`train.batch_size` x N x `train.grad_accum_steps`",  # as gears/cli/job.py computes it
        "`effective_batch_size`",
        "train.batch_size=16",  # the single-process batch of 32 kept under --nproc 2
        "train.grad_accum_steps=2",
        "distributed.sync_batchnorm=true",
    ):
        assert needed in para, f"README's --nproc paragraph lacks {needed!r}"
    assert COMMIT.search(para), "the measured shifts need the commit they were measured at"


# ------------------------------------------------------ figures stay out of the code (fast)
# Docstrings and comments keep shapes, invariants and the reason a design exists; a measured
# timing, speed or speed-up goes to a docs page with its command and commit (numbers above), and
# the code names the page. The code's figures: a number with a unit of time or rate, or a ratio
# written 4.9x. Not figures: sizes such as 500 x 2k, hex literals, dimensions.
CODE_FIGURE = re.compile(
    r"(?<![\w.^/-])~?\d[\d,]*(?:\.\d+)?(?:\s?-\s?\d[\d,]*(?:\.\d+)?)?"
    r"(?:\s?(?:s|ms|us|µs|ns|sec|min|cells/s|batches/s|steps/s)(?![\w/])|x(?!\w))"
)
# Figures in the code that define behaviour rather than measure it, with why.
CODE_FIGURE_SETTINGS = {
    "5-20x": "gears/data/synthetic.py: the simulated CRISPRa activation of a gene, a setting",
}


def code_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and each string statement (docstrings, module to method) of
    a Python file."""
    source = path.read_text(encoding="utf-8")
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            lines = node.value.value.splitlines()
            found += [(node.lineno + i, line) for i, line in enumerate(lines)]
    return sorted(found)


def code_figures(files: list[Path]) -> list[str]:
    """'file:line: figure: text' for each measured figure in the files' comments and docstrings."""
    found = []
    for path in files:
        for line, text in code_prose(path):
            for match in CODE_FIGURE.finditer(text):
                if match.group(0).lstrip("~") not in CODE_FIGURE_SETTINGS:
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    found.append(f"{where}:{line}: {match.group(0)!r}: {text.strip()}")
    return found


def test_the_codes_docstrings_and_comments_carry_no_measured_figures():
    """gears/ (every module, at any depth) and the entry-point scripts: a timing, speed or ratio
    in a docstring or comment belongs in docs/ with its command and commit."""
    files = sorted((ROOT / "gears").rglob("*.py")) + sorted(ROOT.glob("*.py"))
    assert len(files) > 30, "the package's modules were not found"
    found = code_figures(files)
    assert not found, (
        "measured figures in docstrings or comments (move them to docs/, e.g. "
        "docs/performance.md, with their command and commit, and name the page):\n"
        + "\n".join(found)
    )
    text = " ".join(p.read_text(encoding="utf-8") for p in files)
    stale = [f for f in CODE_FIGURE_SETTINGS if f not in text]
    assert not stale, f"stale CODE_FIGURE_SETTINGS entries: {stale}"


def test_a_figure_in_a_comment_or_docstring_is_caught_and_code_is_not(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""One row per cell: 3.4x faster, 0.46 vs 1.56 ms a step."""\n'
        "LIMIT_S = 30  # seconds, a setting\n"
        "x = 2  # [B, G] rows; ~10x slower on this CPU\n"
        "def f():\n"
        '    """Grouped: 110 -> 70 ms per step, 351 cells/s."""\n'
        '    return "12 ms"  # a string the code returns is not prose\n'
    )
    found = code_figures([module])
    figures = [entry.split(": ")[1] for entry in found]
    assert figures == ["'3.4x'", "'1.56 ms'", "'~10x'", "'70 ms'", "'351 cells/s'"], found
