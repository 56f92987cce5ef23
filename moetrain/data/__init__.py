"""Datasets: `build_datasets(cfg)` gives (train, eval) for the config's `data.type`, and
`build_sampler(cfg, train)` the sampler that draws the global batches.

A dataset is indexable (`len`, `ds[i] -> tuple of numpy arrays`) and may offer a vectorised
`ds.batch(indices)`; `tokens_per_sample` (LM) lets the trainer report tokens/s. `data.path` /
`data.eval_path` name one token shard or a weighted blend of several (`moetrain.data.blend`)."""
from __future__ import annotations

import math
import os

import numpy as np

from moetrain.data.blend import BlendedBatchSampler, BlendedDataset, build_blended_lm_dataset, parse_blend
from moetrain.data.errors import DataError
from moetrain.data.lm import build_lm_dataset
from moetrain.data.mnist import MnistDataset
from moetrain.data.sampler import GlobalBatchSampler, collate

__all__ = ["DataError", "build_datasets", "build_lm_data", "build_sampler", "check_same_vocabulary", "fetch"]


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
        if not isinstance(data.path, str) or not os.path.isdir(data.path):
            raise DataError(f"data.path {data.path!r} is not a folder; MNIST needs the folder of the idx files "
                            f"(e.g. ../shared/data/mnist)")
        return MnistDataset(data.path, "train"), MnistDataset(data.eval_path or data.path, "test")
    seq = data.seq_length or getattr(cfg.model, "seq_length", 0)
    vocab = getattr(cfg.model, "vocab_size", None)
    train = build_lm_data(data.path, "data.path", seq, vocab, data)
    evaluation = build_lm_data(data.eval_path, "data.eval_path", seq, vocab, data) if data.eval_path else None
    if evaluation is not None:
        check_same_vocabulary(train, evaluation)
    return train, evaluation


def _shard_vocabularies(dataset):
    """(prefix, tokenizer name, tokenizer sha256, vocab size) of every token shard under `dataset`."""
    parts = getattr(dataset, "datasets", None) or [dataset]
    return [(d.shard.prefix, d.shard.meta.get("tokenizer"), d.shard.meta.get("tokenizer_sha256"), d.shard.vocab_size)
            for d in parts if hasattr(d, "shard")]


def check_same_vocabulary(train, evaluation) -> None:
    """data.path and data.eval_path must be token ids of one tokenizer, as their shards record it
    (sha256 of the tokenizer file, else the vocabulary size): otherwise the eval loss is computed on
    another vocabulary's ids. Checked whether or not data.tokenizer names the tokenizer."""
    train_vocab, eval_vocab = _shard_vocabularies(train), _shard_vocabularies(evaluation)
    if not train_vocab or not eval_vocab:
        return
    _, t_name, t_sha, t_size = train_vocab[0]
    for prefix, name, sha, size in eval_vocab:
        if (sha and t_sha and sha != t_sha) or size != t_size:
            raise DataError(
                f"data.eval_path {prefix!r} was encoded with another tokenizer than data.path {train_vocab[0][0]!r}: "
                f"{name!r} (sha256 {sha}, {size} tokens) vs {t_name!r} (sha256 {t_sha}, {t_size} tokens); the eval "
                f"loss would be computed on another vocabulary's ids. Re-encode the eval text with the training data's "
                f"tokenizer (tools/preprocess_data.py --tokenizer {t_name}) or point data.eval_path at shards made with it")


def build_lm_data(path, key: str, seq_length: int, vocab_size, data):
    """An LMDataset for a prefix string, a BlendedDataset for a weighted list / mapping (`key` names
    the config key in errors)."""
    options = dict(tokenizer_path=data.tokenizer or None, reset_attention_mask=data.reset_attention_mask,
                   reset_position_ids=data.reset_position_ids)
    sources = parse_blend(path, key)
    if sources is None:
        return build_lm_dataset(path, seq_length, vocab_size, **options)
    return build_blended_lm_dataset(sources, seq_length, vocab_size, key=key, **options)


def build_sampler(cfg, train_set):
    """The trainer's sampler: GlobalBatchSampler, or for a blend a BlendedBatchSampler whose index
    covers the run's steps (train.steps, or train.epochs of the blend's total samples)."""
    t = cfg.train
    if not isinstance(train_set, BlendedDataset):
        return GlobalBatchSampler(len(train_set), t.global_batch_size, t.seed, cfg.data.shuffle)
    steps = t.steps or math.ceil(t.epochs * (len(train_set) // t.global_batch_size))
    return BlendedBatchSampler(train_set, t.global_batch_size, steps, t.seed, cfg.data.shuffle,
                               cfg.data.cache_dir, os.path.join(t.output_dir, "data_cache"))
