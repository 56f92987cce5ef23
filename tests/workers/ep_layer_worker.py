"""Worker of tests/test_expert_parallel.py (4 ranks, dp=4): every case of ep_cases.CASES through
an expert-parallel dispatcher and this rank's slice of the experts, forward and backward, with the
"ep" byte ledger of the call; then the 'global' aux-loss scope of a MoELayer. Writes
<out>/rank_<r>.npz (arrays) and <out>/rank_<r>.json (ledgers, timings).

    python tests/workers/ep_layer_worker.py OUT_DIR
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_cases as C  # noqa: E402


def main():
    out_dir = sys.argv[1]
    import mindspore as ms
    from mindspore import Tensor

    ms.set_device("CPU")
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.ep_dispatcher import build_ep_dispatcher
    from moetrain.moe.experts import GroupedExperts
    from moetrain.moe.layer import MoELayer
    from moetrain.dist import comm
    from moetrain.parallel.expert_parallel import shard_experts
    from moetrain.dist.topology import init_parallel

    # ep=4 needs no new communicator (its groups are the world); ep=2 then creates its groups
    contexts = {4: init_parallel(dp=4, ep=4), 2: init_parallel(dp=4, ep=2, verbose=False)}
    rank = contexts[4].rank
    arrays, report = {}, {"rank": rank}
    full_weights = C.expert_weights()

    for name, (dispatcher_name, ep, capacity_factor, routing_kind, mode) in C.CASES.items():
        pctx = contexts[ep]
        experts = GroupedExperts(C.EXPERTS, C.HIDDEN, C.FFN)
        for param, full in zip((experts.w_gate, experts.w_up, experts.w_down), full_weights):
            param.set_data(Tensor(full))
        shard_experts(experts, pctx.ep_rank, ep)
        dispatcher = build_ep_dispatcher(dispatcher_name, C.EXPERTS, C.TOP_K, capacity_factor, pctx.group("ep"))
        idx, weight = C.routing(routing_kind, rank)
        topk_idx = Tensor(idx)

        def loss_fn(x, topk_weight, cot):
            expert_input, state = dispatcher.dispatch(x, topk_idx, topk_weight)
            y = dispatcher.combine(experts(expert_input, state.get("block_expert")), state)
            return (y * cot).sum(), y, state["tokens_per_expert"], state["dropped"]

        grad_fn = ms.value_and_grad(loss_fn, (0, 1), experts.trainable_params(), has_aux=True)
        fn = ms.jit(grad_fn) if mode == "jit" else grad_fn
        start = time.perf_counter()
        with comm.CommLedger() as ledger:    # one call (jit: compile included): one step's bytes
            (_, y, load, dropped), (input_grads, param_grads) = fn(
                Tensor(C.tokens(name, rank)), Tensor(weight), Tensor(C.cotangent(name, rank)))
        for label, value in (("y", y), ("load", load), ("dropped", dropped), ("dx", input_grads[0]),
                             ("dweight", input_grads[1]), ("dw_gate", param_grads[0]),
                             ("dw_up", param_grads[1]), ("dw_down", param_grads[2])):
            arrays[f"{name}/{label}"] = value.asnumpy()
        report[name] = {"seconds": time.perf_counter() - start,
                        "native": ledger.bytes_by_group(backward=True).get("ep", 0),
                        "native_forward": ledger.bytes_by_group(backward=False).get("ep", 0),
                        "emulated": ledger.bytes_by_group(backward=True, emulated=True).get("ep", 0)}
        print(f"rank {rank}: {name} ({mode}) {report[name]['seconds']:.1f} s", flush=True)

    # 'global' aux-loss scope: value and router gradient of the aux loss on every dp rank
    cfg = MoEConfig(num_experts=C.EXPERTS, top_k=C.TOP_K, ffn_hidden_size=C.FFN, aux_loss_coeff=C.AUX_COEFF)
    for scope in ("global", "micro_batch"):
        layer = MoELayer(C.HIDDEN, cfg)
        layer.router.weight.set_data(Tensor(C.router_weight()))
        layer.set_aux_loss_scope(scope, contexts[4].group("dp"))

        def aux_fn(x):
            _, stats = layer(x)
            return stats["aux_loss"]

        mode = "jit" if scope == "global" else "pynative"
        fn = ms.value_and_grad(aux_fn, None, [layer.router.weight])
        aux, grads = (ms.jit(fn) if mode == "jit" else fn)(Tensor(C.aux_tokens(rank)))
        arrays[f"aux/{scope}/value"] = aux.asnumpy()
        arrays[f"aux/{scope}/router_grad"] = grads[0].asnumpy()

    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, f"rank_{rank}.npz"), **arrays)
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
