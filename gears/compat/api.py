"""The GEARS facade of `cell-gears`: model_initialize, train, predict, GI_predict, save/load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gears.compat import cell_gears
from gears.config import DataConfig, DistributedConfig, ModelConfig, TrainConfig
from gears.errors import GearsInputError
from gears.eval.predictor import (
    PREDICT_CONTROL_CELLS,  # noqa: F401 (re-exported: the control cells predict() reads)
    Predictor,
)
from gears.train import checkpoint as ckpt
from gears.train.build import (
    LOADER_KEYS,  # noqa: F401 (re-exported: the loader settings train() compares)
    BuiltNetwork,
    build_network,
    new_network,
    train_network,
)
from gears.train.distributed import DistEnv, choose_device
from gears.train.engine import Trainer
from gears.train.evaluate import Evaluator
from gears.train.metrics import gi_params
from gears.train.saved_model import (
    CONFIG_FILE,
    MODEL_FILE,
    checkpoint_meta,
    read_model_json,
    write_model_folder,
)


class GEARS:
    """Train and query a GEARS model on a PertData (after `prepare_split`): cell-gears's API over
    the pieces the run uses too (gears.train.build's network and Trainer, gears.eval.predictor's
    predictions, gears.train.saved_model's saved folder)."""

    def __init__(
        self,
        pert_data,
        device: str = "auto",
        weight_bias_track: bool = False,
        proj_name: str = "GEARS",
        exp_name: str = "GEARS",
        env: DistEnv | None = None,
        seed: int = 1,
    ):
        self.pert_data = pert_data
        self.env = env or DistEnv(device=choose_device(device))
        self.device = self.env.device
        self.wandb = None
        if weight_bias_track:
            import wandb  # here: an optional package, imported when asked for

            self.wandb = wandb.init(project=proj_name, name=exp_name)
        self.seed = seed
        self.config: dict | None = None  # config.json: model_cfg and the graph settings
        self.model_cfg: ModelConfig | None = None
        self.model: torch.nn.Module | None = None  # the network model.impl names
        self.model_folder: Path | None = None  # the folder load_pretrained read it from
        self.trust_code = False  # whether that folder's own code (a fork's file) may run
        # A model loaded from cell-gears: its predict() protocol around self.model (predictions
        # equal cell-gears's); None otherwise (gears/compat/cell_gears.py CellGearsPrediction).
        self.cell_gears_net: torch.nn.Module | None = None
        self.trainer: Trainer | None = None
        # The one Evaluator of this model (validation in training, evaluate), built with the
        # network.
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
        self.model_folder, self.trust_code = None, False
        self._use(new_network(self.pert_data, model_cfg, graph_cfg, self.env, graphs))
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
        """The network model.impl names (self.model_cfg), its covariates' categories
        (self.config's, else this data's), and the model's one Evaluator (gears.train.build)."""
        built = build_network(
            self.pert_data,
            self.model_cfg,
            self.config,
            go_ei,
            go_w,
            co_ei,
            co_w,
            self.env,
            self.model_folder,
            self.trust_code,
        )
        self._use(built)

    def _use(self, built: BuiltNetwork) -> None:
        self.cell_gears_net = None
        self.model, self.model_cfg, self.config = built.network, built.model_cfg, built.config
        self.graphs, self.evaluator = built.graphs, built.evaluator

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
        **train_kwargs,
    ):
        """Train with the shared engine (gears.train.build.train_network); keeps the model chosen by
        train_cfg.select (the final one by default; `val_mse_de` is GEARS's best_model).
        control_mean: how validation forms predicted means
        (config.CHOICES['eval.control_mean'])."""
        if self.model is None:
            raise GearsInputError("call model_initialize() before train()")
        cfg = train_cfg or TrainConfig(
            epochs=epochs, lr=lr, weight_decay=weight_decay, **train_kwargs
        )
        explicit = set(LOADER_KEYS) if train_cfg is not None else set(train_kwargs)
        self.cell_gears_net = None  # trained here, the model is this project's network
        built = BuiltNetwork(self.model, self.model_cfg, self.config, self.graphs, self.evaluator)
        self.trainer, self.history = train_network(
            built,
            self.pert_data,
            self.env,
            cfg,
            explicit=explicit,
            dist_cfg=dist_cfg,
            wandb_run=self.wandb,
            seed=self.seed,
            control_mean=control_mean,
            resume=resume,
            progress=progress,
        )
        self.best_model = self.model
        return self.history

    @property
    def best_epoch(self) -> int:
        """The epoch (0-based) whose weights training kept (train.select), -1 before training."""
        return self.trainer.best_epoch if self.trainer is not None else -1

    # -------------------------------------------------------------------------------- predict
    def predictor(self) -> Predictor:
        """This model's predictions by gene names (gears.eval.predictor): from prediction_net()."""
        if self.model is None:
            raise GearsInputError("no model: call model_initialize()+train() or load_pretrained()")
        # A network set by hand (model.model = net) has no config.json record: no covariates.
        categories = (self.config or {}).get("covariates", {})
        net = self.prediction_net()
        return Predictor(self.pert_data, net, categories, self.evaluator, self.ctrl_expression)

    def predict(self, pert_list: list[list[str]], covariates: dict[str, str] | None = None):
        """Mean expression after each perturbation (dict keyed 'A' or 'A_B', as GEARS).

        The response is computed once per perturbation and added to the control mean (the exact
        mean of GEARS's per-control-cell predictions). With uncertainty, also returns a confidence
        per perturbation: exp(-mean log-variance), GEARS's definition. A network that reads
        covariates needs their values (e.g. covariates={"context": "K562"}); then the control
        mean is that context's when the data has contexts. A network that reads x: the mean
        over PREDICT_CONTROL_CELLS control cells of each one's prediction (predict_changes).
        """
        return self.predictor().predict(pert_list, covariates)

    def predict_changes(
        self, pert_list: list[list[str]], covariates: dict[str, str] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The network's predicted change from control for each perturbation, [len, G] float64
        (and the log-variance [len, G] with the uncertainty head, else None); the one path of
        predict, GI_predict, predict.py and the run's cell-eval scores. covariates: a value per
        covariate the network reads, the same for every perturbation. A network that reads x
        is run on PREDICT_CONTROL_CELLS control cells (a seeded sample) per perturbation: the
        change is the mean of their predictions minus their mean."""
        return self.predictor().predict_changes(pert_list, covariates)

    def GI_predict(
        self,
        combo: list[str],
        GI_genes_file: str | None = None,
        covariates: dict[str, str] | None = None,
    ) -> dict:
        """Genetic-interaction scores of a double from predicted changes versus control, on the
        genes of GI_genes_file (a text file of one gene a line, or a .npy of strings) if given,
        else on every gene."""
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
        ctrl = self.predictor().control_mean(covariates)
        first, second, double = (
            pred[k][genes] - ctrl[genes] for k in (combo[0], combo[1], f"{combo[0]}_{combo[1]}")
        )
        return gi_params(first, second, double)

    def test_units(self) -> list[tuple[str, dict[str, str]]]:
        """The scored units of the test set: (condition, {covariate: value}) in the
        evaluator's order ({} for a network that reads no covariate)."""
        return self.predictor().test_units()

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
        profile; None: formed from the split, gears.eval.plots.split_baselines). title: a second
        title line (gears.eval.plots.run_title)."""
        return self.predictor().plot_perturbation(
            query, save_file, covariates, baselines=baselines, title=title
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
        control_cells.h5ad and prediction.json (gears.train.saved_model.write_model_folder). A
        fork's network file (model.impl=path/to/file.py:Class) is copied in with the modules
        beside it that it imports (gears.model.fork_files), and loads from there (with
        trust_code)."""
        if not self.env.is_main:
            return
        write_model_folder(
            path, self.model, self.model_cfg, self.config, self.graphs, self.pert_data, self.seed
        )

    def _checkpoint_meta(self) -> dict:
        """The data vocabulary hash and model size a saved model.pt must match."""
        return checkpoint_meta(self.gene_list, self.pert_list, self.model_cfg)

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
        gene and perturbation order as cell-gears builds it (gears/compat/cell_gears.py,
        docs/cell_gears_models.md). Predictions add the mean of all the data's control cells."""
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
        + model.pt; gears/compat/cell_gears.py, docs/cell_gears_models.md). A cell-gears model's
        vocabulary must be this PertData's: its sizes are checked, and with check_go_graph its
        perturbation order against the model's GO graph. cell_gears_predict: predict as
        cell-gears's predict() does (True, same numbers) or with this project's network, which
        applies the co-expression graph to every cell (False). trust_code: a folder whose
        config.json names a fork's class runs the copy of its file kept in the folder only when
        True (read the file first; like transformers' trust_remote_code); without it that is an
        error naming the file, and nothing of the folder runs (gears.model.folder_code)."""
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
