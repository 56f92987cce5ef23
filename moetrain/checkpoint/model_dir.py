"""The "model directory": the portable form of a trained model.

    <dir>/config.yaml         a moetrain config (at least its `model:` section)
    <dir>/model.safetensors   every Parameter of the model (trainable or not), keyed by its
                              name from `model.parameters_and_names()`, fp32

Training checkpoints have this form too, so `moetrain forward`, `generate` and `convert` read
either; `load_model_dir` also reassembles a checkpoint sharded over ranks (`model-rankNNNNN` files,
no whole `model.safetensors`) from its `metadata.json`. Files are written under a temporary name
and renamed into place; the weights go first, so a directory whose config.yaml exists is complete.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import numpy as np
from safetensors.numpy import load_file

from moetrain.checkpoint.distributed import CheckpointReader
from moetrain.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, model_section, save_model_dir  # noqa: F401
from moetrain.config import model_config_from_dict
from moetrain.registry import get_model, import_model_module
from moetrain.fileio import read_yaml
from moetrain.param_init import deferred_parameters


def load_model_dir(model_dir: str) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """`(config_dict, state)` of a model directory (or a training checkpoint folder, saved on any
    layout: without a whole `model.safetensors`, every model tensor is reassembled from the ranks'
    pieces as `metadata.json` places them, checked against the manifest)."""
    if (not os.path.isfile(os.path.join(model_dir, WEIGHTS_FILE))
            and os.path.isfile(os.path.join(model_dir, "metadata.json"))):
        return _load_sharded(model_dir)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(model_dir, name)):
            raise FileNotFoundError(f"{model_dir!r} is not a model directory: {name} is missing (expected "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE}, as written by training checkpoints "
                                    f"or `moetrain convert hf-import`)")
    config_dict = read_yaml(os.path.join(model_dir, CONFIG_FILE)) or {}
    model_section(config_dict, os.path.join(model_dir, CONFIG_FILE))
    return config_dict, load_file(os.path.join(model_dir, WEIGHTS_FILE))


def _load_sharded(path: str) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    reader = CheckpointReader(path)
    keys = reader.keys("model")
    reader.verify(reader.files_of(keys))
    config_dict = reader.metadata.get("config") or {}
    if os.path.isfile(os.path.join(path, CONFIG_FILE)):
        config_dict = read_yaml(os.path.join(path, CONFIG_FILE)) or {}
    model_section(config_dict, os.path.join(path, CONFIG_FILE))
    return config_dict, {key: reader.global_tensor(key) for key in keys}


def model_state(model) -> Dict[str, np.ndarray]:
    """Every Parameter of `model` as fp32 numpy, keyed by its name."""
    return {name: param.asnumpy().astype(np.float32, copy=False) for name, param in model.parameters_and_names()}


def load_model_state(model, state: Dict[str, np.ndarray], strict: bool = True):
    """Copy `state` into `model`'s Parameters of the same names.

    Shapes must match. With `strict`, the names must match exactly; otherwise only the common
    names are loaded. Returns `(missing, unexpected)` name lists."""
    # MindSpore only where a model is loaded: the conversions that move arrays never start it
    import mindspore as ms

    params = dict(model.parameters_and_names())
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    mismatched = [f"{name}: checkpoint {tuple(state[name].shape)} vs model {tuple(param.shape)}"
                  for name, param in params.items()
                  if name in state and tuple(state[name].shape) != tuple(param.shape)]
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if strict and unexpected:
        problems.append(f"not in the model: {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches: {mismatched}")
    if problems:
        raise ValueError("the checkpoint does not fit the model (was it written for another model config?); "
                         + "; ".join(problems))
    for name, param in params.items():
        if name in state:
            param.set_data(ms.Tensor(np.asarray(state[name]), dtype=param.dtype))
    return missing, unexpected


def build_config_from_dict(model_dict: Dict[str, Any]):
    """The registered model's config dataclass from a `model:` dict (validated like a YAML config)."""
    return model_config_from_dict(model_dict, "model directory config.yaml")


def build_model_from_dict(model_dict: Dict[str, Any], deferred: bool = False):
    """A freshly initialised model from a `model:` dict; `deferred`: its parameters get shapes but no
    memory (`moetrain.param_init`), for a model whose every weight is loaded next (`load_model_state`
    with `strict`), so no random copy is built beside the loaded one."""
    cls = get_model(model_dict["name"]).cls
    if not deferred:
        return cls(build_config_from_dict(model_dict))
    with deferred_parameters():
        return cls(build_config_from_dict(model_dict))


def load_model(model_dir: str):
    """`(model, config_dict)`: the model of a model directory with its weights loaded."""
    config_dict, state = load_model_dir(model_dir)
    import_model_module(config_dict.get("model_module"))   # a user model registered outside models/
    model = build_model_from_dict(config_dict["model"], deferred=True)
    load_model_state(model, state, strict=True)
    return model, config_dict
