"""Worker of tests/test_comm.py (4 ranks, dp=2 x tp=2), one launch for every backend phase
(comm_cases.PHASES): every op of moetrain.distributed.comm, its output and gradient (PyNative and ms.jit),
per-op byte ledgers beside the primitive calls recorded by comm_recorder, PairLink exchanges, and
on the contract backend mutated native call sites. Writes <out>/rank_<r>.npz (arrays) and
<out>/rank_<r>.json (ledgers, records, errors, timings).

    python tests/workers/comm_worker.py OUT_DIR [--bench]
"""
import argparse
import json
import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comm_cases import (CASES, DYNAMIC_CASES, EXACT_EXPERTS, EXACT_FFN, EXACT_HIDDEN, EXACT_TOP_K,  # noqa: E402
                        LINK_EXCHANGES, LINK_SHAPE, MUTATIONS, PHASES, SPARE_WEIGHT, case_input, exact_inputs,
                        exact_weights, link_payload, loss_weight, phase_cases, position)
from comm_recorder import CONTRACT_PRIMS, Recorder  # noqa: E402
from mindspore import ops  # noqa: E402

from moetrain.distributed import comm  # noqa: E402


def apply(op, x, group, kw):
    if kw.get("stop_gradient"):
        x = ops.stop_gradient(x)
    if op == "all_reduce":
        return comm.all_reduce(x, group)
    if op == "all_gather":
        return comm.all_gather(x, group, kw["axis"])
    if op == "reduce_scatter":
        return comm.reduce_scatter(x, group, kw["axis"])
    if op == "all_to_all":
        return comm.all_to_all(x, group, kw["split_axis"], kw["concat_axis"])
    if op == "all_to_all_v":
        return comm.all_to_all_v(x, kw["send_counts"], kw["recv_counts"], group)
    if op == "broadcast":
        return comm.broadcast(x, kw["src"], group)
    if op == "copy_to_region":
        return comm.copy_to_region(x, group)
    if op == "reduce_from_region":
        return comm.reduce_from_region(x, group)
    if op == "scatter_to_region":
        return comm.scatter_to_region(x, group, kw["axis"])
    if op == "gather_from_region":
        return comm.gather_from_region(x, group, kw["axis"])
    if op == "reduce_scatter_to_sequence":
        return comm.reduce_scatter_to_sequence(x, group, kw["axis"])
    return comm.gather_from_sequence(x, group, kw["axis"])


def log(message):
    print(f"[comm_worker] {time.strftime('%H:%M:%S')} {message}", flush=True)


def columns(ledger, backward):
    return {"native": ledger.bytes_by_group(backward=backward),
            "emulated": ledger.bytes_by_group(backward=backward, emulated=True)}


class Worker:
    def __init__(self, ctx, recorder):
        import mindspore as ms
        from mindspore import Tensor

        self.ms, self.ctx, self.rank, self.recorder = ms, ctx, ctx.rank, recorder
        self.arrays, self.report = {}, {"rank": ctx.rank, "phases": {}, "mutations": {},
                                        "group_kinds": {g.name: kind for kind, g in ctx.groups.items()
                                                        if not g.is_trivial and kind in ("world", "tp", "dp")}}
        self.specs, self.xs, self.ws = {}, {}, {}   # by case name
        for name, op, kind, shape_of, kw in CASES:
            kw = dict(kw)
            if op == "all_to_all_v":
                counts, pos = kw.pop("counts"), position(kind, self.rank)
                kw["send_counts"] = list(counts[pos])
                kw["recv_counts"] = [row[pos] for row in counts]
            self.specs[name] = (op, ctx.group(kind), kw)
            self.xs[name] = x = Tensor(case_input(name, self.rank, shape_of(self.rank)))
            self.ws[name] = Tensor(loss_weight(name, self.rank, apply(op, x, ctx.group(kind), kw).shape))

    def measured(self, fn, x, w):
        """`y = fn(x)` and the gradient of <w, y> (PyNative), with the ledger's columns and the
        primitive calls of both (those of the backward marked)."""
        def loss(x, w):
            y = fn(x)
            self.recorder.backward_starts()
            return (y * w).sum(), y

        grad = self.ms.value_and_grad(loss, grad_position=0, has_aux=True)
        with self.recorder.recording() as calls, comm.CommLedger() as ledger:
            (_, y), dx = grad(x, w)
        return y.asnumpy(), dx.asnumpy(), {"forward": columns(ledger, backward=False),
                                           "all": columns(ledger, backward=True), "calls": list(calls)}

    # ---- PyNative: per op, values, gradients, ledger and the primitive calls -----------------
    def pynative(self, label, phase):
        out = {}
        start = time.perf_counter()
        for name, *_ in phase_cases(label):
            (op, g, kw), x, w = self.specs[name], self.xs[name], self.ws[name]
            y, dx, out[name] = self.measured(lambda x, op=op, g=g, kw=kw: apply(op, x, g, kw), x, w)
            self.arrays[f"{label}/pynative/{name}/y"], self.arrays[f"{label}/pynative/{name}/dx"] = y, dx
        phase["ledgers"] = out
        phase["pynative_s"] = time.perf_counter() - start

    # ---- ms.jit: every op of the phase in one graph ------------------------------------------
    def jit(self, label, phase):
        ms, cases = self.ms, phase_cases(label)
        specs = tuple(self.specs[case[0]] for case in cases)
        count = len(specs)

        def loss_fn(*tensors):   # inputs then loss weights (tuple arguments break grads under jit)
            outs, loss = (), 0.0
            for spec, x, w in zip(specs, tensors[:count], tensors[count:]):
                y = apply(spec[0], x, spec[1], spec[2])
                loss = loss + (y * w).sum()
                outs = outs + (y,)
            return loss, outs

        fn = ms.jit(ms.value_and_grad(loss_fn, grad_position=tuple(range(count)), has_aux=True))
        inputs = [self.xs[case[0]] for case in cases] + [self.ws[case[0]] for case in cases]
        start = time.perf_counter()
        fn(*inputs)                     # first call: compiles
        phase["jit_first_call_s"] = time.perf_counter() - start
        with comm.CommLedger() as ledger:
            (_, outs), grads = fn(*inputs)
        phase["jit_ledger"] = columns(ledger, backward=True)
        for (name, *_), y, dx in zip(cases, outs, grads):
            self.arrays[f"{label}/jit/{name}/y"] = y.asnumpy()
            self.arrays[f"{label}/jit/{name}/dx"] = dx.asnumpy()

    # ---- PairLink on the tp pair: position 0 is the lower stage --------------------------------
    def links(self, label, phase):
        from mindspore import Tensor

        tp = self.ctx.group("tp")
        lower = tp.rank_in_group == 0
        link = comm.PairLink(tp, lower)
        out = {}
        for name, lower_sends, upper_sends in LINK_EXCHANGES:
            sends, receives = (lower_sends, upper_sends) if lower else (upper_sends, lower_sends)
            payload = Tensor(link_payload(name, self.rank)) if sends else None
            with self.recorder.recording() as calls, comm.CommLedger() as ledger:
                got = link.exchange(payload, LINK_SHAPE if receives else None)
            self.arrays[f"{label}/link/{name}"] = got.asnumpy() if got is not None else np.zeros(0, np.float32)
            out[name] = {"ledger": columns(ledger, backward=False), "calls": list(calls)}
        phase["links"] = out

    def int32_exchange(self, label):
        """Counts travel as int32 on the native path: exact, negative and > 2**24 values included."""
        from mindspore import Tensor

        x = (np.arange(8, dtype=np.int64).reshape(4, 2) * 70001 - 3 * 10 ** 7 * self.rank).astype(np.int32)
        self.arrays[f"{label}/int32/y"] = comm.all_to_all(Tensor(x), self.ctx.group("world")).asnumpy()

    # ---- all_to_all_v_dynamic: Tensor counts, a spare row in and out (contract Ascend, PyNative) --
    def dynamic_input(self, name):
        """(x with a zero spare row, loss weights with SPARE_WEIGHT on the spare, send, recv counts)."""
        from mindspore import Tensor

        op, g, kw = self.specs[name]
        x, w = self.xs[name].asnumpy(), self.ws[name].asnumpy()
        spare = lambda a, v: Tensor(np.concatenate([a, np.full((1,) + a.shape[1:], v, a.dtype)]))  # noqa: E731
        counts = lambda c: Tensor(np.array(c, np.int64))   # noqa: E731
        return g, spare(x, 0.0), spare(w, SPARE_WEIGHT), counts(kw["send_counts"]), counts(kw["recv_counts"])

    def dynamic(self, label, phase):
        out = {}
        for name in DYNAMIC_CASES:
            g, x, w, send, recv = self.dynamic_input(name)
            y, dx, out[name] = self.measured(
                lambda x, g=g, send=send, recv=recv: comm.all_to_all_v_dynamic(x, send, recv, g), x, w)
            self.arrays[f"{label}/dynamic/{name}/y"], self.arrays[f"{label}/dynamic/{name}/dx"] = y, dx
        phase["dynamic"] = out

    # ---- the exact-split alltoall dispatcher, every token to position 0 of its tp pair ----------
    def exact_dispatch(self, phase):
        from mindspore import Tensor

        from moetrain.moe.ep_dispatcher import build_ep_dispatcher
        from moetrain.moe.experts import GroupedExperts
        from moetrain.parallel.expert_parallel import shard_experts

        os.environ["MOETRAIN_MOE_PLATFORM"] = "ascend"   # read when the cells are built
        try:
            tp = self.ctx.group("tp")
            experts = GroupedExperts(EXACT_EXPERTS, EXACT_HIDDEN, EXACT_FFN)
            for param, full in zip((experts.w_gate, experts.w_up, experts.w_down), exact_weights()):
                param.set_data(Tensor(full))
            shard_experts(experts, tp.rank_in_group, tp.size)
            dispatcher = build_ep_dispatcher("alltoall", EXACT_EXPERTS, EXACT_TOP_K, 0.0, tp, experts.layout,
                                             experts.ops.path)
        finally:
            os.environ.pop("MOETRAIN_MOE_PLATFORM")
        x, idx, weight, cot = exact_inputs(self.rank)

        def loss_fn(x, topk_weight):
            expert_input, state = dispatcher.dispatch(x, Tensor(idx), topk_weight)
            y = dispatcher.combine(experts(expert_input, state.get("row_expert"), state.get("group_sizes")), state)
            return (y * Tensor(cot)).sum(), y, state["expert_rows"], state["group_sizes"]

        grad_fn = self.ms.value_and_grad(loss_fn, (0, 1), has_aux=True)
        with self.recorder.recording() as calls:
            (_, y, rows, sizes), (dx, dweight) = grad_fn(Tensor(x), Tensor(weight))
        for key, value in (("y", y), ("dx", dx), ("dweight", dweight), ("expert_rows", rows), ("group_sizes", sizes)):
            self.arrays[f"exact/{key}"] = value.asnumpy()
        phase["exact"] = {"splits": dispatcher.splits, "capacity_fields": list(dispatcher.capacity_fields()),
                          "compute": experts.compute, "calls": list(calls)}

    # ---- emulated extras: jitted loops book nothing, inf stays in its slot ---------------------
    def loop_and_inf(self, phase):
        from mindspore import Tensor

        tp = self.ctx.group("tp")

        def chained(x):
            for _ in range(3):
                x = comm.all_reduce(x, tp) * 0.5
            return x

        probe = Tensor(np.full((5, 7), self.rank + 1.0, np.float32))
        for mode, fn in (("pynative", chained), ("jit", self.ms.jit(chained))):
            fn(probe)
            with comm.CommLedger() as ledger:
                self.arrays[f"loop_{mode}/y"] = fn(probe).asnumpy()
            phase[f"loop_{mode}_ledger"] = ledger.bytes_by_group(backward=False)
        special = np.zeros((2, 2), np.float32) + self.rank
        if self.rank == 1:
            special[0, 0] = np.inf
        self.arrays["inf/y"] = comm.all_gather(Tensor(special), self.ctx.group("world")).asnumpy()

    # ---- mutated native call sites (contract backend, PyNative, forward only) ------------------
    def mutations(self):
        for mutation, target in MUTATIONS.items():
            log(f"mutation {mutation}")
            record = {"error": None}
            saved = (comm.primitives, comm.native_target, comm._AllToAllV._exchange_v,
                     os.environ.get("MOETRAIN_CONTRACT_TARGET"))
            try:
                y = self._mutated(mutation, target)
                if y is not None:
                    self.arrays[f"mutation/{mutation}/y"] = y.asnumpy()
            except Exception as exc:  # noqa: BLE001 - the error is the result
                record["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                comm.primitives, comm.native_target, comm._AllToAllV._exchange_v = saved[:3]
                os.environ["MOETRAIN_CONTRACT_TARGET"] = saved[3]
                comm.clear_op_cache()
            self.report["mutations"][mutation] = record

    def _mutated(self, mutation, target):
        from mindspore.communication import GlobalComm

        from moetrain.testing import contract

        overrides = {}
        if mutation == "alltoall_axes_swapped":
            class Swapped(contract.AlltoAll):
                def __init__(self, split_count, split_dim, concat_dim, group=GlobalComm.WORLD_COMM_GROUP):
                    super().__init__(split_count, concat_dim, split_dim, group)
            overrides["AlltoAll"] = Swapped
        elif mutation == "broadcast_global_root":
            class GlobalRoot(contract.Broadcast):   # the pre-fix call site: a global root
                def __init__(self, root_rank, group=GlobalComm.WORLD_COMM_GROUP):
                    super().__init__(contract.group_ranks(group)[root_rank], group)
            overrides["Broadcast"] = GlobalRoot
        elif mutation == "allgather_wrong_group":
            class WorldGather(contract.AllGather):
                def __init__(self, group=GlobalComm.WORLD_COMM_GROUP):
                    super().__init__(GlobalComm.WORLD_COMM_GROUP)
            overrides["AllGather"] = WorldGather
        elif mutation == "alltoallv_recv_reversed":
            class Reversed(contract.AlltoAllV):
                def __call__(self, x, send_numel_list, recv_numel_list):
                    return super().__call__(x, send_numel_list, list(recv_numel_list)[::-1])
            overrides["AlltoAllV"] = Reversed
        elif mutation == "alltoall_on_gpu":   # a GPU run taking the Ascend-only branch
            os.environ["MOETRAIN_CONTRACT_TARGET"] = "GPU"
            comm.native_target = lambda: "Ascend"
        elif mutation == "receive_wrong_shape":
            class WrongShape(contract.Receive):
                def __init__(self, sr_tag, src_rank, shape, dtype, group=GlobalComm.WORLD_COMM_GROUP,
                             group_back=GlobalComm.WORLD_COMM_GROUP):
                    super().__init__(sr_tag, src_rank, list(shape)[::-1], dtype, group, group_back)
            overrides["Receive"] = WrongShape
        elif mutation == "send_recv_tag_mismatch":
            class OtherTag(contract.Receive):
                def __init__(self, sr_tag, *args, **kwargs):
                    super().__init__(sr_tag + 1, *args, **kwargs)
            overrides["Receive"] = OtherTag
        elif mutation == "alltoallv_tensor_lists_swapped":
            class SwappedLists(contract.AlltoAllV):
                def __call__(self, x, send_numel_list, recv_numel_list):
                    return super().__call__(x, recv_numel_list, send_numel_list)
            overrides["AlltoAllV"] = SwappedLists
        elif mutation == "alltoallv_tensor_block_size":
            class BlockOfOne(contract.AlltoAllV):
                def __init__(self, group=GlobalComm.WORLD_COMM_GROUP, block_size=1):
                    super().__init__(group, 1)
            overrides["AlltoAllV"] = BlockOfOne
        elif mutation == "alltoallv_empty_reshaped":   # the pre-fix code: reshape what AlltoAllV returns
            def exchange_v(cell, x, send_numel, recv_numel, elements, rows):
                y = cell.prim(ops.Reshape()(x, (elements,)), send_numel, recv_numel)
                return ops.Reshape()(y, (rows,) + cell.rest)
            comm._AllToAllV._exchange_v = exchange_v
        prims = types.SimpleNamespace(**{name: getattr(contract, name) for name in CONTRACT_PRIMS})
        prims.__dict__.update(overrides)
        comm.primitives = lambda: prims
        comm.clear_op_cache()
        if target == "link":
            tp = self.ctx.group("tp")
            link = comm.PairLink(tp, tp.rank_in_group == 0)
            if mutation == "both_stages_send_first":
                link.lower = True   # the upper stage also sends before it receives
            exchange = "lower_to_upper" if mutation == "receive_wrong_shape" else "two_way"
            sends = exchange == "two_way" or tp.rank_in_group == 0
            receives = exchange == "two_way" or tp.rank_in_group == 1
            payload = self.ms.Tensor(link_payload(exchange, self.rank)) if sends else None
            return link.exchange(payload, LINK_SHAPE if receives else None)
        if target.startswith("dynamic:"):
            group, x, _, send, recv = self.dynamic_input(target[len("dynamic:"):])
            return comm.all_to_all_v_dynamic(x, send, recv, group)
        op, group, kw = self.specs[target]
        return apply(op, self.xs[target], group, kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--bench", action="store_true", help="also time 1 MB all_reduce / all_to_all (emulated)")
    args = ap.parse_args()

    import mindspore as ms

    ms.set_device("CPU")
    from moetrain.distributed.topology import init_parallel

    ctx = init_parallel(dp=2, tp=2)
    recorder = Recorder()
    recorder.install()
    worker = Worker(ctx, recorder)
    for label, backend, target, modes in PHASES:
        os.environ["MOETRAIN_COMM_BACKEND"], os.environ["MOETRAIN_CONTRACT_TARGET"] = backend, target
        phase = worker.report["phases"][label] = {"backend": comm.backend_name(), "target": comm.native_target()}
        log(f"{label}: PyNative")
        worker.pynative(label, phase)
        if "jit" in modes:
            log(f"{label}: jit")
            worker.jit(label, phase)
        if label != "contract_gpu":   # PairLink's path does not depend on the target
            log(f"{label}: links")
            worker.links(label, phase)
        if backend == "contract":
            worker.int32_exchange(label)
        if label == "contract":
            log(f"{label}: dynamic all_to_all_v, exact dispatch")
            worker.dynamic(label, phase)
            worker.exact_dispatch(phase)
        if label == "emulated":
            worker.loop_and_inf(phase)
    os.environ["MOETRAIN_COMM_BACKEND"], os.environ["MOETRAIN_CONTRACT_TARGET"] = "contract", "Ascend"
    log("mutations")
    worker.mutations()
    log("done")

    if args.bench:
        os.environ["MOETRAIN_COMM_BACKEND"] = "emulated"
        world = ctx.group("world")
        big = ms.Tensor(np.ones((256, 1024), np.float32))   # 1 MiB
        for label, run in (("all_reduce_1MiB_ms", lambda: comm.all_reduce(big, world)),
                           ("all_to_all_1MiB_ms", lambda: comm.all_to_all(big, world))):
            run().asnumpy()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                run().asnumpy()
                times.append((time.perf_counter() - start) * 1000)
            worker.report[label] = float(np.median(times))

    os.makedirs(args.out_dir, exist_ok=True)
    np.savez(os.path.join(args.out_dir, f"rank_{ctx.rank}.npz"), **worker.arrays)
    with open(os.path.join(args.out_dir, f"rank_{ctx.rank}.json"), "w") as f:
        json.dump(worker.report, f)


if __name__ == "__main__":
    main()
