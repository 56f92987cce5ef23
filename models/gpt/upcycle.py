"""Dense `gpt` -> `moe_gpt` upcycling: the MoE `model:` section and tensors with the same forward
(the method and why it is exact: `moetrain/checkpoint/upcycle.py`). Pure numpy; the command checks the
result by building the MoE model and loading the tensors strictly."""
from __future__ import annotations

import copy
from typing import Any, Dict

import numpy as np


def upcycled_section(dense: Dict[str, Any], num_experts: int, top_k: int, granularity: int) -> Dict[str, Any]:
    """The `moe_gpt` `model:` section for the `gpt` section `dense` (arguments already checked >= 1)."""
    ffn = dense["ffn_hidden_size"]
    if ffn % granularity:
        raise ValueError(f"upcycle: --granularity {granularity} must divide the FFN width model.ffn_hidden_size "
                         f"({ffn})")
    model = copy.deepcopy(dense)
    model.update(name="moe_gpt", first_k_dense=0, moe_layer_freq=1, moe={
        "num_experts": num_experts * granularity, "top_k": top_k * granularity, "ffn_hidden_size": ffn // granularity,
        "num_shared_experts": 0, "score_func": "softmax", "norm_topk_prob": True, "route_scale": float(granularity),
        "num_groups": 1, "topk_groups": 1, "capacity_factor": 0.0})
    return model


def upcycled_state(state: Dict[str, np.ndarray], model: Dict[str, Any], num_experts: int, granularity: int,
                   seed: int = 0) -> Dict[str, np.ndarray]:
    """The upcycled model's tensors from the dense `state`: expert `c*G + g` holds FFN slice g, the
    router row of copy c is one random row repeated for its G slices."""
    rng = np.random.default_rng(seed)
    hidden, slice_width = model["hidden_size"], model["moe"]["ffn_hidden_size"]
    out = {name: value for name, value in state.items() if ".mlp." not in name}
    for i in range(model["num_layers"]):
        w_gate, w_up, w_down = (state[f"layers.{i}.mlp.{n}.weight"] for n in ("w_gate", "w_up", "w_down"))  # [F, H], [H, F]
        slices = range(granularity)
        gate = [w_gate[g * slice_width:(g + 1) * slice_width].T for g in slices]            # [H, F/G]
        up = [w_up[g * slice_width:(g + 1) * slice_width].T for g in slices]
        down = [w_down[:, g * slice_width:(g + 1) * slice_width].T for g in slices]          # [F/G, H]
        prefix = f"layers.{i}.moe."
        out[prefix + "experts.w_gate"] = np.stack(gate * num_experts)                       # expert c*G + g
        out[prefix + "experts.w_up"] = np.stack(up * num_experts)
        out[prefix + "experts.w_down"] = np.stack(down * num_experts)
        rows = (model["init_std"] * rng.standard_normal((num_experts, hidden))).astype(np.float32)
        out[prefix + "router.weight"] = np.repeat(rows, granularity, axis=0)                 # one row per copy
        out[prefix + "expert_bias"] = np.zeros(num_experts * granularity, np.float32)
    return out
