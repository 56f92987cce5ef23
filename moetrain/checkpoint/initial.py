"""`checkpoint.load_path`: start a new run from the weights of a model directory or a training checkpoint.

The counterpart of MindFormers' `load_checkpoint` with `resume_training: False`, Megatron's
`--finetune` and torchtitan's `initial_load_path`: the model's weights come from DIR (any moetrain
model directory, e.g. `moetrain convert hf-import` output or `moetrain convert upcycle` output, or a
training checkpoint saved on any layout), resliced for this run's layout by the same reassembly as
a resume (`moetrain.checkpoint.distributed`); the step, the optimizer moments, the schedule, the
loss scale and the data position start fresh. ZeRO fp32 masters follow the loaded weights.

The saved `model:` section must describe the same architecture as the run's. Keys that only
shape training (initialisation, loss coefficients, balancing rate, capacity, compute dtype) may
differ; any other difference is an error naming every mismatching key.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from moetrain.checkpoint.manager import CheckpointError

# `model:` keys a fine-tune may change: they do not change which tensors exist or what they mean.
TRAINING_ONLY_KEYS = frozenset({
    "compute_dtype", "init_std", "scale_output_init", "mtp_loss_weight",
    "moe.aux_loss_coeff", "moe.seq_aux_loss_coeff", "moe.z_loss_coeff", "moe.bias_update_rate",
    "moe.capacity_factor",
})


def _flatten(section: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def model_config_mismatches(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """`model.<key> (saved X, config Y)` for every architecture key on which the two `model:` sections differ.

    A key the saved section lacks is compared with the run's dataclass default, which is what the
    saved model was built with."""
    from moetrain.checkpoint.model_dir import build_config_from_dict

    saved_full = _flatten(_asdict(build_config_from_dict(saved)))
    current_flat = _flatten(current)
    keys = sorted((set(saved_full) | set(current_flat)) - TRAINING_ONLY_KEYS)
    return [f"model.{k} (saved {saved_full.get(k)!r}, config {current_flat.get(k)!r})"
            for k in keys if saved_full.get(k) != current_flat.get(k)]


def _asdict(cfg) -> Dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg)


def load_initial_weights(path: str, tensors: Sequence, model_section: Dict[str, Any], holds_whole_model: bool) -> int:
    """Load the model weights of `path` into this rank's `tensors` (`distributed.local_tensors`), resliced
    to their layout; optimizer moments are left fresh. Returns the number of model tensors loaded."""
    from moetrain.checkpoint.distributed import MASTER_PREFIX, CheckpointReader, load_into

    reader = CheckpointReader(path)
    saved = (reader.metadata.get("config") or {}).get("model")
    if not isinstance(saved, dict) or "name" not in saved:
        raise CheckpointError(f"checkpoint.load_path {path}: its config has no `model:` section to check against")
    mismatches = model_config_mismatches(saved, model_section)
    if mismatches:
        raise CheckpointError(f"checkpoint.load_path {path} holds another model than this config describes; "
                              f"mismatching keys: " + "; ".join(mismatches))
    wanted = [t for t in tensors if t.part == "model" or t.key.startswith(MASTER_PREFIX)]
    load_into(reader, wanted, holds_whole_model)
    reader.close()
    return sum(t.part == "model" for t in wanted)
