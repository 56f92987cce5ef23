"""`checkpoint.load_path`: start a new run from the weights of a model directory or a training checkpoint.

The counterpart of MindFormers' `load_checkpoint` with `resume_training: False`, Megatron's
`--finetune` and torchtitan's `initial_load_path`: the model's weights come from DIR (any moetrain
model directory, e.g. `moetrain convert hf-import` output or `moetrain convert upcycle` output, or a
training checkpoint saved on any layout), resliced for this run's layout by the same reassembly as
a resume (`moetrain.checkpoint.distributed`); the step, the optimizer moments, the schedule, the
loss scale and the data position start fresh. ZeRO fp32 masters follow the loaded weights.

The saved `model:` section must describe the same architecture as the run's. Keys that only
shape training (initialisation, loss coefficients, balancing rate, capacity, compute dtype) may
differ silently; keys that set positions (`seq_length`, `rope_theta`, YaRN scaling) may differ and
each difference is logged (fine-tuning at another length, context extension: no weight depends on
them); any other difference changes a tensor's shape or meaning and is an error naming every
mismatching key.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Sequence, Tuple

from moetrain.checkpoint.manager import CheckpointError
from moetrain.checkpoint.distributed import MASTER_PREFIX, CheckpointReader, load_into
from moetrain.checkpoint.model_dir import build_config_from_dict

# `model:` keys a fine-tune may change: they do not change which tensors exist or what they mean.
TRAINING_ONLY_KEYS = frozenset({
    "compute_dtype", "init_std", "scale_output_init", "mtp_loss_weight",
    "moe.aux_loss_coeff", "moe.seq_aux_loss_coeff", "moe.z_loss_coeff", "moe.bias_update_rate",
    "moe.capacity_factor",
})
# `model:` keys a fine-tune may change, logged: positions and RoPE hold no weights.
POSITION_KEYS = frozenset({
    "seq_length", "rope_theta", "yarn_factor", "yarn_original_max_positions", "yarn_beta_fast",
    "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
})


def _flatten(section: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def model_config_differences(saved: Dict[str, Any], current: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """`(mismatches, position_changes)`: `model.<key> (saved X, config Y)` for every architecture key
    on which the two `model:` sections differ, and for every position key (allowed, to be logged).

    A key the saved section lacks is compared with the run's dataclass default, which is what the
    saved model was built with."""
    saved_full = _flatten(_asdict(build_config_from_dict(saved)))
    current_flat = _flatten(current)
    keys = sorted((set(saved_full) | set(current_flat)) - TRAINING_ONLY_KEYS)
    differ = [k for k in keys if saved_full.get(k) != current_flat.get(k)]

    def say(k):
        return f"model.{k} (saved {saved_full.get(k)!r}, config {current_flat.get(k)!r})"

    return ([say(k) for k in differ if k not in POSITION_KEYS], [say(k) for k in differ if k in POSITION_KEYS])


def _asdict(cfg) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


def load_initial_weights(path: str, tensors: Sequence, model_section: Dict[str, Any], holds_whole_model: bool,
                         log: Callable[[str], None] = print) -> int:
    """Load the model weights of `path` into this rank's `tensors` (`distributed.local_tensors`), resliced
    to their layout; optimizer moments are left fresh. Returns the number of model tensors loaded."""
    reader = CheckpointReader(path)
    saved = (reader.metadata.get("config") or {}).get("model")
    if not isinstance(saved, dict) or "name" not in saved:
        raise CheckpointError(f"checkpoint.load_path {path}: its config has no `model:` section to check against")
    mismatches, positions = model_config_differences(saved, model_section)
    if mismatches:
        raise CheckpointError(f"checkpoint.load_path {path} holds another model than this config describes; "
                              f"mismatching keys: " + "; ".join(mismatches))
    for change in positions:   # no weight depends on these: fine-tune at another length, extend the context
        log(f"moetrain: checkpoint.load_path: positions differ from the saved model's, weights load unchanged: {change}")
    wanted = [t for t in tensors if t.part == "model" or t.key.startswith(MASTER_PREFIX)]
    load_into(reader, wanted, holds_whole_model)
    reader.close()
    return sum(t.part == "model" for t in wanted)
