"""Worker of tests/test_expert_parallel.py (4 ranks, dp=4): every case of ep_cases.CASES through
an expert-parallel dispatcher and this rank's slice of the experts, forward and backward, with the
"ep" byte ledger of the call and the shapes of the buffers that entered MindSpore's AllReduce
primitive (a test-only recorder); then the 'global' aux-loss scope of a MoELayer. Writes
<out>/rank_<r>.npz (arrays) and <out>/rank_<r>.json (ledgers, recorded buffers, capacities, timings).

    python tests/workers/ep_layer_worker.py OUT_DIR [CONFIG RUN ...]

With CONFIG and RUNs, the training runs of ep_train_worker.py follow in the same job (one msrun
launch instead of two), their records in OUT_DIR/train/rank_<r>.json.
"""
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_cases as C  # noqa: E402


class AllReduceRecorder:
    """Test-only: (group, shape, dtype) of every AllReduce primitive call while `calls` is a list,
    taken where the tensor enters MindSpore's collective (PyNative: forward and backward)."""

    def __init__(self, ops):
        self.calls = None
        original = ops.AllReduce.__call__
        recorder = self

        def call(prim, *args, **kwargs):
            if recorder.calls is not None:
                recorder.calls.append([getattr(prim, "group", ""), list(args[0].shape), str(args[0].dtype)])
            return original(prim, *args, **kwargs)

        ops.AllReduce.__call__ = call


def main():
    out_dir = sys.argv[1]
    import mindspore as ms
    from mindspore import Tensor, ops

    ms.set_device("CPU")
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.ep_dispatcher import build_ep_dispatcher
    from moetrain.moe.experts import GroupedExperts
    from moetrain.moe.layer import MoELayer
    from moetrain.distributed import comm
    from moetrain.parallel.expert_parallel import shard_experts
    from moetrain.distributed.topology import init_parallel

    from moetrain import compat

    # ep=4 needs no new communicator (its groups are the world); ep=2 then creates its groups, which
    # a MindSpore without CPU sub-group collectives (2.7, moetrain/compat.py) cannot use: there the
    # ep=4 cases run alone (the test skips the others, C.runs_here)
    contexts = {4: init_parallel(dp=4, ep=4)}
    if compat.cpu_subgroup_collectives():
        contexts[2] = init_parallel(dp=4, ep=2, verbose=False)
    rank = contexts[4].rank
    arrays, report = {}, {"rank": rank}
    full_weights = C.expert_weights()
    recorder = AllReduceRecorder(ops)

    for name, case in C.CASES.items():
        if case.ep not in contexts:
            continue
        os.environ["MOETRAIN_MOE_PLATFORM"] = case.path       # read when the cells are built
        pctx = contexts[case.ep]
        ep_group = pctx.group("ep")
        experts = GroupedExperts(C.EXPERTS, C.HIDDEN, C.FFN, compute=case.compute)
        for param, full in zip((experts.w_gate, experts.w_up, experts.w_down), full_weights):
            param.set_data(Tensor(full))
        shard_experts(experts, pctx.ep_rank, case.ep)
        dispatcher = build_ep_dispatcher(case.dispatcher, C.EXPERTS, C.TOP_K, case.capacity_factor, ep_group,
                                         experts.layout, experts.ops.path)
        if case.capacity == "tight":       # exactly what the routing of this ep group needs
            needed = dispatcher.needed_capacity(C.loads(case.routing, ep_group.ranks))
            for field in dispatcher.capacity_fields():
                setattr(dispatcher, field, needed[field])
        capacities = {f: getattr(dispatcher, f) for f in dispatcher.capacity_fields()}
        idx, weight = C.routing(case.routing, rank)
        topk_idx = Tensor(idx)

        def loss_fn(x, topk_weight, cot):
            expert_input, state = dispatcher.dispatch(x, topk_idx, topk_weight)
            expert_output = experts(expert_input, state.get("row_expert"), state.get("group_sizes"))
            y = dispatcher.combine(expert_output, state)
            return (y * cot).sum(), y, state["tokens_per_expert"], state["dropped"], state["expert_rows"]

        grad_fn = ms.value_and_grad(loss_fn, (0, 1), experts.trainable_params(), has_aux=True)
        fn = ms.jit(grad_fn) if case.mode == "jit" else grad_fn
        start = time.perf_counter()
        recorder.calls = []
        with comm.CommLedger() as ledger:    # one call (jit: compile included): one step's bytes
            (_, y, load, dropped, expert_rows), (input_grads, param_grads) = fn(
                Tensor(C.tokens(case.data, rank)), Tensor(weight), Tensor(C.cotangent(case.data, rank)))
            y.asnumpy()
        calls, recorder.calls = [c[1:] for c in recorder.calls if c[0] == ep_group.name], None
        for label, value in (("y", y), ("load", load), ("dropped", dropped), ("expert_rows", expert_rows),
                             ("dx", input_grads[0]), ("dweight", input_grads[1]), ("dw_gate", param_grads[0]),
                             ("dw_up", param_grads[1]), ("dw_down", param_grads[2])):
            arrays[f"{name}/{label}"] = value.asnumpy()
        report[name] = {"seconds": time.perf_counter() - start,
                        "native": ledger.bytes_by_group(backward=True).get("ep", 0),
                        "native_forward": ledger.bytes_by_group(backward=False).get("ep", 0),
                        "emulated": ledger.bytes_by_group(backward=True, emulated=True).get("ep", 0),
                        "allreduce_inputs": calls, "capacity": capacities,
                        "dispatcher": type(dispatcher).__name__, "compute": experts.compute}
        print(f"rank {rank}: {name} ({case.mode}) {report[name]['seconds']:.1f} s", flush=True)
    os.environ.pop("MOETRAIN_MOE_PLATFORM")

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

    if len(sys.argv) > 2:
        from ep_train_worker import train_runs

        os.makedirs(os.path.join(out_dir, "train"), exist_ok=True)
        train_runs(os.path.join(out_dir, "train"), sys.argv[2], sys.argv[3:],
                   {(4, 1, 1, 4): contexts[4], (4, 1, 1, 2): contexts[2]})


if __name__ == "__main__":
    main()
