"""All local routed experts as one SwiGLU over stacked weights.

MindSpore has no grouped matmul on CPU; `moetrain.kernels` provides one (oneDNN GEMM per run of
rows with the same expert) for the exact dropless layout of one row per group."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from moetrain import kernels
from moetrain.layers import compute_dtype_of, normal_parameter
from moetrain.dist.sharding import mark_role


class GroupedExperts(nn.Cell):
    """`down(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]` for every local expert e at once.

    Parameters (one tensor per projection, experts stacked first; Mixtral's `experts.{e}.w1/w3/w2`
    are the transposed slices): `w_gate [E, H, F]`, `w_up [E, H, F]`, `w_down [E, F, H]`.

    `construct(x [G, R, H], block_expert=None)`: G groups of R rows. Group g uses expert
    `block_expert[g]` (the dropless block layout), or expert g when `block_expert` is None (the
    `[E, C, H]` capacity layout). Padding rows are zero and so produce zero output and zero gradient.
    * capacity layout: one batched matmul per projection;
    * blocks of one row (`R == 1`, the exact dropless layout) with `moetrain.kernels` available:
      the grouped GEMM kernel, one GEMM per run of rows of the same expert, and the fused SwiGLU
      kernel (fp32 arithmetic; a lower compute dtype rounds the operands to it, as its matmul would);
    * other blocks: the weights are gathered per block, then one batched matmul per projection.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int,
                 init_std: float = 0.02, compute_dtype=ms.float32):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.compute_dtype = compute_dtype_of(compute_dtype)
        shape_in = (num_local_experts, hidden_size, ffn_hidden_size)
        self.w_gate = normal_parameter(shape_in, init_std, "w_gate")
        self.w_up = normal_parameter(shape_in, init_std, "w_up")
        self.w_down = normal_parameter((num_local_experts, ffn_hidden_size, hidden_size), init_std, "w_down")
        for weight in (self.w_gate, self.w_up, self.w_down):   # expert parallel reduces them over edp
            mark_role(weight, expert=True)
        self.bmm = ops.BatchMatMul()
        self.grouped_matmul = self.swiglu = None
        if kernels.available():
            from moetrain.kernels.ops import FusedSwiGLU, GroupedMatmul, shared

            self.grouped_matmul, self.swiglu = shared(GroupedMatmul), shared(FusedSwiGLU)

    def construct(self, x, block_expert=None):
        if block_expert is not None and x.shape[1] == 1 and self.grouped_matmul is not None:
            return self._grouped_rows(x.reshape(x.shape[0], x.shape[2]), block_expert).reshape(x.shape)
        w_gate, w_up, w_down = self.w_gate, self.w_up, self.w_down
        if self.compute_dtype != ms.float32:
            x = x.astype(self.compute_dtype)
            w_gate = w_gate.astype(self.compute_dtype)
            w_up = w_up.astype(self.compute_dtype)
            w_down = w_down.astype(self.compute_dtype)
        if block_expert is not None:
            w_gate = ops.gather(w_gate, block_expert, 0)
            w_up = ops.gather(w_up, block_expert, 0)
            w_down = ops.gather(w_down, block_expert, 0)
        hidden = ops.silu(self.bmm(x, w_gate)) * self.bmm(x, w_up)
        return self.bmm(hidden, w_down)

    def _grouped_rows(self, x, row_expert):
        """`x [N, H]`, row n computed by expert `row_expert[n]` -> `[N, H]` in the compute dtype.

        Gate and up projections are one GEMM over the concatenated `[E, H, 2F]` weights, followed by
        the fused SwiGLU kernel."""
        w_gate_up = ops.concat((self.w_gate, self.w_up), axis=2)
        w_down = self.w_down
        x = x.astype(self.compute_dtype).astype(ms.float32)
        if self.compute_dtype != ms.float32:  # round the operands as a compute-dtype matmul would
            w_gate_up = w_gate_up.astype(self.compute_dtype).astype(ms.float32)
            w_down = w_down.astype(self.compute_dtype).astype(ms.float32)
        row_expert = row_expert.astype(ms.int32)
        hidden = self.swiglu(self.grouped_matmul(x, w_gate_up, row_expert))
        hidden = hidden.astype(self.compute_dtype).astype(ms.float32)
        return self.grouped_matmul(hidden, w_down, row_expert).astype(self.compute_dtype)
