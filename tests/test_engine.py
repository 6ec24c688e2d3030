"""The training engine: accumulation, precision, checkpoints, resume, the GEARS facade."""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import subprocess
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import final_train_state, metrics_without_timing, run_train_cli, tiny_split

from gears.compat.api import GEARS
from gears.config import DistributedConfig, ModelConfig, TrainConfig
from gears.data.pertdata import PertData
from gears.errors import GearsInputError
from gears.model.batch import ModelBatch
from gears.train import checkpoint as ckpt
from gears.train.distributed import DistEnv
from gears.train.engine import Trainer, autocast_dtype, make_scheduler, seed_everything


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    return tiny_split(tmp_path_factory.mktemp("data"))


def build(pd_: PertData, hidden: int = 16, seed: int = 0) -> GEARS:
    seed_everything(seed)
    model = GEARS(pd_, device="cpu")
    return model.model_initialize(hidden_size=hidden)


def train(pd_: PertData, model: GEARS, **kw) -> Trainer:
    cfg = TrainConfig(**kw)
    loaders = pd_.get_dataloader_distributed(
        cfg.batch_size, 64, batching=cfg.batching, cells_per_group=cfg.cells_per_group
    )
    trainer = Trainer(model.model, pd_, cfg, model.model_config(), DistEnv())
    trainer.fit(loaders, progress=False)
    return trainer


def params(model: GEARS) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.model.state_dict().items()}


class ListLoader:
    """A fixed sequence of batches with the loader interface the engine uses."""

    def __init__(self, batches):
        self.batches = batches

    def set_epoch(self, epoch):
        pass

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def group_batches(pd_: PertData, n_conditions: int, cells: int, per_batch: int):
    """Batches of `per_batch` distinct training conditions x `cells` cells, no condition twice."""
    ds = pd_.example_set("train")
    conds = [c for c in np.unique(ds.cond) if c != pd_.ctrl_id][:n_conditions]
    ids = [np.flatnonzero(ds.cond == c)[:cells] for c in conds]
    return [ds[np.concatenate(ids[i : i + per_batch])] for i in range(0, len(ids), per_batch)]


def fit_on(pd_: PertData, model: GEARS, batches, **kw) -> Trainer:
    cfg = TrainConfig(**{"epochs": 1, "schedule": "constant", **kw})
    trainer = Trainer(model.model, pd_, cfg, model.model_config(), DistEnv())
    trainer.fit({"train_loader": ListLoader(batches)}, progress=False)
    return trainer


SGD = dict(optimizer="sgd", lr=0.01, weight_decay=0.0, grad_clip=0.0, freeze_batchnorm=True)


def test_accumulation_equals_one_large_batch(tiny):
    """2 micro-batches of 2 conditions with accumulation = 1 batch of the 4 conditions: GEARS's
    loss is a mean over the perturbations of a batch, so the two agree when each micro-batch holds
    whole perturbation groups, equally many. Batch-norm frozen (batch statistics differ by
    definition); SGD, because Adam's per-element normalisation turns float noise in near-zero
    gradients into full-size steps."""
    micro = group_batches(tiny, 8, 4, 2)
    large = group_batches(tiny, 8, 4, 4)
    a, b = build(tiny), build(tiny)
    ta = fit_on(tiny, a, micro, grad_accum_steps=2, **SGD)
    tb = fit_on(tiny, b, large, grad_accum_steps=1, **SGD)
    assert ta.step == tb.step == 2
    pa, pb, p0 = params(a), params(b), params(build(tiny))
    moved = [k for k in pa if not torch.equal(pa[k], p0[k])]
    assert len(moved) > 20  # training really changed the weights
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-5, rtol=1e-4, msg=k)


def test_accumulation_differs_without_accumulation(tiny):
    """The check above can fail: the same micro-batches as separate steps give other weights."""
    micro = group_batches(tiny, 8, 4, 2)
    large = group_batches(tiny, 8, 4, 4)
    a, b = build(tiny), build(tiny)
    fit_on(tiny, a, micro, grad_accum_steps=1, **SGD)
    fit_on(tiny, b, large, grad_accum_steps=1, **SGD)
    diffs = [(params(a)[k] - params(b)[k]).abs().max().item() for k in params(a)]
    assert max(diffs) > 1e-3


def test_the_built_fingerprint_holds_every_data_part(tiny):
    """The fingerprint a Trainer records in its checkpoints (training_state.fingerprint) holds
    every part checkpoint.DATA_PARTS names, each read from this run: another split or another
    world size changes exactly those parts."""
    from gears.model import graph_buffer_names
    from gears.train.state import fingerprint

    model = build(tiny, hidden=8)
    trainer = Trainer(model.model, tiny, TrainConfig(), model.model_config(), DistEnv())
    built = fingerprint(trainer)
    assert set(ckpt.DATA_PARTS) <= set(built), set(ckpt.DATA_PARTS) - set(built)
    buffers = dict(trainer.net.named_buffers())
    graphs = {name: buffers[name] for name in graph_buffer_names(trainer.net)}
    now = ckpt.run_fingerprint({}, tiny, graphs, world_size=1)
    assert {k: built[k] for k in ckpt.DATA_PARTS} == {k: now[k] for k in ckpt.DATA_PARTS}
    moved = copy.copy(tiny)  # one test condition moved to train
    sets = {k: list(v) for k, v in tiny.set2conditions.items()}
    sets["train"].append(sets["test"].pop())
    moved.set2conditions = sets
    other = ckpt.run_fingerprint({}, moved, graphs, world_size=2)
    assert {k for k in ckpt.DATA_PARTS if other[k] != now[k]} == {"split:sets", "world_size"}


def test_a_last_partial_accumulation_is_stepped_and_leaves_no_gradient(tiny):
    """3 micro-batches with accumulation 2: ceil(3/2) = 2 optimizer steps, the second on the
    epoch's last micro-batch alone, and no gradient left for the next epoch. Independent
    computation, plain steps without accumulation: one on the first two micro-batches as one
    batch, then one on the third; each micro-batch's loss is divided by grad_accum_steps, so
    with SGD the third's step is one at half the learning rate."""
    micro = group_batches(tiny, 6, 4, 2)
    first_two = group_batches(tiny, 4, 4, 4)
    assert len(micro) == 3 and len(first_two) == 1
    a, b = build(tiny), build(tiny)
    ta = fit_on(tiny, a, micro, grad_accum_steps=2, **SGD)
    assert ta.step == 2
    assert all(p.grad is None for p in a.model.parameters()), "a gradient was left over"
    fit_on(tiny, b, first_two, grad_accum_steps=1, **SGD)
    fit_on(tiny, b, micro[2:], grad_accum_steps=1, **{**SGD, "lr": SGD["lr"] / 2})
    pa, pb, p0 = params(a), params(b), params(build(tiny))
    assert len([k for k in pa if not torch.equal(pa[k], p0[k])]) > 20
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-5, rtol=1e-4, msg=k)


def _bf16_and_fp32_trainers(pd_: PertData, model: GEARS, epochs: int = 1):
    """An fp32 Trainer on model's network and a bf16 Trainer on a copy of it."""
    trainers = []
    for precision, net in (("fp32", model.model), ("bf16", copy.deepcopy(model.model))):
        cfg = TrainConfig(
            epochs=epochs, batch_size=16, lr=5e-3, precision=precision, schedule="constant"
        )
        trainers.append(Trainer(net, pd_, cfg, model.model_config(), DistEnv()))
    return trainers[0], trainers[1]


def test_bf16_steps_match_fp32(tiny):
    """bf16 autocast computes fp32's loss and gradients, step by step: 12 batches (uneven
    counts: the weighted batch-norms) along the fp32 trajectory, the bf16 copy reloaded with the
    fp32 weights before each, so the comparison never sees two diverged trajectories. Measured:
    loss within 7e-4, gradients at cosine >= 0.955 (median 0.997) to fp32's. Whole-run metrics
    cannot test this: a 3-epoch run's validation mse_de (6 perturbations) moves by -10..+32%
    when fp32 merely starts from bf16-rounded weights, as much as bf16 training moves it."""
    t32, t16 = _bf16_and_fp32_trainers(tiny, build(tiny))
    loader = tiny.get_dataloader_distributed(16, 64)["train_loader"]
    loader.set_epoch(0)
    cosines = []
    for i, batch in enumerate(loader):
        if i == 12:
            break
        assert not bool((batch.counts == batch.counts[0]).all())  # the weighted path
        t16.net.load_state_dict(t32.net.state_dict())
        losses, grads = [], []
        for trainer in (t32, t16):
            trainer.net.train()
            trainer.opt.zero_grad(set_to_none=True)
            loss = trainer.loss_on(batch)
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.flatten() for p in trainer.net.parameters()]))
        assert abs(losses[1] - losses[0]) < 2e-3 * losses[0], (i, losses)
        cosines.append(torch.nn.functional.cosine_similarity(*grads, dim=0).item())
        t32.opt.step()
    print("COS", np.round(cosines, 4), losses)
    assert min(cosines) > 0.9 and float(np.median(cosines)) > 0.98, np.round(cosines, 4)


def test_bf16_learns_as_fp32(tiny):
    """bf16 training lowers the training loss as fp32 does over 3 epochs: the drop (1 - last /
    first epoch loss), median over 3 model seeds, within 20% of fp32's. Unlike a validation
    metric this is not chaotic (per seed, bf16's drop is within 0.009 of fp32's, fp32's is 0.06
    to 0.1)."""
    drops = {"fp32": [], "bf16": []}
    train_only = {"train_loader": tiny.get_dataloader_distributed(16, 64)["train_loader"]}
    for seed in range(3):
        for trainer in _bf16_and_fp32_trainers(tiny, build(tiny, seed=seed), epochs=3):
            loss = trainer.fit(train_only, progress=False).train_loss
            assert np.isfinite(loss).all()
            drops[trainer.cfg.precision].append(1 - loss[-1] / loss[0])
    fp32, bf16 = float(np.median(drops["fp32"])), float(np.median(drops["bf16"]))
    print("DROPS", drops)
    assert fp32 > 0.05, drops  # it learns
    assert abs(bf16 - fp32) < 0.2 * fp32, drops


def test_train_uses_loaders_built_for_its_settings(tmp_path, capsys):
    """cell-gears style (get_dataloader, then train()) keeps the user's loaders and records their
    batch size; a batch size given to train() itself is honoured, not silently ignored."""
    pd_ = tiny_split(tmp_path)
    pd_.get_dataloader(16, 64)
    model = build(pd_)
    model.train(epochs=1, progress=False, limit_batches=1)
    assert model.trainer.cfg.batch_size == 16
    assert next(iter(pd_.dataloader["train_loader"])).x.shape[0] == 16

    model.train(epochs=1, progress=False, limit_batches=1, batch_size=8)
    assert model.trainer.cfg.batch_size == 8
    assert pd_.dataloader_settings["batch_size"] == 8
    assert next(iter(pd_.dataloader["train_loader"])).x.shape[0] == 8
    assert "batch_size=8 (loaders: 16)" in capsys.readouterr().out


def test_fp16_on_cpu_is_a_clear_error():
    with pytest.raises(GearsInputError, match="fp16 needs a CUDA device"):
        autocast_dtype("fp16", torch.device("cpu"))
    assert autocast_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert autocast_dtype("fp32", torch.device("cpu")) is None


def test_a_finished_run_is_freed_without_the_garbage_collector(tiny, tmp_path):
    """Nothing holds the Trainer in a reference cycle (the fault hooks held it while it held
    them), so a finished run's network, optimizer state and checkpoint copies are freed as soon
    as the model is dropped, not when the cycle collector happens to run."""
    model = build(tiny)
    model.out_dir = tmp_path
    model.train(epochs=1, batch_size=16, limit_batches=2, select="val_mse", progress=False)
    refs = {"trainer": weakref.ref(model.trainer), "network": weakref.ref(model.model)}
    gc.disable()
    try:
        del model
        alive = [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()
    assert alive == []


def test_unknown_schedule_is_a_clear_error():
    """A misspelt train.schedule (set past the config's check, as a Python caller can) names
    the choices instead of training silently at a constant rate."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(GearsInputError, match=r"unknown train.schedule 'cosine_warmup'.*'step'"):
        make_scheduler(opt, TrainConfig(schedule="cosine_warmup"))
    assert make_scheduler(opt, TrainConfig(schedule="constant")).get_last_lr() == [0.1]


def test_gradients_reach_graph_embeddings_after_many_steps(tiny):
    """Regression: PyG SGConv(cached=True) detaches its input after the first call, which froze
    the perturbation and positional embeddings. They must keep learning."""
    model = build(tiny)
    before = params(model)
    train(tiny, model, epochs=1, batch_size=16, limit_batches=5, schedule="constant")
    after = params(model)
    for name in ("pert_emb.weight", "emb_pos.weight", "gene_emb.weight"):
        assert not torch.equal(before[name], after[name]), name
    net = model.model
    net.train()
    for _ in range(2):  # a second forward must still reach pert_emb
        net.zero_grad()
        out = net(ModelBatch(torch.tensor([[0, 1], [2, -1]]), torch.tensor([3.0, 2.0])))
        out.pow(2).mean().backward()
        assert net.pert_emb.weight.grad.abs().sum() > 0
        assert net.emb_pos.weight.grad.abs().sum() > 0


def test_checkpoint_truncated_gives_clear_error_previous_loads(tmp_path):
    folder = tmp_path / "checkpoints"
    for epoch in (1, 2):
        ckpt.atomic_save(
            {"epoch": epoch, "w": torch.randn(1000)}, ckpt.checkpoint_path(folder, epoch)
        )
    newest = ckpt.checkpoint_path(folder, 2)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with pytest.raises(GearsInputError, match="truncated"):
        ckpt.load(newest)
    messages = []
    state = ckpt.load_latest(folder, log=messages.append)
    assert state["epoch"] == 1
    assert "epoch_0002.pt" in messages[0]


def test_resume_at_another_thread_count_says_so(tiny, tmp_path, capsys):
    """A checkpoint records the CPU threads it was written at: resumed at another count, a run
    sums in another order and ends near, not at, the uninterrupted result; a note says so."""
    cfg = TrainConfig(epochs=2)
    models = [build(tiny) for _ in range(2)]
    trainers = [Trainer(m.model, tiny, cfg, m.model_config(), DistEnv(), tmp_path) for m in models]
    torch.set_num_threads(1)  # (the suite's fixture restores the count)
    trainers[0].save_checkpoint()
    assert ckpt.load(ckpt.list_checkpoints(tmp_path / "checkpoints")[-1])["cpu_threads"] == 1
    capsys.readouterr()
    torch.set_num_threads(2)
    assert trainers[1].resume()
    note = "this run has 2 CPU threads, the checkpoint's run had 1"
    assert note in capsys.readouterr().out
    torch.set_num_threads(1)
    assert trainers[1].resume()
    assert "note:" not in capsys.readouterr().out


def test_atomic_save_keeps_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "model.pt"
    ckpt.atomic_save({"ok": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.atomic_save({"bad": Unpicklable()}, path)
    assert ckpt.load(path) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temp file left behind


def test_predict_save_load_roundtrip_and_module_prefix(tiny, tmp_path):
    model = build(tiny)
    train(tiny, model, epochs=1, batch_size=32, limit_batches=3)
    genes = list(tiny.pert_names[:2])
    pred = model.predict([[genes[0]], genes])
    assert set(pred) == {genes[0], "_".join(genes)}
    assert pred[genes[0]].shape == (tiny.n_genes,)
    model.save_model(tmp_path / "m")
    again = GEARS(tiny, device="cpu").load_pretrained(tmp_path / "m")
    pred2 = again.predict([[genes[0]], genes])
    np.testing.assert_allclose(pred2[genes[0]], pred[genes[0]], rtol=1e-6, atol=1e-6)
    # Weights saved from a DDP-wrapped model carry a `module.` prefix: still loadable.
    state = ckpt.load(tmp_path / "m" / "model.pt")
    state["state_dict"] = {f"module.{k}": v for k, v in state["state_dict"].items()}
    ckpt.atomic_save(state, tmp_path / "m" / "model.pt")
    pred3 = GEARS(tiny, device="cpu").load_pretrained(tmp_path / "m").predict([genes])
    np.testing.assert_allclose(pred3["_".join(genes)], pred["_".join(genes)], rtol=1e-6, atol=1e-6)
    with pytest.raises(GearsInputError, match="not in the perturbation graph"):
        model.predict([["NOT_A_GENE"]])


def test_predict_equals_mean_of_per_cell_predictions(tiny):
    """predict() runs once per perturbation; GEARS averages per-control-cell predictions. In eval
    mode the two are the same number: response + mean control expression."""
    model = build(tiny)
    train(tiny, model, epochs=1, batch_size=32, limit_batches=2)
    gene = str(tiny.pert_names[3])
    net = model.model.eval()
    x = tiny.expr.rows(tiny.ctrl_rows)
    index = torch.full((len(x), 2), -1)
    index[:, 0] = tiny.node_map_pert[gene]
    with torch.no_grad():
        per_cell = (net(ModelBatch(index)) + x).mean(0).numpy()
    np.testing.assert_allclose(model.predict([[gene]])[gene], per_cell, atol=1e-5)


def build_impl(pd_: PertData, impl: str) -> GEARS:
    seed_everything(0)
    return GEARS(pd_, device="cpu").initialize(ModelConfig(hidden_size=16, impl=impl))


def test_reference_network_trains_to_the_same_weights(tiny, tmp_path):
    """model.impl=reference through the engine (one row per cell) and the fast network (its
    equal-count, weighted and per-cell row layouts) from one seed: the same weights after 10
    grouped and random batches, the same predictions, and a saved reference folder loads as the
    reference (config.json's impl), or as the fast network without the key (older folders).
    Both in float64: in float32 the two runs' rounding differences (1e-5 after one step) grow
    ~10x a step; SGD, as Adam turns the rounding noise of the gradients that are zero by design
    (biases before a batch-norm) into full steps."""
    # One thread (the suite's fixture restores the count): on a busy 2-core machine two OpenMP
    # threads wait on each other at every small kernel (20 s instead of 5 s here).
    torch.set_num_threads(1)
    fast, ref = build_impl(tiny, "fast"), build_impl(tiny, "reference")
    assert type(ref.model).__name__ == "GEARSReference"
    grouped = group_batches(tiny, 12, 4, 3)  # equal counts
    ds = tiny.example_set("train")
    gen = np.random.default_rng(0)
    random = [ds[gen.choice(len(ds), 16, replace=False)] for _ in range(6)]
    for model in (fast, ref):
        model.model.double()
        fit_on(tiny, model, grouped + random, optimizer="sgd", lr=0.01, weight_decay=0.0)
    pf, pr = params(fast), params(ref)
    p0 = params(build_impl(tiny, "fast"))
    assert sum(not torch.allclose(pf[k], p0[k].to(pf[k].dtype)) for k in pf) > 30  # trained
    for k in pf:
        torch.testing.assert_close(pf[k], pr[k], atol=1e-9, rtol=1e-6, msg=k)
    genes = [[str(g)] for g in tiny.pert_names[:3]]
    want = fast.predict(genes)
    ref.save_model(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["impl"] == "reference"
    loaded = GEARS(tiny, device="cpu").load_pretrained(tmp_path / "m")
    assert type(loaded.model).__name__ == "GEARSReference"
    del config["impl"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    old = GEARS(tiny, device="cpu").load_pretrained(tmp_path / "m")
    assert type(old.model).__name__ == "GEARSNet"
    for got in (loaded.predict(genes), old.predict(genes)):  # (loaded as float32)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_reference_refuses_what_it_cannot_run(tiny):
    ref = build_impl(tiny, "reference")
    for train_cfg, dist_cfg, key in (
        (TrainConfig(compile=True), DistributedConfig(), "train.compile"),
        (TrainConfig(), DistributedConfig(sync_batchnorm=True), "distributed.sync_batchnorm"),
    ):
        with pytest.raises(GearsInputError, match=f"{key}=true needs model.impl=fast"):
            Trainer(ref.model, tiny, train_cfg, ref.model_config(), DistEnv(), dist_cfg=dist_cfg)


def test_training_batch_of_one_cell_is_a_clear_error(tiny):
    for impl in ("fast", "reference"):
        model = build_impl(tiny, impl)
        with pytest.raises(GearsInputError, match="train.batch_size >= 2"):
            train(tiny, model, epochs=1, batch_size=1, limit_batches=1)


def test_gi_predict_returns_gears_keys(tiny):
    model = build(tiny)
    genes = list(tiny.pert_names[:2])
    scores = model.GI_predict(genes)
    for key in ("c1", "c2", "mag", "dcor", "corr_fit", "dominance", "eq_contr"):
        assert np.isfinite(scores[key]) or key == "dominance", key


class _MakesADirectory:
    """Unpickled, it calls os.mkdir(path): a stand-in for any command a pickle can run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_gi_predict_reads_its_gene_file_without_unpickling(tiny, tmp_path):
    """GI_predict read GI_genes_file with np.load(allow_pickle=True): a crafted .npy ran what
    its pickle named. Now an object array is one line naming the file, nothing runs; a .npy of
    strings and a text file (one gene a line) both give the same scores."""
    model = build(tiny)
    genes = list(tiny.pert_names[:2])
    some = [str(g) for g in tiny.gene_names[:8]]
    crafted = tmp_path / "genes.npy"
    mark = tmp_path / "ran"
    np.save(crafted, np.array([_MakesADirectory(str(mark)), *some], dtype=object))
    with pytest.raises(GearsInputError, match=r"genes\.npy.*(object|pickle)") as refused:
        model.GI_predict(genes, str(crafted))
    assert "\n" not in str(refused.value) and not mark.exists()
    np.save(tmp_path / "names.npy", np.array(some))
    (tmp_path / "names.txt").write_text("\n".join(some) + "\n")
    # (a fresh model per call: a predict on an untrained model moves its batch-norm statistics)
    from_npy = build(tiny).GI_predict(genes, str(tmp_path / "names.npy"))
    from_text = build(tiny).GI_predict(genes, str(tmp_path / "names.txt"))
    assert json.dumps(from_npy) == json.dumps(from_text)
    assert json.dumps(from_npy) != json.dumps(build(tiny).GI_predict(genes))


def _run_cli(out_dir: Path, data_dir: Path, *extra: str, env=None) -> subprocess.CompletedProcess:
    """The TINY screen, hidden 16, 3 epochs, one thread."""
    return run_train_cli(out_dir, data_dir, *extra, env=env, threads=1)


@pytest.fixture(scope="module")
def whole_run(tiny_cli_run) -> Path:
    """One uninterrupted CLI run (3 epochs, as _run_cli) that the fault and rerun tests compare
    against: the session's tiny_cli_run (tests/conftest.py), shared with test_faults.py and
    test_report.py."""
    return tiny_cli_run[0]


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(tmp_path, whole_run):
    data = tmp_path / "data"
    killed = _run_cli(tmp_path / "resumed", data, env={"GEARS_FAULT_KILL": "0:epoch:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "resumed" / "checkpoints")] == [
        "epoch_0001.pt"
    ]
    resumed = _run_cli(tmp_path / "resumed", data, "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    a = ckpt.load(whole_run / "model" / "model.pt")["state_dict"]
    b = ckpt.load(tmp_path / "resumed" / "model" / "model.pt")["state_dict"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-6, msg=k)
    ma = json.loads((whole_run / "metrics.json").read_text())
    mb = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert ma["test"]["mse_de"] == pytest.approx(mb["test"]["mse_de"], rel=1e-6)
    assert ma["history"]["train_loss"] == pytest.approx(mb["history"]["train_loss"], rel=1e-6)
    assert final_train_state(tmp_path / "resumed") == final_train_state(whole_run)


@pytest.mark.slow
def test_rerun_gives_identical_metrics_json(tmp_path, whole_run):
    """Determinism on CPU: the same config and seed, a fresh process, the same metrics.json bit
    for bit (timing aside). The 2-process check is in tests/test_distributed.py."""
    again = _run_cli(tmp_path / "again", tmp_path / "data")
    assert again.returncode == 0, again.stderr[-2000:]
    want = metrics_without_timing(whole_run)
    assert metrics_without_timing(tmp_path / "again") == want
    assert want["history"]["skipped_steps"] == [0, 0, 0]  # GradScaler skips, recorded per epoch


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_equals_uninterrupted(tmp_path, whole_run):
    """SIGTERM (Slurm's preemption signal) 3 steps into epoch 2: the process writes a mid-epoch
    checkpoint and exits 0; train.resume=true then ends exactly where the whole run ended."""
    run_dir = tmp_path / "term"
    stopped = _run_cli(run_dir, tmp_path / "data", env={"GEARS_FAULT_KILL": "0:step:13:TERM"})
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert (
        "SIGTERM received: stopped after epoch 1 + 3 steps of epoch 2 (step 13 in all)"
        in stopped.stdout
    )
    assert "train.resume=true" in stopped.stdout
    names = [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")]
    assert names == ["epoch_0001.pt", "epoch_0001_step_000003.pt"]
    assert not (run_dir / "metrics.json").exists()
    state = ckpt.load(run_dir / "checkpoints" / names[-1])
    assert (state["step"], state["epoch"], state["partial"]["batch"]) == (13, 1, 3)
    resumed = _run_cli(run_dir, tmp_path / "data", "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "epoch_0001_step_000003.pt: after epoch 1 + 3 steps of epoch 2 (step 13 in all)" in (
        resumed.stdout
    )
    assert metrics_without_timing(run_dir) == metrics_without_timing(whole_run)
    assert final_train_state(run_dir) == final_train_state(whole_run)


def test_bad_config_key_is_one_clear_line(tmp_path):
    result = _run_cli(tmp_path / "x", tmp_path / "d", "train.epoch=3")
    assert result.returncode == 2
    assert "unknown config key 'train.epoch'" in result.stderr
    assert "train.epochs" in result.stderr  # the suggestion / list of valid keys
    assert "Traceback" not in result.stderr
