"""gears/train/checkpoint.py: pruning and loading around unreadable files, and the resume rule
(which
keys a resume may change, which refuse it)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest
import torch

from gears.config import Config, valid_keys
from gears.errors import GearsInputError
from gears.train import checkpoint as ckpt


def _save(folder, epoch: int) -> None:
    ckpt.atomic_save(
        {"epoch": epoch, "w": torch.full((1000,), float(epoch))},
        ckpt.checkpoint_path(folder, epoch),
    )


def test_prune_never_deletes_a_readable_checkpoint_for_an_unreadable_one(tmp_path):
    """A stray unreadable epoch_0009.pt (another run's, half copied) used to count as one of
    the two kept: the valid epoch_0002.pt was deleted and only epoch_0003.pt was left."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for epoch in (1, 2):
        _save(folder, epoch)
    stray = ckpt.checkpoint_path(folder, 9)
    stray.write_bytes(ckpt.checkpoint_path(folder, 1).read_bytes()[:500])
    _save(folder, 3)
    ckpt.prune(folder, keep=2)
    names = [p.name for p in ckpt.list_checkpoints(folder)]
    assert names == ["epoch_0002.pt", "epoch_0003.pt", "epoch_0009.pt"]  # the stray is kept
    assert ckpt.load_latest(folder, log=lambda _: None)["epoch"] == 3


def test_a_flipped_bit_is_refused_not_loaded_as_a_wrong_weight(tmp_path):
    """torch.load does not check the archive's CRCs: a damaged tensor loaded silently."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    _save(folder, 1)
    _save(folder, 2)
    newest = ckpt.checkpoint_path(folder, 2)
    data = bytearray(newest.read_bytes())
    at = data.index(torch.full((1,), 2.0).numpy().tobytes())  # inside the tensor's bytes
    data[at + 3] ^= 0x01
    damaged = folder / "damaged"
    damaged.write_bytes(bytes(data))
    damaged.replace(newest)  # a damaged copy in its place
    with pytest.raises(GearsInputError, match="CRC check"):
        ckpt.load(newest)
    assert not ckpt.is_readable(newest)
    messages = []
    assert ckpt.load_latest(folder, log=messages.append)["epoch"] == 1
    assert "epoch_0002.pt" in messages[0]


def test_resume_finds_no_readable_checkpoint_and_says_so(tmp_path):
    """Files that all fail to load are not 'no checkpoint' (a resume would start afresh)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    assert ckpt.load_for_resume(folder) is None  # nothing there: start afresh
    for epoch in (1, 2):
        ckpt.checkpoint_path(folder, epoch).write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.NoReadableCheckpoint, match=r"none of the 2 checkpoint file\(s\)"):
        ckpt.load_for_resume(folder, log=lambda _: None)


# ------------------------------------------------------------------------------ the resume rule
def _flat(cfg: Config) -> dict:
    return ckpt.flat_config(cfg.to_dict())


def _other(value):
    """A value different from `value` of a comparable kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, 0]
    if isinstance(value, dict):
        return {**value, "n_genes": 7}
    if value is None:
        return "set"
    raise AssertionError(value)


def _state(fingerprint: dict, epoch: int = 2, partial=None) -> dict:
    return {"fingerprint": fingerprint, "epoch": epoch, "partial": partial}


DATA = {"world_size": 1, "data:expression": "a", "split:sets": "b", "graphs": "c"}


@pytest.mark.parametrize("key", sorted(set(valid_keys()) | set(DATA)))
def test_every_key_either_may_change_on_resume_or_refuses_it(key):
    """One rule for every config key and data part: RESUME_MAY_CHANGE's keys resume, every
    other difference refuses by name. train.epochs has its own rule (below)."""
    before = {**_flat(Config()), **DATA}
    if key == "train.epochs":
        pytest.skip("train.epochs: test_epochs_may_rise_but_not_fall")
    now = {**before, key: _other(before[key])}
    if ckpt.may_change_on_resume(key):
        ckpt.check_resume(_state(before), "x.pt", now)
    else:
        with pytest.raises(GearsInputError, match=rf"{key}\b.*: checkpoint"):
            ckpt.check_resume(_state(before), "x.pt", now)


def test_the_keys_a_resume_may_change():
    """The list in one place, spelled as config keys (a typo would silently protect nothing),
    and what it means: paths, launch, logging and speed, never the trajectory."""
    keys = set(valid_keys())
    for entry in ckpt.RESUME_MAY_CHANGE:
        assert entry in keys or any(k.startswith(entry) for k in keys), entry
    may = {k for k in keys if ckpt.may_change_on_resume(k)}
    wandb = {k for k in keys if k.startswith("wandb.")}
    assert may - wandb == {
        "out_dir",
        "replace_out_dir",
        "device",
        "data.dataset",
        "data.data_dir",
        "data.gene2go",
        "data.gene_aliases",
        "data.mirror_url",
        "data.store",
        "data.store_dir",
        "data.chunk_cells",
        "split.split_dict_path",
        "train.resume",
        "train.checkpoint_every",
        "train.log_every",
        "train.plot_conditions",
        "train.num_workers",
        "train.threads",
        "eval.cell_eval",
        "distributed.backend",
        "distributed.gpu_ids",
        "distributed.master_addr",
        "distributed.master_port",
        "distributed.timeout_s",
        "distributed.data_wait_s",
        "distributed.find_unused_parameters",
        "distributed.static_graph",
        "distributed.gradient_as_bucket_view",
    }
    for trajectory in ("seed", "train.lr", "train.optimizer", "train.schedule", "model.gamma"):
        assert not ckpt.may_change_on_resume(trajectory)


@pytest.mark.parametrize(
    "schedule,done,partial,epochs,ok",
    [
        ("step", 2, None, 5, True),  # more epochs: the same run, continued
        ("constant", 2, None, 2, True),
        ("step", 2, None, 1, False),  # fewer than trained
        ("step", 2, {"batch": 3}, 2, False),  # mid-epoch 3: at least 3
        ("step", 2, {"batch": 3}, 3, True),
        ("cosine", 2, None, 3, False),  # the cosine schedule's length is the epochs
        ("cosine", 2, None, 4, True),  # (as written)
    ],
)
def test_epochs_may_rise_but_not_fall(schedule, done, partial, epochs, ok):
    before = {**_flat(Config()), "train.schedule": schedule, "train.epochs": 4}
    now = {**before, "train.epochs": epochs}
    if ok:
        ckpt.check_resume(_state(before, done, partial), "x.pt", now)
        return
    with pytest.raises(GearsInputError, match="train.epochs"):
        ckpt.check_resume(_state(before, done, partial), "x.pt", now)


def test_a_checkpoint_without_a_fingerprint_is_refused():
    with pytest.raises(GearsInputError, match="records no fingerprint"):
        ckpt.check_resume({"epoch": 1}, "old.pt", _flat(Config()))


def test_flat_config_matches_the_config_keys():
    """Every dotted key of the Config, and free-form dicts kept whole."""
    cfg = Config()
    cfg.data.synthetic = {"n_genes": 50}
    flat = _flat(cfg)
    assert set(flat) == set(valid_keys())
    assert flat["data.synthetic"] == {"n_genes": 50}
    assert all(not is_dataclass(v) for v in flat.values())
    assert len(fields(Config)) < len(flat)
