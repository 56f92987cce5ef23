"""Router auxiliary losses as pure functions (MindSpore ops; PyNative and `ms.jit`).

They take per-expert statistics rather than raw routing decisions, so a data-parallel caller can
all-reduce the statistics first and compute the loss over the global token set.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops


def tokens_per_expert(topk_idx, num_experts: int):
    """`[..., N, k]` int expert ids -> `[..., E]` fp32 count of assignments per expert (no gradient)."""
    lead_shape = topk_idx.shape[:-2]
    flat = topk_idx.reshape(lead_shape + (-1,))
    one_hot = ops.one_hot(flat, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
    return ops.stop_gradient(one_hot.sum(-2))


def load_balancing_loss(probs_mean_per_expert, tokens_fraction_per_expert, num_experts: int, top_k: int):
    """Switch/GShard load-balancing loss `E/k * sum_i f_i * P_i`, averaged over leading axes.

    probs_mean_per_expert: `[..., E]` mean router probability of each expert over the tokens
        (softmax scores, or sigmoid scores normalised over all experts); carries the gradient.
    tokens_fraction_per_expert: `[..., E]` assignments to each expert / number of tokens
        (sums to top_k over experts); treated as a constant.
    Equals 1 for perfectly uniform routing. With `[E]` inputs over a batch it is the Switch loss
    (Megatron-Core `switch_load_balancing_loss_func`); with `[B, E]` inputs over each sequence it is
    the DeepSeek-V2/V3 sequence-wise balance loss `sum_i f'_i P_i` with `f'_i = E/(k S) * count_i`.
    """
    fraction = ops.stop_gradient(tokens_fraction_per_expert)
    per_row = (probs_mean_per_expert * fraction).sum(-1)
    return per_row.mean() * (num_experts / top_k)


def z_loss(logits):
    """ST-MoE router z-loss: mean over tokens of `logsumexp(logits)^2`; `logits [T, E]` fp32."""
    return ops.square(ops.logsumexp(logits, -1)).mean()
