"""Dense-to-MoE upcycling: a dense `gpt` model directory -> a `moe_gpt` model directory with the same forward.

    moetrain convert upcycle DENSE_MODEL_DIR OUT --num-experts E --top-k K [--granularity G]

Every layer's SwiGLU FFN (width F) becomes a MoE layer of E x G experts of width F / G, top-k K x G,
softmax routing with renormalised top-k weights, dropless, `route_scale` G; attention, norms,
embedding and head are copied. Train on from it with `checkpoint.load_path: OUT`.

Why the forward is unchanged. SwiGLU acts element-wise along F, so splitting F into G slices
splits the FFN into a sum: `ffn(x) = sum_g W_down[:, g] (silu(W_gate[g] x) * W_up[g] x) =
sum_g seg_g(x)`. Expert `c*G + g` (copy c = 0..E-1, slice g) holds `seg_g`. The router row of
copy c is one random row repeated for its G slices ("virtual groups", He et al. 2024, Upcycling
LLMs into MoE), so the G slices of a copy always score the same and top-(K G) picks whole copies:
K copies, every slice once each. With renormalised weights a chosen slice of copy c gets
`G * p_c / (G * sum_{chosen c'} p_c')` after `route_scale` G, so the output is
`sum_c p_c / sum p * sum_g seg_g(x) = ffn(x)`. With G = 1 this is plain upcycling (identical
experts, weights summing to 1). Exact up to float rounding (the test bounds it by 1e-5).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
from typing import Any, Dict, Tuple

import numpy as np

from moetrain.checkpoint.model_dir import (build_config_from_dict, build_model_from_dict, load_model_dir,
                                           load_model_state, save_model_dir)
from moetrain.errors import EXIT_BAD_INPUT, describe, expected_errors
from moetrain.fileio import check_output_folder


def upcycled_model_section(dense: Dict[str, Any], num_experts: int, top_k: int, granularity: int) -> Dict[str, Any]:
    """The `moe_gpt` `model:` section for upcycling the `gpt` section `dense`."""
    if dense.get("name") != "gpt":
        raise ValueError(f"upcycle: the model directory holds a {dense.get('name')!r} model; it upcycles dense "
                         f"`gpt` models")
    for key, value, low in (("--num-experts", num_experts, 1), ("--top-k", top_k, 1), ("--granularity", granularity, 1)):
        if value < low:
            raise ValueError(f"upcycle: {key} must be >= {low}, got {value}")
    if top_k > num_experts:
        raise ValueError(f"upcycle: --top-k ({top_k}) cannot exceed --num-experts ({num_experts})")
    ffn = dense["ffn_hidden_size"]
    if ffn % granularity:
        raise ValueError(f"upcycle: --granularity {granularity} must divide the FFN width model.ffn_hidden_size "
                         f"({ffn})")
    model = copy.deepcopy(dense)
    model.update(name="moe_gpt", first_k_dense=0, moe_layer_freq=1, moe={
        "num_experts": num_experts * granularity, "top_k": top_k * granularity, "ffn_hidden_size": ffn // granularity,
        "num_shared_experts": 0, "score_func": "softmax", "norm_topk_prob": True, "route_scale": float(granularity),
        "num_groups": 1, "topk_groups": 1, "capacity_factor": 0.0})

    return dataclasses.asdict(build_config_from_dict(model))


def upcycle_state(state: Dict[str, np.ndarray], model: Dict[str, Any], num_experts: int, granularity: int,
                  seed: int = 0) -> Dict[str, np.ndarray]:
    """The upcycled model's tensors from the dense `state` (see the module docstring for the layout)."""
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


def upcycle(dense_dir: str, out_dir: str, num_experts: int, top_k: int, granularity: int = 1,
            seed: int = 0) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """Write the upcycled model directory; returns its `(model section, state)`."""
    config, state = load_model_dir(dense_dir)
    model = upcycled_model_section(config["model"], num_experts, top_k, granularity)
    new_state = upcycle_state(state, model, num_experts, granularity, seed)

    load_model_state(build_model_from_dict(model, deferred=True), new_state, strict=True)   # every name and shape fits
    save_model_dir(out_dir, {"model": model}, new_state)
    return model, new_state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert upcycle", description="dense gpt model directory -> "
                                 "moe_gpt model directory with the same forward (continue with checkpoint.load_path)")
    ap.add_argument("dense_dir", help="model directory or training checkpoint of a `gpt` model")
    ap.add_argument("out_dir", help="model directory to write")
    ap.add_argument("--num-experts", type=int, required=True, help="expert copies E")
    ap.add_argument("--top-k", type=int, required=True, help="copies per token K")
    ap.add_argument("--granularity", type=int, default=1,
                    help="split every copy's FFN into G experts: E x G experts of width F / G, top-k K x G")
    ap.add_argument("--seed", type=int, default=0, help="seed of the router rows")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into an out_dir that already holds files (never a training checkpoint or run folder)")
    args = ap.parse_args(argv)

    try:
        if os.path.realpath(args.out_dir) == os.path.realpath(args.dense_dir):
            raise ValueError(f"the output folder {args.out_dir!r} is the input folder; choose a new one")
        check_output_folder(args.out_dir, args.overwrite, "moetrain convert upcycle")
        model = upcycle(args.dense_dir, args.out_dir, args.num_experts, args.top_k, args.granularity, args.seed)[0]
    except expected_errors() as exc:
        print(f"moetrain convert upcycle: error: {describe(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    moe = model["moe"]
    print(f"wrote {args.out_dir}: moe_gpt, {model['num_layers']} MoE layers of {moe['num_experts']} experts "
          f"(ffn {moe['ffn_hidden_size']}), top-{moe['top_k']}; train on with checkpoint.load_path={args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
