"""Datasets, the deterministic global sampler, and batch gathering (torch layer; no ray)."""

from pt_ray.data.base import (
    Batch,
    BatchedSamples,
    DatasetSplits,
    EpochAugmented,
    IndexedTargets,
    SampleDataset,
    StoredSamples,
    SubsetDataset,
    TensorSampleDataset,
    fast_paths,
    finish_batch,
    gather,
    gather_stored,
    gather_targets,
    set_epoch,
)
from pt_ray.data.idx import load_mnist_idx, read_idx
from pt_ray.data.registry import DATASETS, build_dataset, cap_train, keep_classes
from pt_ray.data.sampler import (
    GlobalSampler,
    accumulation_chunks,
    eval_shards,
    split_for_replica,
    training_sampler,
)
from pt_ray.data.synthetic import synthetic_image, synthetic_text
from pt_ray.data.text import load_glue_tsv, load_squad_json, load_tokenizer
from pt_ray.data.transforms import ImageTransform, random_crop_flip
from pt_ray.data.vision import (
    ImageArrayDataset,
    ImageFileDataset,
    load_cifar,
    load_digits,
    load_imagefolder,
    load_mnist5k,
)
from pt_ray.data.wordnet import load_wordnet

__all__ = [
    "DATASETS",
    "Batch",
    "BatchedSamples",
    "DatasetSplits",
    "EpochAugmented",
    "GlobalSampler",
    "ImageArrayDataset",
    "ImageFileDataset",
    "ImageTransform",
    "IndexedTargets",
    "SampleDataset",
    "StoredSamples",
    "SubsetDataset",
    "TensorSampleDataset",
    "accumulation_chunks",
    "build_dataset",
    "cap_train",
    "eval_shards",
    "fast_paths",
    "finish_batch",
    "gather",
    "gather_stored",
    "gather_targets",
    "keep_classes",
    "load_cifar",
    "load_digits",
    "load_glue_tsv",
    "load_imagefolder",
    "load_mnist5k",
    "load_mnist_idx",
    "load_squad_json",
    "load_tokenizer",
    "load_wordnet",
    "random_crop_flip",
    "read_idx",
    "set_epoch",
    "split_for_replica",
    "training_sampler",
    "synthetic_image",
    "synthetic_text",
]
