"""The GEARS facade of `cell-gears`: model_initialize, train, predict, GI_predict, save/load."""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from gears import checkpoint as ckpt
from gears.config import DataConfig, DistributedConfig, ModelConfig, TrainConfig
from gears.data.conditions import CTRL, canonical_condition, condition_genes
from gears.data.covariates import CONTEXT, data_categories, encode
from gears.device import module_to_device, to_host
from gears.distributed import DistEnv, choose_device, release
from gears.engine import Trainer
from gears.errors import GearsInputError
from gears.evaluate import Evaluator, predict_deltas
from gears.model import fork_files, network_class, network_options, spec_file
from gears.model.batch import declared_covariates, predicted_expression, reads_x
from gears.model_folder import (
    CONFIG_FILE,
    MODEL_FILE,
    control_sample_rows,
    read_model_json,
    write_prediction_inputs,
)

# A network that reads x predicts a perturbation's mean from this many control cells (a seeded
# sample), as cell-gears's predict() runs 300.
PREDICT_CONTROL_CELLS = 300
# TrainConfig fields that shape the data loaders (PertData.dataloader_settings has them too).
LOADER_KEYS = (
    "batch_size",
    "test_batch_size",
    "num_workers",
    "batching",
    "cells_per_group",
    "block_size",
)


class GEARS:
    """Train and query a GEARS model on a PertData (after `prepare_split`)."""

    def __init__(
        self,
        pert_data,
        device: str = "auto",
        weight_bias_track: bool = False,
        proj_name: str = "GEARS",
        exp_name: str = "GEARS",
        env: DistEnv | None = None,
        wandb_run=None,
        out_dir: str | Path | None = None,
        seed: int = 1,
    ):
        self.pert_data = pert_data
        self.env = env or DistEnv(device=choose_device(device))
        self.device = self.env.device
        self.wandb = wandb_run
        if weight_bias_track and wandb_run is None:
            import wandb

            self.wandb = wandb.init(project=proj_name, name=exp_name)
        self.out_dir = out_dir
        self.seed = seed
        self.config: dict | None = None  # config.json: model_cfg and the graph settings
        self.model_cfg: ModelConfig | None = None
        self.model: torch.nn.Module | None = None  # the network model.impl names
        self.model_folder: Path | None = None  # the folder load_pretrained read it from
        self.trust_code = False  # whether that folder's own code (a fork's file) may run
        # A model loaded from cell-gears: its predict() protocol around self.model (predictions
        # equal cell-gears's); None otherwise (gears/cell_gears.py CellGearsPrediction).
        self.cell_gears_net: torch.nn.Module | None = None
        self.trainer: Trainer | None = None
        # The one Evaluator of this model (validation in training, evaluate, the run's test
        # scores), built with the network.
        self.evaluator: Evaluator | None = None
        self.history = None
        self.gene_list = list(pert_data.gene_names)
        self.pert_list = list(pert_data.pert_names)
        self.ctrl_expression = pert_data.ctrl_mean

    # --------------------------------------------------------------------------------- model
    def initialize(self, model_cfg: ModelConfig, graph_cfg: DataConfig | None = None, graphs=None):
        """Build the network from one ModelConfig (the config file's `model:` section) and the
        data's GO and co-expression graphs, built with graph_cfg's top-k and thresholds (the
        `data:` section) unless given as graphs = ((go_edge_index, go_weight),
        (coexpress_edge_index, coexpress_weight))."""
        graph_cfg = graph_cfg or DataConfig()
        if graphs is None:
            go = self.pert_data.go_graph(graph_cfg.go_top_k, graph_cfg.go_threshold)
            co = self.pert_data.coexpress_graph(
                graph_cfg.coexpress_top_k, graph_cfg.coexpress_threshold
            )
            graphs = ((go.edge_index, go.edge_weight), (co.edge_index, co.edge_weight))
        self.model_cfg, self.model_folder, self.trust_code = model_cfg, None, False
        # config.json: the hyperparameters, and the graph settings under cell-gears's names.
        self.config = {
            **asdict(model_cfg),
            "num_similar_genes_go_graph": graph_cfg.go_top_k,
            "num_similar_genes_co_express_graph": graph_cfg.coexpress_top_k,
            "coexpress_threshold": graph_cfg.coexpress_threshold,
            "go_threshold": graph_cfg.go_threshold,
            "num_genes": len(self.gene_list),
            "num_perts": len(self.pert_list),
        }
        self._build(*(torch.as_tensor(t) for graph in graphs for t in graph))
        return self

    def model_initialize(
        self,
        hidden_size: int = 64,
        num_go_gnn_layers: int = 1,
        num_gene_gnn_layers: int = 1,
        decoder_hidden_size: int = 16,
        num_similar_genes_go_graph: int = 20,
        num_similar_genes_co_express_graph: int = 20,
        coexpress_threshold: float = 0.4,
        go_threshold: float = 0.1,
        uncertainty: bool = False,
        uncertainty_reg: float = 1.0,
        direction_lambda: float = 1e-1,
        direction_temperature: float = 0.1,
        gamma: float = 2.0,
        G_go=None,
        G_go_weight=None,
        G_coexpress=None,
        G_coexpress_weight=None,
        no_perturb: bool = False,
    ) -> GEARS:
        """cell-gears's signature for initialize() (decoder_hidden_size and no_perturb are
        accepted for compatibility and unused, as in the original)."""
        model_cfg = ModelConfig(
            hidden_size=hidden_size,
            num_go_gnn_layers=num_go_gnn_layers,
            num_gene_gnn_layers=num_gene_gnn_layers,
            uncertainty=uncertainty,
            uncertainty_reg=uncertainty_reg,
            direction_lambda=direction_lambda,
            direction_temperature=direction_temperature,
            gamma=gamma,
        )
        graph_cfg = DataConfig(
            go_top_k=num_similar_genes_go_graph,
            go_threshold=go_threshold,
            coexpress_top_k=num_similar_genes_co_express_graph,
            coexpress_threshold=coexpress_threshold,
        )
        graphs = None
        if G_go is not None or G_coexpress is not None:
            if G_go is None or G_coexpress is None:
                go = self.pert_data.go_graph(num_similar_genes_go_graph, go_threshold)
                co = self.pert_data.coexpress_graph(
                    num_similar_genes_co_express_graph, coexpress_threshold
                )
                if G_go is None:
                    G_go, G_go_weight = go.edge_index, go.edge_weight
                if G_coexpress is None:
                    G_coexpress, G_coexpress_weight = co.edge_index, co.edge_weight
            graphs = ((G_go, G_go_weight), (G_coexpress, G_coexpress_weight))
        return self.initialize(model_cfg, graph_cfg, graphs)

    def _build(self, go_ei, go_w, co_ei, co_w) -> None:
        """The network model.impl names, its covariates' categories (config.json's, else this
        data's), and the model's one Evaluator."""
        self.cell_gears_net = None
        network = network_class(self.model_cfg.impl, self.model_folder, self.trust_code)
        # The fork's own options, defaults filled in: the network and config.json get them all.
        extra = network_options(network, self.model_cfg.extra, self.model_cfg.impl)
        self.model_cfg = replace(self.model_cfg, extra=extra)
        self.config["extra"] = dict(extra)
        names = declared_covariates(network)
        categories = self.config.get("covariates") or data_categories(self.pert_data, names)
        self.config["covariates"] = {n: list(categories[n]) for n in names}
        kwargs = {"categories": self.config["covariates"]} if names else {}
        self.model = network(
            self.model_cfg,
            len(self.gene_list),
            len(self.pert_list),
            go_ei,
            go_w,
            co_ei,
            co_w,
            **kwargs,
        )
        self.model = module_to_device(self.model, self.device)  # (stand-in: DeviceTensors)
        self.graphs = {"go": (go_ei, go_w), "coexpress": (co_ei, co_w)}
        self.evaluator = Evaluator(
            self.pert_data, self.env, self.model, categories=self.config["covariates"]
        )

    def model_config(self) -> ModelConfig:
        return self.model_cfg

    def prediction_net(self) -> torch.nn.Module:
        """The network predictions come from: the model, or for a model loaded from cell-gears
        with cell_gears_predict, cell-gears's predict() protocol around it."""
        return self.cell_gears_net if self.cell_gears_net is not None else self.model

    # ---------------------------------------------------------------------------------- train
    def train(
        self,
        epochs: int = 20,
        lr: float = 1e-3,
        weight_decay: float = 5e-4,
        train_cfg: TrainConfig | None = None,
        dist_cfg: DistributedConfig | None = None,
        resume: bool = False,
        progress: bool = True,
        control_mean: str = "all",
        run_config: dict | None = None,
        **train_kwargs,
    ):
        """Train with the shared engine; keeps the model chosen by train_cfg.select (the final one
        by default; `val_mse_de` is GEARS's best_model). control_mean: how validation forms
        predicted means (config.CHOICES['eval.control_mean']). run_config: the whole run
        configuration as a dict (Config.to_dict()), recorded in checkpoints so that a resume
        with other settings is refused by name."""
        if self.model is None:
            raise GearsInputError("call model_initialize() before train()")
        cfg = train_cfg or TrainConfig(
            epochs=epochs, lr=lr, weight_decay=weight_decay, **train_kwargs
        )
        explicit = set(LOADER_KEYS) if train_cfg is not None else set(train_kwargs)
        self.cell_gears_net = None  # trained here, the model is this project's network
        loaders = self._loaders(cfg, explicit)
        if "train_loader" not in loaders:
            raise GearsInputError(f"split {self.pert_data.split.split_type!r} has no training set")
        self.evaluator.control_mean = control_mean
        self.trainer = Trainer(
            self.model,
            self.pert_data,
            cfg,
            self.model_cfg,
            self.env,
            out_dir=self.out_dir,
            dist_cfg=dist_cfg,
            wandb_run=self.wandb,
            seed=self.seed,
            evaluator=self.evaluator,
            run_config=run_config,
        )
        self.trainer.resume(asked=resume or cfg.resume)
        self.history = self.trainer.fit(loaders, progress=progress)
        self.best_model = self.model
        return self.history

    @property
    def best_epoch(self) -> int:
        """The epoch (0-based) whose weights training kept (train.select), -1 before training."""
        return self.trainer.best_epoch if self.trainer is not None else -1

    def release_process_group(self) -> DistEnv:
        """After the last collective of a distributed run: drop the DDP wrapper while the
        process group is alive, leave the group (gears.distributed.release), and go on in this
        process alone (rank 0 scores and writes; the others are done). -> the new DistEnv."""
        if self.trainer is not None:
            self.trainer.unwrap()
        self.env = release(self.env)
        if self.evaluator is not None:
            self.evaluator.env = self.env
        return self.env

    def _loaders(self, cfg: TrainConfig, explicit: set[str]) -> dict:
        """The training loaders: pert_data's own (cell-gears style: get_dataloader(...), then
        train()) when they were built for this process and for every loader setting the caller
        gave explicitly, their settings then copied into cfg; else new ones built from cfg."""
        pd_ = self.pert_data
        built = pd_.dataloader_settings if pd_.dataloader else None
        reads = declared_covariates(self.model)  # the loaders must carry exactly these
        if built is not None and tuple(built.get("covariates", ())) != reads:
            built = None
        if built is not None and "train_loader" in pd_.dataloader:
            mine = (built["world_size"], built["rank"]) == (self.env.world_size, self.env.rank)
            differs = {
                k: (getattr(cfg, k), built[k])
                for k in LOADER_KEYS
                if k in explicit and getattr(cfg, k) != built[k]
            }
            if mine and not differs:
                for k in LOADER_KEYS:
                    setattr(cfg, k, built[k])
                return pd_.dataloader
            if mine and self.env.is_main:
                asked = ", ".join(
                    f"{k}={want!r} (loaders: {have!r})" for k, (want, have) in differs.items()
                )
                print(f"train(): rebuilding the data loaders for {asked}")
        return pd_.get_dataloader_distributed(
            cfg.batch_size,
            cfg.test_batch_size,
            self.env.world_size,
            self.env.rank,
            num_workers=cfg.num_workers,
            batching=cfg.batching,
            cells_per_group=cfg.cells_per_group,
            pin_memory=self.device.type == "cuda",
            device=self.device,
            block_size=cfg.block_size,
            covariates=self.evaluator.cell_covariates(declared_covariates(self.model)),
        )

    # -------------------------------------------------------------------------------- predict
    def _pert_rows(self, pert_list: list[list[str]]) -> np.ndarray:
        rows = np.full((len(pert_list), 2), -1, dtype=np.int64)
        index = self.pert_data.node_map_pert
        for i, genes in enumerate(pert_list):
            genes = [genes] if isinstance(genes, str) else list(genes)
            genes = [g for g in genes if g != CTRL]
            if len(genes) > 2:
                raise GearsInputError(f"perturbation {genes} has more than two genes")
            for slot, gene in enumerate(genes):
                if gene not in index:
                    raise GearsInputError(
                        f"gene {gene!r} is not in the perturbation graph (genes with GO "
                        "annotations among the measured and perturbed genes); it cannot be "
                        "predicted. Choose genes from GEARS.pert_list (check the spelling), or "
                        "retrain with data.unmapped_perts=keep to include genes without GO terms"
                    )
                rows[i, slot] = index[gene]
        return rows

    def predict(self, pert_list: list[list[str]], covariates: dict[str, str] | None = None):
        """Mean expression after each perturbation (dict keyed 'A' or 'A_B', as GEARS).

        The response is computed once per perturbation and added to the control mean (the exact
        mean of GEARS's per-control-cell predictions). With uncertainty, also returns a confidence
        per perturbation: exp(-mean log-variance), GEARS's definition. A network that reads
        covariates needs their values (e.g. covariates={"context": "K562"}); then the control
        mean is that context's when the data has contexts. A network that reads x: the mean
        over PREDICT_CONTROL_CELLS control cells of each one's prediction (predict_changes).
        """
        delta, logvar = self.predict_changes(pert_list, covariates)
        keys = ["_".join(g for g in ([p] if isinstance(p, str) else p)) for p in pert_list]
        ctrl = self._control_mean(covariates)
        pred = {k: predicted_expression(delta[i], ctrl) for i, k in enumerate(keys)}
        if logvar is not None:
            return pred, {k: float(np.exp(-logvar[i].mean())) for i, k in enumerate(keys)}
        return pred

    def predict_changes(
        self, pert_list: list[list[str]], covariates: dict[str, str] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The network's predicted change from control for each perturbation, [len, G] float64
        (and the log-variance [len, G] with the uncertainty head, else None); the one path of
        predict, GI_predict, predict.py and the run's cell-eval scores. covariates: a value per
        covariate the network reads, the same for every perturbation. A network that reads x
        is run on PREDICT_CONTROL_CELLS control cells (a seeded sample) per perturbation: the
        change is the mean of their predictions minus their mean."""
        if self.model is None:
            raise GearsInputError("no model: call model_initialize()+train() or load_pretrained()")
        net, rows = self.prediction_net(), self._pert_rows(pert_list)
        codes = self._covariate_codes(declared_covariates(net), covariates, len(rows))
        runner = getattr(self.evaluator, "forward_runner", None)  # (train.cuda_graphs)
        if not reads_x(net):
            return predict_deltas(net, rows, covariates=codes, runner=runner)
        x = self._prediction_controls(covariates)  # [n, G]
        n = len(x)
        repeat = {k: np.repeat(v, n) for k, v in codes.items()}
        cells = np.repeat(rows, n, axis=0)
        x = np.tile(x, (len(rows), 1))
        change, logvar = predict_deltas(net, cells, covariates=repeat, x=x, runner=runner)
        mean = lambda a: None if a is None else a.reshape(len(rows), n, -1).mean(1)  # noqa: E731
        return mean(change), mean(logvar)

    def _covariate_codes(self, names, values: dict[str, str] | None, n: int) -> dict:
        """Codes [n] of the given covariate values (each the same for every row)."""
        if not names:
            return {}
        values = values or {}
        missing = [name for name in names if name not in values]
        if missing:
            raise GearsInputError(
                f"this network reads covariates {list(names)}: give a value for {missing} "
                f"(e.g. covariates={{{missing[0]!r}: ...}}; the model knows "
                f"{self.config['covariates'][missing[0]][:10]})"
            )
        cats = self.config["covariates"]
        return {name: np.repeat(encode([values[name]], cats[name], name), n) for name in names}

    def _control_mean(self, covariates: dict[str, str] | None) -> np.ndarray:
        """The control mean a predicted change is added to: the context's when the data has
        contexts and a context is given, else all control cells'."""
        contexts = getattr(self.pert_data, "contexts", [])
        context = (covariates or {}).get(CONTEXT)
        if context is not None and context in contexts:
            return self.pert_data.context_ctrl_means[contexts.index(context)]
        return self.ctrl_expression

    def _prediction_controls(self, covariates: dict[str, str] | None) -> np.ndarray:
        """The control cells a network that reads x predicts from -> [n, G] float32: a seeded
        sample of PREDICT_CONTROL_CELLS of the data's control cells (of the given context, when
        the data has contexts)."""
        pd_ = self.pert_data
        if not hasattr(pd_, "ctrl_rows"):
            raise GearsInputError(
                "this network reads the control cell x: predict needs control cells; load the "
                "model with its PertData (GEARS(pert_data).load_pretrained(path))"
            )
        rows = pd_.ctrl_rows
        context = (covariates or {}).get(CONTEXT)
        if context is not None and context in getattr(pd_, "contexts", []):
            rows = rows[pd_.cell_context[rows] == pd_.contexts.index(context)]
        rows = control_sample_rows(rows, PREDICT_CONTROL_CELLS, seed=0)
        return to_host(pd_.expr.rows(rows)).numpy()

    def GI_predict(
        self,
        combo: list[str],
        GI_genes_file: str | None = None,
        covariates: dict[str, str] | None = None,
    ) -> dict:
        """Genetic-interaction scores of a double from predicted changes versus control, on the
        genes of GI_genes_file (a text file of one gene a line, or a .npy of strings) if given,
        else on every gene."""
        from gears.metrics import gi_params

        if len(combo) != 2:
            raise GearsInputError(f"GI_predict needs two genes, got {combo}")
        wanted = read_gene_file(GI_genes_file) if GI_genes_file is not None else None
        pred = self.predict([[combo[0]], [combo[1]], list(combo)], covariates)
        pred = pred[0] if isinstance(pred, tuple) else pred
        genes = np.arange(len(self.gene_list))
        if wanted is not None:
            genes = np.array([i for i, g in enumerate(self.gene_list) if g in wanted])
            if genes.size == 0:
                raise GearsInputError(
                    f"GI_genes_file {GI_genes_file}: none of its {len(wanted)} gene(s) is a "
                    f"gene of this model (e.g. {sorted(wanted)[:5]}); list genes the model "
                    f"measures (e.g. {list(self.gene_list[:5])}), or pass GI_genes_file=None"
                )
        ctrl = self._control_mean(covariates)
        first, second, double = (
            pred[k][genes] - ctrl[genes] for k in (combo[0], combo[1], f"{combo[0]}_{combo[1]}")
        )
        return gi_params(first, second, double)

    def test_units(self) -> list[tuple[str, dict[str, str]]]:
        """The scored units of the test set: (condition, {covariate: value}) in the
        evaluator's order ({} for a network that reads no covariate)."""
        view = self.evaluator.set_view("test")
        cats = self.config["covariates"]
        return [
            (cond, {n: cats[n][int(c[i])] for n, c in view["covariates"].items()})
            for i, cond in enumerate(view["conditions"])
        ]

    def plot_perturbation(
        self,
        query: str,
        save_file: str | Path | None = None,
        covariates: dict[str, str] | None = None,
        *,
        baselines: dict | None = None,
        title: str = "",
    ):
        """GEARS's plot: true per-cell changes on the top-20 DE genes with the prediction
        (for a network that reads covariates, the prediction for `covariates`' values), and
        beside it train_mean and, for a double, additive (baselines: name -> [genes] mean
        profile; None: formed from the split, gears.plotting.split_baselines). title: a second
        title line (gears.plotting.run_title)."""
        from gears.plotting import plot_perturbation, split_baselines

        cond = canonical_condition(query)
        pred = self.predict([condition_genes(cond)], covariates)
        pred = pred[0] if isinstance(pred, tuple) else pred
        if baselines is None:
            baselines = split_baselines(self.pert_data, cond)
        return plot_perturbation(
            self.pert_data,
            cond,
            next(iter(pred.values())),
            save_file,
            baselines=baselines,
            title=title,
        )

    def evaluate(self, set_name: str = "test", control_mean: str = "all") -> dict:
        """GEARS's metrics on a split set (Evaluator.full), predicted means formed as
        control_mean says (config.CHOICES['eval.control_mean'])."""
        if self.model is None:
            raise GearsInputError("no model: call model_initialize()+train() or load_pretrained()")
        self.evaluator.control_mean = control_mean
        return self.evaluator.full(set_name, net=self.prediction_net())

    # ---------------------------------------------------------------------------- save / load
    def save_model(self, path: str | Path) -> None:
        """A folder with config.json and model.pt (weights without any DDP `module.` prefix,
        plus the graphs and gene lists, so loading needs no graph rebuild), and for predict.py
        control_cells.h5ad and prediction.json (gears.predict.write_prediction_inputs). A fork's
        network file (model.impl=path/to/file.py:Class) is copied in with the modules beside it
        that it imports (gears.model.fork_files), and loads from there (with trust_code)."""
        if not self.env.is_main:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = dict(self.config, gene_names=self.gene_list, pert_names=self.pert_list)
        text = json.dumps(meta, indent=1)
        ckpt.atomic_write(path / CONFIG_FILE, lambda tmp: tmp.write_text(text))
        state = {
            "format": ckpt.FORMAT_VERSION,
            "meta": self._checkpoint_meta(),
            "state_dict": self.model.state_dict(),
            "graphs": {k: (to_host(v[0]), to_host(v[1])) for k, v in self.graphs.items()},
            "ctrl_expression": torch.as_tensor(np.asarray(self.ctrl_expression)),
        }
        ckpt.atomic_save(state, path / MODEL_FILE)
        fork = spec_file(self.model_cfg.impl)
        if fork is not None:  # the fork's code beside its weights (network_class reads it)
            source = Path(inspect.getsourcefile(type(self.model)))
            for file in fork_files(source):
                text = file.read_text()
                name = fork.name if file == source else file.name
                ckpt.atomic_write(path / name, lambda tmp, text=text: tmp.write_text(text))
        if hasattr(self.pert_data, "ctrl_rows"):  # a PertData, not a folder's vocabulary
            # Control cells and the input's spelling, so predict.py needs no dataset.
            write_prediction_inputs(self.pert_data, path, seed=self.seed)

    def _checkpoint_meta(self) -> dict:
        """The data vocabulary hash and model size a saved model.pt must match (config.json
        and model.pt from different runs are refused by name, not by a tensor shape error)."""
        vocab = ckpt.vocab_hash(self.gene_list, self.pert_list)
        return {"vocab_hash": vocab, **self.model_cfg.shape_fields()}

    @classmethod
    def from_cell_gears(
        cls,
        path: str | Path,
        adata,
        gene2go,
        gene_set=None,
        device: str = "cpu",
        check_go_graph: bool = True,
        cell_gears_predict: bool = True,
    ) -> GEARS:
        """A GEARS ready to predict from a model folder saved by cell-gears 0.1.2 and the data
        it was trained on, without this project's PertData: adata (AnnData or .h5ad path, e.g.
        its perturb_processed.h5ad), gene2go (its gene2go_all.pkl) and, for cell-gears's
        default perturbation graph, gene_set (its essential_all_data_pert_genes.pkl) give the
        gene and perturbation order as cell-gears builds it (gears/cell_gears.py,
        docs/cell_gears_models.md). Predictions add the mean of all the data's control cells."""
        from gears import cell_gears

        vocab = cell_gears.vocabulary_of_data(adata, gene2go, gene_set)
        model = cls(vocab, device=device)
        return model.load_pretrained(path, check_go_graph, cell_gears_predict)

    def load_pretrained(
        self,
        path: str | Path,
        check_go_graph: bool = True,
        cell_gears_predict: bool = True,
        trust_code: bool = False,
    ) -> GEARS:
        """Load a model folder written by save_model, or by cell-gears's save_model (config.pkl
        + model.pt; gears/cell_gears.py, docs/cell_gears_models.md). A cell-gears model's
        vocabulary must be this PertData's: its sizes are checked, and with check_go_graph its
        perturbation order against the model's GO graph. cell_gears_predict: predict as
        cell-gears's predict() does (True, same numbers) or with this project's network, which
        applies the co-expression graph to every cell (False). trust_code: a folder whose
        config.json names a fork's class runs the copy of its file kept in the folder only when
        True (read the file first; like transformers' trust_remote_code); without it that is an
        error naming the file, and nothing of the folder runs (gears.model.folder_code)."""
        from gears import cell_gears

        path = Path(path)
        if cell_gears.is_cell_gears_folder(path):
            return cell_gears.load_into(
                self, path, check_go=check_go_graph, cell_gears_predict=cell_gears_predict
            )
        if not (path / CONFIG_FILE).exists():
            raise GearsInputError(f"{path} has no {CONFIG_FILE}: not a saved GEARS model folder")
        meta = read_model_json(path, CONFIG_FILE)
        for key in ("gene_names", "pert_names"):
            names = meta.get(key)
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise GearsInputError(
                    f"{path / CONFIG_FILE} has no list of names under {key!r}: it was edited or "
                    "damaged; restore it from the run folder, or save the model again"
                )
        if meta["gene_names"] != self.gene_list:
            raise GearsInputError(
                f"the model at {path} was trained on {len(meta['gene_names'])} genes that differ "
                f"from this PertData's {len(self.gene_list)} genes "
                f"({_vocab_difference(meta['gene_names'], self.gene_list)}); load it with the "
                "PertData (dataset, data.subset) it was trained on"
            )
        if meta["pert_names"] != self.pert_list:
            raise GearsInputError(
                f"the model at {path} has a different perturbation vocabulary from this "
                f"PertData ({_vocab_difference(meta['pert_names'], self.pert_list)}); use the "
                "dataset, GO source (data.gene2go) and data.unmapped_perts it was trained with"
            )
        state = ckpt.load(path / MODEL_FILE, map_location="cpu")
        self.config = {k: v for k, v in meta.items() if k not in ("gene_names", "pert_names")}
        self.model_cfg = ModelConfig.from_dict(self.config)
        ckpt.check_compatible(state, path / MODEL_FILE, self._checkpoint_meta())
        (go_ei, go_w), (co_ei, co_w) = state["graphs"]["go"], state["graphs"]["coexpress"]
        self.model_folder, self.trust_code = path, trust_code
        self._build(go_ei, go_w, co_ei, co_w)
        weights = {k.removeprefix("module."): v for k, v in state["state_dict"].items()}
        self.model.load_state_dict(weights)
        self.best_model = self.model
        return self


def read_gene_file(path: str | Path) -> set[str]:
    """The gene names of GI_predict's gene file: a .npy of strings (read without unpickling:
    an object array is refused, since loading it could run code), or a text file of one name
    a line."""
    path = Path(path)
    if not path.is_file():
        raise GearsInputError(f"GI_genes_file {path} does not exist")
    if path.read_bytes()[:6] == b"\x93NUMPY":
        try:
            names = np.load(path, allow_pickle=False)
        except ValueError as e:
            if "pickle" not in str(e).lower():
                raise GearsInputError(f"GI_genes_file {path} is unreadable ({e})") from None
            raise GearsInputError(
                f"GI_genes_file {path} holds an object array, which only unpickling reads (and "
                "unpickling can run code): save the names as strings, "
                "np.save(path, np.array(names, dtype=str)), or as text, one gene a line"
            ) from None
        if names.dtype.kind not in "US":
            raise GearsInputError(
                f"GI_genes_file {path} holds {names.dtype} values, not gene names: save them as "
                "strings (np.array(names, dtype=str)) or as text, one gene a line"
            )
        return {str(n) for n in names.ravel()}
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise GearsInputError(
            f"GI_genes_file {path} is neither a .npy of strings nor text (one gene a line)"
        ) from None
    return {line.strip() for line in lines if line.strip()}


def _vocab_difference(saved: list[str], current: list[str]) -> str:
    """A short description of how two name lists differ, naming a few names."""
    saved_set, current_set = set(saved), set(current)
    only_saved = [g for g in saved if g not in current_set]
    only_now = [g for g in current if g not in saved_set]
    if not only_saved and not only_now:
        return "same names in a different order"
    return f"only in the model: {only_saved[:5]}, only in this data: {only_now[:5]}"
