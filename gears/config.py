"""Typed run configuration: defaults, YAML files, dotted `key=value` overrides, strict keys."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from gears.choices import CHOICES, DEFAULT_SAMPLER
from gears.data.synthetic import make_synthetic
from gears.errors import GearsInputError
from gears.io import atomic_write


@dataclass
class DataConfig:
    dataset: str = "synthetic"  # synthetic | norman | adamson | dixit | replogle_* | path.h5ad
    data_dir: str = "data"
    gene2go: str | None = None  # GO source path; None = dataset default
    gene_aliases: str | None = None  # alias<TAB>SYMBOL table for GO lookups
    keep_unmapped_perts: bool = False  # deprecated spelling of unmapped_perts=keep
    # Perturbations of genes in neither the data nor the GO source: error (stop and list them),
    # drop (GEARS: remove those conditions, listed with cell counts in the report) or keep
    # (keep them without GO edges).
    unmapped_perts: str = "error"
    condition_key: str | None = None  # obs column naming each cell's perturbation; None = detect
    context_key: str | None = (
        None  # obs column naming each cell's context (e.g. cell line); None = one context
    )
    # Without context_key, a file whose cells span several contexts (an obs column naming cell
    # lines or types, gears/data/pooling.py) is refused; true pools them on purpose (one
    # control mean for all).
    pool_contexts: bool = False
    control_names: list[str] = field(default_factory=list)  # extra spellings of control cells
    mirror_url: str | None = None  # base URL replacing the public download host
    # Processed expression that every local rank memory-maps: auto (memory-map when the data
    # is large), memory (each process holds it) or mmap (always the shared store).
    store: str = "auto"
    store_dir: str | None = None  # None: <data_dir>/<dataset>/store
    chunk_cells: int = 20000  # cells per chunk when processing a backed .h5ad out of core
    subset: dict = field(default_factory=dict)  # obs column -> value(s) of cells to keep
    synthetic: dict = field(default_factory=dict)  # make_synthetic() arguments
    go_top_k: int = 20
    go_threshold: float = 0.1
    coexpress_top_k: int = 20
    coexpress_threshold: float = 0.4
    # none: X is log-normalised already; log1p: X holds raw counts (the Virtual Cell Challenge's
    # file): scale each cell to the median total count, then log1p, as cell-eval does.
    normalize: str = "none"
    # With context_key: `auto` trains one model per context unless the network reads the
    # context (then one model across contexts); `per_context` or `joint` choose either.
    context_models: str = "auto"


@dataclass
class SplitConfig:
    type: str = "simulation"
    seed: int = 1
    train_gene_set_size: float = 0.75
    combo_seen2_train_frac: float = 0.75
    test_size: float = 0.1
    val_size: float = 0.1
    split_dict_path: str | None = None


# A ModelConfig field whose value changes the weights' shapes (or which weights exist): saved
# models and checkpoints record it, and one trained with another value is refused by name.
SHAPES = {"shapes": True}


@dataclass
class ModelConfig:
    """GEARS's hyperparameters: the config file's `model:` section, passed whole to the network
    (gears/model/network.py); the loss's four (uncertainty_reg ... gamma) are passed by name to
    gears_loss in Trainer.cell_loss (gears/train/engine.py). A new hyperparameter is one field here
    (marked `metadata=SHAPES` if it changes the weights; a loss parameter also passed in
    Trainer.cell_loss); config.json and checkpoints record it by themselves."""

    hidden_size: int = field(default=64, metadata=SHAPES)
    num_go_gnn_layers: int = field(default=1, metadata=SHAPES)
    num_gene_gnn_layers: int = field(default=1, metadata=SHAPES)
    uncertainty: bool = field(default=False, metadata=SHAPES)  # GEARS's log-variance head
    uncertainty_reg: float = 1.0
    direction_lambda: float = 0.1
    direction_temperature: float = 0.1
    gamma: float = 2.0
    # Which network computes GEARS: fast (gears/model/network.py: one row per distinct
    # perturbation, fused kernels) or reference (gears/model/reference.py: one row per cell,
    # plain PyTorch, several times slower), same weights; or a fork's network class,
    # path/to/file.py:ClassName or module:ClassName. Saved models record it.
    impl: str = "fast"
    # A fork's own options (model.extra.<name>=value): the names and defaults its class
    # declares in `options` (gears.model.network_options); others are refused, naming them.
    # Saved models record the resolved values, defaults included.
    extra: dict = field(default_factory=dict)

    def shape_fields(self) -> dict:
        """{"model.<name>": value} of the fields that change the weights: what a saved model or
        checkpoint must share with the network loading it."""
        shaping = [f.name for f in fields(self) if f.metadata.get("shapes")]
        return {f"model.{name}": getattr(self, name) for name in shaping}

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """The fields of a saved config.json (other keys ignored; absent ones default: a folder
        written before model.impl existed loads as fast)."""
        cfg = cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})
        if not _known_impl(cfg.impl):
            raise GearsInputError(
                f"config.json names model.impl={cfg.impl!r}; this code knows "
                f"{CHOICES['model.impl']} and file.py:Class or module:Class: edit config.json "
                "or use the code that wrote it"
            )
        return cfg


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32
    test_batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 5e-4
    optimizer: str = "adam"  # adam (GEARS) | adamw | sgd
    schedule: str = "cosine"  # cosine (to 0 over the epochs) | step (GEARS: x0.5/epoch) | constant
    step_gamma: float = 0.5
    grad_clip: float = 1.0  # gradient value clip, as GEARS; 0 disables
    grad_accum_steps: int = 1
    precision: str = "fp32"  # fp32 | bf16 | fp16 (CUDA only)
    # CUDA only: fp32 matmuls and convolutions in TF32 (10-bit mantissa, ~1e-3 relative error,
    # several times faster on Ampere and later). Off: fp32 means fp32.
    tf32: bool = False
    batching: str = "random"  # random | grouped (perturbations x cells_per_group) | block
    cells_per_group: int = 4
    block_size: int = 1024  # batching=block: consecutive examples read together
    checkpoint_every: int = 1
    resume: bool = False
    early_stopping_patience: int = 0  # epochs without val improvement; 0 = off
    freeze_batchnorm: bool = False  # batch-norm uses running statistics while training
    limit_batches: int = 0  # batches per epoch and process; 0 = all (smoke tests, benchmarks)
    num_workers: int = 0
    log_every: int = 50
    plot_conditions: int = 4
    compile: bool = False  # torch.compile the network (distinct-perturbation rows bucketed)
    # The training step replayed as one CUDA graph per shape bucket, fed by an epoch plan on the
    # device (gears/train/graph_step.py): null = auto (on with CUDA, off on CPU) | true | false.
    # true
    # on CPU runs the same planned step without the capture.
    cuda_graphs: bool | None = None
    threads: int = 0  # torch/numba CPU threads after the data is built; 0 = leave as is
    # Which epoch's weights the run keeps: last (the final model), val_mse (lowest validation mse
    # over all genes) or val_mse_de (lowest validation mse on the top-20 DE genes, GEARS's rule).
    select: str = "last"


@dataclass
class DistributedConfig:
    backend: str = "auto"  # auto (nccl with CUDA, else gloo) | nccl | gloo
    gpu_ids: list[int] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port (mp.spawn launcher)
    timeout_s: int = 1800  # collective timeout; rank-0-only work happens outside collectives
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    # How long ranks wait, before the process group exists, for rank 0 (and each node's local
    # rank 0) to download and process the data; not a collective, so no watchdog applies.
    data_wait_s: int = 14400


@dataclass
class EvalConfig:
    # A perturbation's predicted mean = predicted change + the mean of all control cells (all,
    # exact) or of the control cells randomly paired with its cells (paired, GEARS's protocol).
    control_mean: str = "all"
    cell_eval: bool = False  # score test predictions with cell-eval's vcc profile (optional)
    # Score the test split with cell-eval2's vcc2026 preset (the 2026 challenge): each member raw
    # and rescaled (0 = its mean-response baseline, 1 = a replicate), for GEARS and the baselines.
    cell_eval2: bool = False
    # How predicted cells become integer counts for the 2026 score (gears/eval/counts.py).
    counts_sampler: str = DEFAULT_SAMPLER


@dataclass
class WandbConfig:
    mode: str = "offline"  # disabled | offline | online
    project: str = "gears"
    entity: str | None = None
    name: str | None = None


@dataclass
class Config:
    seed: int = 1
    out_dir: str = "runs/default"
    # An out_dir holding another run's outputs is refused; true moves them aside, to
    # <out_dir>.replaced-<date>-<time>/, and starts afresh (nothing is deleted). Ignored with
    # train.resume=true, which continues the run in out_dir.
    replace_out_dir: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    data: DataConfig = field(default_factory=DataConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        """Write config.yaml atomically (a crash leaves the old file or the new one)."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        atomic_write(path, lambda tmp: tmp.write_text(text))


INT64 = 2**63
# Numeric keys: (lowest, highest or None, lowest excluded). Every int must also fit int64 and
# every float be finite; a value outside is an error naming the key, not a crash later.
DOMAIN = {
    "seed": (0, INT64 - 1, False),
    "split.seed": (0, INT64 - 1, False),
    "data.chunk_cells": (1, None, False),
    "data.go_top_k": (1, None, False),
    "data.go_threshold": (0.0, 1.0, False),
    "data.coexpress_top_k": (1, None, False),
    "data.coexpress_threshold": (0.0, 1.0, False),
    "split.train_gene_set_size": (0.0, 1.0, True),
    "split.combo_seen2_train_frac": (0.0, 1.0, False),
    "split.test_size": (0.0, 1.0, True),
    "split.val_size": (0.0, 1.0, True),
    "model.hidden_size": (1, None, False),
    "model.num_go_gnn_layers": (1, None, False),
    "model.num_gene_gnn_layers": (1, None, False),
    "model.uncertainty_reg": (0.0, None, False),
    "model.direction_lambda": (0.0, None, False),
    "model.direction_temperature": (0.0, None, True),
    "model.gamma": (0.0, None, False),
    "train.epochs": (1, None, False),
    "train.batch_size": (1, None, False),
    "train.test_batch_size": (1, None, False),
    "train.lr": (0.0, None, True),
    "train.weight_decay": (0.0, None, False),
    "train.step_gamma": (0.0, 1.0, True),
    "train.grad_clip": (0.0, None, False),
    "train.grad_accum_steps": (1, None, False),
    "train.cells_per_group": (1, None, False),
    "train.block_size": (1, None, False),
    "train.checkpoint_every": (1, None, False),
    "train.early_stopping_patience": (0, None, False),
    "train.limit_batches": (0, None, False),
    "train.num_workers": (0, None, False),
    "train.log_every": (1, None, False),
    "train.plot_conditions": (0, None, False),
    "train.threads": (0, None, False),
    "distributed.master_port": (0, 65535, False),
    "distributed.timeout_s": (1, None, False),
    "distributed.data_wait_s": (1, None, False),
}


def valid_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key a config accepts (dict-valued keys accept any sub-key)."""
    keys = []
    for f in fields(cls):
        if dataclasses.is_dataclass(
            f.default_factory if f.default_factory is not dataclasses.MISSING else None
        ):
            keys += valid_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _coerce(value: Any, annotation, key: str) -> Any:
    """Turn a YAML/CLI value into the field's type, or raise naming the key."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # noqa: S307 - our own annotations only
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            if type(None) in args:
                return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except GearsInputError:
                continue
        raise GearsInputError(
            f"config key {key!r}: cannot read {value!r} as {annotation}; give it a value of "
            "that type (null for none)"
        )
    name = getattr(annotation, "__name__", annotation)
    try:
        if value is None:  # null where the key takes none: str(None) would be 'None'
            raise ValueError
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes", "on"):
                return True
            if str(value).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number = int(float(value)) if isinstance(value, str) else int(value)
            if not -INT64 <= number < INT64:
                raise ValueError
            return number
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):
                raise ValueError
            return number
        if annotation is str:  # a YAML yes/no/true is no name: quote it to mean the word
            if isinstance(value, (dict, list, bool)):
                raise ValueError
            return str(value)
        if annotation is dict or origin is dict:
            value = _yaml_text(value)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ValueError
            return dict(value)
        if annotation is list or origin is list:
            value = _yaml_text(value)
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                value = [value]
            if not isinstance(value, list):
                raise ValueError
            item = args[0] if args else None
            return [_coerce(v, item, key) if item else v for v in value]
    except (TypeError, ValueError, OverflowError):
        raise GearsInputError(
            f"config key {key!r}: {value!r} is not a valid {name}; give it a {name} value in "
            f"the YAML file or as {key}=<{name}> on the command line"
        ) from None
    return value


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names one key twice: YAML keeps the last value and silently drops the first."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (a second `train:` block
    would otherwise replace the first whole, dropping its keys without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges may override
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    break
                if first is not None:
                    where = f"lines {first} and {line}" if first != line else f"line {line}"
                    raise DuplicateKeyError(
                        f"key {key!r} appears twice ({where}); YAML keeps only the last, "
                        "dropping the first one's values: merge them into one"
                    )
        return super().construct_mapping(node, deep=deep)


def yaml_load(text: str) -> Any:
    """yaml.safe_load, except that a key repeated in one mapping is a DuplicateKeyError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _yaml_text(value: Any) -> Any:
    """A string holding a YAML list or mapping ('[a, b]', '{n_genes: 50}') read as one."""
    if not isinstance(value, str):
        return value
    try:
        return yaml_load(value)
    except yaml.YAMLError:
        raise ValueError(value) from None


def _annotation(dotted: str):
    """The declared type of a dotted key, or None (unknown keys, sub-keys of a dict key)."""
    obj = Config()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(obj):
            return None
        names = {f.name: f for f in fields(obj)}
        if part not in names:
            return None
        found, obj = names[part], getattr(obj, part)
    return None if dataclasses.is_dataclass(obj) else found.type


def _parse_override(key: str, text: str) -> Any:
    """`key=text` from the command line: YAML for the value (so 5, 1e-4, [0, 1], {a: 1}, null
    work), except that a str key keeps the text as typed unless YAML reads it as a string
    (quotes) or null: yes, on, 0o10, 1_000 or 1.10 are names there, not booleans or numbers."""
    if not text.strip():
        return ""
    try:
        value = yaml_load(text)
    except DuplicateKeyError as e:
        raise GearsInputError(f"config key {key!r}: {text!r}: {e}") from None
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0]
        raise GearsInputError(
            f"config key {key!r}: cannot read {text!r} ({first}); quote the value or write it "
            f"as YAML, e.g. {key}='{text}'"
        ) from None
    annotation = _annotation(key)
    wants_text = annotation in (str, "str", "str | None")
    if wants_text and value is not None and not isinstance(value, str):
        return text.strip()
    return value


def _unknown(key: str) -> GearsInputError:
    keys = valid_keys()
    close = difflib.get_close_matches(key, keys, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return GearsInputError(f"unknown config key {key!r}.{hint} Valid keys: {', '.join(keys)}")


def _set(cfg: Config, dotted: Any, value: Any) -> None:
    if not isinstance(dotted, str):  # a YAML key such as 1, true or null
        raise GearsInputError(f"config key {dotted!r} is not a name; keys are words (train, ...)")
    obj, parts = cfg, dotted.split(".")
    for i, part in enumerate(parts):
        names = {f.name: f for f in fields(obj)}
        if part not in names:
            raise _unknown(dotted)
        f = names[part]
        current = getattr(obj, part)
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(current):
            if last:
                if not isinstance(value, dict):
                    raise GearsInputError(f"config key {dotted!r} is a section; set its keys")
                for k, v in value.items():
                    _set(cfg, f"{dotted}.{k}", v)
                return
            obj = current
            continue
        if isinstance(current, dict) and not last:  # free-form dict (data.synthetic)
            try:
                current[".".join(parts[i + 1 :])] = _yaml_text(value)
            except ValueError:
                raise GearsInputError(f"config key {dotted!r}: cannot read {value!r}") from None
            return
        if not last:
            raise _unknown(dotted)
        new = _coerce(value, f.type, dotted)
        choices = CHOICES.get(dotted)
        if choices and new not in choices and not (dotted == "model.impl" and _known_impl(new)):
            raise GearsInputError(f"config key {dotted!r} must be one of {choices}, got {new!r}")
        setattr(obj, part, new)
        return


def _dotted_leaves(data: dict, prefix: str = "") -> list[str]:
    """The dotted keys a YAML mapping sets: {'train': {'lr': 1}, 'train.epochs': 2} ->
    ['train.lr', 'train.epochs']."""
    keys = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        keys += _dotted_leaves(v, f"{key}.") if isinstance(v, dict) and v else [key]
    return keys


def _refuse_repeated_keys(data: dict, path: Path) -> None:
    """One file setting a key twice, spelled two ways (`train.lr: 1` beside `train: {lr: 2}`),
    would keep whichever comes last: an error naming the key, as a repeated YAML key is."""
    seen = set()
    for key in _dotted_leaves(data):
        if key in seen:
            raise GearsInputError(
                f"config file {path} sets {key!r} twice (as a dotted key and inside its section); "
                "only one would be kept: keep one of them"
            )
        seen.add(key)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: str | Path | None = None,
) -> Config:
    """Defaults <- `base` YAML (configs/default.yaml) <- `path` YAML <- `key=value` overrides."""
    cfg = Config()
    for p in (base, path):
        if p is None:
            continue
        p = Path(p)
        if not p.exists():
            raise GearsInputError(f"config file {p} does not exist; check the --config path")
        if not p.is_file():
            raise GearsInputError(f"config file {p} is not a file; give the path of a YAML file")
        try:
            data = yaml_load(p.read_text(encoding="utf-8")) or {}
        except DuplicateKeyError as e:
            raise GearsInputError(f"config file {p}: {e}") from None
        except (UnicodeDecodeError, yaml.YAMLError) as e:
            first = str(e).strip().splitlines()[0]
            raise GearsInputError(
                f"config file {p} is not readable YAML ({first}); fix it or start from "
                "configs/default.yaml"
            ) from None
        if not isinstance(data, dict):
            raise GearsInputError(f"config file {p} must hold a mapping of keys, not {type(data)}")
        _refuse_repeated_keys(data, p)
        for k, v in data.items():
            _set(cfg, k, v)
    for item in overrides or []:
        if "=" not in item:
            raise GearsInputError(
                f"override {item!r} must look like key=value (e.g. train.epochs=5)"
            )
        key, value = item.split("=", 1)
        _set(cfg, key.strip(), _parse_override(key.strip(), value))
    _check(cfg)
    return cfg


def _known_impl(impl: str) -> bool:
    """A built-in network name, or a class spec (file.py:Class, module:Class; whether it
    exists is checked when the network is built, gears.model.network_class)."""
    return impl in CHOICES["model.impl"] or ":" in impl


def check_impl(model: ModelConfig, train: TrainConfig, dist: DistributedConfig) -> None:
    """Refuse the settings that model.impl=reference cannot run with, by name."""
    if model.impl != "reference":
        return
    if train.compile:
        raise GearsInputError(
            "train.compile=true needs model.impl=fast: the reference network's per-cell rows "
            "and data-dependent shapes break the compiled graph (inductor fails on its "
            "nonzero and recompiles per batch); drop train.compile or use model.impl=fast"
        )
    if dist.sync_batchnorm:
        raise GearsInputError(
            "distributed.sync_batchnorm=true needs model.impl=fast: the reference network's "
            "nn.BatchNorm1d normalises each process's cells (PyTorch's SyncBatchNorm runs on "
            "GPUs only); drop distributed.sync_batchnorm or use model.impl=fast"
        )


def _check(cfg: Config) -> None:
    """Ranges (DOMAIN) and the free-form keys' contents, checked once every source is merged."""
    check_impl(cfg.model, cfg.train, cfg.distributed)
    for key, (low, high, open_low) in DOMAIN.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        too_low = value <= low if open_low else value < low
        if too_low or (high is not None and value > high):
            bound = f"> {low}" if open_low else f">= {low}"
            where = f"{bound} and <= {high}" if high is not None else bound
            raise GearsInputError(f"config key {key!r} must be {where}, got {value}")
    for i in cfg.distributed.gpu_ids or []:
        if i < 0:
            raise GearsInputError(f"config key 'distributed.gpu_ids': {i} is not a GPU index")
    for column, wanted in cfg.data.subset.items():
        items = wanted if isinstance(wanted, list) else [wanted]
        if not all(isinstance(w, (str, int, float)) for w in items):
            raise GearsInputError(
                f"config key 'data.subset.{column}': {wanted!r}; give a value or a list of "
                "values of that obs column"
            )
    if not cfg.data.synthetic:
        return
    known = set(inspect.signature(make_synthetic).parameters)
    unknown = sorted(set(cfg.data.synthetic) - known)
    if unknown:
        raise GearsInputError(
            f"config key 'data.synthetic' has unknown keys {unknown}; valid: {sorted(known)}"
        )
