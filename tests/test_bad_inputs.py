"""Bad inputs across the whole path, one table: each must raise the named exception type with a
message that names the offending item (column, condition, gene, key, file, rank) and says what
to do. Everything runs in-process on a 25-gene hand-made screen (seconds)."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from helpers import GENES, tiny_gene2go, tiny_screen, write_gene2go

from gears.compat.api import GEARS
from gears.config import ModelConfig, TrainConfig, load_config
from gears.data.pertdata import PertData
from gears.errors import GearsInputError, TrainingStopped
from gears.train import checkpoint as ckpt
from gears.train.distributed import DistEnv, check_gpu_ids, choose_device, launch_ranks
from gears.train.engine import Trainer, autocast_dtype, seed_everything


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> SimpleNamespace:
    """A processed tiny screen with a split, a saved model of it, a checkpoint folder, and
    variants of the data with another gene set and another perturbation vocabulary."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    go = write_gene2go(tmp / "go.tsv", tiny_gene2go())

    def pert_data(adata=None, gene2go=go, **kw) -> PertData:
        p = PertData(tmp / "data", gene2go=gene2go, verbose=False, **kw)
        p.new_data_process("tiny", tiny_screen() if adata is None else adata, write=False)
        return p.prepare_split("simulation", seed=1)

    data = pert_data()
    seed_everything(0)
    model = GEARS(data, device="cpu").model_initialize(hidden_size=8)
    model.save_model(tmp / "model")
    model.save_model(tmp / "model_run" / "model")  # a finished run's folder, as a run leaves it
    cfg = TrainConfig(epochs=1, batch_size=8, limit_batches=2)
    loaders = data.get_dataloader(cfg.batch_size, 16)
    trainer = Trainer(model.model, data, cfg, model.model_config(), DistEnv(), out_dir=tmp / "run")
    trainer.fit(loaders, progress=False)  # writes run/checkpoints/epoch_0001.pt
    # A run stopped by SIGTERM after its first step: a mid-epoch checkpoint in stopped/.
    stopped = Trainer(
        model.model, data, cfg, model.model_config(), DistEnv(), out_dir=tmp / "stopped"
    )
    stopped.stop_requested = True
    with pytest.raises(TrainingStopped):
        stopped.fit(loaders, progress=False)
    # Two finished epochs (a resume asking for fewer must be refused).
    two = Trainer(
        model.model,
        data,
        TrainConfig(epochs=2, batch_size=8, limit_batches=2),
        model.model_config(),
        DistEnv(),
        out_dir=tmp / "two_epochs",
    )
    two.fit(loaders, progress=False)
    fewer_genes = tiny_screen()[:, :-1].copy()  # G24 gone from the measured genes
    go_without_g03 = tiny_gene2go()
    del go_without_g03["G03"]
    return SimpleNamespace(
        tmp=tmp,
        go=go,
        data=data,
        model=model,
        pert_data=pert_data,
        other_genes=pert_data(fewer_genes),
        other_perts=pert_data(gene2go=write_gene2go(tmp / "go2.tsv", go_without_g03)),
        other_values=pert_data(tiny_screen(seed=1)),  # same names, other expression
    )


def _relabel(mapping: dict[str, str]):
    adata = tiny_screen()
    adata.obs["condition"] = adata.obs["condition"].astype(str).replace(mapping)
    return adata


def _process(ctx, adata, **kw) -> None:
    PertData(ctx.tmp / "d", gene2go=ctx.go, verbose=False, **kw).new_data_process(
        "x", adata, write=False
    )


def sparse_with_nan(ctx):
    adata = tiny_screen()
    X = sp.csr_matrix(adata.X)
    X.data[7] = np.nan
    adata.X = X
    _process(ctx, adata)


def raw_counts(ctx):
    adata = tiny_screen()
    adata.X = np.round(adata.X * 40)  # integers up to ~360: UMI counts, not log1p values
    _process(ctx, adata)


def negative_values(ctx):
    adata = tiny_screen()
    adata.X = adata.X - 2.0  # z-scored / centred data
    _process(ctx, adata)


def missing_condition_column(ctx):
    adata = tiny_screen()
    adata.obs = adata.obs.rename(columns={"condition": "perturbation_label"})
    _process(ctx, adata)


def duplicate_genes(ctx):
    adata = tiny_screen()
    adata.var_names = ["G00", *adata.var_names[1:-1], "G00"]
    _process(ctx, adata)


def no_control_cells(ctx):
    _process(ctx, _relabel({"control": "G04"}))


def config_file_missing(ctx):
    load_config(ctx.tmp / "no_such.yaml")


def choose_missing_gpu(ctx):
    choose_device("auto", 0, [3])  # the CPU twin of a machine with fewer GPUs than listed


def _resume(ctx, data, hidden: int, run: str = "run", **train_kw):
    """A trainer over `data` resuming from the checkpoint folder of `run`."""
    seed_everything(0)
    model = GEARS(data, device="cpu").model_initialize(hidden_size=hidden)
    cfg = TrainConfig(**{"epochs": 2, "batch_size": 8, **train_kw})
    trainer = Trainer(
        model.model, data, cfg, ModelConfig(hidden_size=hidden), DistEnv(), out_dir=ctx.tmp / run
    )
    trainer.resume()


def _resume_same(ctx, data=None, run: str = "run", **train_kw):
    """A trainer resuming `run` with the settings that wrote it (hidden 8, batch 8, 2 batches
    an epoch, 1 epoch), except `train_kw`."""
    seed_everything(0)
    data = ctx.data if data is None else data
    model = GEARS(data, device="cpu").model_initialize(hidden_size=8)
    cfg = TrainConfig(**{"epochs": 1, "batch_size": 8, "limit_batches": 2, **train_kw})
    trainer = Trainer(
        model.model, data, cfg, ModelConfig(hidden_size=8), DistEnv(), out_dir=ctx.tmp / run
    )
    return trainer.resume()


def _checkpoints_copy(ctx, name: str, edit) -> str:
    """The run's checkpoint folder copied to `name`, each file passed through edit(path)."""
    folder = ctx.tmp / name / "checkpoints"
    if not folder.exists():
        shutil.copytree(ctx.tmp / "run" / "checkpoints", folder)
        for path in ckpt.list_checkpoints(folder):
            edit(path)
    return name


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _drop_fingerprint(path: Path) -> None:
    state = ckpt.load(path)
    del state["fingerprint"]
    torch.save(state, path)


def _h5ad(ctx, name: str, edit) -> Path:
    """tiny_screen written to `name`, then its bytes passed through edit(bytes) -> bytes."""
    path = ctx.tmp / name
    tiny_screen().write_h5ad(path)
    path.write_bytes(edit(path.read_bytes()))
    return path


def _load_h5ad(ctx, path: Path):
    PertData(ctx.tmp / "d", gene2go=ctx.go, verbose=False).load(data_path=path)


def ensembl_var_names(ctx):
    """Gene ids of another kind than the labels and GO source (which use symbols)."""
    adata = tiny_screen()
    adata.var_names = [f"ENSG{i:011d}" for i in range(adata.n_vars)]
    _process(ctx, adata, unmapped_perts="keep")


def model_json(ctx, name: str):
    """A model folder whose config.json (read by load_pretrained) or prediction.json (read by
    predict.py through read_model_json) was cut short."""
    folder = _model_copy(ctx, f"cut_{name}")
    (folder / name).write_text((ctx.tmp / "model" / name).read_text()[:40])
    if name == "config.json":
        GEARS(ctx.data, device="cpu").load_pretrained(folder)
    from gears.train.saved_model import read_model_json

    read_model_json(folder, name)


def run_into(ctx, out_dir: Path, *overrides: str):
    """The main job (gears.cli.job.run) on out_dir: refused at its start, before any data work."""
    from gears.cli.job import run

    cfg = load_config(None, [f"out_dir={out_dir}", f"data.data_dir={ctx.tmp / 'd'}", *overrides])
    run(cfg, DistEnv())


def out_dir_a_file(ctx):
    path = ctx.tmp / "notes.txt"
    path.write_text("my notes")
    run_into(ctx, path)


def yaml_file(ctx, text: str):
    path = ctx.tmp / f"cfg_{abs(hash(text))}.yaml"
    path.write_text(text)
    load_config(path)


def _model_copy(ctx, name: str) -> Path:
    folder = ctx.tmp / name
    if not folder.exists():
        shutil.copytree(ctx.tmp / "model", folder)
    return folder


def model_file_not_a_checkpoint(ctx):
    folder = _model_copy(ctx, "text_model")
    (folder / "model.pt").write_text("these are my notes, not weights\n")
    GEARS(ctx.data, device="cpu").load_pretrained(folder)


def model_file_foreign_pickle(ctx):
    folder = _model_copy(ctx, "pickled_model")
    (folder / "model.pt").write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    GEARS(ctx.data, device="cpu").load_pretrained(folder)


def model_file_old_format(ctx):
    folder = _model_copy(ctx, "old_model")
    state = ckpt.load(folder / "model.pt")
    del state["format"]
    ckpt.atomic_save(state, folder / "model.pt")
    GEARS(ctx.data, device="cpu").load_pretrained(folder)


def model_file_other_size(ctx):
    """config.json says hidden 8 but model.pt came from a hidden-16 model of the same data."""
    folder = _model_copy(ctx, "mixed_model")
    seed_everything(0)
    GEARS(ctx.data, device="cpu").model_initialize(hidden_size=16).save_model(ctx.tmp / "m16")
    shutil.copy(ctx.tmp / "m16" / "model.pt", folder / "model.pt")
    GEARS(ctx.data, device="cpu").load_pretrained(folder)


def split_file(ctx, content: dict, split: str = "custom"):
    path = ctx.tmp / f"split_{len(json.dumps(content))}.json"
    path.write_text(json.dumps(content))
    ctx.data.prepare_split(split, split_dict_path=path)
    ctx.data.prepare_split("simulation", seed=1)  # not reached; keeps the module data usable


def gene_named_with_plus(ctx):
    """A measured gene 'HLA+A' named by the labels of its single perturbation."""
    adata = tiny_screen()
    adata.var_names = ["HLA+A" if g == "G03" else g for g in adata.var_names]
    adata.obs["condition"] = adata.obs["condition"].astype(str).replace({"G03": "HLA+A"})
    go = write_gene2go(ctx.tmp / "go_plus.tsv", {**tiny_gene2go(), "HLA+A": {"GO:1"}})
    PertData(ctx.tmp / "d", gene2go=go, verbose=False).new_data_process("x", adata, write=False)


def fork_output(ctx, broken: str):
    """One training step of a fork whose forward breaks the output contract."""
    import copy

    net = copy.deepcopy(ctx.model.model)

    class BrokenFork(type(net)):
        def forward(self, batch):
            out = super().forward(batch)
            out = out[0] if isinstance(out, tuple) else out
            if broken == "genes":
                return out[:, :-1]
            if broken == "dtype":
                return out.long()
            return [out]

    net.__class__ = BrokenFork
    cfg = TrainConfig(epochs=1, batch_size=8, limit_batches=1)
    trainer = Trainer(
        net, ctx.data, cfg, ctx.model.model_config(), DistEnv(), out_dir=ctx.tmp / f"fork_{broken}"
    )
    trainer.fit(ctx.data.get_dataloader(cfg.batch_size, 16), progress=False)


def gi_genes_file_naming_no_model_gene(ctx):
    path = ctx.tmp / "gi_genes.npy"
    np.save(path, np.array(["NOT_A_GENE", "NOR_THIS"]))
    ctx.model.GI_predict(["G00", "G03"], GI_genes_file=str(path))


def read_only_data_dir(ctx):
    """data_dir where nothing can be written: a read-only folder (for root, who writes
    anywhere, a folder below a file: the same OSError path)."""
    import os

    folder = ctx.tmp / "read_only"
    folder.mkdir(exist_ok=True)
    data_dir = folder
    if os.geteuid() == 0:
        (folder / "a_file").write_text("")
        data_dir = folder / "a_file" / "data"
    folder.chmod(0o555)
    try:
        PertData(data_dir, verbose=False).load(
            "synthetic", synthetic_params={"n_genes": 30, "n_single": 8, "n_double": 0}
        )
    finally:
        folder.chmod(0o755)


def wandb_online_without_a_key(ctx):
    import os

    saved = {k: os.environ.pop(k, None) for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")}
    os.environ["NETRC"] = str(ctx.tmp / "no_netrc")
    try:
        run_into(ctx, ctx.tmp / "online_run", "wandb.mode=online")
    finally:
        os.environ.pop("NETRC")
        os.environ.update({k: v for k, v in saved.items() if v is not None})


def context_that_cannot_be_split(ctx):
    """Two contexts; lineB holds controls and one perturbation: refused before lineA trains."""
    from gears.cli.contexts import run_contexts
    from gears.cli.job import split_and_graphs

    adata = tiny_screen()
    label = adata.obs["condition"].astype(str)
    adata.obs["line"] = np.where(
        label.isin(["control", "G00"]) & (np.arange(len(label)) % 2 == 1), "lineB", "lineA"
    )
    data = PertData(ctx.tmp / "d", gene2go=ctx.go, verbose=False)
    data.new_data_process("lines", adata, write=False, context_key="line")
    cfg = load_config(None, [f"out_dir={ctx.tmp / 'lines_run'}", "data.context_key=line"])
    trained = []
    run_contexts(
        cfg,
        DistEnv(),
        data,
        load=None,
        prepare=split_and_graphs,
        run_one=lambda cfg, env, **kw: trained.append(cfg.out_dir),
    )
    assert not trained, trained


@dataclass
class Case:
    id: str
    run: Callable[[SimpleNamespace], object]
    error: type[Exception]
    names: tuple[str, ...]  # what the message must name (regexes)
    fix: str  # regex for the instruction the message must give


CASES = [
    # ---------------------------------------------------------------- AnnData
    Case(
        "sparse X with NaN",
        sparse_with_nan,
        GearsInputError,
        (r"adata\.X", r"1 NaN", r"cell\d+"),
        r"drop those cells|sc\.pp\.log1p",
    ),
    Case(
        "raw integer counts",
        raw_counts,
        GearsInputError,
        (r"adata\.X", "raw counts"),
        r"data\.normalize=log1p.*sc\.pp\.normalize_total.*sc\.pp\.log1p",
    ),
    Case(
        "negative (scaled) values",
        negative_values,
        GearsInputError,
        (r"adata\.X", "negative"),
        r"sc\.pp\.log1p",
    ),
    Case(
        "no condition column",
        missing_condition_column,
        GearsInputError,
        (r"'condition'", "perturbation_label"),
        r"set data\.condition_key",
    ),
    Case(
        "duplicate gene names", duplicate_genes, GearsInputError, ("G00",), r"var_names_make_unique"
    ),
    Case(
        "no control cells",
        no_control_cells,
        GearsInputError,
        (r"obs\['condition'\]", "ctrl"),
        r"control_names",
    ),
    # ------------------------------------------------------- condition strings
    Case(
        "condition with three genes",
        lambda c: _process(c, _relabel({"G03": "G03+G04+G05"})),
        GearsInputError,
        (r"G03\+G04\+G05", "3 genes"),
        r"drop these cells",
    ),
    Case(
        "condition with an empty gene",
        lambda c: _process(c, _relabel({"G03": "G03+"})),
        GearsInputError,
        (r"'G03\+'",),
        r"spell conditions",
    ),
    Case(
        "condition naming a gene twice",
        lambda c: _process(c, _relabel({"G03": "G03+G03"})),
        GearsInputError,
        (r"G03\+G03",),
        r"write a single perturbation",
    ),
    # ------------------------------------------------------------ files as found
    Case(
        "truncated .h5ad",
        lambda c: _load_h5ad(c, _h5ad(c, "cut.h5ad", lambda b: b[: len(b) // 2])),
        GearsInputError,
        (r"cut\.h5ad", "truncated"),
        r"Copy it again",
    ),
    Case(
        "empty .h5ad",
        lambda c: _load_h5ad(c, _h5ad(c, "empty.h5ad", lambda b: b"")),
        GearsInputError,
        (r"empty\.h5ad", r"empty \(0 bytes\)"),
        r"Copy it again|adata\.write_h5ad",
    ),
    Case(
        "CSV renamed .h5ad",
        lambda c: _load_h5ad(c, _h5ad(c, "table.h5ad", lambda b: b"cell,G00,G01\nc1,1,2\n")),
        GearsInputError,
        (r"table\.h5ad", r"text starting 'cell,G00,G01'", "CSV"),
        r"scanpy\.read_csv",
    ),
    Case(
        "gene names matching no perturbed gene and no GO term",
        ensembl_var_names,
        GearsInputError,
        ("none of the 25 measured gene names", "ENSG00000000000", "G00"),
        r"gene symbols in adata\.var\['gene_name'\]",
    ),
    Case(
        "synthetic screen larger than memory",
        lambda c: PertData(c.tmp / "d", verbose=False).load(
            "synthetic", synthetic_params={"n_control_cells": 10**20}
        ),
        GearsInputError,
        ("100,000,000,000,000,005,000 cells", "GB"),
        r"lower n_control_cells",
    ),
    Case(
        "model folder's config.json cut short",
        lambda c: model_json(c, "config.json"),
        GearsInputError,
        (r"cut_config\.json/config\.json", "not valid JSON"),
        r"save the model again",
    ),
    Case(
        "model folder's prediction.json cut short",
        lambda c: model_json(c, "prediction.json"),
        GearsInputError,
        (r"cut_prediction\.json/prediction\.json", "not valid JSON"),
        r"save the model again",
    ),
    # --------------------------------------------------------- genes and GO
    Case(
        "perturbed gene absent from var and GO",
        lambda c: _process(c, _relabel({"G03": "NOPE1"})),
        GearsInputError,
        ("NOPE1", "go.tsv"),
        r"unmapped_perts.*'error'.*'drop'.*'keep'",
    ),
    Case(
        "GO source in an unknown format",
        lambda c: PertData(
            c.tmp / "d", gene2go=_write(c.tmp / "go.xyz", "gene GO\nfoo"), verbose=False
        ).new_data_process("x", tiny_screen(), write=False),
        GearsInputError,
        (r"go\.xyz", "line 1"),
        r"Accepted formats",
    ),
    Case(
        "GO source missing",
        lambda c: PertData(c.tmp / "d", gene2go=c.tmp / "nope.gaf", verbose=False).new_data_process(
            "x", tiny_screen(), write=False
        ),
        GearsInputError,
        (r"nope\.gaf", "does not exist"),
        r"Accepted formats",
    ),
    Case(
        "unknown dataset name",
        lambda c: PertData(c.tmp / "d", verbose=False).load("normann"),
        GearsInputError,
        ("'normann'",),
        r"use 'synthetic'.*norman.*or a path",
    ),
    Case(
        "predict a gene outside the graph",
        lambda c: c.model.predict([["NOT_A_GENE"]]),
        GearsInputError,
        ("NOT_A_GENE", "perturbation graph"),
        r"Choose genes from GEARS\.pert_list",
    ),
    Case(
        "unmapped_perts not a choice",
        lambda c: PertData(c.tmp / "d", unmapped_perts="ignore"),
        GearsInputError,
        ("'ignore'",),
        r"'drop'",
    ),
    # ---------------------------------------------------------------- splits
    Case(
        "split file naming unknown conditions",
        lambda c: split_file(c, {"train": ["G00+ctrl", "G99+ctrl"], "test": ["G01+ctrl"]}),
        GearsInputError,
        (r"split_\d+\.json", r"G99\+ctrl"),
        r"Fix their spelling or remove",
    ),
    Case(
        "split file that is not JSON",
        lambda c: c.data.prepare_split("custom", split_dict_path=_write(c.tmp / "s.txt", "hi")),
        GearsInputError,
        (r"s\.txt",),
        r"write it as JSON",
    ),
    Case(
        "empty test set for combo_seen2",
        lambda c: c.data.prepare_split("combo_seen2"),
        GearsInputError,
        ("combo_seen2", "0 double"),
        r"Raise test_size or use a split type",
    ),
    # ------------------------------------------------- configs and CLI overrides
    Case(
        "config value of the wrong type",
        lambda c: load_config(None, ["train.batch_size=big"]),
        GearsInputError,
        ("'train.batch_size'", "'big'"),
        r"give it a int value",
    ),
    Case(
        "unknown config key",
        lambda c: load_config(None, ["train.epoch=3"]),
        GearsInputError,
        ("'train.epoch'",),
        r"Did you mean train.epochs",
    ),
    Case(
        "config value not a choice",
        lambda c: load_config(None, ["data.unmapped_perts=ignore"]),
        GearsInputError,
        ("'data.unmapped_perts'", "'ignore'"),
        r"must be one of",
    ),
    Case(
        "override without '='",
        lambda c: load_config(None, ["train.epochs"]),
        GearsInputError,
        ("'train.epochs'",),
        r"key=value",
    ),
    Case(
        "config file with two train: blocks",
        lambda c: yaml_file(
            c, "train:\n  lr: 0.002\nmodel:\n  hidden_size: 8\ntrain:\n  epochs: 3\n"
        ),
        GearsInputError,
        (r"cfg_\d+\.yaml", r"key 'train' appears twice \(lines 1 and 5\)"),
        r"merge them into one",
    ),
    Case(
        "config file setting a key as dotted and in its section",
        lambda c: yaml_file(c, "train.lr: 0.002\ntrain:\n  lr: 0.01\n"),
        GearsInputError,
        (r"cfg_\d+\.yaml", "'train.lr' twice"),
        r"keep one of them",
    ),
    Case(
        "override naming a sub-key twice",
        lambda c: load_config(None, ["data.synthetic={n_genes: 50, n_genes: 60}"]),
        GearsInputError,
        ("'data.synthetic'", "'n_genes' appears twice"),
        r"merge them into one",
    ),
    Case(
        "config file missing",
        config_file_missing,
        GearsInputError,
        (r"no_such\.yaml", "does not exist"),
        r"check the --config path",
    ),
    Case(
        "train.batch_size larger than the training set",
        lambda c: (
            GEARS(c.pert_data(), device="cpu")
            .model_initialize(hidden_size=8)
            .train(epochs=1, batch_size=100_000, progress=False)
        ),
        GearsInputError,
        ("train.batch_size=100000", "training set"),
        r"Lower train\.batch_size",
    ),
    Case(
        "fp16 on CPU",
        lambda c: autocast_dtype("fp16", torch.device("cpu")),
        GearsInputError,
        ("train.precision=fp16", "CUDA"),
        r"use train\.precision=bf16",
    ),
    Case(
        "non-positive learning rate",
        lambda c: load_config(None, ["train.lr=0"]),
        GearsInputError,
        ("'train.lr'",),
        r"must be > 0",
    ),
    # ------------------------------------------------------------ checkpoints
    Case(
        "saved model from another gene set",
        lambda c: GEARS(c.other_genes, device="cpu").load_pretrained(c.tmp / "model"),
        GearsInputError,
        ("25 genes", "G24"),
        r"load it with the PertData",
    ),
    Case(
        "saved model from another perturbation vocabulary",
        lambda c: GEARS(c.other_perts, device="cpu").load_pretrained(c.tmp / "model"),
        GearsInputError,
        ("perturbation vocabulary", "G03"),
        r"data\.gene2go",
    ),
    Case(
        "saved model.pt of another model size",
        model_file_other_size,
        GearsInputError,
        (r"mixed_model/model\.pt", "model.hidden_size: checkpoint 16 vs now 8"),
        r"Use the settings",
    ),
    Case(
        "resume from a checkpoint of another model size",
        lambda c: _resume(c, c.data, hidden=16),
        GearsInputError,
        (r"epoch_0001\.pt", "model.hidden_size: checkpoint 8 vs now 16"),
        r"Use the settings",
    ),
    Case(
        "resume from a checkpoint of another gene set",
        lambda c: _resume(c, c.other_genes, hidden=8),
        GearsInputError,
        (r"epoch_0001\.pt", "vocab_hash"),
        r"use the same dataset",
    ),
    Case(
        "resume mid-epoch with another batch size",
        lambda c: _resume(c, c.data, hidden=8, run="stopped", batch_size=16),
        GearsInputError,
        (r"epoch_0000_step_000001\.pt", "train.batch_size: checkpoint 8 vs now 16"),
        r"Use the settings",
    ),
    Case(
        "resume with another learning rate",
        lambda c: _resume_same(c, lr=0.5),
        GearsInputError,
        (r"epoch_0001\.pt", "train.lr: checkpoint 0.001 vs now 0.5"),
        r"Resume with the data and settings it was written with.*replace_out_dir=true",
    ),
    Case(
        "resume with another optimizer",
        lambda c: _resume_same(c, optimizer="sgd"),
        GearsInputError,
        (r"epoch_0001\.pt", "train.optimizer: checkpoint 'adam' vs now 'sgd'"),
        r"Resume with the data and settings",
    ),
    Case(
        "resume with another schedule",
        lambda c: _resume_same(c, schedule="constant"),
        GearsInputError,
        (r"epoch_0001\.pt", "train.schedule: checkpoint 'cosine' vs now 'constant'"),
        r"Resume with the data and settings",
    ),
    Case(
        "resume with other data under the same names",
        lambda c: _resume_same(c, data=c.other_values),
        GearsInputError,
        (r"epoch_0001\.pt", r"data:expression \(the expression of 256 cells"),
        r"Resume with the data and settings",
    ),
    Case(
        "resume asking for fewer epochs than done",
        lambda c: _resume_same(c, run="two_epochs", epochs=1, schedule="cosine"),
        GearsInputError,
        (r"two_epochs/checkpoints/epoch_0002\.pt", "train.epochs: 1 is fewer", r"2 epoch\(s\)"),
        r"ask for at least 2",
    ),
    Case(
        "resume when every checkpoint is unreadable",
        lambda c: _resume_same(c, run=_checkpoints_copy(c, "all_cut", _truncate)),
        GearsInputError,
        (r"none of the 1 checkpoint file\(s\)", r"all_cut/checkpoints", r"epoch_0001\.pt"),
        r"replace_out_dir=true",
    ),
    Case(
        "resume from a checkpoint without a fingerprint",
        lambda c: _resume_same(c, run=_checkpoints_copy(c, "unsigned", _drop_fingerprint)),
        GearsInputError,
        (r"unsigned/checkpoints/epoch_0001\.pt", "records no fingerprint"),
        r"another out_dir, or replace_out_dir=true",
    ),
    Case(
        "model file that is not a checkpoint",
        model_file_not_a_checkpoint,
        GearsInputError,
        (r"text_model/model\.pt",),
        r"not a GEARS checkpoint",
    ),
    Case(
        "model file that is a foreign pickle",
        model_file_foreign_pickle,
        GearsInputError,
        (r"pickled_model/model\.pt",),
        r"not a GEARS checkpoint",
    ),
    Case(
        "model file of an older format",
        model_file_old_format,
        GearsInputError,
        (r"old_model/model\.pt", "format None"),
        r"Train again",
    ),
    Case(
        "checkpoint path that does not exist",
        lambda c: ckpt.load(c.tmp / "nowhere.pt"),
        GearsInputError,
        (r"nowhere\.pt",),
        r"check the path",
    ),
    # ------------------------------------------------------- names, forks, services
    Case(
        "measured gene whose name holds '+'",
        gene_named_with_plus,
        GearsInputError,
        (r"'HLA\+A' contains '\+'", r"join the two genes of a double", r"\['HLA', 'A'\]"),
        r"rename the gene without '\+' \(e\.g\. 'HLA_A'\)",
    ),
    Case(
        "fork returning the wrong gene count",
        lambda c: fork_output(c, "genes"),
        GearsInputError,
        (r"BrokenFork returned shape \[\d+, 24\]",),
        r"must return a floating-point torch\.Tensor \[rows, genes\] = \[\d+, 25\]",
    ),
    Case(
        "fork returning integers",
        lambda c: fork_output(c, "dtype"),
        GearsInputError,
        (r"BrokenFork returned dtype torch\.int64",),
        r"must return a floating-point torch\.Tensor",
    ),
    Case(
        "fork returning a list",
        lambda c: fork_output(c, "list"),
        GearsInputError,
        (r"BrokenFork returned a list",),
        r"must return a floating-point torch\.Tensor",
    ),
    Case(
        "GI genes file naming no model gene",
        gi_genes_file_naming_no_model_gene,
        GearsInputError,
        (r"gi_genes\.npy", r"none of its 2 gene", r"NOT_A_GENE"),
        r"list genes the model measures",
    ),
    Case(
        "read-only data_dir with the synthetic dataset",
        read_only_data_dir,
        GearsInputError,
        (r"read_only", r"not writable|cannot write|could not write"),
        r"data\.data_dir",
    ),
    Case(
        "wandb online without an API key",
        wandb_online_without_a_key,
        GearsInputError,
        (r"wandb\.mode=online", r"WANDB_API_KEY"),
        r"wandb login.*wandb\.mode=offline",
    ),
    Case(
        "context that cannot be split",
        context_that_cannot_be_split,
        GearsInputError,
        (r"context 'lineB'", r"cannot be split", r"no context was trained"),
        r"data\.subset",
    ),
    # ------------------------------------------------------------- run folders
    Case(
        "out_dir that is a file",
        out_dir_a_file,
        GearsInputError,
        (r"out_dir .*notes\.txt is a file",),
        r"choose another out_dir",
    ),
    Case(
        "out_dir holding a finished run",
        lambda c: run_into(c, c.tmp / "model_run", "wandb.mode=disabled"),
        GearsInputError,
        (r"model_run holds another run's outputs", r"model/"),
        r"another out_dir; train\.resume=true .* replace_out_dir=true",
    ),
    # ------------------------------------------------------- launcher variables
    Case(
        "WORLD_SIZE without RANK",
        lambda c: launch_ranks({"WORLD_SIZE": "2"}),
        GearsInputError,
        ("WORLD_SIZE=2", "RANK"),
        r"launch with torchrun",
    ),
    Case(
        "RANK outside WORLD_SIZE",
        lambda c: launch_ranks({"WORLD_SIZE": "2", "RANK": "2"}),
        GearsInputError,
        ("RANK=2", "WORLD_SIZE=2"),
        r"let torchrun / srun set them",
    ),
    Case(
        "RANK not an integer",
        lambda c: launch_ranks({"WORLD_SIZE": "2", "RANK": "zero"}),
        GearsInputError,
        ("RANK='zero'",),
        r"launch with torchrun",
    ),
    Case(
        "gpu_ids naming a missing GPU",
        lambda c: check_gpu_ids([0, 3], n_visible=2),
        GearsInputError,
        (r"gpu_ids=\[0, 3\]", r"\[3\]", "2 GPU"),
        r"use ids 0\.\.1",
    ),
    Case(
        "gpu_ids on a machine without GPUs",
        choose_missing_gpu,
        GearsInputError,
        (r"gpu_ids=\[3\]", "0 GPU"),
        r"device=cpu",
    ),
]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_table_is_large_enough():
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_a_clear_error(ctx, case: Case):
    with pytest.raises(case.error) as info:
        case.run(ctx)
    message = str(info.value)
    for pattern in case.names:
        assert re.search(pattern, message), (pattern, message)
    assert re.search(case.fix, message), (case.fix, message)
    assert "Traceback" not in message


def test_unmapped_perts_drop_removes_conditions_and_reports_cell_counts(ctx):
    adata = _relabel({"G03": "NOPE1"})
    p = PertData(ctx.tmp / "d", gene2go=ctx.go, verbose=False, unmapped_perts="drop")
    p.new_data_process("x", adata, write=False)
    assert "NOPE1+ctrl" not in p.conditions
    assert p.report["dropped_condition_cells"] == {"NOPE1+ctrl": 12}
    assert p.report["perturbed_genes_without_go"] == ["NOPE1"]
    assert p.adata.n_obs == adata.n_obs - 12
    keep = PertData(ctx.tmp / "d", gene2go=ctx.go, verbose=False, unmapped_perts="keep")
    assert "NOPE1+ctrl" in keep.new_data_process("x", adata, write=False).conditions
    # The deprecated boolean still means keep; contradicting it with drop is an error.
    assert PertData(ctx.tmp / "d", keep_unmapped_perts=True).unmapped_perts == "keep"
    with pytest.raises(GearsInputError, match="contradicts data.unmapped_perts=drop"):
        PertData(ctx.tmp / "d", keep_unmapped_perts=True, unmapped_perts="drop")


def test_log_normalised_data_with_large_values_is_accepted(ctx):
    """The raw-count check refuses integers only: log-normalised values are never all integer,
    and integer data below the threshold (e.g. binarised) passes too."""
    adata = tiny_screen()
    adata.X = adata.X * 10.0 + 0.5  # max ~ 100, not integer-valued
    _process(ctx, adata)
    small = tiny_screen()
    small.X = np.round(small.X)  # integers, max 9
    _process(ctx, small)


def test_crafted_pickle_checkpoint_is_refused_and_runs_no_code(ctx, tmp_path):
    """A `__reduce__` that would write a file: loading must refuse it before anything runs,
    whether through ckpt.load, resume or load_pretrained."""
    marker = tmp_path / "pwned.txt"

    class Exploit:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    folder = _model_copy(ctx, "exploit_model")
    torch.save({"format": ckpt.FORMAT_VERSION, "payload": Exploit()}, folder / "model.pt")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(
        {"format": ckpt.FORMAT_VERSION, "x": Exploit()},
        ckpt.checkpoint_path(run_dir / "checkpoints", 1),
    )
    with pytest.raises(GearsInputError, match="refused") as info:
        ckpt.load(folder / "model.pt")
    assert "model.pt" in str(info.value)
    with pytest.raises(GearsInputError, match="refused"):
        GEARS(ctx.data, device="cpu").load_pretrained(folder)
    messages: list[str] = []
    assert ckpt.load_latest(run_dir / "checkpoints", log=messages.append) is None
    assert "refused" in messages[0]
    assert not marker.exists()
    # The same object under a trusting load does run: the test would catch a weaker loader.
    torch.load(folder / "model.pt", weights_only=False)
    assert marker.read_text() == "code ran"


def test_crafted_pickle_split_file_runs_no_code(ctx, tmp_path):
    marker = tmp_path / "pwned.txt"

    class Exploit:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    path = tmp_path / "split.pkl"
    path.write_bytes(pickle.dumps({"train": ["G00+ctrl"], "x": Exploit()}))
    with pytest.raises(GearsInputError, match="split.pkl"):
        ctx.data.prepare_split("custom", split_dict_path=path)
    ctx.data.prepare_split("simulation", seed=1)
    assert not marker.exists()
    plain = tmp_path / "plain.pkl"  # GEARS's own split pickles (dicts of name lists) still load
    plain.write_bytes(pickle.dumps({"train": ["G00+ctrl"], "val": [], "test": ["G01+ctrl"]}))
    assert ctx.data.prepare_split("custom", split_dict_path=plain).set2conditions["test"] == [
        "G01+ctrl"
    ]
    ctx.data.prepare_split("simulation", seed=1)


def _with_gene_ctrl(labels: dict[str, str]):
    """tiny_screen with measured gene G05 named CTRL (a real human gene) and relabelled cells."""
    adata = _relabel(labels)
    adata.var_names = ["CTRL" if g == "G05" else g for g in adata.var_names]
    return adata


def test_a_gene_named_like_the_control_stays_a_gene_and_is_reported(ctx):
    """Labels 'CTRL' and 'CTRL+G00' perturb the measured gene CTRL: they were read as the
    control (6 conditions became 4, silently). A spelling listed in data.control_names is
    the control, as asked; controls spelled like the gene are refused, saying why."""
    go = write_gene2go(
        ctx.tmp / "go_ctrl.tsv", tiny_gene2go(["CTRL" if g == "G05" else g for g in GENES])
    )
    adata = _with_gene_ctrl({"G03": "CTRL", "G03+G00": "CTRL+G00"})
    p = PertData(ctx.tmp / "d", gene2go=go, verbose=False).new_data_process("x", adata, write=False)
    assert p.conditions == ["ctrl", "CTRL+G00", "CTRL+ctrl", "G00+ctrl", "G01+ctrl", "G02+ctrl"]
    assert p.report["control_like_genes"] == {"CTRL": 24}
    assert "CTRL" in p.node_map_pert
    asked = PertData(ctx.tmp / "d", gene2go=go, verbose=False).new_data_process(
        "x", adata, control_names=("CTRL",), write=False
    )
    assert asked.conditions == ["ctrl", "G00+ctrl", "G01+ctrl", "G02+ctrl"]
    assert "control_like_genes" not in asked.report
    controls_spelled_ctrl = _with_gene_ctrl({"control": "CTRL"})
    with pytest.raises(GearsInputError, match=r"no control cells.*spelled \['CTRL'\] were read as"):
        PertData(ctx.tmp / "d", gene2go=go, verbose=False).new_data_process(
            "x", controls_spelled_ctrl, write=False
        )


@pytest.mark.parametrize("store", ["memory", "mmap"])
def test_labels_with_surrounding_spaces_are_stripped_everywhere(ctx, tmp_path, store):
    """' G00 ' is condition G00+ctrl, and the spelling kept for predictions (prediction.json,
    predict.py's obs) is 'G00', not ' G00 ', in memory and out of core."""
    adata = _relabel({"G00": " G00 ", "control": "control "})
    adata.write_h5ad(tmp_path / "spaced.h5ad")
    p = PertData(tmp_path / "d", gene2go=ctx.go, verbose=False, store=store)
    p.load(data_path=tmp_path / "spaced.h5ad")
    assert "G00+ctrl" in p.conditions
    assert p.condition_spelling["G00+ctrl"] == "G00"
    assert p.condition_spelling["ctrl"] == "control"
