"""`moetrain forward CKPT_DIR --input ids.npy --output logits.npy`: logits of a saved model.

CKPT_DIR is a model directory (training checkpoint or `moetrain convert hf-import` output).
The input holds integer token ids `[B, S]` (or `[S]`); the output is fp32 logits `[B, S, V]`.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from moetrain.checkpoint.model_dir import load_model
from moetrain.errors import EXIT_BAD_INPUT, describe, expected_errors


def compute_logits(model, token_ids: np.ndarray, batch_size: int = 8, jit: bool = False) -> np.ndarray:
    """fp32 logits `[B, S, V]` of `model` for int token ids `[B, S]`, `batch_size` rows at a time."""
    import mindspore as ms   # MindSpore is imported only once a model runs: `moetrain forward --help` stays quick

    logits_fn = ms.jit(model.logits) if jit else model.logits
    model.set_train(False)
    chunks = [logits_fn(ms.Tensor(token_ids[start:start + batch_size], ms.int32)).asnumpy()
              for start in range(0, len(token_ids), batch_size)]
    return np.concatenate(chunks, axis=0).astype(np.float32, copy=False)


def read_npy(path: str, what: str = "token ids") -> np.ndarray:
    """An array from a `.npy` file; a file that is not one (text, a pickle, truncated) is a ValueError
    naming it, not numpy's own message."""
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as exc:     # OSError (missing, a folder) passes as it is: it names the path
        raise ValueError(f"{path}: not a .npy array file ({exc}); write the {what} with np.save(path, "
                         f"ids.astype(np.int32))") from None


def read_token_ids(path: str, vocab_size: int) -> np.ndarray:
    ids = read_npy(path)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.size == 0:
        raise ValueError(f"{path}: expected token ids of shape [batch, seq], got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{path}: token ids must be integers, got dtype {ids.dtype} (save with "
                         f"np.save(path, ids.astype(np.int32)))")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size}) for this model, "
                         f"got min {ids.min()} max {ids.max()}")
    return ids.astype(np.int32)


def run_forward(ckpt_dir: str, input_npy: str, output_npy: str, batch_size: int = 8, jit: bool = False):
    """Load `ckpt_dir`, run the token ids in `input_npy`, write fp32 logits to `output_npy`."""
    model, config = load_model(ckpt_dir)
    token_ids = read_token_ids(input_npy, config["model"]["vocab_size"])
    logits = compute_logits(model, token_ids, batch_size, jit)
    np.save(output_npy, logits)
    return logits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain forward", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt_dir", help="model directory (config.yaml + model.safetensors)")
    ap.add_argument("--input", required=True, help=".npy file of int token ids [B, S]")
    ap.add_argument("--output", required=True, help=".npy file to write fp32 logits [B, S, V] to")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per forward call")
    ap.add_argument("--jit", action="store_true", help="compile the forward with ms.jit (faster for many batches)")
    ap.add_argument("--device", default="CPU", choices=("CPU", "GPU", "Ascend"), help="MindSpore device target")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if os.path.isdir(args.output):
        ap.error(f"--output {args.output} is a folder: name the .npy file to write")
    import mindspore as ms   # after the arguments are parsed (see compute_logits)


    try:
        ms.set_device(args.device)
        logits = run_forward(args.ckpt_dir, args.input, args.output, args.batch_size, args.jit)
    except expected_errors() as exc:
        print(f"moetrain forward: error: {describe(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {args.output}: logits {list(logits.shape)} float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
