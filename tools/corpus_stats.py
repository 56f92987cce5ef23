"""Token count and unigram entropy of a token shard: the loss a model that ignores context gets.

    python tools/corpus_stats.py data/kjv_tiny/kjv_tiny_eval [--reference data/kjv_tiny/kjv_tiny_train]

`entropy` is H(p) = -sum p log p (nats/token) of the shard's own unigram distribution p, the
lowest loss any context-free predictor can reach on it. With --reference, `cross_entropy` is the
loss on this shard of the (add-one smoothed) unigram distribution of the reference shard: what a
unigram model trained on the training split scores on the eval split. An LM's validation loss
must be below both to have learned anything from context.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from moetrain.data.lm import open_token_shard
from moetrain.errors import run_main


def token_counts(shard) -> np.ndarray:
    return np.bincount(shard.tokens, minlength=shard.vocab_size)


def unigram_entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def cross_entropy(counts: np.ndarray, reference_counts: np.ndarray) -> float:
    q = (reference_counts + 1.0) / (reference_counts.sum() + reference_counts.size)
    return float(-(counts * np.log(q)).sum() / counts.sum())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="token shard prefix (tools/preprocess_data.py --output-prefix)")
    parser.add_argument("--reference", help="shard whose unigram distribution to score `prefix` with")
    args = parser.parse_args(argv)
    shard = open_token_shard(args.prefix)
    counts = token_counts(shard)
    stats = dict(tokens=int(counts.sum()), documents=shard.num_documents, vocab_size=shard.vocab_size,
                 distinct_tokens=int((counts > 0).sum()), entropy=unigram_entropy(counts))
    if shard.meta.get("num_text_bytes"):
        stats["bytes_per_token"] = shard.meta["num_text_bytes"] / stats["tokens"]
    if args.reference:
        reference = open_token_shard(args.reference)
        if reference.meta.get("tokenizer_sha256") != shard.meta.get("tokenizer_sha256"):
            raise ValueError(f"{args.reference!r} and {args.prefix!r} were encoded with different tokenizers "
                             f"({reference.meta.get('tokenizer')!r} vs {shard.meta.get('tokenizer')!r}); "
                             f"their unigram statistics are not comparable")
        stats["cross_entropy"] = cross_entropy(counts, token_counts(reference))
    for key, value in stats.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return stats


def cli(argv=None) -> int:
    """The command line: a missing or damaged shard is one line and exit 2 (moetrain.errors)."""
    return run_main("corpus_stats.py", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
