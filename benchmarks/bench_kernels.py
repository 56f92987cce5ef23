"""Micro-benchmark of each fused CPU kernel against the plain MindSpore ops it replaces, in one process.

    python benchmarks/bench_kernels.py                          # every piece, the bench model's shapes
    python benchmarks/bench_kernels.py --pieces lm_head --rounds 7

Each piece is jitted twice per path, forward only and forward + backward (`value_and_grad` with
respect to every float input), at the shapes of `benchmarks/bench.py`'s reference model (batch 8 x
sequence 256, hidden 256, 8 heads of 32, vocab 8192, 8 experts top-2, FFN 512). "plain" is the
MindSpore-ops path that runs where the kernels are not available (Ascend, GPU, no compiler). Rounds interleave the paths so that load
from other processes hits them alike; the table gives the median wall time and the median process
CPU time (all threads) per call over the rounds. One JSON line per piece and mode goes to stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402


def lm_head_piece(tokens: int, hidden: int, vocab: int):
    """Final hidden state -> LM head -> mean cross-entropy; gradients for the hidden state and the head."""
    from moetrain.kernels.ops import FusedLMHeadCrossEntropy
    from moetrain.layers import CrossEntropy

    rng = np.random.default_rng(0)
    h = Tensor(rng.standard_normal((tokens, hidden)).astype(np.float32))
    w = Tensor((0.02 * rng.standard_normal((vocab, hidden))).astype(np.float32))
    labels = Tensor(rng.integers(0, vocab, tokens).astype(np.int32))

    class Plain(nn.Cell):
        def __init__(self):
            super().__init__()
            self.matmul, self.loss = ops.MatMul(transpose_b=True), CrossEntropy()

        def construct(self, h_, w_, labels_):
            return self.loss(self.matmul(h_, w_), labels_)

    return {"plain": Plain(), "fused": FusedLMHeadCrossEntropy()}, (h, w, labels), (0, 1)


def attention_piece(batch: int, seq: int, hidden: int, heads: int):
    """The Attention layer (projections, RoPE, causal attention, output projection) on `[B, S, H]`."""
    from moetrain.layers import Attention, CausalAttentionCore

    ms.set_seed(0)
    fused = Attention(hidden, heads, heads, hidden // heads, seq)
    plain = Attention(hidden, heads, heads, hidden // heads, seq)
    plain.core, plain.fused = CausalAttentionCore(), False    # RoPE ops, transposes, mask, MindSpore matmuls
    x = Tensor(np.random.default_rng(0).standard_normal((batch, seq, hidden)).astype(np.float32))
    return {"plain": plain, "fused": fused}, (x,), 0


def packed_attention_piece(batch: int, seq: int, hidden: int, heads: int, document: int):
    """The Attention layer on packed documents of `document` tokens (`data.reset_attention_mask` and
    `reset_position_ids`): the fused kernel and the plain path (document mask, gathered RoPE), beside
    the fused kernel on the same input without documents (plain causal attention over the window)."""
    from moetrain.layers import Attention, CausalAttentionCore

    class Packed(nn.Cell):
        def __init__(self, layer, documents=True):
            super().__init__()
            self.layer, self.documents = layer, documents

        def construct(self, x, document_ids, position_ids):
            return self.layer(x, (document_ids, position_ids) if self.documents else None)

    ms.set_seed(0)
    fused = Attention(hidden, heads, heads, hidden // heads, seq)
    plain = Attention(hidden, heads, heads, hidden // heads, seq)
    plain.core, plain.fused = CausalAttentionCore(), False
    x = Tensor(np.random.default_rng(0).standard_normal((batch, seq, hidden)).astype(np.float32))
    tokens = np.arange(seq)
    ids = np.broadcast_to(tokens // document, (batch, seq)).astype(np.int32)
    positions = np.broadcast_to(tokens % document, (batch, seq)).astype(np.int32)
    cells = {"plain": Packed(plain), "fused": Packed(fused), "fused_causal": Packed(fused, documents=False)}
    return cells, (x, Tensor(ids), Tensor(positions)), 0


def router_piece(tokens: int, hidden: int, experts: int, top_k: int):
    """TopKRouter (router matmul, softmax, top-k, combine weights, balance-loss probabilities) on `[T, H]`."""
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.router import TopKRouter

    cfg = MoEConfig(num_experts=experts, top_k=top_k, ffn_hidden_size=8)
    ms.set_seed(0)
    fused, plain = TopKRouter(hidden, cfg), TopKRouter(hidden, cfg)
    plain.fused = None
    x = Tensor(np.random.default_rng(0).standard_normal((tokens, hidden)).astype(np.float32))
    bias = Tensor(np.zeros(experts, np.float32))
    return {"plain": plain, "fused": fused}, (x, bias), 0


def adamw_piece(num_params: int):
    """One optimizer step over `num_params` fp32 parameters with a gradient multiplier (unscale x
    clip): MindSpore's fused `AdamWeightDecay` on one flat buffer after a `Mul` (the plain flat
    path; bias correction folded into lr / eps / decay as moetrain.optim does) against the in-place
    kernel. No backward."""
    from mindspore import Parameter

    from moetrain.kernels.ops import FusedAdamW

    rng = np.random.default_rng(0)
    grad = Tensor(rng.standard_normal(num_params).astype(np.float32))
    lr, step, scale = Tensor([1e-4], ms.float32), Tensor([3.0], ms.float32), Tensor([0.5], ms.float32)

    def buffers(tag):
        return [Parameter(Tensor(rng.standard_normal(num_params).astype(np.float32) * (i > 0)), name=f"{tag}{i}")
                for i in range(3)]

    class Plain(nn.Cell):
        def __init__(self):
            super().__init__()
            self.param, self.exp_avg, self.exp_avg_sq = buffers("plain")
            self.kernel = ops.AdamWeightDecay()

        def construct(self, grad_, lr_, step_, scale_):
            c1 = 1.0 - ops.pow(Tensor(0.9, ms.float32), step_)
            sqrt_c2 = ops.sqrt(1.0 - ops.pow(Tensor(0.95, ms.float32), step_))
            step_lr = lr_ * sqrt_c2 / c1
            return self.kernel(self.param, self.exp_avg, self.exp_avg_sq, step_lr.reshape(()), 0.9, 0.95,
                               (1e-8 * sqrt_c2).reshape(()), (0.1 * lr_ / step_lr).reshape(()), grad_ * scale_)[0]

    class Fused(nn.Cell):
        def __init__(self):
            super().__init__()
            self.param, self.exp_avg, self.exp_avg_sq = buffers("fused")
            self.kernel = FusedAdamW(0.9, 0.95, 1e-8)
            self.ends, self.decay = Tensor([num_params], ms.int64), Tensor([0.1], ms.float32)

        def construct(self, grad_, lr_, step_, scale_):
            return self.kernel((self.param,), (self.exp_avg,), (self.exp_avg_sq,), grad_, lr_, step_, scale_,
                               self.ends, self.decay)

    return {"plain": Plain(), "fused": Fused()}, (grad, lr, step, scale), None


def grad_norm_piece(num_params: int):
    """Squared norm of a flat gradient buffer (for clipping): `(g * g).sum()` against the kernel."""
    from moetrain.kernels.ops import SumOfSquares

    class Plain(nn.Cell):
        def construct(self, g):
            return (g * g).sum()

    grad = Tensor(np.random.default_rng(0).standard_normal(num_params).astype(np.float32))
    return {"plain": Plain(), "fused": SumOfSquares()}, (grad,), None


PIECES = {"lm_head": lambda a: lm_head_piece(a.batch * a.seq, a.hidden, a.vocab),
          "attention": lambda a: attention_piece(a.batch, a.seq, a.hidden, a.heads),
          "packed_attention": lambda a: packed_attention_piece(a.batch, a.seq, a.hidden, a.heads, a.document),
          "router": lambda a: router_piece(a.batch * a.seq, a.hidden, a.experts, a.top_k),
          "adamw": lambda a: adamw_piece(a.params),
          "grad_norm": lambda a: grad_norm_piece(a.params)}


class SumOfSquares(nn.Cell):
    """A scalar of every float output (`sum(y * y)`), so that `value_and_grad` runs the whole backward."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def construct(self, *args):
        out = self.cell(*args)
        if not isinstance(out, tuple):
            out = (out,)
        total = 0.0
        for y in out:
            if y.dtype == ms.float32:
                total = total + (y * y).sum()
        return total


def timed(fn, args):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    for leaf in (out if isinstance(out, (tuple, list)) else (out,)):
        for t in (leaf if isinstance(leaf, (tuple, list)) else (leaf,)):
            t.asnumpy()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def run_piece(name: str, cells: dict, inputs, grad_positions, rounds: int, calls: int) -> list:
    runners = {}
    for path, cell in cells.items():
        runners[(path, "fwd" if grad_positions is not None else "step")] = ms.jit(cell)
        if grad_positions is not None:
            runners[(path, "fwd+bwd")] = ms.jit(ms.value_and_grad(SumOfSquares(cell), grad_positions))
    samples = {key: ([], []) for key in runners}
    for key, fn in runners.items():   # compile and warm up
        timed(fn, inputs)
    for _ in range(rounds):
        for key, fn in runners.items():
            for _ in range(calls):
                wall, cpu = timed(fn, inputs)
                samples[key][0].append(wall)
                samples[key][1].append(cpu)
    rows = []
    for (path, mode), (walls, cpus) in samples.items():
        rows.append({"piece": name, "mode": mode, "path": path, "wall_ms_median": round(statistics.median(walls), 2),
                     "wall_ms_min": round(min(walls), 2), "cpu_ms_median": round(statistics.median(cpus), 2)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pieces", nargs="+", default=list(PIECES), choices=list(PIECES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="calls per path per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--document", type=int, default=64, help="tokens per document (packed_attention)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--params", type=int, default=17_800_000, help="optimizer buffer size (the bench model's)")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args(argv)
    ms.set_device("CPU")
    from moetrain import kernels

    if not kernels.available():
        sys.exit("moetrain.kernels are not available here (see the warning above)")
    print(f"{'piece':10} {'mode':8} {'path':10} {'wall ms (median / min)':>24} {'cpu ms':>8}", file=sys.stderr)
    for name in args.pieces:
        cells, inputs, grad_positions = PIECES[name](args)
        for row in run_piece(name, cells, inputs, grad_positions, args.rounds, args.calls):
            print(f"{row['piece']:10} {row['mode']:8} {row['path']:10} {row['wall_ms_median']:>14.1f} / "
                  f"{row['wall_ms_min']:>7.1f} {row['cpu_ms_median']:>8.1f}", file=sys.stderr)
            print(json.dumps(row))


if __name__ == "__main__":
    main()
