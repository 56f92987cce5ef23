"""All local routed experts as one SwiGLU over stacked weights (no grouped matmul on CPU)."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from moetrain.layers import compute_dtype_of, normal_parameter


class GroupedExperts(nn.Cell):
    """`down(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]` for every local expert e at once.

    Parameters (one tensor per projection, experts stacked first; Mixtral's `experts.{e}.w1/w3/w2`
    are the transposed slices): `w_gate [E, H, F]`, `w_up [E, H, F]`, `w_down [E, F, H]`.

    `construct(x [G, R, H], block_expert=None)`: G groups of R rows. Group g uses expert
    `block_expert[g]` (the dropless block layout; the weights are gathered per block), or expert g
    when `block_expert` is None (the `[E, C, H]` capacity layout). One batched matmul per
    projection either way. Padding rows are zero and so produce zero output and zero gradient.
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
        self.bmm = ops.BatchMatMul()

    def construct(self, x, block_expert=None):
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
