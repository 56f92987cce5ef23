"""The files of a model directory (moetrain/checkpoint/model_dir.py): their names, the `model:`
section every one has, and writing them. Kept apart so that the sharded checkpoints, which read a
model directory as a step-0 checkpoint and consolidate into one, need not import the model loader
(which reads sharded checkpoints)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Sequence, Tuple

import numpy as np
import yaml
from safetensors.numpy import save_file

CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"


def model_section(config_dict: Dict[str, Any], where: str) -> Dict[str, Any]:
    model = config_dict.get("model") if isinstance(config_dict, dict) else None
    if not isinstance(model, dict) or "name" not in model:
        raise ValueError(f"{where}: the config has no `model:` section with a `name` key "
                         f"(a model directory's config.yaml needs at least `model: {{name: ..., ...}}`)")
    return model


def save_model_dir(out_dir: str, config_dict: Dict[str, Any], state: Dict[str, np.ndarray]) -> None:
    """Write `config_dict` (a moetrain config with a `model:` section) and `state` (name -> array)."""
    model_section(config_dict, out_dir)
    os.makedirs(out_dir, exist_ok=True)
    arrays = {name: np.ascontiguousarray(value, dtype=np.float32 if np.issubdtype(value.dtype, np.floating)
                                         else value.dtype)
              for name, value in state.items()}
    weights = os.path.join(out_dir, WEIGHTS_FILE)
    save_file(arrays, weights + ".tmp", metadata={"format": "np"})
    os.replace(weights + ".tmp", weights)
    write_config(out_dir, config_dict)


def write_config(out_dir: str, config_dict: Dict[str, Any]) -> None:
    """The model directory's config.yaml (written last: a folder whose config.yaml exists is complete)."""
    config = os.path.join(out_dir, CONFIG_FILE)
    with open(config + ".tmp", "w") as fh:
        yaml.safe_dump(config_dict, fh, sort_keys=False)
    os.replace(config + ".tmp", config)


class Fp32SafetensorsWriter:
    """A safetensors file of fp32 tensors written one tensor at a time, so that no more than the tensor
    being written need be in memory (hf-import of a model larger than the machine).

    The names and shapes are given up front: the header (and each tensor's place) is written first,
    then `write(name, array)` puts each tensor's bytes at its place, in any order; `close()` checks
    every tensor was written. The layout is exactly `safetensors.numpy.save_file`'s for fp32 tensors
    (tensors in name order, compact JSON header padded with spaces to 8 bytes), so the file is byte
    for byte what writing the whole dict at once gives."""

    def __init__(self, path: str, shapes: Dict[str, Sequence[int]], metadata: Dict[str, str]):
        self.path, self._offsets, self._shapes, header, end = path, {}, {}, {"__metadata__": dict(metadata)}, 0
        for name in sorted(shapes):
            shape = [int(d) for d in shapes[name]]
            size = 4 * int(np.prod(shape, dtype=np.int64))
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [end, end + size]}
            self._offsets[name], self._shapes[name] = (end, size), tuple(shape)
            end += size
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._base, self._left = 8 + len(raw), set(shapes)
        self._fh = open(path, "wb")
        self._fh.write(len(raw).to_bytes(8, "little") + raw)
        self._fh.truncate(self._base + end)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._shapes[name]

    def write(self, name: str, array: np.ndarray) -> None:
        """Tensor `name`'s values (fp32, of its declared shape; a contiguous array is written without a copy)."""
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.shape != self._shapes[name]:
            raise ValueError(f"{name}: shape {array.shape}, declared {self._shapes[name]}")
        self._fh.seek(self._base + self._offsets[name][0])
        self._fh.write(memoryview(array.reshape(-1)).cast("B"))
        self._left.discard(name)

    def close(self) -> None:
        self._fh.close()
        if self._left:
            raise ValueError(f"{self.path}: tensors never written: {sorted(self._left)[:10]}")

    def abort(self) -> None:
        """Close and remove the unfinished file."""
        self._fh.close()
        if os.path.exists(self.path):
            os.remove(self.path)
