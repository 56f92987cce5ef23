"""Dense-to-MoE upcycling: a dense model directory -> a MoE model directory with the same forward
(the family declares it, `moetrain.family.Upcycling`: dense `gpt` -> `moe_gpt` ships).

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
import dataclasses
import os
import sys
from typing import Any, Dict, Tuple

import numpy as np

from moetrain.checkpoint.model_dir import (build_config_from_dict, build_model_from_dict, load_model_dir,
                                           load_model_state, save_model_dir)
from moetrain.family import Upcycling
from moetrain.registry import get_model, registered_models
from moetrain.errors import EXIT_BAD_INPUT, describe, expected_errors
from moetrain.fileio import check_output_folder


def _upcycling(dense: Dict[str, Any]) -> Upcycling:
    try:
        family = get_model(dense.get("name")).family
    except KeyError:
        family = None
    if family is None or family.upcycle is None:
        offered = sorted(name for name, e in registered_models().items() if e.family.upcycle is not None)
        raise ValueError(f"upcycle: the model directory holds a {dense.get('name')!r} model; it upcycles dense "
                         f"{' / '.join(f'`{name}`' for name in offered)} models")
    return family.upcycle


def upcycled_model_section(dense: Dict[str, Any], num_experts: int, top_k: int, granularity: int) -> Dict[str, Any]:
    """The MoE `model:` section for upcycling the dense section `dense` (its family's `Upcycling`)."""
    upcycling = _upcycling(dense)
    for key, value, low in (("--num-experts", num_experts, 1), ("--top-k", top_k, 1), ("--granularity", granularity, 1)):
        if value < low:
            raise ValueError(f"upcycle: {key} must be >= {low}, got {value}")
    if top_k > num_experts:
        raise ValueError(f"upcycle: --top-k ({top_k}) cannot exceed --num-experts ({num_experts})")
    return dataclasses.asdict(build_config_from_dict(upcycling.section(dense, num_experts, top_k, granularity)))


def upcycle_state(state: Dict[str, np.ndarray], dense: Dict[str, Any], model: Dict[str, Any], num_experts: int,
                  granularity: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """The upcycled model's tensors from the dense `state` of the section `dense` (see the module
    docstring for the layout)."""
    return _upcycling(dense).state(state, model, num_experts, granularity, seed)


def upcycle(dense_dir: str, out_dir: str, num_experts: int, top_k: int, granularity: int = 1,
            seed: int = 0) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
    """Write the upcycled model directory; returns its `(model section, state)`."""
    config, state = load_model_dir(dense_dir)
    model = upcycled_model_section(config["model"], num_experts, top_k, granularity)
    new_state = upcycle_state(state, config["model"], model, num_experts, granularity, seed)

    load_model_state(build_model_from_dict(model, deferred=True), new_state, strict=True)   # every name and shape fits
    save_model_dir(out_dir, {"model": model}, new_state)
    return model, new_state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moetrain convert upcycle", description="dense model directory -> "
                                 "MoE model directory with the same forward (continue with checkpoint.load_path)")
    ap.add_argument("dense_dir", help="model directory or training checkpoint of a dense model whose family upcycles")
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
    print(f"wrote {args.out_dir}: {model['name']}, {model['num_layers']} MoE layers of {moe['num_experts']} experts "
          f"(ffn {moe['ffn_hidden_size']}), top-{moe['top_k']}; train on with checkpoint.load_path={args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
