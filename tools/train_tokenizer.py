"""Train a SentencePiece tokenizer with this project's fixed special ids.

    python tools/train_tokenizer.py --input corpus.txt --model-prefix data/tok --vocab-size 2048

writes data/tok.model (what config key data.tokenizer points at) and data/tok.vocab.
Ids: unk=0, bos=1, eos=2, pad=3, then --special-tokens in order, then learned pieces.
The model file records the --input and --model-prefix strings, so regenerate it with the same
command from the same directory to get the same sha256 (shards store it to detect mismatches).
An existing PREFIX.model is not replaced unless --overwrite.
"""
from __future__ import annotations

import argparse
import sys
import time

from moetrain.data.tokenizer import Tokenizer, train_tokenizer
from moetrain.errors import run_main
from moetrain.fileio import check_output_files


def main(argv=None) -> Tokenizer:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="UTF-8 text files, one sentence a line")
    parser.add_argument("--model-prefix", required=True, help="output path without .model")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--special-tokens", nargs="*", default=[],
                        help="extra pieces that are never split, ids 4, 5, ...")
    parser.add_argument("--byte-fallback", action="store_true",
                        help="encode characters unseen in training as UTF-8 bytes instead of unk (+256 pieces)")
    parser.add_argument("--character-coverage", type=float, default=1.0)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing PREFIX.model / PREFIX.vocab (shards encoded with it will no longer match)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    check_output_files([args.model_prefix + ".model", args.model_prefix + ".vocab"], args.overwrite,
                       "train_tokenizer.py")
    model_path = train_tokenizer(args.input, args.model_prefix, args.vocab_size, args.model_type,
                                 args.special_tokens, args.byte_fallback, args.character_coverage)
    tokenizer = Tokenizer(model_path)
    print(f"{model_path}: vocab_size={tokenizer.vocab_size} unk={tokenizer.unk_id} bos={tokenizer.bos_id} "
          f"eos={tokenizer.eos_id} pad={tokenizer.pad_id} sha256={tokenizer.checksum} "
          f"({time.perf_counter() - start:.1f} s)")
    return tokenizer


def cli(argv=None) -> int:
    """The command line: bad input (a missing, binary or non-UTF-8 file, a vocab_size that cannot hold the
    reserved ids and characters, an existing output) is one line and exit 2 (moetrain.errors)."""
    return run_main("train_tokenizer.py", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
