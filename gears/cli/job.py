"""The main job shared by train_single.py and train_distributed.py: data, train, evaluate, write."""

from __future__ import annotations

import argparse
import json
import math
import netrc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from gears.cli.contexts import one_model_per_context, run_contexts
from gears.cli.exiting import EXIT_WAIT_S, exit_quickly  # noqa: F401 (EXIT_WAIT_S: for callers)
from gears.cli.run_folder import claim_run_folder, prior_outputs
from gears.config import Config, load_config
from gears.data.pertdata import PertData
from gears.errors import GearsInputError, TrainingStopped
from gears.eval import scoring
from gears.eval.plots import plot_history, run_title
from gears.eval.predicted_cells import print_cell_eval_table, require_cell_eval
from gears.eval.predictor import Predictor
from gears.eval.report import print_table
from gears.eval.vcc2026 import print_vcc2026_table, require_cell_eval2, require_scorable
from gears.io import CheckpointWriteError, atomic_write, file_name
from gears.model import network_class, network_options
from gears.torch_compat import default_store
from gears.train import checkpoint as ckpt
from gears.train.build import LOADER_KEYS, BuiltNetwork, new_network, train_network
from gears.train.distributed import DistEnv, build_in_stages, release
from gears.train.engine import Trainer, seed_everything
from gears.train.faults import injected_delay
from gears.train.runtime import (
    auto_threads,
    fixed_threads_reason,
    follow_load,
    set_threads,
    tune_allocator,
    wait_report,
)
from gears.train.saved_model import write_model_folder
from gears.train.state import History

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"


def parse_args(argv: list[str] | None, description: str, extra=None):
    parser = argparse.ArgumentParser(
        description=description,
        epilog="overrides are dotted config keys, e.g. train.epochs=5 split.type=combo_seen2",
    )
    parser.add_argument("--config", default=None, help="YAML file overriding configs/default.yaml")
    if extra is not None:
        extra(parser)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    # Intermixed: `train.epochs=5 --config FILE train.limit_batches=5` takes both overrides
    # (plain parse_args stops the positional list at the first option and rejects the rest).
    return parser.parse_intermixed_args(argv)


def config_from_args(args) -> Config:
    base = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
    return load_config(args.config, args.overrides, base=base)


def split_and_graphs(pert_data, cfg: Config):
    """cfg's split of pert_data, and the model's graphs (GO, co-expression of its training
    cells) built with cfg's settings. -> pert_data"""
    split = cfg.split
    pert_data.prepare_split(
        split.type,
        seed=split.seed,
        train_gene_set_size=split.train_gene_set_size,
        combo_seen2_train_frac=split.combo_seen2_train_frac,
        combo_single_split_test_set_fraction=split.test_size,
        split_dict_path=split.split_dict_path,
        val_size=split.val_size,
    )
    # The model's graphs belong to the data step too: built here, before any process group
    # exists, rank 0 first (it caches them in a shared store, which the others then read),
    # instead of by every rank at once inside model_initialize while collectives wait
    # (the co-expression graph takes minutes at genome scale).
    pert_data.go_graph(cfg.data.go_top_k, cfg.data.go_threshold)
    pert_data.coexpress_graph(cfg.data.coexpress_top_k, cfg.data.coexpress_threshold)
    return pert_data


def load_pert_data(cfg: Config, env: DistEnv, store=None, split: bool = True):
    """Every rank's PertData; rank 0 first (downloads, writes caches), then the others read them.
    split=False: loaded only, not split and without graphs (gears.cli.contexts splits each
    context's view).

    The ranks wait for each other on a store (`build_in_stages`, distributed.data_wait_s), never
    in a collective: train_distributed.py passes the rendezvous store before the process group
    exists (env has no group yet); a caller already in a group uses the group's store."""

    def build():
        pert_data = PertData(
            cfg.data.data_dir,
            gene2go=cfg.data.gene2go,
            gene_aliases=cfg.data.gene_aliases,
            keep_unmapped_perts=cfg.data.keep_unmapped_perts,
            unmapped_perts=cfg.data.unmapped_perts,
            mirror_url=cfg.data.mirror_url,
            verbose=env.is_main,
            store=cfg.data.store,
            store_dir=cfg.data.store_dir,
            chunk_cells=cfg.data.chunk_cells,
        )
        if cfg.data.dataset == "synthetic":
            pert_data.load(
                "synthetic", synthetic_params=cfg.data.synthetic, context_key=cfg.data.context_key
            )
        else:
            pert_data.load(
                data_name=cfg.data.dataset,
                subset=cfg.data.subset or None,
                condition_key=cfg.data.condition_key,
                control_names=tuple(cfg.data.control_names),
                normalize=cfg.data.normalize,
                context_key=cfg.data.context_key,
                pool_contexts=cfg.data.pool_contexts,
            )
        return split_and_graphs(pert_data, cfg) if split else pert_data

    def staged():
        injected_delay("data", env.rank)
        seed_everything(cfg.seed)  # the same state whichever rank or launcher builds
        return build()

    if store is None and env.distributed:
        store = default_store()
    if store is None:
        return staged()
    return build_in_stages(
        staged, store, env.rank, env.local_rank, env.world_size, cfg.distributed.data_wait_s
    )


def init_wandb(cfg: Config, env: DistEnv):
    if not env.is_main or cfg.wandb.mode == "disabled":
        return None

    import wandb  # here: an optional package, imported by the runs that log to it

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        name=cfg.wandb.name,
        mode=cfg.wandb.mode,
        dir=str(Path(cfg.out_dir)),
        config=cfg.to_dict(),
    )


def _clean(obj):
    """JSON-safe: numpy scalars to floats, NaN to None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if math.isnan(float(obj)) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def run(cfg: Config, env: DistEnv, pert_data=None, later: list | None = None) -> dict | None:
    """Train on cfg's data (gears.train.build), score the test set beside the baselines
    (gears.eval.scoring), write the run directory (rank 0).

    The run owns out_dir while it lives (gears.cli.run_folder: a lock, and never another run's
    outputs overwritten). pert_data: this rank's data when the launcher prepared it before
    joining the group. After the test predictions are gathered every rank leaves the process
    group (`release`); the other ranks return None and rank 0 scores, runs baselines, plots and
    writes with no collective pending, however long that takes.

    The model and metrics.json are written before the optional outputs (plots, cell-eval,
    cell-eval2), and a failure in those prints one line and keeps the run. later: a list that
    receives the optional outputs as a callable (-> the updated results) instead of running
    them (gears.cli.contexts runs every context's once every model is written)."""
    check_before_the_run(cfg)
    if env.is_main:  # rank 0 alone logs to wandb
        check_wandb_login(cfg)
    folder = claim_run_folder(cfg, env)
    try:
        return _run(cfg, env, pert_data, later)
    except CheckpointWriteError as e:
        # A full disk after the first checkpoint: this run continues from its checkpoints
        # (a plain rerun would be refused, the folder now holding them).
        if "train.resume=true" in str(e) or not prior_outputs(Path(cfg.out_dir)):
            raise
        error = CheckpointWriteError(
            f"{e} with train.resume=true (this run's checkpoints are kept)"
        )
        error.reported, error.every_rank = e.reported, e.every_rank
        raise error from None
    finally:
        folder.release()


def check_before_the_run(cfg: Config) -> None:
    """What a run needs that the config alone shows, said before out_dir is claimed or
    anything is trained or written: an uninstalled scorer (not after an hour of training), a
    fork's class that cannot be found, a model cell-eval2 cannot score."""
    if cfg.eval.cell_eval:
        require_cell_eval()
    network = network_class(cfg.model.impl)
    network_options(network, cfg.model.extra, cfg.model.impl)  # model.extra: names it takes
    if cfg.eval.cell_eval2:
        require_cell_eval2()
        require_scorable(cfg, network, one_model_per_context(cfg))


def plot_examples(model, out: Path, n: int, baseline_means=None, title=None) -> None:
    """The first n test units' perturbation plots, in out/plots whatever the names (a gene
    named like a path names no place, gears.io.file_name). baseline_means: predictor -> [units,
    G] means drawn beside the prediction; title(context) -> the plot's title. model: what
    gives the test units and draws a plot (a Predictor, or the GEARS facade)."""
    for i, (cond, values) in enumerate(model.test_units()[:n]):
        name = file_name("_".join([cond.replace("+", "_"), *map(str, values.values())]))
        extra = {}
        if baseline_means is not None:
            extra["baselines"] = {b: m[i] for b, m in baseline_means.items()}
        if title is not None:
            extra["title"] = title(values.get("context"))
        model.plot_perturbation(cond, out / "plots" / f"{name}.png", values, **extra)


def check_wandb_login(cfg: Config) -> None:
    """wandb.mode=online needs a W&B API key on this machine (WANDB_API_KEY, an identity
    token file, or `wandb login`'s netrc entry); without one wandb.init fails after the run's
    folder is written: say so before anything is written. Reads no network."""
    if cfg.wandb.mode != "online":
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc")).expanduser()
    try:
        if path.is_file() and netrc.netrc(str(path)).authenticators(host or ""):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise GearsInputError(
        f"wandb.mode=online needs a W&B API key and none is set (no WANDB_API_KEY, no entry "
        f"for {host} in {path}): run `wandb login` or export WANDB_API_KEY=..., or set "
        "wandb.mode=offline (sync later with `wandb sync`) or wandb.mode=disabled"
    )


@dataclass
class Trained:
    """A trained network and how long training took (rank 0's clocks)."""

    built: BuiltNetwork
    trainer: Trainer
    history: History
    train_s: float
    train_cpu_s: float  # every thread: spinning waits show here


def _run(cfg: Config, env: DistEnv, pert_data=None, later: list | None = None) -> dict | None:
    """run's work once out_dir is claimed: train, score, write."""
    t_start = time.perf_counter()
    if one_model_per_context(cfg) and getattr(pert_data, "context", None) is None:
        # one model per context, then a summary
        return run_contexts(
            cfg, env, pert_data, load=_load_unsplit, prepare=split_and_graphs, run_one=run
        )
    keep_config = _start(cfg, env)
    if pert_data is None:
        pert_data = load_pert_data(cfg, env)
    # After the data: scanpy's numba DE resets torch's pool. 0: this rank's share of the cores.
    threads = set_threads(cfg.train.threads or auto_threads())
    # Fewer threads while other processes use the CPUs, where that changes no bit of the run.
    policy = follow_load(threads, fixed_threads_reason(cfg, env.device, threads))
    tune_allocator()  # glibc keeps freed activations: no per-step page faults
    wandb_run = init_wandb(cfg, env)
    trained = train_model(cfg, env, pert_data, wandb_run)
    policy.finish()  # evaluation and scoring: at the count the load asks for now
    if env.is_main and keep_config:
        # the resumed run's settings (train.epochs may have risen)
        cfg.save(Path(cfg.out_dir) / "config.yaml")
    t_eval = time.perf_counter()
    evaluator = trained.built.evaluator  # its protocol: eval.control_mean, set in training
    predictions = scoring.gather_predictions(evaluator, pert_data)  # every rank takes part
    # Every collective (each gathered prediction) must come before this point: the ranks leave
    # the group here and rank 0 alone scores below, with no collective timeout pending.
    env = leave_process_group(trained, env)  # the last collective: the other ranks are done
    if not env.is_main:
        return None
    injected_delay("scoring", env.rank)
    results = run_facts(cfg, env, pert_data, trained)
    scores = scoring.score(evaluator, pert_data, predictions, cfg.eval.control_mean)
    results.update(scores.results)
    eval_s = time.perf_counter() - t_eval
    results["timing"] = run_timing(trained, threads, eval_s, time.perf_counter() - t_start)
    results["timing"]["thread_policy"] = policy.report()
    results["history"] = {
        "train_loss": trained.history.train_loss,
        "val": trained.history.val,
        "skipped_steps": trained.history.skipped_steps,  # fp16 GradScaler overflow skips per epoch
    }
    results["report"] = pert_data.report
    return write_outputs(cfg, results, trained, pert_data, scores, wandb_run, later)


def _load_unsplit(cfg: Config, env: DistEnv):
    return load_pert_data(cfg, env, split=False)


def _start(cfg: Config, env: DistEnv) -> bool:
    """Seed, make out_dir/plots and write config.yaml (rank 0). -> whether config.yaml is kept
    for now: a resume keeps the checkpoint's until the checkpoint has accepted this one."""
    seed_everything(cfg.seed)
    out = Path(cfg.out_dir)
    keep_config = cfg.train.resume and bool(ckpt.list_checkpoints(out / "checkpoints"))
    if env.is_main:
        (out / "plots").mkdir(parents=True, exist_ok=True)
        if not keep_config:
            cfg.save(out / "config.yaml")
    return keep_config


def train_model(cfg: Config, env: DistEnv, pert_data, wandb_run) -> Trained:
    """cfg's network, trained on pert_data with checkpoints in out_dir (gears.train.build)."""
    seed_everything(cfg.seed)  # the same initial weights on every rank, whatever ran before
    built = new_network(pert_data, cfg.model, cfg.data, env)
    t_train, cpu_train = time.perf_counter(), time.process_time()
    trainer, history = train_network(
        built,
        pert_data,
        env,
        cfg.train,
        explicit=set(LOADER_KEYS),
        dist_cfg=cfg.distributed,
        wandb_run=wandb_run,
        out_dir=Path(cfg.out_dir),
        seed=cfg.seed,
        control_mean=cfg.eval.control_mean,
        run_config=cfg.to_dict(),
    )
    train_s = time.perf_counter() - t_train
    return Trained(built, trainer, history, train_s, time.process_time() - cpu_train)


def leave_process_group(trained: Trained, env: DistEnv) -> DistEnv:
    """After the last collective of a distributed run: drop the DDP wrapper while the process
    group is alive, leave the group (gears.train.distributed.release), and go on in this process
    alone (rank 0 scores and writes; the others are done). -> the new DistEnv."""
    trained.trainer.unwrap()
    env = release(env)
    trained.built.evaluator.env = env
    return env


def run_facts(cfg: Config, env: DistEnv, pert_data, trained: Trained) -> dict:
    """metrics.json's first fields: what was trained on what, and which epoch was kept."""
    best, history = trained.trainer.best_epoch, trained.history
    return {
        "dataset": pert_data.dataset_name,
        "split": cfg.split.type,
        "world_size": env.world_size,
        "effective_batch_size": cfg.train.batch_size * env.world_size * cfg.train.grad_accum_steps,
        "best_epoch": best + 1,
        "select": cfg.train.select,
        "control_mean": cfg.eval.control_mean,
        "val_best": history.val[best] if history.val else {},
    }


def run_timing(trained: Trained, threads: int, eval_s: float, total_s: float) -> dict:
    """metrics.json's timing: training speed, time per phase, threads and OpenMP waits."""
    history = trained.history
    return {
        "train_cells_per_s": float(np.mean(history.cells_per_s)) if history.cells_per_s else 0,
        "epoch_s": float(np.mean(history.epoch_s)) if history.epoch_s else 0.0,
        "train_s": trained.train_s,
        "train_cpu_s": trained.train_cpu_s,
        "epochs": max(len(history.epoch_s), 1),
        "eval_s": eval_s,
        "total_s": total_s,
        "threads": threads,  # torch's CPU threads while training (rank 0)
        "omp_waits": wait_report(),  # governed: switches between spinning and short waits
    }


def write_outputs(
    cfg: Config, results: dict, trained: Trained, pert_data, scores, wandb_run, later
) -> dict:
    """model/ and metrics.json, the printed table and wandb's summary; then the optional
    outputs (plots, cell-eval, cell-eval2), or, with later, a callable that makes them
    appended to it. Rank 0. -> the run's results"""
    out, built = Path(cfg.out_dir), trained.built
    # The model and metrics.json first: what follows (plots, cell-eval, cell-eval2) is
    # optional, and a failure there loses none of this.
    write_model_folder(
        out / "model",
        built.network,
        built.model_cfg,
        built.config,
        built.graphs,
        pert_data,
        cfg.seed,
    )
    results = _write_metrics(out, results)
    if scores.tested:
        print_table(results)
    if wandb_run is not None:
        wandb_run.summary.update({f"test/{k}": v for k, v in results["test"].items()})
        wandb_run.finish()
    categories = built.config["covariates"]
    predictor = Predictor(
        pert_data, built.network, categories, built.evaluator, pert_data.ctrl_mean
    )

    def optional_outputs() -> dict:
        return _optional_outputs(cfg, out, results, predictor, pert_data, trained.history, scores)

    if later is not None:  # the caller runs it once every context's model is written
        later.append(optional_outputs)
        return results
    return optional_outputs()


def _write_metrics(out: Path, results: dict) -> dict:
    results = _clean(results)
    text = json.dumps(results, indent=1)
    atomic_write(out / "metrics.json", lambda tmp: tmp.write_text(text))
    return results


def _optional(what: str, work):
    """work(), or, when it raises, one printed line and {"error": why}: a trained run's optional
    outputs never end it (its model and metrics.json are already written)."""
    try:
        return work()
    except Exception as e:  # noqa: BLE001 - any failure of optional work keeps the run
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")
        print(
            f"warning: {what} failed ({why}); the model and metrics.json are kept",
            file=sys.stderr,
            flush=True,
        )
        return {"error": why}


def _optional_outputs(
    cfg: Config, out: Path, results: dict, predictor, pert_data, history, scores
) -> dict:
    """Plots, cell-eval and cell-eval2 of a run whose model and metrics.json are written (rank
    0); each that fails prints one line. metrics.json is rewritten with the scores.
    scores: gears.eval.scoring.Scores (the test units and the baselines' means).
    -> the run's results"""
    t0 = time.perf_counter()
    _optional("plots", lambda: _plots(cfg, out, results, predictor, pert_data, history, scores))
    args = (cfg, pert_data, predictor, scores.conditions, scores.baseline_means, out)
    scored = False
    if scores.conditions and cfg.eval.cell_eval:
        results["cell_eval"] = _optional(
            "cell-eval scoring", lambda: scoring.cell_eval_scores(*args)
        )
        scored = True
    if scores.conditions and cfg.eval.cell_eval2:
        results["cell_eval2"] = _optional(
            "cell-eval2 scoring", lambda: scoring.cell_eval2_scores(*args)
        )
        scored = True
    if scored:
        results["timing"]["scoring_s"] = time.perf_counter() - t0
        results = _write_metrics(out, results)
        if results.get("cell_eval") and "error" not in results["cell_eval"]:
            print_cell_eval_table(results["cell_eval"])
        if results.get("cell_eval2") and "error" not in results["cell_eval2"]:
            print_vcc2026_table(results["cell_eval2"])
    print(
        f"\nwrote {out}/ (config.yaml, metrics.json, model/, checkpoints/, plots/) in "
        f"{results['timing']['total_s'] + time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return results


def _plots(cfg: Config, out: Path, results: dict, predictor, pert_data, history, scores) -> None:
    """The loss curves, and the first train.plot_conditions test units' perturbation plots."""
    network = network_class(cfg.model.impl).__name__
    context = getattr(pert_data, "context", None)
    plot_history(
        history,
        out / "plots" / "loss.png",
        kept_epoch=results["best_epoch"],
        no_change=results["val_no_change"].get("mse_de"),
        title=run_title(out, network, context, context_run=context is not None),
    )
    if scores.conditions:
        plot_examples(
            predictor,
            out,
            cfg.train.plot_conditions,
            scores.baseline_means,
            lambda ctx: run_title(out, network, ctx or context, context_run=context is not None),
        )


def guarded(main):
    """Run `main`; bad input prints one clear line (no traceback) and exits with status 2; a
    stop on SIGTERM or SIGINT during training (checkpoint written, message printed by rank 0)
    exits with status 0 or 130; a Ctrl-C outside training exits 130 with one line."""
    try:
        return main()
    except TrainingStopped as e:
        sys.exit(e.exit_status)
    except GearsInputError as e:
        if not e.reported:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print(
            "interrupted (SIGINT) outside a training epoch: no checkpoint written by this "
            "interruption; train.resume=true continues from the last one, if any",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(130)


def command(main) -> None:
    """A script's entry point (`if __name__ == "__main__"`, and each spawned rank): guarded(main),
    then exit_quickly with its status. Never call it in a process that should go on (a notebook,
    pytest): it ends the process."""
    try:
        guarded(main)
        status = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr, flush=True)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    exit_quickly(status)
