"""The Trainer through its public behaviour (fit, resume, the loaders it is given), each checked
against an independent computation rather than against itself: the per-epoch validation
metrics that pick the kept epoch, the per-epoch reshuffle, and every RNG restored on resume."""

from __future__ import annotations

import random
import signal

import numpy as np
import pytest
import torch
from helpers import tiny_split

from gears.compat.api import GEARS
from gears.config import TrainConfig
from gears.data.conditions import CTRL
from gears.data.pertdata import PertData
from gears.errors import TrainingStopped
from gears.model.batch import ModelBatch
from gears.train import checkpoint as ckpt
from gears.train import metrics
from gears.train.distributed import DistEnv
from gears.train.engine import Trainer, seed_everything
from gears.train.state import TrainState

HIDDEN = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> PertData:
    return tiny_split(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread (the suite's fixture restores the count): these kernels are too small to
    share, and two OpenMP threads on a busy 2-core machine wait on each other at every one."""
    torch.set_num_threads(1)


def _trainer(pd_: PertData, out_dir=None, **train_kw) -> Trainer:
    seed_everything(0)
    model = GEARS(pd_, device="cpu").model_initialize(hidden_size=HIDDEN)
    cfg = TrainConfig(**{"batch_size": 16, "limit_batches": 4, **train_kw})
    return Trainer(model.model, pd_, cfg, model.model_config(), DistEnv(), out_dir=out_dir)


def _loaders(pd_: PertData, batch_size: int = 16) -> dict:
    return pd_.get_dataloader(batch_size, 64)


# --------------------------------------------------------------- validation metrics, selection
def _gears_val_metrics(pd_: PertData, weights: dict) -> dict[str, float]:
    """GEARS's metrics (gears/train/metrics.py, as the final test metrics) on the validation
    perturbations for these weights, from the cells themselves: the network in eval mode gives
    each perturbation's change, plus the mean of all control cells."""
    net = GEARS(pd_, device="cpu").model_initialize(hidden_size=HIDDEN).model
    net.load_state_dict(weights)
    net.eval()
    conds = [c for c in pd_.set2conditions["val"] if c != CTRL]
    ids = np.array([pd_.cond_to_id[c] for c in conds])
    with torch.no_grad():
        delta = net(ModelBatch(torch.as_tensor(pd_.cond_pert_index[ids]))).double().numpy()
    pred = delta + pd_.ctrl_mean[None, :]
    cells = np.flatnonzero(np.isin(pd_.cell_condition, ids))
    row_of = {c: i for i, c in enumerate(ids)}
    cell_row = np.array([row_of[c] for c in pd_.cell_condition[cells]])
    X = pd_.expr.numpy()[cells]
    per = metrics.condition_metrics(
        pred, X, cell_row, pd_.ctrl_mean, pd_.de_ranked_idx[ids], pd_.non_dropout_de_idx[ids]
    )
    return {k: float(np.mean(per[k])) for k in ("mse", "mse_de", "pearson", "pearson_delta")}


def test_per_epoch_validation_metrics_and_the_kept_epoch_are_gears_metrics(tiny, tmp_path):
    """history.val (Evaluator.quick) after each epoch equals GEARS's metric code on that
    epoch's weights (read back from its checkpoint), and train.select=val_mse_de keeps the
    epoch with the lowest of those mse_de."""
    trainer = _trainer(tiny, tmp_path, epochs=2, schedule="constant", select="val_mse_de")
    history = trainer.fit(_loaders(tiny), progress=False)
    scores = []
    for epoch, path in enumerate(ckpt.list_checkpoints(tmp_path / "checkpoints")):
        want = _gears_val_metrics(tiny, ckpt.load(path)["model"])
        got = history.val[epoch]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (epoch, key)
        scores.append(want["mse_de"])
    assert len(scores) == 2 and scores[0] != scores[1]
    assert trainer.best_epoch == int(np.argmin(scores))


# ------------------------------------------------------------------------ the per-epoch reshuffle
class RecordingLoader:
    """A loader handed to fit that records, per pass, each batch's examples and paired
    controls, and passes set_epoch on."""

    def __init__(self, loader):
        self.loader, self.passes = loader, []

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        self.passes.append(seen := [])
        for batch in self.loader:
            seen.append((batch.example.clone(), batch.x.clone()))
            yield batch


def _epoch_batches(pd_: PertData, epoch: int, n: int) -> list:
    """The first n batches of `epoch` from a fresh loader: the order fit must have trained on."""
    loader = _loaders(pd_)["train_loader"]
    loader.set_epoch(epoch)
    return [(b.example, b.x) for _, b in zip(range(n), loader, strict=False)]


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        torch.equal(ge, we) and torch.equal(gx, wx) for (ge, gx), (we, wx) in zip(got, want)
    )


def test_every_epoch_trains_on_that_epochs_shuffle_and_pairing(tiny, tmp_path):
    """Each epoch's batches (examples and their paired control cells) are the loader's for that
    epoch, whether fit starts at epoch 0 or resumes at epoch 1; epochs differ."""
    first = _trainer(tiny, tmp_path, epochs=1, schedule="constant")
    recorded = RecordingLoader(_loaders(tiny)["train_loader"])
    first.fit({"train_loader": recorded}, progress=False)
    resumed = _trainer(tiny, tmp_path, epochs=3, schedule="constant")
    assert resumed.resume()
    recorded_after = RecordingLoader(_loaders(tiny)["train_loader"])
    resumed.fit({"train_loader": recorded_after}, progress=False)
    passes = [p[:4] for p in recorded.passes + recorded_after.passes]  # limit_batches=4
    assert len(passes) == 3
    for epoch, seen in enumerate(passes):
        assert _same(seen, _epoch_batches(tiny, epoch, 4)), f"epoch {epoch}"
    assert not _same(passes[0], passes[1]) and not _same(passes[1], passes[2])


# ---------------------------------------------------------------------- RNGs restored on resume
RNGS = {
    "torch": (lambda s: torch.manual_seed(s), lambda: torch.rand(4).tolist()),
    "numpy": (lambda s: np.random.seed(s), lambda: np.random.random(4).tolist()),
    "python": (lambda s: random.seed(s), lambda: [random.random() for _ in range(4)]),
}


@pytest.mark.parametrize("name", sorted(RNGS))
def test_resume_restores_every_global_rng(tiny, tmp_path, name):
    """After resume the global generator draws what the checkpointed run would have drawn next
    (whatever it was seeded with meanwhile): torch, numpy and Python's random."""
    seed, draw = RNGS[name]
    trainer = _trainer(tiny, tmp_path, epochs=1, schedule="constant")
    trainer.fit(_loaders(tiny), progress=False)  # the checkpoint is the last thing written
    expected = draw()
    seed(12345)
    scrambled = draw()
    resumed = _trainer(tiny, tmp_path, epochs=1, schedule="constant")
    seed(999)
    assert resumed.resume()
    assert draw() == expected != scrambled


# ------------------------------------------------------------------ the training state on resume
class StopAt:
    """A training loader during which a SIGTERM arrives (recorded as the signal handler records
    it) while `trainer` trains batch `batch` of epoch `epoch`."""

    def __init__(self, loader, trainer: Trainer, epoch: int, batch: int):
        self.loader, self.trainer, self.at, self.epoch = loader, trainer, (epoch, batch), 0

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if (self.epoch, i) == self.at:
                self.trainer.stop_requested = signal.SIGTERM
            yield batch


def test_a_run_stopped_mid_epoch_resumes_into_the_uninterrupted_runs_state(tiny, tmp_path):
    """A SIGTERM 2 batches into epoch 2 of 3: the mid-epoch checkpoint holds the stopped
    trainer's TrainState whole (position, best model, early-stopping count, history), and the
    resumed run ends in the uninterrupted run's state (one equality on TrainState: epoch, step,
    best epoch, metric and weights, stale epochs, history without its timings, skipped steps)
    and weights."""
    kw = {"epochs": 3, "schedule": "step", "select": "val_mse_de", "early_stopping_patience": 9}
    whole = _trainer(tiny, **kw)
    whole.fit(_loaders(tiny), progress=False)
    stopped = _trainer(tiny, tmp_path, **kw)
    loaders = _loaders(tiny)
    loaders["train_loader"] = StopAt(loaders["train_loader"], stopped, epoch=1, batch=1)
    with pytest.raises(TrainingStopped):
        stopped.fit(loaders, progress=False)
    newest = ckpt.list_checkpoints(tmp_path / "checkpoints")[-1]
    assert newest.name == "epoch_0001_step_000002.pt"
    assert TrainState.from_checkpoint(ckpt.load(newest)) == stopped.state
    assert stopped.state.partial is not None and stopped.state != whole.state
    resumed = _trainer(tiny, tmp_path, **kw)
    assert resumed.resume()
    assert resumed.state == stopped.state
    resumed.fit(_loaders(tiny), progress=False)
    assert resumed.state == whole.state
    assert whole.state.best_state is not None and whole.state.history.val[2]
    got, want = resumed.net.state_dict(), whole.net.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
