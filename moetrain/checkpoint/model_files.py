"""The files of a model directory (moetrain/checkpoint/model_dir.py): their names, the `model:`
section every one has, and writing them. Kept apart so that the sharded checkpoints, which read a
model directory as a step-0 checkpoint and consolidate into one, need not import the model loader
(which reads sharded checkpoints)."""
from __future__ import annotations

import os
from typing import Any, Dict

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
    config = os.path.join(out_dir, CONFIG_FILE)
    with open(config + ".tmp", "w") as fh:
        yaml.safe_dump(config_dict, fh, sort_keys=False)
    os.replace(config + ".tmp", config)
