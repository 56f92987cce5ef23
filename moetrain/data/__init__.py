"""Datasets: `build_datasets(cfg)` gives (train, eval) for the config's `data.type`.

A dataset is indexable (`len`, `ds[i] -> tuple of numpy arrays`) and may offer a vectorised
`ds.batch(indices)`; `tokens_per_sample` (LM) lets the trainer report tokens/s."""
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

        if not os.path.isdir(data.path):
            raise DataError(f"data.path {data.path!r} is not a folder; MNIST needs the folder of the idx files "
                            f"(e.g. ../shared/data/mnist)")
        return MnistDataset(data.path, "train"), MnistDataset(data.eval_path or data.path, "test")
    from moetrain.data.lm import build_lm_dataset

    seq = data.seq_length or getattr(cfg.model, "seq_length", 0)
    vocab = getattr(cfg.model, "vocab_size", None)
    tokenizer = data.tokenizer or None
    train = build_lm_dataset(data.path, seq, vocab, tokenizer_path=tokenizer)
    evaluation = build_lm_dataset(data.eval_path, seq, vocab, tokenizer_path=tokenizer) if data.eval_path else None
    return train, evaluation
