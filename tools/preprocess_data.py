r"""Encode text, JSONL or parquet corpora into token shards for `moetrain.data.lm.LMDataset`.

    python tools/preprocess_data.py --input corpus.txt --tokenizer tok.model \
        --output-prefix data/corpus --eval-fraction 0.05
    python tools/preprocess_data.py --input 'web/*.jsonl' --json-key text --tokenizer tokenizer.json \
        --output-prefix data/web --workers 8

writes data/corpus_train.{bin,idx.npy,json} and data/corpus_eval.* (or data/corpus.* when
--eval-fraction is 0). Inputs are files or quoted globs; the format follows the suffix (.jsonl,
.ndjson, .json: one JSON object a line, the document is its --json-key field; .parquet: the
--json-key column, needs pyarrow; anything else: UTF-8 text) unless --input-format says. In text,
a document is one non-blank line (--document-boundary line) or a block of lines between blank
lines (blank_line; its lines are joined with a space). Every document is followed by the
tokenizer's EOS. Eval documents are a seeded random choice of round(fraction * documents); both
splits keep the input order. The output does not depend on --workers. Existing output shards are
not replaced unless --overwrite, and never written into a training checkpoint or run folder.
"""
from __future__ import annotations

import argparse
import sys

from moetrain.data.lm import shard_files
from moetrain.data.preprocess import FORMATS, peak_rss_mb, preprocess, split_names
from moetrain.errors import run_main
from moetrain.fileio import check_output_files


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files or quoted globs ('data/*.jsonl')")
    parser.add_argument("--tokenizer", required=True,
                        help="sentencepiece .model (tools/train_tokenizer.py), Hugging Face tokenizer.json, "
                             "or a model folder holding one")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--eval-fraction", type=float, default=0.0,
                        help="fraction of documents held out as PREFIX_eval (default 0: one shard PREFIX)")
    parser.add_argument("--json-key", default="text", help="JSONL field / parquet column holding the text")
    parser.add_argument("--input-format", choices=FORMATS, help="override the format chosen by file suffix")
    parser.add_argument("--workers", type=int, default=1, help="encoding processes (default 1)")
    parser.add_argument("--eos-token", help="tokenizer.json only: the end-of-document token, if the file "
                                            "does not tell (e.g. '<|endoftext|>')")
    parser.add_argument("--append-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="end every document with EOS (default on)")
    parser.add_argument("--document-boundary", choices=("line", "blank_line"), default="line")
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="status line on stderr: MB done, MB/s, documents, tokens, ETA (default on)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace output shards that already exist (a run may be reading them: only when none is)")
    args = parser.parse_args(argv)
    outputs = [f for name in split_names(args.output_prefix, args.eval_fraction).values() for f in shard_files(name)]
    check_output_files(outputs, args.overwrite, "preprocess_data.py")
    try:
        metas = preprocess(args.input, args.tokenizer, args.output_prefix, args.eval_fraction, args.append_eos,
                           args.document_boundary, args.split_seed, args.json_key, args.input_format, args.workers,
                           args.eos_token, args.progress)
    except ImportError as exc:          # e.g. parquet input without pyarrow: a message, not a traceback
        raise ValueError(str(exc)) from None
    for split, meta in metas.items():
        print(f"{split}: {split_names(args.output_prefix, args.eval_fraction)[split]}  "
              f"documents={meta['num_documents']} tokens={meta['num_tokens']} dtype={meta['dtype']} "
              f"bytes/token={meta['num_text_bytes'] / meta['num_tokens']:.2f}")
    meta = next(iter(metas.values()))
    main_rss, worker_rss = peak_rss_mb()
    print(f"done in {meta['seconds']:.2f} s ({meta['input_mb_per_s']:.2f} MB/s of input, {args.workers} worker(s)); "
          f"peak RSS {main_rss:.0f} MB" + (f", largest worker {worker_rss:.0f} MB" if args.workers > 1 else ""),
          file=sys.stderr)
    return metas


def cli(argv=None) -> int:
    """The command line: bad input (missing, empty, binary or non-UTF-8 inputs, a bad tokenizer, existing
    outputs) is one line and exit 2 (moetrain.errors)."""
    return run_main("preprocess_data.py", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
