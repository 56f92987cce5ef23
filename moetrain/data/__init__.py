"""Datasets: `build_datasets(cfg)` gives (train, eval) for the config's `data.type`, and
`build_sampler(cfg, train)` the sampler that draws the global batches.

A dataset is indexable (`len`, `ds[i] -> tuple of numpy arrays`) and may offer a vectorised
`ds.batch(indices)`; `tokens_per_sample` (LM) lets the trainer report tokens/s. `data.path` /
`data.eval_path` name one token shard or a weighted blend of several (`moetrain.data.blend`)."""
from __future__ import annotations

import os

import numpy as np

from moetrain.data.sampler import GlobalBatchSampler, collate


class DataError(ValueError):
    pass


def fetch(dataset, indices) -> tuple:
    if hasattr(dataset, "batch"):
        return tuple(dataset.batch(np.asarray(indices)))
    return collate(dataset, indices)


def build_datasets(cfg):
    data = cfg.data
    if not data.path:
        raise DataError("data.path is empty: set it to your training data "
                        "(an MNIST idx folder, or the prefix of token shards made by tools/preprocess_data.py)")
    if data.type == "mnist":
        from moetrain.data.mnist import MnistDataset

        if not isinstance(data.path, str) or not os.path.isdir(data.path):
            raise DataError(f"data.path {data.path!r} is not a folder; MNIST needs the folder of the idx files "
                            f"(e.g. ../shared/data/mnist)")
        return MnistDataset(data.path, "train"), MnistDataset(data.eval_path or data.path, "test")
    seq = data.seq_length or getattr(cfg.model, "seq_length", 0)
    vocab = getattr(cfg.model, "vocab_size", None)
    train = build_lm_data(data.path, "data.path", seq, vocab, data)
    evaluation = build_lm_data(data.eval_path, "data.eval_path", seq, vocab, data) if data.eval_path else None
    return train, evaluation


def build_lm_data(path, key: str, seq_length: int, vocab_size, data):
    """An LMDataset for a prefix string, a BlendedDataset for a weighted list / mapping (`key` names
    the config key in errors)."""
    from moetrain.data.blend import build_blended_lm_dataset, parse_blend
    from moetrain.data.lm import build_lm_dataset

    options = dict(tokenizer_path=data.tokenizer or None, reset_attention_mask=data.reset_attention_mask,
                   reset_position_ids=data.reset_position_ids)
    sources = parse_blend(path, key)
    if sources is None:
        return build_lm_dataset(path, seq_length, vocab_size, **options)
    return build_blended_lm_dataset(sources, seq_length, vocab_size, key=key, **options)


def build_sampler(cfg, train_set):
    """The trainer's sampler: GlobalBatchSampler, or for a blend a BlendedBatchSampler whose index
    covers the run's steps (train.steps, or train.epochs of the blend's total samples)."""
    import math

    from moetrain.data.blend import BlendedBatchSampler, BlendedDataset

    t = cfg.train
    if not isinstance(train_set, BlendedDataset):
        return GlobalBatchSampler(len(train_set), t.global_batch_size, t.seed, cfg.data.shuffle)
    steps = t.steps or math.ceil(t.epochs * (len(train_set) // t.global_batch_size))
    return BlendedBatchSampler(train_set, t.global_batch_size, steps, t.seed, cfg.data.shuffle,
                               cfg.data.cache_dir, os.path.join(t.output_dir, "data_cache"))
