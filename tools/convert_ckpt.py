"""Offline checkpoint conversion: reshard onto another parallel layout, or consolidate.

    python tools/convert_ckpt.py CKPT OUT --consolidate                 # -> config.yaml + model.safetensors
    python tools/convert_ckpt.py CKPT OUT --to-layout dp=4,tp=2,zero=1  # -> the checkpoint that layout saves
    python tools/convert_ckpt.py MODEL_DIR OUT --to-layout dp=2,zero=1  # model directory -> step-0 weights

Resuming reshards by itself (`moetrain train CONFIG --resume CKPT` on any layout); converting
ahead only pre-splits the files. Also available as `moetrain convert consolidate|reshard`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moetrain.checkpoint.distributed import main  # noqa: E402
from moetrain.errors import run_main  # noqa: E402


def cli(argv=None) -> int:
    """The command line: bad input (a missing or damaged checkpoint, an existing output, a layout the
    model cannot take) is one line and exit 2 (moetrain.errors)."""
    return run_main("convert_ckpt", main, argv, exit_code=lambda code: code)


if __name__ == "__main__":
    sys.exit(cli())
