"""The kernels as differentiable MindSpore ops (Cells; PyNative and `ms.jit`). fp32 only.

Build them only when `moetrain.kernels.available()` is True. Shapes and dtypes are inferred by the
C++ functions in the library (`out_shape=None`), which MindSpore needs where it compiles a graph
without the Python primitive (e.g. a jitted step that returns a dict of stats)."""
from __future__ import annotations

import functools

from mindspore import nn, ops
from mindspore.ops import CustomRegOp, DataType

from moetrain.kernels import library_path


def _custom(name: str, input_dtypes, bprop=None):
    """The kernel `name` of the library: inputs of `input_dtypes`, one fp32 output."""
    reg = CustomRegOp()
    for i in range(len(input_dtypes)):
        reg = reg.input(i, f"x{i}")
    reg = reg.output(0, "y").dtype_format(*input_dtypes, DataType.F32_Default).target("CPU").get_op_info()
    return ops.Custom(f"{library_path()}:{name}", out_shape=None, out_dtype=None, func_type="aot", bprop=bprop,
                      reg_info=reg)


F32, I32 = DataType.F32_Default, DataType.I32_Default


class GroupedMatmul(nn.Cell):
    """`construct(x [N, K], w [E, K, F], row_expert [N] int32) -> [N, F]`: `y[n] = x[n] @ w[row_expert[n]]`.

    Runs of rows with the same expert are one GEMM each, so rows sorted by expert (the exact
    dropless MoE layout) cost one GEMM per expert. Gradients flow to `x` and `w` (an expert that
    owns no rows gets a zero weight gradient). Id `E` marks a padding row: no work, a zero output
    row and a zero input gradient; an id outside `[0, E]` fails the op."""

    def __init__(self):
        super().__init__()
        matmul_nt = _custom("GroupedMatmulNT", (F32, F32, I32))
        matmul_tn = _custom("GroupedMatmulTN", (F32, F32, I32, F32))

        def bprop(x, w, row_expert, out, dout):
            return matmul_nt(dout, w, row_expert), matmul_tn(x, dout, row_expert, w), ops.zeros_like(row_expert)

        self.matmul_nn = _custom("GroupedMatmulNN", (F32, F32, I32), bprop)

    def construct(self, x, w, row_expert):
        return self.matmul_nn(x, w, row_expert)


class FusedSwiGLU(nn.Cell):
    """`construct(gate_up [..., 2F]) -> silu(gate_up[..., :F]) * gate_up[..., F:]`, one pass each way."""

    def __init__(self):
        super().__init__()
        backward = _custom("SwiGLUBackward", (F32, F32))

        def bprop(gate_up, out, dout):
            return (backward(gate_up, dout),)

        self.forward = _custom("SwiGLUForward", (F32,), bprop)

    def construct(self, gate_up):
        return self.forward(gate_up)


class FusedRMSNorm(nn.Cell):
    """`construct(x [..., H], weight [H], eps [1]) -> x / sqrt(mean(x^2, -1) + eps) * weight`, fp32;
    gradients for `x` and `weight` (`eps` is a constant)."""

    def __init__(self):
        super().__init__()
        backward_input = _custom("RMSNormBackwardInput", (F32, F32, F32, F32))
        backward_weight = _custom("RMSNormBackwardWeight", (F32, F32, F32))

        def bprop(x, weight, eps, out, dout):
            return backward_input(x, weight, eps, dout), backward_weight(x, eps, dout), ops.zeros_like(eps)

        self.forward = _custom("RMSNormForward", (F32, F32, F32), bprop)

    def construct(self, x, weight, eps):
        return self.forward(x, weight, eps)


class FusedCausalAttention(nn.Cell):
    """`construct(q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, D]) -> softmax(q k^T + causal) v`
    as `[B, S, Hq, D]`, fp32, `q` pre-scaled; query head h uses key/value head `h // (Hq / Hkv)`.

    Reads the projection layout directly (no transposes, no mask tensor), skips the key blocks
    above the diagonal, and recomputes the probabilities in the backward instead of storing them."""

    def __init__(self):
        super().__init__()
        backward = _custom("CausalAttentionBackward", (F32,) * 5)

        def bprop(q, k, v, out, dout):
            grads = backward(q, k, v, out, dout)
            dq, dk, dv = ops.split(grads, [q.size, k.size, v.size])
            return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

        self.forward = _custom("CausalAttentionForward", (F32,) * 3, bprop)

    def construct(self, q, k, v):
        return self.forward(q, k, v)


@functools.lru_cache(maxsize=None)
def shared(kernel_class):
    """One instance of a (parameter-free) kernel Cell for every layer that uses it: MindSpore then
    parses and type-infers its backward once instead of once per layer (compile time: about 18 %
    less per MoE layer, measured in CPU seconds). Marking it for recompute marks it in every layer,
    as the recompute policies (`layers.*...`) do anyway."""
    return kernel_class()
