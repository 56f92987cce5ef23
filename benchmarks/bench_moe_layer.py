"""Micro-benchmark of the MoE layer's dispatch schemes: forward + backward under `ms.jit` on CPU.

    python benchmarks/bench_moe_layer.py                       # all candidates, T=2048 H=256 F=512 E=8 k=2
    python benchmarks/bench_moe_layer.py --candidates rows capacity1.25 --rounds 3

Candidates (all compute the same function; dropless ones exactly, capacity ones drop overflow):
  rows            dropless: rows sorted by expert, one GEMM per expert (GroupedMatmul kernel; the
                  library default where the kernels build)
  capacityT       dropless: the [E, C, H] capacity buffer with C = T (an expert can see every token;
                  the library runs this layout without the kernels, C sized from the routing counts)
  loop-dynamic    dropless: a Python loop over experts on exact, dynamically shaped slices of the
                  sorted tokens (no padding; dynamic shapes in the graph)
  capacityF       capacity factor F: [E, C, H] buffer, C = ceil(F T k / E), batched matmul
  loop-capacityF  capacity factor F: the same buffer, a loop of per-expert matmuls
Rounds interleave the candidates so that load from other processes hits all of them alike; the
minimum wall time over runs is the number to compare, the median and the process CPU time (all
threads) show how much other processes on the machine disturbed the run.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from moetrain.moe.config import MoEConfig
from moetrain.moe.dispatcher import SortDispatcher
from moetrain.moe.experts import GroupedExperts
from moetrain.moe.layer import MoELayer
from moetrain.moe.permutation import sort_by_expert


class LoopExperts(GroupedExperts):
    """Same parameters as GroupedExperts, one 2-D matmul chain per expert over its buffer slice."""

    def construct(self, x, row_expert=None, group_sizes=None):
        matmul = ops.MatMul()
        outputs = []
        inputs = ops.split(x, 1, 0)
        w_gate, w_up, w_down = ops.split(self.w_gate, 1, 0), ops.split(self.w_up, 1, 0), ops.split(self.w_down, 1, 0)
        for e in range(self.num_local_experts):
            rows = inputs[e][0]
            hidden = ops.silu(matmul(rows, w_gate[e][0])) * matmul(rows, w_up[e][0])
            outputs.append(matmul(hidden, w_down[e][0]))
        return ops.stack(outputs, 0)


class DynamicLoopDispatcher(SortDispatcher):
    """Exact dropless routing with per-expert dynamic shapes; `experts` is called from `combine`."""

    def __init__(self, num_experts, top_k, experts):
        super().__init__(num_experts, top_k)
        self.loop_experts = experts
        self.matmul = ops.MatMul()

    def dispatch(self, x, topk_idx, topk_weight):
        order, _, _, tokens_per_expert = sort_by_expert(topk_idx.reshape(-1), self.num_experts)
        sorted_tokens = ops.gather(x, order // self.top_k, 0)
        state = {"order": order, "tokens_per_expert": tokens_per_expert, "topk_weight": topk_weight,
                 "dropped": ops.zeros((), ms.float32),
                 "expert_rows": ops.full((), x.shape[0] * self.top_k, dtype=ms.float32),
                 "computed_rows": ops.full((), x.shape[0] * self.top_k, dtype=ms.float32)}
        return sorted_tokens, state

    def combine(self, sorted_tokens, state):
        counts = state["tokens_per_expert"]
        ends = ops.cumsum(counts, 0)
        experts = self.loop_experts
        outputs = []
        for e in range(self.num_experts):
            rows = sorted_tokens[ends[e] - counts[e]:ends[e]]
            hidden = ops.silu(self.matmul(rows, experts.w_gate[e])) * self.matmul(rows, experts.w_up[e])
            outputs.append(self.matmul(hidden, experts.w_down[e]))
        sorted_output = ops.concat(outputs, 0)
        order, weight = state["order"], state["topk_weight"]
        unsorted = ops.scatter_nd(order.reshape(-1, 1), sorted_output, sorted_output.shape)
        num_tokens, top_k = weight.shape
        picked = unsorted.reshape(num_tokens, top_k, -1)
        return ops.BatchMatMul()(weight.reshape(num_tokens, 1, top_k), picked).reshape(num_tokens, -1)


class PassThrough(nn.Cell):
    """Stands in for the experts when the dispatcher runs them itself (loop-dynamic)."""

    def construct(self, x, row_expert=None, group_sizes=None):
        return x


def build_candidate(name: str, args) -> MoELayer:
    capacity_factor = 0.0
    if name.startswith("loop-capacity"):
        capacity_factor = float(name[len("loop-capacity"):])
    elif name == "capacityT":
        capacity_factor = args.experts / args.top_k  # C = T: never drops
    elif name.startswith("capacity"):
        capacity_factor = float(name[len("capacity"):])
    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, ffn_hidden_size=args.ffn,
                    capacity_factor=capacity_factor, aux_loss_coeff=0.0)
    ms.set_seed(0)
    layer = MoELayer(args.hidden, cfg)
    if name.startswith("capacity") or name.startswith("loop-"):   # batched matmul over [E, C, H]
        layer.experts.compute, layer.dispatcher.layout = "bmm", "capacity"
    if name == "rows":
        if layer.experts.compute != "kernel":
            raise SystemExit("candidate 'rows' needs the moetrain kernels (moetrain.kernels.available())")
    elif name.startswith("loop-capacity"):
        loop = LoopExperts(args.experts, args.hidden, args.ffn)
        for name in ("w_gate", "w_up", "w_down"):
            getattr(loop, name).set_data(getattr(layer.experts, name).data)
        layer.experts = loop
    elif name == "loop-dynamic":
        layer.dispatcher = DynamicLoopDispatcher(args.experts, args.top_k, layer.experts)
        layer.experts = PassThrough()
    elif not name.startswith("capacity"):
        raise SystemExit(f"unknown candidate {name!r}; see --help")
    return layer


def make_step(layer: MoELayer):
    params = layer.trainable_params()

    def loss_fn(x, cotangent):
        y, stats = layer(x)
        return (y * cotangent).sum(), stats["dropped"]

    return ms.jit(ms.value_and_grad(loss_fn, grad_position=0, weights=params, has_aux=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per candidate per round")
    parser.add_argument("--candidates", nargs="+", default=[
        "rows", "capacityT", "loop-dynamic",
        "capacity1.25", "loop-capacity1.25"])
    args = parser.parse_args()
    ms.set_context(device_target="CPU")

    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((args.tokens, args.hidden)).astype(np.float32))
    cotangent = Tensor(rng.standard_normal((args.tokens, args.hidden)).astype(np.float32))
    steps, reference, times, cpu_times = {}, None, {}, {}
    for name in args.candidates:
        step = make_step(build_candidate(name, args))
        start = time.perf_counter()
        (loss, dropped), grads = step(x, cotangent)
        compile_s = time.perf_counter() - start
        steps[name], times[name], cpu_times[name] = step, [], []
        routed = args.tokens * args.top_k
        dx = grads[0].asnumpy()
        if dropped.asnumpy() == 0:
            reference = dx if reference is None else reference
            match = f"max |dx - first exact| {np.abs(dx - reference).max():.1e}"
        else:
            match = "drops tokens"
        print(f"{name:18s} compile {compile_s:5.1f} s  dropped {dropped.asnumpy() / routed:6.1%}  {match}", flush=True)
    for _ in range(args.rounds):
        for name, step in steps.items():
            for _ in range(args.reps):
                start, cpu_start = time.perf_counter(), time.process_time()
                (loss, _), grads = step(x, cotangent)
                grads[0].asnumpy()
                times[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.process_time() - cpu_start)
    print(f"\nfwd+bwd under ms.jit, T={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} k={args.top_k}")
    print(f"{'candidate':18s} {'min ms':>8s} {'median ms':>10s} {'CPU ms (median)':>16s} {'tokens/s (min)':>15s}")
    for name, samples in times.items():
        best, median, cpu = min(samples), float(np.median(samples)), float(np.median(cpu_times[name]))
        print(f"{name:18s} {best * 1e3:8.1f} {median * 1e3:10.1f} {cpu * 1e3:16.1f} {args.tokens / best:15.0f}")


if __name__ == "__main__":
    main()
