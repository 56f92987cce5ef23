r"""Encode text files into token shards for `moetrain.data.lm.LMDataset`.

    python tools/preprocess_data.py --input corpus.txt --tokenizer tok.model \
        --output-prefix data/corpus --eval-fraction 0.05

writes data/corpus_train.{bin,idx.npy,json} and data/corpus_eval.* (or data/corpus.* when
--eval-fraction is 0). A document is one non-blank line (--document-boundary line) or a block of
lines between blank lines (blank_line; its lines are joined with a space). Eval documents are a
seeded random choice of round(fraction * documents); both splits keep the input order.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Iterator, List

import numpy as np

from moetrain.data import DataError
from moetrain.data.lm import TokenShardWriter
from moetrain.data.tokenizer import Tokenizer, check_text_file

CHUNK_DOCUMENTS = 8192  # documents encoded per sentencepiece batch call


def iter_documents(path: str, boundary: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            block: List[str] = []
            for line in f:
                line = line.rstrip("\r\n")
                if boundary == "line":
                    if line.strip():
                        yield line
                elif line.strip():
                    block.append(line)
                elif block:
                    yield " ".join(block)
                    block = []
            if block:
                yield " ".join(block)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path!r} is not UTF-8 text ({e}); convert it, e.g. with iconv") from e


def split_names(prefix: str, eval_fraction: float) -> dict:
    return {"train": prefix + "_train", "eval": prefix + "_eval"} if eval_fraction > 0 else {"all": prefix}


def preprocess(inputs: List[str], tokenizer_path: str, output_prefix: str, eval_fraction: float = 0.0,
               append_eos: bool = True, document_boundary: str = "line", split_seed: int = 0) -> dict:
    """Encode `inputs` into shards; returns {split name: metadata written}."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if document_boundary not in ("line", "blank_line"):
        raise ValueError(f"--document-boundary must be 'line' or 'blank_line', got {document_boundary!r}")
    tokenizer = Tokenizer(tokenizer_path)
    for path in inputs:
        check_text_file(path, fix="remove it from --input")
    # First pass: count documents, so the eval split is an exact, seeded choice.
    docs_per_file = [sum(1 for _ in iter_documents(p, document_boundary)) for p in inputs]
    for path, count in zip(inputs, docs_per_file):
        if count == 0:
            raise ValueError(f"input text {path!r} is empty (no non-blank lines); remove it from --input")
    num_docs = sum(docs_per_file)
    num_eval = int(round(eval_fraction * num_docs))
    if eval_fraction > 0 and not 0 < num_eval < num_docs:
        raise ValueError(f"--eval-fraction {eval_fraction} of {num_docs} documents gives {num_eval} eval "
                         f"documents; choose a fraction that leaves at least one document in each split")
    is_eval = np.zeros(num_docs, dtype=bool)
    is_eval[np.random.default_rng(split_seed).choice(num_docs, num_eval, replace=False)] = True

    names = split_names(output_prefix, eval_fraction)
    writers = {split: TokenShardWriter(prefix, tokenizer.vocab_size) for split, prefix in names.items()}
    text_bytes = dict.fromkeys(names, 0)
    eos = [tokenizer.eos_id] if append_eos else []

    def flush(texts: List[str], first_doc: int) -> None:
        routed = {split: [] for split in names}
        for offset, (text, ids) in enumerate(zip(texts, tokenizer.encode_batch(texts))):
            split = "all" if eval_fraction == 0 else ("eval" if is_eval[first_doc + offset] else "train")
            routed[split].append(ids + eos)
            text_bytes[split] += len(text.encode("utf-8"))
        for split, documents in routed.items():
            writers[split].add_documents(documents)

    doc_index, pending = 0, []
    for path in inputs:
        for text in iter_documents(path, document_boundary):
            pending.append(text)
            if len(pending) == CHUNK_DOCUMENTS:
                flush(pending, doc_index)
                doc_index, pending = doc_index + len(pending), []
    flush(pending, doc_index)

    common = dict(tokenizer=tokenizer_path, tokenizer_sha256=tokenizer.checksum, eos_id=tokenizer.eos_id,
                  append_eos=append_eos, document_boundary=document_boundary, sources=list(inputs),
                  eval_fraction=eval_fraction, split_seed=split_seed)
    return {split: writer.close(split=split, num_text_bytes=text_bytes[split], **common)
            for split, writer in writers.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="UTF-8 text files")
    parser.add_argument("--tokenizer", required=True, help="sentencepiece .model (tools/train_tokenizer.py)")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--eval-fraction", type=float, default=0.0,
                        help="fraction of documents held out as PREFIX_eval (default 0: one shard PREFIX)")
    parser.add_argument("--append-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="end every document with EOS (default on)")
    parser.add_argument("--document-boundary", choices=("line", "blank_line"), default="line")
    parser.add_argument("--split-seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        metas = preprocess(args.input, args.tokenizer, args.output_prefix, args.eval_fraction,
                           args.append_eos, args.document_boundary, args.split_seed)
    except (ValueError, FileNotFoundError, DataError) as exc:    # bad input: the message, not a traceback
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    for split, meta in metas.items():
        print(f"{split}: {split_names(args.output_prefix, args.eval_fraction)[split]}  "
              f"documents={meta['num_documents']} tokens={meta['num_tokens']} dtype={meta['dtype']} "
              f"bytes/token={meta['num_text_bytes'] / meta['num_tokens']:.2f}")
    print(f"done in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return metas


if __name__ == "__main__":
    main()
