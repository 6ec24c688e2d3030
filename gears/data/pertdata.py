"""PertData: the cell-gears handle over a processed Perturb-seq screen. Processing is a pipeline
of plain functions (gears.data.pipeline: read -> validate -> normalise -> DE -> store); PertData
holds its result and serves splits, graphs, contexts and loaders over it."""

from __future__ import annotations

import re
import time
from pathlib import Path

import anndata as ad
import numpy as np

from gears.choices import CHOICES
from gears.data import de as de_mod
from gears.data import graphs, splits
from gears.data.conditions import CTRL
from gears.data.covariates import categories_of, context_ctrl_means, encode, obs_values
from gears.data.de import N_DE, DEIndex
from gears.data.loaders import EpochLoader, ExampleSet, eval_loader, train_loader
from gears.data.pipeline import (
    Processed,
    ReadOptions,
    StoreSettings,
    load_file,
    load_synthetic,
    process_adata,
    process_context,
    process_file,
)
from gears.data.read import (
    AUTO_STORE_BYTES,
    PROCESSED_NAME,
    source_record,
)
from gears.data.vocabulary import (
    GeneSources,
    Vocabulary,
    cond_pert_index,
    resolve_unmapped_perts,
)
from gears.errors import GearsInputError
from gears.io import atomic_write, write_h5ad


class PertData:
    """A Perturb-seq screen ready for GEARS: conditions, DE genes, splits, gene graphs, tensors.

    data_dir: where datasets are cached and processed files written.
    gene2go: path of a gene -> GO source (GEARS pickle, TSV, GAF, GMT); None = the dataset's
      default (the synthetic screen's own annotations, or GEARS's gene2go_all.pkl downloaded).
    gene_aliases: optional `alias<TAB>SYMBOL` table used for symbols missing from the GO source.
    unmapped_perts: what to do with conditions perturbing a gene that is neither measured nor in
      the GO source: "error" (default: stop, listing the genes), "drop" (GEARS: remove those
      conditions; `report["dropped_condition_cells"]` lists them with their cell counts) or
      "keep" (keep them, without GO edges). Measured genes without GO terms are dropped as GEARS
      does, except with "keep".
    keep_unmapped_perts: deprecated spelling of unmapped_perts="keep".
    mirror_url: base URL of a mirror of GEARS's public files (see gears.data.download); None
      reads the GEARS_MIRROR_URL environment variable, else Harvard Dataverse.
    """

    def __init__(
        self,
        data_dir: str | Path = "data",
        gene2go: str | Path | None = None,
        gene_aliases: str | Path | None = None,
        keep_unmapped_perts: bool = False,
        seed: int = 1,
        verbose: bool = True,
        store: str = "auto",
        store_dir: str | Path | None = None,
        chunk_cells: int = 20000,
        unmapped_perts: str | None = None,
        mirror_url: str | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.gene2go_user = gene2go  # as given; the synthetic screen brings its own otherwise
        self.gene2go_path = gene2go
        self.gene_aliases_path = gene_aliases
        self.unmapped_perts = resolve_unmapped_perts(unmapped_perts, keep_unmapped_perts)
        self.keep_unmapped_perts = self.unmapped_perts == "keep"
        self.mirror_url = mirror_url
        self.seed = seed
        self.verbose = verbose
        self.adata: ad.AnnData | None = None
        self.dataset_name: str | None = None
        self.split = None
        self.set2conditions: dict[str, list[str]] | None = None
        self.subgroup: dict | None = None
        self.dataloader: dict[str, EpochLoader] | None = None
        # The arguments the current loaders were built with (GEARS.train compares them with its
        # training config instead of silently training on loaders built for other settings).
        self.dataloader_settings: dict | None = None
        self.report: dict = {}
        self._graphs: dict = {}
        self.synthetic = None
        if store not in CHOICES["data.store"]:
            raise GearsInputError(
                f"data.store must be one of {CHOICES['data.store']}, got {store!r}"
            )
        self.store_mode = store  # auto | memory | mmap (see _wants_store)
        self.store_dir = store_dir
        self.chunk_cells = chunk_cells
        self.store = None  # the open gears.data.store.Store when the data came from one
        self._cond_means = None
        # The input's own spelling: its perturbation column, and per canonical condition the
        # first raw name seen (e.g. 'non-targeting', 'KLF1'); predictions are written with them.
        self.condition_key: str = "condition"
        self.condition_spelling: dict[str, str] = {}
        self.normalize_target_sum: float | None = None  # set by normalize='log1p'
        # Raw counts' totals per cell [cells] (normalize='log1p'): the depth that counts output
        # (gears/eval/counts.py) gives predicted cells.
        self.library_size: np.ndarray | None = None
        # Contexts (e.g. cell lines; data.context_key): set by set_context_key, which load
        # calls with its context_key.
        self.context_key: str | None = None
        self.contexts: list[str] = []  # the context names ([] without a context key)
        self.cell_context: np.ndarray | None = None  # [cells] code into contexts
        self.context_ctrl_means: np.ndarray | None = None  # [contexts, genes] float64
        self.context: str | None = None  # the one context a context_view holds
        # Each cell's context as read with the cells [cells] (str), and the column it came
        # from: set_context_key codes these (a memory-mapped store keeps no other obs column).
        self._context_labels: tuple[str, np.ndarray] | None = None
        self._source: dict | None = None  # how a file was read (context views re-read it)
        self._unmatched_genes: str | None = None  # see refuse_unmatched_genes

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def _sources(self) -> GeneSources:
        """The GO source, alias table and unmapped policy the vocabulary is resolved with."""
        return GeneSources(
            self.gene2go_path,
            self.gene_aliases_path,
            self.unmapped_perts,
            self.data_dir,
            self.mirror_url,
        )

    # ----------------------------------------------------------------------------------- loading
    def load(
        self,
        data_name: str | None = None,
        data_path: str | Path | None = None,
        synthetic_params: dict | None = None,
        subset: dict | None = None,
        condition_key: str | None = None,
        control_names: tuple[str, ...] = (),
        normalize: str = "none",
        context_key: str | None = None,
        target_sum: float | None = None,
        pool_contexts: bool | None = None,
    ) -> PertData:
        """Load a named dataset (`synthetic`, `norman`, `adamson`, `dixit`,
        `replogle_k562_essential`, `replogle_rpe1_essential`) or a processed/raw `.h5ad` path
        (a file, or a folder holding perturb_processed.h5ad).

        subset: keep only cells whose obs columns hold the given value(s), e.g.
        {"dataset": "norman19"} or {"cell_type": ["K562", "RPE1"]}.
        condition_key, control_names, normalize, context_key, target_sum: as in
        new_data_process (files only).
        pool_contexts: what to do, without a context_key, with a file whose kept cells span
        several contexts (an obs column naming cell lines or types; gears.data.pooling): False
        refuses naming the column (what train_single.py does), True pools them, None (the
        default here) pools them and says so (set_context_key may follow).
        """
        self.gene2go_path = self.gene2go_user
        sources, settings = self._sources(), self._store_settings()
        if data_name == "synthetic":
            processed, self.synthetic, self.gene2go_path = load_synthetic(
                dict(synthetic_params or {}), context_key, sources, self._log
            )
        else:
            opts = ReadOptions(
                condition_key, "+", tuple(control_names), normalize, context_key, target_sum
            )
            processed, self._source = load_file(
                data_name,
                data_path,
                opts,
                sources,
                settings,
                subset=subset,
                pool_contexts=pool_contexts,
                log=self._log,
            )
        self._adopt(processed)
        self._say_processed()
        return self

    def new_data_process(
        self,
        dataset_name: str,
        adata: ad.AnnData,
        *,
        condition_key: str | None = None,
        sep: str = "+",
        control_names: tuple[str, ...] = (),
        skip_calc_de: bool = False,
        write: bool = True,
        normalize: str = "none",
        copy_x: bool = True,
        context_key: str | None = None,
        target_sum: float | None = None,
    ) -> PertData:
        """Validate, canonicalise condition names, compute DE genes, write the processed h5ad.

        Accepts `ctrl`/`control`/`non-targeting`, `A`, `A+ctrl`, `ctrl+A`, `A+B` (separator `sep`).
        condition_key: the obs column naming each cell's perturbation; None = the first of
        `condition`, `perturbation`, `target_gene`, `gene`, `guide_target` present (printed).
        normalize: `none` (X is already log-normalised) or `log1p` (X holds raw counts: scale
        each cell to the median total count, then log1p, as cell-eval and the Virtual Cell
        Challenge do; the caller's AnnData is left unchanged unless copy_x=False, which saves a
        copy of X when the caller hands the AnnData over, as `load` does). target_sum: scale
        each cell to this total instead of the median (a context view keeps the whole data's).
        The raw totals are kept as `library_size`.
        context_key: the obs column naming each cell's context (e.g. its cell line): `contexts`
        and `context_view` then serve one context at a time.
        DE results go to `.uns` under the keys in gears.data.de.DE_KEYS, keyed by condition.
        """
        opts = ReadOptions(
            condition_key, sep, tuple(control_names), normalize, context_key, target_sum
        )
        processed = process_adata(
            dataset_name,
            adata,
            opts,
            self._sources(),
            skip_calc_de=skip_calc_de,
            copy_x=copy_x,
            log=self._log,
        )
        self._adopt(processed)
        if write:
            out = self.data_dir / dataset_name / PROCESSED_NAME
            # temp + fsync + rename: never torn
            atomic_write(out, lambda tmp: write_h5ad(processed.adata, tmp))
            self._log(f"wrote {out}")
        self._say_processed()
        return self

    def _say_processed(self) -> None:
        """The line that closes processing: cells, genes, conditions and seconds taken."""
        seconds = time.perf_counter() - self._started
        if self.store is not None:
            self._log(
                f"{self.dataset_name}: {self.adata.n_obs} cells x {self.n_genes} genes, "
                f"{len(self.conditions)} conditions from the {self.store.meta['layout']} "
                f"store in {seconds:.1f}s"
            )
        else:
            self._log(
                f"processed {self.dataset_name}: {self.adata.n_obs} cells x "
                f"{self.adata.n_vars} genes, {len(self.conditions)} conditions in {seconds:.1f}s"
            )

    def _adopt(self, p: Processed) -> None:
        """Hold a pipeline's result: its cells, tables and vocabulary become PertData's
        attributes (cell-gears's names); splits, loaders and graphs start afresh."""
        self.dataset_name, self._started = p.dataset_name, p.started
        self.store, self._cond_means = p.store, p.cond_means
        self.report = p.report
        self.condition_key, self.condition_spelling = p.condition_key, p.condition_spelling
        self.normalize_target_sum, self.library_size = p.normalize_target_sum, p.library_size
        self._context_labels = p.context_labels
        self.gene_names = p.gene_names
        self.node_map = {g: i for i, g in enumerate(self.gene_names)}
        self.adata = p.adata
        self.conditions = p.conditions
        self.cond_to_id = {c: i for i, c in enumerate(self.conditions)}
        self.ctrl_id = self.cond_to_id[CTRL]
        self.cell_condition = p.cell_condition
        self.ctrl_rows = np.flatnonzero(self.cell_condition == self.ctrl_id)
        self.expr = p.expr
        self.n_genes = len(self.gene_names)
        self._set_vocabulary(p.vocab)
        self.de_ranked_idx = p.de.ranked
        self.de_idx = p.de.ranked[:, :N_DE].copy()
        self.non_dropout_de_idx = p.de.non_dropout
        self.non_zero_mask = p.de.non_zero_mask
        self.ctrl_mean = p.ctrl_mean
        self.split = self.set2conditions = self.subgroup = self.dataloader = None
        # Contexts belong to the cells just loaded: those read with them, else none.
        self.set_context_key(self._context_labels[0] if self._context_labels else None)

    def _set_vocabulary(self, vocab: Vocabulary) -> None:
        """The perturbation vocabulary and GO sets (and the rows they index)."""
        self.pert_names = vocab.pert_names
        self.node_map_pert = vocab.node_map_pert
        self.gene2go = vocab.gene2go
        self._unmatched_genes = vocab.unmatched
        self.cond_pert_index = cond_pert_index(self.conditions, self.node_map_pert)
        self._graphs = {}

    def _processed(self) -> Processed:
        """This data as a pipeline result (what a context view is cut from)."""
        return Processed(
            dataset_name=self.dataset_name,
            adata=self.adata,
            expr=self.expr,
            gene_names=self.gene_names,
            conditions=self.conditions,
            cell_condition=self.cell_condition,
            vocab=Vocabulary(self.pert_names, self.node_map_pert, self.gene2go, self.report),
            de=DEIndex(self.de_ranked_idx, self.non_dropout_de_idx, self.non_zero_mask),
            ctrl_mean=self.ctrl_mean,
            report=self.report,
            condition_key=self.condition_key,
            condition_spelling=self.condition_spelling,
            normalize_target_sum=self.normalize_target_sum,
            library_size=self.library_size,
            context_labels=self._context_labels,
            store=self.store,
            cond_means=self._cond_means,
        )

    def refuse_unmatched_genes(self) -> None:
        """Raise the error vocabulary resolution found: measured genes that match neither a
        perturbed gene nor the GO source (the data would train, wrongly, without a word)."""
        if self._unmatched_genes:
            raise GearsInputError(self._unmatched_genes)

    # ---------------------------------------------------------------------------------- splits
    def prepare_split(
        self,
        split: str = "simulation",
        seed: int = 1,
        train_gene_set_size: float = 0.75,
        combo_seen2_train_frac: float = 0.75,
        combo_single_split_test_set_fraction: float = 0.1,
        test_perts: list[str] | None = None,
        only_test_set_perts: bool = False,
        test_pert_genes: list[str] | None = None,
        split_dict_path: str | Path | None = None,
        val_size: float = 0.1,
    ) -> PertData:
        """Make one of the GEARS split types; cached under data_dir keyed by every parameter."""
        if self.adata is None:
            raise GearsInputError(
                "load data before prepare_split (PertData.load / new_data_process)"
            )
        params = dict(
            split_type=split,
            seed=seed,
            train_gene_set_size=train_gene_set_size,
            combo_seen2_train_frac=combo_seen2_train_frac,
            test_size=combo_single_split_test_set_fraction,
            val_size=val_size,
            test_perts=sorted(test_perts) if test_perts else None,
            test_pert_genes=sorted(test_pert_genes) if test_pert_genes else None,
            only_test_set_perts=only_test_set_perts,
        )
        if split == "custom":
            if split_dict_path is None:
                raise GearsInputError("split 'custom' needs split_dict_path (a JSON/pickle file)")
            params["split_dict"] = splits.load_split_dict(split_dict_path, self.conditions)
        folder = self.data_dir / (self.dataset_name or "data") / "splits"
        result = splits.cached_split(self.conditions, folder, **params)
        self.split = result
        self.seed = seed
        self.set2conditions = {"train": result.train, "val": result.val, "test": result.test}
        self.subgroup = {f"{k}_subgroup": v for k, v in result.subgroups.items()}
        # The co-expression graph depends on the training cells.
        self._graphs = {k: v for k, v in self._graphs.items() if k[0] != "coexpress"}
        self._log(result.summary())
        return self

    def set_rows(self, set_name: str) -> tuple[np.ndarray, np.ndarray]:
        """Cell rows and condition ids of a split set ('train', 'val', 'test')."""
        if self.set2conditions is None:
            raise GearsInputError("call prepare_split before asking for split sets")
        ids = [self.cond_to_id[c] for c in self.set2conditions[set_name] if c in self.cond_to_id]
        rows = np.flatnonzero(np.isin(self.cell_condition, ids))
        return rows, self.cell_condition[rows]

    def example_set(
        self, set_name: str, seed: int | None = None, covariates: dict | None = None
    ) -> ExampleSet:
        """A split set's examples; each cell paired with a control cell of its own context
        (set_context_key), and with covariates (name -> a code per cell row) batches grouped by
        (condition, codes)."""
        rows, cond = self.set_rows(set_name)
        return ExampleSet(
            self.expr,
            rows,
            cond,
            self.ctrl_rows,
            self.ctrl_id,
            self.cond_pert_index,
            self.de_idx,
            seed=self.seed if seed is None else seed,
            context=self.cell_context,
            covariates=covariates,
        )

    # ------------------------------------------------------------------------------- contexts
    def set_context_key(self, context_key: str | None) -> PertData:
        """Name the obs column holding each cell's context (data.context_key, e.g. the cell
        line): `contexts` lists its values, `cell_context` codes each cell, every context's
        control mean is kept (`context_ctrl_means`), and every cell is paired with a control
        cell of its own context. None: one context (all control cells). Call after loading."""
        self.context_key, self.contexts = context_key, []
        self.cell_context = self.context_ctrl_means = None
        self.dataloader = None  # loaders built before pair across contexts
        if context_key is None:
            return self
        labels = self._context_labels
        if labels is not None and labels[0] == context_key:
            values = labels[1]  # read with the cells (a store keeps no other obs column)
        else:
            values = obs_values(self.adata.obs, context_key)
        self.contexts = categories_of(values)
        self.cell_context = encode(values, self.contexts, "context")
        self.context_ctrl_means = context_ctrl_means(
            self.expr.numpy(), self.cell_context, self.ctrl_rows, self.contexts, context_key
        )
        return self

    # --------------------------------------------------------------------------------- loaders
    def get_dataloader(
        self, batch_size: int, test_batch_size: int | None = None, **kwargs
    ) -> dict[str, EpochLoader]:
        """train/val/test loaders (GEARS names: train_loader, val_loader, test_loader)."""
        return self.get_dataloader_distributed(batch_size, test_batch_size, 1, 0, **kwargs)

    def get_dataloader_distributed(
        self,
        batch_size: int,
        test_batch_size: int | None = None,
        world_size: int = 1,
        rank: int = 0,
        num_workers: int = 0,
        batching: str = "random",
        cells_per_group: int = 4,
        pin_memory: bool = False,
        block_size: int = 1024,
        device=None,
        covariates: dict[str, np.ndarray] | None = None,
    ) -> dict[str, EpochLoader]:
        """Training shards via a seeded DistributedSampler; evaluation sharded without padding.

        device: a CUDA device keeps a dense matrix that fits (ExpressionMatrix.place) on the
        GPU and gathers batches there; with num_workers > 0 batches are gathered on the host.
        covariates: name -> a code per cell row, carried by the batches (example_set).
        """
        if self.set2conditions is None:
            raise GearsInputError("call prepare_split before get_dataloader")
        if device is not None and self.expr.place(device, gather_on_device=num_workers == 0):
            pin_memory = False  # batches are born on the GPU: nothing to pin
        test_batch_size = test_batch_size or batch_size
        loaders = {}
        for name in ("train", "val", "test"):
            if not self.set2conditions.get(name):
                continue
            ds = self.example_set(name, covariates=covariates)
            if name == "train":
                loaders["train_loader"] = train_loader(
                    ds,
                    batch_size,
                    seed=self.seed,
                    world_size=world_size,
                    rank=rank,
                    batching=batching,
                    cells_per_group=cells_per_group,
                    num_workers=num_workers,
                    pin_memory=pin_memory,
                    block_size=block_size,
                )
            else:
                loaders[f"{name}_loader"] = eval_loader(
                    ds,
                    test_batch_size,
                    world_size=world_size,
                    rank=rank,
                    num_workers=num_workers,
                    pin_memory=pin_memory,
                )
        self.dataloader = loaders
        self.dataloader_settings = {
            "batch_size": batch_size,
            "test_batch_size": test_batch_size,
            "world_size": world_size,
            "rank": rank,
            "num_workers": num_workers,
            "batching": batching,
            "cells_per_group": cells_per_group,
            "block_size": block_size,
            "covariates": tuple(covariates or ()),
        }
        return loaders

    # ---------------------------------------------------------------------------------- graphs
    def go_graph(self, top_k: int = 20, threshold: float = 0.1):
        """GO Jaccard similarity graph over the perturbation vocabulary (`pert_names`)."""
        key = ("go", top_k, threshold)
        if key not in self._graphs:
            self._graphs[key] = graphs.go_graph(
                list(self.pert_names), self.gene2go, top_k, threshold
            )
        return self._graphs[key]

    def coexpress_graph(self, top_k: int = 20, threshold: float = 0.4):
        """Gene co-expression graph from control + training cells (needs a split)."""
        key = ("coexpress", top_k, threshold)
        if key not in self._graphs:
            rows, _ = self.set_rows("train")
            rows = np.union1d(rows, self.ctrl_rows)
            self._graphs[key] = self._stored_graph(
                ("coexpress", top_k, threshold, rows),
                lambda: graphs.coexpression_graph(
                    self.expr.numpy(), list(self.gene_names), top_k, threshold, rows=rows
                ),
            )
        return self._graphs[key]

    def _stored_graph(self, key: tuple, build):
        """A graph cached in the store directory (rank 0 builds it, the other ranks read it)."""
        if self.store is None:
            return build()
        return graphs.stored_graph(self.store.path, key, list(self.gene_names), build)

    # ------------------------------------------------------------------------------- summaries
    def condition_means(self, conditions: list[str] | None = None) -> np.ndarray:
        """Observed mean profile per condition. -> [len(conditions), genes] float64."""
        if self._cond_means is None:
            self._cond_means = de_mod.condition_means(
                self.expr.numpy(), self.cell_condition, len(self.conditions)
            )
        means = np.asarray(self._cond_means, dtype=np.float64)
        if conditions is None:
            return means
        return means[[self.cond_to_id[c] for c in conditions]]

    # ------------------------------------------------------------------------- context views
    def context_view(self, name: str) -> PertData:
        """One context's cells as a PertData of their own: its cells and control cells, its
        control mean and its DE genes (against its own control cells), the conditions it holds
        (each with at least 2 cells), with the genes, perturbation vocabulary (pert_names and
        their GO sets) and normalisation of the whole data, so that one model's perturbation
        rows index every view alike. Not split: call prepare_split on it. `view.context` names
        it. In memory a view copies its rows of the processed matrix; from a store it is
        processed into a store of its own (data.store), out of core like its parent."""
        if self.cell_context is None:
            raise GearsInputError(
                "this data has no contexts: set data.context_key (PertData.load(context_key=...)) "
                "to the obs column naming each cell's context"
            )
        if name not in self.contexts:
            raise GearsInputError(
                f"unknown context {name!r} of obs[{self.context_key!r}]; contexts: {self.contexts}"
            )
        view = PertData(
            self.data_dir,
            gene2go=self.gene2go_path,
            gene_aliases=self.gene_aliases_path,
            seed=self.seed,
            verbose=self.verbose,
            store=self.store_mode,
            store_dir=self.store_dir,
            chunk_cells=self.chunk_cells,
            unmapped_perts=self.unmapped_perts,
            mirror_url=self.mirror_url,
        )
        view.gene2go_user = self.gene2go_user
        parent = self._processed()
        dataset = f"{self.dataset_name}__{_safe_name(name)}"
        if self.store is not None:
            src = self._source
            subset = {**src["subset"], self.context_key: [name]}
            view.process_backed(
                dataset,
                src["path"],
                condition_key=self.condition_key,
                control_names=src["control_names"],
                subset=subset,
                normalize=src["normalize"],
                context_key=self.context_key,
                target_sum=self.normalize_target_sum,
            )
        else:
            view._adopt(
                process_context(
                    parent, self.context_key, self.cell_context, self.contexts, name, dataset
                )
            )
        view._set_vocabulary(parent.vocab)
        view.context = name
        view._source = self._source
        return view

    # ------------------------------------------------------------------- out-of-core and store
    def process_backed(
        self,
        dataset_name: str,
        path: str | Path,
        *,
        condition_key: str | None = None,
        sep: str = "+",
        control_names: tuple[str, ...] = (),
        subset: dict | None = None,
        normalize: str = "none",
        context_key: str | None = None,
        target_sum: float | None = None,
        pool_contexts: bool | None = None,
    ) -> PertData:
        """Process an .h5ad out of core into the shared store (or reuse it), then serve from it.

        The file is opened in anndata's backed mode and read in `chunk_cells` row chunks: never
        the whole matrix in memory. One pass validates values, sums and sums of squares per
        condition (means, dropout sets, scanpy's t-test DE ranking via de.de_from_stats) and
        writes the kept rows to the store. The store lives in `store_dir` (default
        <data_dir>/<dataset>/store) under a key over the input and every processing parameter,
        so a second process (another rank) with the same inputs memory-maps it instead.
        Raw counts are refused, or normalised with normalize='log1p' (to target_sum, else the
        median total; the totals are stored as library_size), as new_data_process does.
        context_key: as in new_data_process; each cell's context is stored with it.
        pool_contexts: as in load.
        """
        self._source = source_record(Path(path), subset, condition_key, control_names, normalize)
        opts = ReadOptions(
            condition_key, sep, tuple(control_names), normalize, context_key, target_sum
        )
        settings = self._store_settings()
        processed = process_file(
            dataset_name,
            Path(path),
            opts,
            self._sources(),
            subset=subset,
            pool_contexts=pool_contexts,
            store_dir=settings.store_dir,
            chunk_cells=settings.chunk_cells,
            log=self._log,
        )
        self.context_key = context_key
        self._adopt(processed)
        self._say_processed()
        return self

    def _store_settings(self) -> StoreSettings:
        return StoreSettings(self.store_mode, self.store_dir, self.chunk_cells, AUTO_STORE_BYTES)

    def __repr__(self) -> str:
        if self.adata is None:
            return f"PertData(data_dir={str(self.data_dir)!r}, no data loaded)"
        return (
            f"PertData({self.dataset_name}: {self.adata.n_obs} cells x {self.n_genes} genes, "
            f"{len(self.conditions)} conditions, {len(self.pert_names)} perturbable genes)"
        )


def _safe_name(name: str) -> str:
    """A context name as a file name part."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)) or "context"
