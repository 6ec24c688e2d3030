"""A model's parts built from its config and a PertData: the network, config.json's record of
it and its Evaluator; then the training loaders and the Trainer that fits it. The run
(gears/cli/job.py) and the GEARS facade (gears/compat/api.py) build with these alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from gears.config import DataConfig, DistributedConfig, ModelConfig, TrainConfig
from gears.data.covariates import data_categories
from gears.device import module_to_device
from gears.errors import GearsInputError
from gears.model import network_class, network_options
from gears.model.batch import declared_covariates
from gears.train.distributed import DistEnv
from gears.train.engine import Trainer
from gears.train.evaluate import Evaluator
from gears.train.state import History

# TrainConfig fields that shape the data loaders (PertData.dataloader_settings has them too).
LOADER_KEYS = (
    "batch_size",
    "test_batch_size",
    "num_workers",
    "batching",
    "cells_per_group",
    "block_size",
)


@dataclass
class BuiltNetwork:
    """A network and what travels with it. model_cfg: its ModelConfig, the fork's options
    (`extra`) filled in; config: config.json's record (the hyperparameters, the graph settings
    under cell-gears's names, `extra`, and each covariate's categories); graphs: "go" and
    "coexpress" -> (edge_index, edge_weight); evaluator: the model's one Evaluator (validation
    in training, evaluate, the run's test scores)."""

    network: torch.nn.Module
    model_cfg: ModelConfig
    config: dict
    graphs: dict
    evaluator: Evaluator


def network_record(model_cfg: ModelConfig, graph_cfg: DataConfig, pert_data) -> dict:
    """config.json's record of a new network: the hyperparameters, and the graph settings under
    cell-gears's names."""
    return {
        **asdict(model_cfg),
        "num_similar_genes_go_graph": graph_cfg.go_top_k,
        "num_similar_genes_co_express_graph": graph_cfg.coexpress_top_k,
        "coexpress_threshold": graph_cfg.coexpress_threshold,
        "go_threshold": graph_cfg.go_threshold,
        "num_genes": len(pert_data.gene_names),
        "num_perts": len(pert_data.pert_names),
    }


def data_graphs(pert_data, graph_cfg: DataConfig) -> tuple:
    """The data's GO and co-expression graphs with graph_cfg's top-k and thresholds ->
    ((go_edge_index, go_weight), (coexpress_edge_index, coexpress_weight))."""
    go = pert_data.go_graph(graph_cfg.go_top_k, graph_cfg.go_threshold)
    co = pert_data.coexpress_graph(graph_cfg.coexpress_top_k, graph_cfg.coexpress_threshold)
    return (go.edge_index, go.edge_weight), (co.edge_index, co.edge_weight)


def new_network(
    pert_data, model_cfg: ModelConfig, graph_cfg: DataConfig, env: DistEnv, graphs=None
) -> BuiltNetwork:
    """A fresh network from one ModelConfig (the config file's `model:` section) and the data's
    graphs, built with graph_cfg's settings (the `data:` section) unless given as graphs (as
    data_graphs returns them)."""
    if graphs is None:
        graphs = data_graphs(pert_data, graph_cfg)
    config = network_record(model_cfg, graph_cfg, pert_data)
    tensors = (torch.as_tensor(t) for graph in graphs for t in graph)
    return build_network(pert_data, model_cfg, config, *tensors, env)


def build_network(
    pert_data,
    model_cfg: ModelConfig,
    config: dict,
    go_ei,
    go_w,
    co_ei,
    co_w,
    env: DistEnv,
    folder: Path | None = None,
    trust_code: bool = False,
) -> BuiltNetwork:
    """The network model_cfg.impl names (a fork's class from folder's copy only with
    trust_code), on env's device, with its covariates' categories (config's, else the data's)
    and its Evaluator. config: config.json's record, completed here with `extra` and
    `covariates` (a copy is returned)."""
    network = network_class(model_cfg.impl, folder, trust_code)
    # The fork's own options, defaults filled in: the network and config.json get them all.
    extra = network_options(network, model_cfg.extra, model_cfg.impl)
    model_cfg = replace(model_cfg, extra=extra)
    config = dict(config, extra=dict(extra))
    names = declared_covariates(network)
    categories = config.get("covariates") or data_categories(pert_data, names)
    config["covariates"] = {n: list(categories[n]) for n in names}
    kwargs = {"categories": config["covariates"]} if names else {}
    net = network(
        model_cfg,
        len(pert_data.gene_names),
        len(pert_data.pert_names),
        go_ei,
        go_w,
        co_ei,
        co_w,
        **kwargs,
    )
    net = module_to_device(net, env.device)  # (stand-in: DeviceTensors)
    graphs = {"go": (go_ei, go_w), "coexpress": (co_ei, co_w)}
    evaluator = Evaluator(pert_data, env, net, categories=config["covariates"])
    return BuiltNetwork(net, model_cfg, config, graphs, evaluator)


def training_loaders(
    pert_data, network, evaluator: Evaluator, env: DistEnv, cfg: TrainConfig, explicit: set[str]
) -> dict:
    """The training loaders: pert_data's own (cell-gears style: get_dataloader(...), then
    train()) when they were built for this process and for every loader setting the caller
    gave explicitly, their settings then copied into cfg; else new ones built from cfg."""
    pd_ = pert_data
    built = pd_.dataloader_settings if pd_.dataloader else None
    reads = declared_covariates(network)  # the loaders must carry exactly these
    if built is not None and tuple(built.get("covariates", ())) != reads:
        built = None
    if built is not None and "train_loader" in pd_.dataloader:
        mine = (built["world_size"], built["rank"]) == (env.world_size, env.rank)
        differs = {
            k: (getattr(cfg, k), built[k])
            for k in LOADER_KEYS
            if k in explicit and getattr(cfg, k) != built[k]
        }
        if mine and not differs:
            for k in LOADER_KEYS:
                setattr(cfg, k, built[k])
            return pd_.dataloader
        if mine and env.is_main:
            asked = ", ".join(
                f"{k}={want!r} (loaders: {have!r})" for k, (want, have) in differs.items()
            )
            print(f"train(): rebuilding the data loaders for {asked}")
    return pd_.get_dataloader_distributed(
        cfg.batch_size,
        cfg.test_batch_size,
        env.world_size,
        env.rank,
        num_workers=cfg.num_workers,
        batching=cfg.batching,
        cells_per_group=cfg.cells_per_group,
        pin_memory=env.device.type == "cuda",
        device=env.device,
        block_size=cfg.block_size,
        covariates=evaluator.cell_covariates(declared_covariates(network)),
    )


def train_network(
    built: BuiltNetwork,
    pert_data,
    env: DistEnv,
    cfg: TrainConfig,
    *,
    explicit: set[str],
    dist_cfg: DistributedConfig | None = None,
    wandb_run=None,
    out_dir: str | Path | None = None,
    seed: int = 1,
    control_mean: str = "all",
    run_config: dict | None = None,
    resume: bool = False,
    progress: bool = True,
) -> tuple[Trainer, History]:
    """Train built's network with the shared engine (which keeps the model train_cfg.select
    chooses) -> (the Trainer, its History). explicit: the loader settings the caller set
    (training_loaders); control_mean: how validation forms predicted means
    (config.CHOICES['eval.control_mean']); out_dir: where checkpoints go (None: none);
    run_config: the whole run configuration (Config.to_dict()), recorded in checkpoints so that
    a resume with other settings is refused by name; resume: continue from out_dir's last
    checkpoint (or cfg.resume)."""
    loaders = training_loaders(pert_data, built.network, built.evaluator, env, cfg, explicit)
    if "train_loader" not in loaders:
        raise GearsInputError(f"split {pert_data.split.split_type!r} has no training set")
    built.evaluator.control_mean = control_mean
    trainer = Trainer(
        built.network,
        pert_data,
        cfg,
        built.model_cfg,
        env,
        out_dir=out_dir,
        dist_cfg=dist_cfg,
        wandb_run=wandb_run,
        seed=seed,
        evaluator=built.evaluator,
        run_config=run_config,
    )
    trainer.resume(asked=resume or cfg.resume)
    history = trainer.fit(loaders, progress=progress)
    return trainer, history
