"""All local routed experts as one SwiGLU over stacked weights, without per-row weight copies.

Two input layouts (the dispatcher produces the one `compute` needs, `native_ops.expert_compute()`):

* rows `[N, H]` sorted by local expert, the groups first and padding after them ("kernel": the
  CPU grouped GEMM, row ids with `L` marking padding; "gmm": Ascend's grouped matmul with the group
  sizes). Only the routed rows are computed; padding rows give zero output and zero gradient.
* capacity `[L, C, H]`, group l computed by local expert l ("bmm": one batched matmul per
  projection over the stacked weights; every row of the buffer is computed, padding included).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops

from moetrain.kernels.ops import (FromBF16, FusedSwiGLU, FusedSwiGLUBF16, GroupedMatmul, GroupedMatmulBF16, GroupedMatmulPair,
                                  GroupedMatmulPairBF16, ToBF16, shared)
from moetrain.layers import bf16_rounder, bf16_storage, compute_dtype_of, normal_parameter, to_compute
from moetrain.moe.native_ops import MoEOps
from moetrain.distributed.sharding import mark_role

COMPUTES = ("kernel", "gmm", "bmm")


class GroupedExperts(nn.Cell):
    """`down(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]` for every local expert e at once.

    Parameters (one tensor per projection, experts stacked first; Mixtral's `experts.{e}.w1/w3/w2`
    are the transposed slices): `w_gate [E, H, F]`, `w_up [E, H, F]`, `w_down [E, F, H]`.

    `construct(x, row_expert=None, group_sizes=None)`:
    * `x [L, C, H]` (capacity layout): group l uses local expert l; one batched matmul per projection.
    * `x [N, H]` (rows layout, `compute` "kernel" or "gmm"): rows sorted by local expert; the kernel
      reads `row_expert [N]` int32 (L = padding), the grouped matmul `group_sizes [L]`.
    The kernel computes in fp32 (a lower compute dtype rounds the operands to it, as its matmul
    would); the batched and grouped matmuls run in the compute dtype.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int,
                 init_std: float = 0.02, compute_dtype=ms.float32, compute: Optional[str] = None):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.compute_dtype = compute_dtype_of(compute_dtype)
        self.emulated = bf16_rounder(self.compute_dtype)
        self.ops = MoEOps()
        self.compute = compute or self.ops.compute
        if self.compute not in COMPUTES:
            raise ValueError(f"GroupedExperts: compute {self.compute!r} is not one of {COMPUTES}")
        shape_in = (num_local_experts, hidden_size, ffn_hidden_size)
        self.w_gate = normal_parameter(shape_in, init_std, "w_gate")
        self.w_up = normal_parameter(shape_in, init_std, "w_up")
        self.w_down = normal_parameter((num_local_experts, ffn_hidden_size, hidden_size), init_std, "w_down")
        for weight in (self.w_gate, self.w_up, self.w_down):   # expert parallel reduces them over edp
            mark_role(weight, expert=True)
        self.bmm = ops.BatchMatMul()
        self.grouped_matmul = self.grouped_matmul_pair = self.swiglu = None
        self.bf16 = self.compute == "kernel" and bf16_storage(self.compute_dtype)
        if self.bf16:   # rows, gate|up and h as 2-byte bf16 containers; the fp32 weights read as bf16 in the kernels
            self.grouped_matmul, self.swiglu = shared(GroupedMatmulBF16), shared(FusedSwiGLUBF16)
            self.grouped_matmul_pair = shared(GroupedMatmulPairBF16)
            self.to_bf16, self.from_bf16 = shared(ToBF16), shared(FromBF16)
        elif self.compute == "kernel":
            self.grouped_matmul, self.swiglu = shared(GroupedMatmul), shared(FusedSwiGLU)
            self.grouped_matmul_pair = shared(GroupedMatmulPair)

    @property
    def layout(self) -> str:
        """"rows" or "capacity": the input layout the dispatcher must produce."""
        return "capacity" if self.compute == "bmm" else "rows"

    def construct(self, x, row_expert=None, group_sizes=None):
        if x.ndim == 3:
            return self._capacity(x)
        if self.compute == "kernel":
            return self._kernel_rows(x, row_expert)
        if self.compute == "gmm":
            return self._gmm_rows(x, group_sizes)
        raise ValueError(f"GroupedExperts: rows input {x.shape} needs compute 'kernel' or 'gmm', this one "
                         f"computes with {self.compute!r} (capacity layout [L, C, H] only)")

    def decode(self, x, topk_idx):
        """Inference (PyNative; `MoELayer.decode`): the output of every chosen expert for every token,
        `x [T, H]`, `topk_idx [T, k]` int32 -> `[T, k, H]` in the compute dtype; needs all experts here.
        Few assignments (a decoding step: T k <= E) gather the chosen experts' weights, one `[H, F]`
        slice per assignment, and run one broadcast matmul per projection; more (a prefill) run one
        SwiGLU per expert hit on the rows that chose it (read on the host). No dispatcher, no padding."""
        num_tokens, top_k = topk_idx.shape
        w_gate, w_up, w_down = self._weights()
        x = to_compute(x, self.compute_dtype, self.emulated)
        if num_tokens * top_k <= self.num_local_experts:
            chosen = topk_idx.reshape(-1)
            rows = x.reshape(num_tokens, 1, 1, -1)                                      # [T, 1, 1, H]
            gate = ops.matmul(rows, ops.gather(w_gate, chosen, 0).reshape(num_tokens, top_k, *w_gate.shape[1:]))
            up = ops.matmul(rows, ops.gather(w_up, chosen, 0).reshape(num_tokens, top_k, *w_up.shape[1:]))
            down = ops.gather(w_down, chosen, 0).reshape(num_tokens, top_k, *w_down.shape[1:])
            return ops.matmul(ops.silu(gate) * up, down).reshape(num_tokens, top_k, -1)  # [T, k, H]
        flat = topk_idx.asnumpy().reshape(-1)
        order = np.argsort(flat, kind="stable")                 # assignments grouped by expert
        outputs = []
        for expert in np.unique(flat):
            rows = order[flat[order] == expert] // top_k
            xe = ops.gather(x, Tensor(rows.astype(np.int32)), 0)
            hidden = ops.silu(ops.matmul(xe, w_gate[int(expert)])) * ops.matmul(xe, w_up[int(expert)])
            outputs.append(ops.matmul(hidden, w_down[int(expert)]))
        rows = ops.cat(outputs, 0) if len(outputs) > 1 else outputs[0]
        back = Tensor(np.argsort(order).astype(np.int32))       # assignment -> its row of `rows`
        return ops.gather(rows, back, 0).reshape(num_tokens, top_k, -1)

    def _weights(self):
        w_gate, w_up, w_down = self.w_gate, self.w_up, self.w_down
        if self.compute_dtype != ms.float32:
            w_gate, w_up, w_down = (to_compute(w, self.compute_dtype, self.emulated) for w in (w_gate, w_up, w_down))
        return w_gate, w_up, w_down

    def _capacity(self, x):
        if x.shape[0] != self.num_local_experts:
            raise ValueError(f"GroupedExperts: capacity input {x.shape} must have one group per local expert "
                             f"({self.num_local_experts})")
        w_gate, w_up, w_down = self._weights()
        x = to_compute(x, self.compute_dtype, self.emulated)
        hidden = to_compute(ops.silu(self.bmm(x, w_gate)) * self.bmm(x, w_up), self.compute_dtype, self.emulated)
        return to_compute(self.bmm(hidden, w_down), self.compute_dtype, self.emulated)

    def _gmm_rows(self, x, group_sizes):
        """Ascend grouped matmul. Rows past the groups are not computed (unspecified values and
        input gradients): the selects zero both, so nothing unspecified leaves this function."""
        w_gate, w_up, w_down = self._weights()
        computed = (ops.arange(x.shape[0], dtype=ms.int32) < group_sizes.astype(ms.int32).sum()).reshape(-1, 1)
        zero = ops.zeros((), ms.float32 if self.emulated is not None else self.compute_dtype)
        x = ops.where(computed, to_compute(x, self.compute_dtype, self.emulated), zero)
        gate_up = self.ops.grouped_matmul(x, ops.concat((w_gate, w_up), axis=2), group_sizes)
        if self.emulated is not None:   # a bf16 grouped matmul stores bf16
            gate_up = self.emulated(gate_up)
        gate, up = ops.split(gate_up, [w_gate.shape[2], w_up.shape[2]], 1)
        hidden = to_compute(ops.silu(gate) * up, self.compute_dtype, self.emulated)
        out = to_compute(self.ops.grouped_matmul(hidden, w_down, group_sizes), self.compute_dtype, self.emulated)
        return ops.where(computed, out, zero)

    def _kernel_rows(self, x, row_expert):
        """`x [N, H]`, row n computed by expert `row_expert[n]` (L: padding) -> `[N, H]` in the
        compute dtype. Gate and up projections are one op writing `[N, 2F]` (the two weights read
        in place, not concatenated), followed by the fused SwiGLU kernel."""
        w_gate, w_up, w_down = self.w_gate, self.w_up, self.w_down
        if self.bf16:   # bf16 storage: no rounded copy of a weight, 2-byte activations saved for the backward
            row_expert = row_expert.astype(ms.int32)
            rows = self.to_bf16(x.astype(ms.float32))
            hidden = self.swiglu(self.grouped_matmul_pair(rows, w_gate, w_up, row_expert))
            return self.from_bf16(self.grouped_matmul(hidden, w_down, row_expert))
        if self.emulated is not None:   # bf16: the one-pass rounding kernel
            x, w_gate, w_up, w_down = (self.emulated(t) for t in (x.astype(ms.float32), w_gate, w_up, w_down))
        else:
            x = x.astype(self.compute_dtype).astype(ms.float32)
        if self.emulated is None and self.compute_dtype != ms.float32:  # round the operands as its matmul would
            w_gate = w_gate.astype(self.compute_dtype).astype(ms.float32)
            w_up = w_up.astype(self.compute_dtype).astype(ms.float32)
            w_down = w_down.astype(self.compute_dtype).astype(ms.float32)
        row_expert = row_expert.astype(ms.int32)
        gate_up = self.grouped_matmul_pair(x, w_gate, w_up, row_expert)
        if self.emulated is not None:   # a bf16 grouped matmul stores bf16 (as the bf16 storage path does)
            gate_up = self.emulated(gate_up)
        hidden = self.swiglu(gate_up)
        hidden = hidden.astype(self.compute_dtype).astype(ms.float32) if self.emulated is None else self.emulated(hidden)
        return to_compute(self.grouped_matmul(hidden, w_down, row_expert), self.compute_dtype, self.emulated)
