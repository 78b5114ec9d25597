"""The pydantic schema of the YAML config: one model per section, :class:`Config` for the whole run."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from trakcli.projectors.kinds import KRONECKER_OPTIONS  # noqa: F401  (re-exported)
from trakcli.projectors.registry import DEFAULT_KIND
from trakcli.strict import LocalPath, StrictModel
from trakcli.config.features import (  # noqa: F401  (the feature sections, re-exported here)
    UNKNOWN_KEYS, CurvatureConfig, ProjectorConfig, SecondMomentConfig, StoreConfig,
)
from trakcli.config.inputs import DataConfig, DatasetConfig, ModelConfig  # noqa: F401  (re-exported here)
from trakcli.config.recipe import OptimizeConfig

#: The built-in tasks by name (``trakcli.tasks.BUILTIN``; config does not import torch) and the labels
#: each reads: ``"classes"`` (class indices ``[n]``) or ``"tokens"`` (per-token labels of a causal LM).
BUILTIN_TASK_LABELS = {"classification": "classes", "text_classification": "classes", "language_modeling": "tokens"}
#: The built-in model output functions (``trakcli.tasks.TASKS``).
BUILTIN_TASKS = tuple(BUILTIN_TASK_LABELS)


def builtin_task_labels(task: Any) -> str | None:
    """The labels a built-in task reads (:data:`BUILTIN_TASK_LABELS`); None for a task of one's own."""
    return BUILTIN_TASK_LABELS.get(task) if isinstance(task, str) else None


#: Top-level keys that are not sections, and what the user writes instead.
NOT_SECTIONS = {
    "training": "the training recipe is the optimize: section: write training.KEY as optimize.KEY",
    "optimizer": "the optimizer is set in the optimize: section: write optimizer.name as optimize.optimizer and "
                 "optimizer.KEY (lr, momentum, weight_decay, projection, ...) as optimize.KEY",
}


def group_name(v: str, example: str) -> str:
    """``v`` if it names one group of the store, else ``ValueError`` naming ``example``."""
    if not v or "/" in v or "\\" in v or v in (".", "..") or v.startswith("__") or v != v.strip():
        raise ValueError("must name one group of the store: a non-empty name without '/' or '\\', not '.' or '..', "
                         f"not starting with '__' and without surrounding spaces, e.g. {example}")
    return v

class ScoreConfig(StrictModel):
    """Kernel and scoring options."""

    experiment: str = Field("default", description="Name of this set of targets in the store.")
    method: Literal["kernel", "unroll"] = Field(
        "kernel",
        description="kernel: the scores of the stored features (TRAK's kernel, or the curvature's influence). "
        "unroll: metagradients through the recorded training of each checkpoint, -d loss(target) / d w_i with "
        "w_i the weight of example i's loss in every step (MAGIC; needs checkpoints: <out_dir>/manifest.json "
        "of a trak optimize run with optimize.replay: true, and no trak featurize; docs/guides/unroll.md).",
    )
    lambda_reg: float | None = Field(
        None, ge=0, description="Absolute ridge added to each checkpoint's Φᵀ Φ. Unset: lambda_rel · trace(Φᵀ "
        "Φ)/n_train.",
    )
    lambda_rel: float = Field(
        1.0, gt=0, description="Ridge as a multiple of the mean squared train-feature norm trace(Φᵀ Φ)/n_train "
        "(independent of proj_dim), used when lambda_reg is unset.",
    )
    top_k: PositiveInt | None = Field(
        None, description="Per target, keep the K highest-scoring train rows (proponents) and the K lowest "
        "(opponents), from one streamed pass over the train features: [n_target, K] arrays in the store, memory "
        "independent of n_train. Unset: the full [n_target, n_train] score matrix.",
    )
    full: bool | None = Field(
        None, description="Also write the full [n_target, n_train] score matrix (trak eval lds needs it). Unset: only "
        "when top_k is unset.",
    )
    normalize: Literal["unit"] | None = Field(
        None, description="unit: cosine scores in the kernel's space, cos(A^½φ(t), A^½φ(z)) averaged over "
        "checkpoints, without Q (TrackStar; for retrieving source documents). Unset: TRAK's scores (for predicting "
        "counterfactual retraining).",
    )
    per_token: bool = Field(
        False, description="Language models: split each top document's score over the target's tokens and over the "
        "document's tokens (which completion tokens it explains, which of its tokens carry it); needs top_k. Stored "
        "beside the top-k; trak score --out answers.jsonl and trak report show them.",
    )
    rescore_multiplier: PositiveInt | None = Field(
        None, description="Two-stage top-k (store.dtype int8 or binary; or curvature kfac / ekfac with exact scores, "
        "whose candidates come from the stored features and are re-scored by exact influence), K' = "
        "rescore_multiplier · top_k: per target, the K' train rows with the highest (and lowest) scores from the "
        "compressed codes are re-scored exactly from the bfloat16 copy (FAISS's k_factor, sentence-transformers' "
        "rescore_multiplier). Larger: higher recall, slower. Unset: the default of the store's dtype: int8 2 "
        "(recall@100 1.0 measured at 10^6 rows), binary 16 (recall@100 only 0.35 / 0.10 there: prefer int8). Every "
        "run reports its measured recall.",
    )
    rerank: Literal["auto", "scan"] = Field(
        "auto",
        description="Two-stage top-k: how the candidates are re-ranked. scan: one pass reads each row's codes and "
        "float copy together, in order, and scores every candidate exactly as its block passes. auto: scan where "
        "it can start from a sampled floor (a store of more than about 3 · K' chunks); on a smaller store the "
        "plain streamed pass over the float copy, which is faster there (one info line says so).",
    )
    recall_queries: PositiveInt = Field(
        16, description="Two-stage top-k: targets (evenly spaced) whose exact top-k is also computed from the "
        "bfloat16 copy, to measure and report the recall of the two-stage top-k against it (recorded in the store).",
    )
    show_top: PositiveInt = Field(5, description="Proponents and opponents the summary table shows per target.")
    show_targets: int = Field(3, ge=0, description="How many targets the summary table shows.")

    @field_validator("experiment")
    @classmethod
    def _experiment_name(cls, v: str) -> str:
        return group_name(v, "score.experiment=test_set")

    @model_validator(mode="after")
    def _something_to_write(self) -> "ScoreConfig":
        if self.full is False and self.top_k is None:
            raise ValueError("score.full is false and score.top_k is unset: nothing to compute; set score.top_k "
                             "(e.g. score.top_k=100) or leave score.full unset")
        if self.per_token and self.top_k is None:
            raise ValueError("score.per_token is true and score.top_k is unset: the scores of each target's top "
                             "documents are split over tokens; set score.top_k (e.g. score.top_k=20)")
        return self


class SelectConfig(StrictModel):
    """``select:``: `trak select`, data selection for a target task (LESS: Xia et al. 2024, "LESS: Selecting
    Influential Data for Targeted Instruction Tuning").

    Every data.train row (the pool) gets one score against the data.target rows (a handful of examples of the
    task): per checkpoint the cosine (``normalize: unit``) of its features with each target's, summed over
    checkpoints, aggregated over the targets; the top rows are written to ``out`` in data.train's format.
    """

    fraction: float | None = Field(
        None, gt=0, le=1, description="Share of data.train to keep: round(fraction * n_train) rows (Python's round, "
        "at least 1). Unset together with count: 0.05 (LESS's 5%).",
    )
    count: PositiveInt | None = Field(None, description="Rows of data.train to keep (instead of fraction; at most "
                                      "n_train).")
    out: LocalPath | None = Field(
        None, description="The file the selected rows go to, in data.train's format: .jsonl lines (or .csv records) "
        "copied verbatim, .parquet / .arrow tables, .pt / .npz tensors under data.train's keys, in pool order. Their "
        "scores go beside it to <out stem>.scores.jsonl. Required by trak select.",
    )
    aggregate: Literal["max_mean", "mean", "sum"] = Field(
        "max_mean", description="How a row's scores against the targets become one: max_mean, the highest over the "
        "target groups (group_by) of the mean over the group's targets (LESS); mean or sum over all targets.",
    )
    group_by: str | None = Field(
        None, description="max_mean: the field (text data) or key (tensor file, [n_target]) of data.target whose "
        "values group the targets, e.g. one group per task; a row's score is its best group's. It groups the "
        "targets, not the pool, and does not by itself give every group rows: quota: equal does. Unset: all "
        "targets are one group.",
    )
    quota: Literal["equal"] | None = Field(
        None, description="With group_by. equal: every target group gets an equal share of the kept rows (k // "
        "n_groups each, one more for the first k % n_groups groups in order of appearance; at least one row per "
        "group, so k >= n_groups), the groups taking turns, each its highest-scoring row (mean over its targets) "
        "not yet taken. null: one ranking by each row's best group score (LESS), so a group whose targets match the "
        "pool more closely may take most or all of the rows.",
    )
    normalize: Literal["unit"] | None = Field(
        "unit", description="unit: cosines of the features (LESS). null: their inner products (longer or "
        "higher-loss rows then weigh more).",
    )
    experiment: str = Field(
        "select", description="Name of the target features in the store (targets/<experiment>); a rerun with the "
        "same targets reuses them.",
    )
    show: int = Field(5, ge=0, description="Top selected rows the summary shows, with their texts.")

    @field_validator("experiment")
    @classmethod
    def _experiment_name(cls, v: str) -> str:
        return group_name(v, "select.experiment=task_a")

    @model_validator(mode="after")
    def _one_size(self) -> "SelectConfig":
        if self.fraction is not None and self.count is not None:
            raise ValueError(f"select.fraction ({self.fraction}) and select.count ({self.count}) are both set: give "
                             "one, a share of data.train (fraction) or a number of rows (count)")
        if self.group_by is not None and self.aggregate != "max_mean":
            raise ValueError(f"select.group_by groups the targets of aggregate max_mean; aggregate {self.aggregate} "
                             "takes every target alike: unset group_by, or set aggregate: max_mean")
        if self.quota is not None and self.group_by is None:
            raise ValueError(f"select.quota: {self.quota} shares the kept rows among the target groups of "
                             "select.group_by, which is unset: set group_by (e.g. a task field), or unset quota")
        return self


class SweepConfig(StrictModel):
    """``eval.sweep``: the grid of `trak eval sweep` (one featurization per proj_dim)."""

    proj_dims: list[PositiveInt] = Field(
        default_factory=lambda: [64, 128, 256, 512, 1024, 2048], description="Projection dimensions to featurize."
    )
    n_checkpoints: list[PositiveInt] | None = Field(
        None, description="Ensemble sizes (the first k checkpoints); unset: 1, 2, 5, 10, ... up to all."
    )
    lambda_rel: list[float] = Field(
        default_factory=lambda: [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0],
        description="Ridges relative to trace(Φᵀ Φ)/n_train (see score.lambda_rel).",
    )
    lambda_reg: list[float] = Field(
        default_factory=list, description="Absolute ridges to add to the grid (see score.lambda_reg)."
    )
    dir: LocalPath | None = Field(
        None, description="Where the sweep's per-proj_dim stores go; unset: <store.path>.sweep/ beside the store."
    )

    @field_validator("lambda_rel", "lambda_reg")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        bad = [x for x in v if not x > 0]
        if bad:
            raise ValueError(f"every ridge must be > 0, got {bad}")
        return v


class QLDConfig(StrictModel):
    """``eval.qld``: `trak eval qld`, retraining without each query's top proponents (the query loss difference)."""

    queries: PositiveInt = Field(20, description="Targets taken as queries (a seeded random choice, eval.seed).")
    fraction: float = Field(
        0.01, gt=0, lt=1, description="Share of data.train left out per query: its top proponents, and as many "
        "random rows (round(fraction * n_train), at least 1).",
    )
    seeds: PositiveInt = Field(1, description="Training seeds per model (the three models of a query share each).")
    per_token: bool = Field(
        False, description="Leave out training tokens instead of rows: the round(fraction * n_tokens) train tokens "
        "with the highest per-token scores for the query are masked out of the loss while retraining, against as many "
        "random tokens (language models; needs the featurized and scored store).",
    )


class RecallConfig(StrictModel):
    """``eval.recall``: fact tracing (`trak eval recall`): do the top proponents hold each query's source?

    Every row of data.target names, in the field ``sources``, the 0-based rows of data.train that hold its fact; the
    ranking is the experiment's top-k proponents (``score.top_k``), or its full score matrix ranked.
    """

    sources: str = Field(
        "sources",
        description="Field of each data.target row listing its source documents: 0-based row indices of "
        "data.train (a JSON list of integers; in a .csv cell its JSON text, e.g. \"[3, 17]\").",
    )
    k: list[PositiveInt] | None = Field(
        None, description="The k of recall@k, each at most score.top_k. Unset: 1, 5, 10, 20, 50, 100 up to K, and K.",
    )

    @field_validator("k", mode="before")
    @classmethod
    def _one_k(cls, v: Any) -> Any:
        return [v] if isinstance(v, (int, str)) else v


class EvalConfig(StrictModel):
    """``eval:``: counterfactual retraining for the linear datamodeling score (`trak eval lds`)
    and fact tracing (`trak eval recall`).

    LDS (Park et al. 2023, "TRAK", Sec. 2.2; Ilyas et al. 2022, "Datamodels"):
    ``n_subsets`` models are trained with the config's training recipe on random ``subset_fraction`` subsets of
    data.train; per target, the Spearman correlation between ``mask @ scores[t]`` and the retrained models' outputs.
    """

    n_subsets: PositiveInt = Field(100, description="Models retrained on random subsets.")
    subset_fraction: float = Field(
        0.5, gt=0, lt=1, description="Share of data.train in each subset (exactly round(fraction * n_train) rows)."
    )
    seed: int = Field(
        0, ge=0, description="Seed of the subsets, of the retrained models' initializations and of the bootstrap "
        "resamples (lds and recall)."
    )
    bootstrap: PositiveInt = Field(
        1000, description="Bootstrap resamples of the targets for the 95% interval of the LDS (and of MRR and "
        "recall@k)."
    )
    retrain_seed: Literal["other", "same", "replay"] = Field(
        "other", description="Seed of each retrained model. other: model k gets 10**6 + 100003 * eval.seed + k, "
        "unlike any checkpoint's (the LDS of the question 'what if the data were different and the run "
        "retrained'). same: model k reuses the seed of checkpoint k mod optimize.n_models, optimize.seed + "
        "(k mod n_models): the attributed run's initialization and order generator, only the rows differ. "
        "replay: no new training: checkpoint k mod n_models's recorded training (optimize.replay) rerun with the "
        "rows outside subset k weighted 0 in their batches, same initialization, order and batches (the "
        "counterfactual score.method: unroll differentiates; MAGIC's same-seed LDS, Ilyas & Engstrom 2025). "
        "docs/guides/unroll.md measures all three."
    )
    sweep: SweepConfig = Field(
        default_factory=SweepConfig, description="The grid of `trak eval sweep` (one featurization per proj_dim)."
    )
    recall: RecallConfig = Field(
        default_factory=RecallConfig, description="`trak eval recall`: where each query's sources are, the k of recall@k."
    )
    qld: QLDConfig = Field(
        default_factory=QLDConfig, description="`trak eval qld`: queries, the share of rows left out, seeds."
    )
    bm25: bool = Field(
        True, description="On text data, report BM25 word-overlap scores (bm25s) beside the scores' LDS, QLD and "
        "recall: a result BM25 matches measures word overlap.",
    )


class Config(StrictModel):
    """A whole trakcli run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    checkpoints: str | list[str] = Field(
        description="A glob or a list of .pt / .safetensors state dicts (or, for an hf: model, Hugging Face "
        "model directories or Hub names hf:ORG/NAME[@REVISION][/FOLDER], or PEFT adapter folders "
        "(adapter_config.json; model.entrypoint is then the base model and features default to the adapter's "
        "parameters)); model_id = index in sorted order. Or the manifest.json `trak optimize` writes into its "
        "out_dir: its checkpoints in model_id order, checked against their recorded sha256."
    )
    data: DataConfig
    task: str = Field(
        "classification",
        description="Model output function. classification / text_classification: the margin "
        "logit_y - logsumexp_{j!=y} logit_j of the logits (of a tensor input / of a text's sequence logits); "
        "language_modeling (causal LMs): the sum over the target tokens (per-token labels != -100: every token "
        "of plain text, the completion, the assistant turns) of each next-token margin; "
        'or your own "path/to/file.py:fn" / "package.module:fn", fn(logits, batch) -> (f [n], Q [n]) where '
        'batch holds every tensor of the batch (input_ids, attention_mask, labels, ...) '
        '(docs/guides/own-models.md, "Custom model outputs").',
    )
    grad_wrt: list[str] | None = Field(
        None, description="fnmatch patterns of parameter names to differentiate (unset: all)."
    )
    gradient_method: Literal["auto", "hooks", "vmap"] = Field(
        "auto", description="Per-example gradients: hooks (layer hooks, one batched forward + backward), vmap "
        "(torch.func), auto (hooks where they cover the model, else vmap). Not in the store identity (same to rounding).",
    )
    projector: ProjectorConfig = Field(default_factory=ProjectorConfig)
    second_moment: SecondMomentConfig = Field(
        default_factory=SecondMomentConfig,
        description="Optimizer second-moment correction of the gradients (TrackStar): kind null, adafactor or adam.",
    )
    curvature: CurvatureConfig = Field(
        default_factory=CurvatureConfig, description="The preconditioner: kind gram (TRAK's kernel, the default), "
        "kfac or ekfac (Kronecker-factored Fisher per layer, fit per checkpoint).",
    )
    store: StoreConfig
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    select: SelectConfig = Field(
        default_factory=SelectConfig, description="`trak select`: the share of data.train to keep for the data.target "
        "task, how scores are aggregated, where the selected rows go.",
    )
    optimize: OptimizeConfig | None = Field(
        None, description="The training recipe of `trak optimize` (and of the retrained models of `trak eval`)."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available, else cpu.")
    num_threads: PositiveInt | None = Field(
        None, description="torch intra-op CPU threads (unset: torch's default, one per core)."
    )
    linalg_threads: PositiveInt | None = Field(None, description="torch CPU threads for the dense linear algebra "
                                               "of kernels and scores, not limited by num_threads (unset: one per core).")

    @model_validator(mode="before")
    @classmethod
    def _hf_defaults(cls, raw: Any) -> Any:
        """With ``model.entrypoint: hf:DIR``: text datasets default to DIR's tokenizer, and
        ``task: language_modeling`` to ``model.kwargs.model_class: causal_lm``."""
        if not isinstance(raw, dict):
            return raw
        model = raw.get("model")
        ep = model.get("entrypoint") if isinstance(model, dict) else None
        if not (isinstance(ep, str) and ep.startswith("hf:")):
            return raw
        raw = dict(raw)
        data = raw.get("data")
        if isinstance(data, dict):
            data = dict(data)
            for name in ("train", "target", "validation"):
                ds = data.get(name)
                if (isinstance(ds, dict) and ds.get("tokenizer") is None
                        and any(ds.get(k) is not None for k in ("text", "prompt", "completion", "messages", "input_ids"))):
                    data[name] = {**ds, "tokenizer": ep.removeprefix("hf:")}
            raw["data"] = data
        if builtin_task_labels(raw.get("task")) == "tokens":
            kwargs = model.get("kwargs") if isinstance(model.get("kwargs"), dict) else {}
            if "model_class" not in kwargs:
                raw["model"] = {**model, "kwargs": {**kwargs, "model_class": "causal_lm"}}
        return raw

    @model_validator(mode="after")
    def _second_moment_kind(self) -> "Config":
        """``adam`` scales entries of the whole per-example gradient, which a kind built from the model
        (kronecker) never forms."""
        if self.second_moment.kind == "adam" and self.projector.built_from_model:
            raise ValueError("second_moment.kind: adam scales each entry of the whole per-example gradient, which "
                             f"projector.kind {self.projector.kind} never forms; use second_moment.kind: adafactor "
                             "(factored per layer) or another projector kind")
        return self

    @model_validator(mode="after")
    def _rescore_needs_codes(self) -> "Config":
        if self.score.rescore_multiplier is None and self.score.rerank != "auto":
            if self.store.dtype not in ("int8", "binary") or self.score.top_k is None:
                raise ValueError(
                    f"score.rerank ({self.score.rerank}) sets how the two-stage top-k re-ranks its candidates, which "
                    f"needs store.dtype int8 or binary (here {self.store.dtype}) and score.top_k "
                    f"(here {self.score.top_k}); set both, or unset score.rerank")
        if self.score.rescore_multiplier is None:
            return self
        exact_curvature = self.curvature.kind != "gram" and self.curvature.exact
        if self.store.dtype not in ("int8", "binary") and not exact_curvature:
            raise ValueError(f"score.rescore_multiplier ({self.score.rescore_multiplier}) sets the candidates of the "
                             "two-stage top-k, which finds them from int8 or binary codes, but store.dtype is "
                             f"{self.store.dtype}; set store.dtype: int8 (or binary) and featurize again, or unset "
                             "score.rescore_multiplier")
        if self.score.top_k is None:
            raise ValueError(f"score.rescore_multiplier ({self.score.rescore_multiplier}) sets the candidates of the "
                             "two-stage top-k, but score.top_k is unset; set score.top_k (e.g. score.top_k=100) or "
                             "unset score.rescore_multiplier")
        return self

    @model_validator(mode="after")
    def _curvature_projector(self) -> "Config":
        """kfac / ekfac take projector kind kronecker unless a kind is set; refinement needs another kind."""
        if self.curvature.kind == "gram":
            return self
        if "kind" not in self.projector.model_fields_set and not self.projector.built_from_model:
            self.projector = self.projector.model_copy(update={"kind": "kronecker"})
        if self.curvature.refine.iterations and self.projector.built_from_model:
            raise ValueError("curvature.refine.iterations refines each target's solve over whole per-example "
                             f"gradients, which projector.kind {self.projector.kind} never forms; set projector.kind: "
                             f"{DEFAULT_KIND} with the refinement, or curvature.refine.iterations: 0")
        return self

    @model_validator(mode="after")
    def _labels_for_task(self) -> "Config":
        """A built-in classification task needs class labels, not the per-token labels of language-model data."""
        if builtin_task_labels(self.task) != "classes":
            return self
        for name in ("train", "target", "validation"):
            ds = getattr(self.data, name)
            source = ds.text_source if ds is not None else None
            if source == "text" and ds.labels is None:
                raise ValueError(f"data.{name}.labels: task {self.task} needs the label field of the text file (only "
                                 "task language_modeling reads texts without labels)")
            if source in ("prompt", "messages") or (source == "input_ids" and ds.labels is None):
                what = {"prompt": "prompt + completion", "messages": "chat (messages)"}.get(source, "token")
                raise ValueError(f"data.{name}: {what} data is language-model data with per-token targets; set task: "
                                 "language_modeling (or your own task reading batch['labels'])")
        return self

    @model_validator(mode="before")
    @classmethod
    def _not_sections(cls, raw: Any) -> Any:
        """Refuse ``training:`` and ``optimizer:`` naming the ``optimize:`` keys that replace them."""
        if isinstance(raw, dict):
            for key, fix in NOT_SECTIONS.items():
                if key in raw:
                    raise ValueError(f"{key}: is not a config section; {fix}")
        return raw

    @field_validator("second_moment", mode="before")
    @classmethod
    def _second_moment_off(cls, v: Any) -> Any:
        """``second_moment: null`` is no correction."""
        return {} if v is None else v

    @field_validator("store", mode="before")
    @classmethod
    def _store_path(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, (str, Path)) else v

    @field_validator("task")
    @classmethod
    def _task_name(cls, v: str) -> str:
        if v in BUILTIN_TASKS or (":" in v and all(v.rsplit(":", 1))):
            return v
        close = difflib.get_close_matches(v, BUILTIN_TASKS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"{v!r} is not a task; {hint}use one of {', '.join(BUILTIN_TASKS)} or your own output function "
            'as "path/to/file.py:fn" or "package.module:fn"'
        )

    @field_validator("grad_wrt", mode="before")
    @classmethod
    def _one_pattern(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @property
    def recipe(self) -> OptimizeConfig | None:
        """The training recipe (``optimize:``); ``None``: the config has none."""
        return self.optimize

    def resolved(self) -> dict[str, Any]:
        """The config as plain JSON-able data (what `--print-config` shows and the store records)."""
        return self.model_dump(mode="json")
