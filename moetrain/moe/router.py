"""Top-k token router (Mixtral softmax / DeepSeek-V3 sigmoid, group-limited, bias-balanced)."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from moetrain import kernels
from moetrain.kernels.ops import FusedRouter
from moetrain.layers import normal_parameter
from moetrain.moe.config import MoEConfig


class TopKRouter(nn.Cell):
    """Scores every expert for every token and keeps the top k. Computes in fp32.

    `construct(x [T, H], expert_bias [E])` returns
      topk_idx    [T, k] int32  chosen experts, best first;
      topk_weight [T, k] fp32   combine weights: the chosen scores, optionally renormalised to sum
                                to 1 (`norm_topk_prob`), times `route_scale`;
      probs       [T, E] fp32   probabilities for the balance losses: softmax scores, or sigmoid
                                scores normalised over all experts (DeepSeek-V3);
      logits      [T, E] fp32   for the z-loss.
    `expert_bias` (aux-loss-free balancing) is added to the scores only to choose experts; the
    weights come from the unbiased scores and the bias gets no gradient (DeepSeek-V3).

    With `moetrain.kernels` available and no group-limited routing (`num_groups == 1`), everything
    after the router matmul is one fused kernel each way (`moetrain.kernels.ops.FusedRouter`).
    """

    def __init__(self, hidden_size: int, cfg: MoEConfig, init_std: float = 0.02):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.score_func = cfg.score_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.route_scale = float(cfg.route_scale)
        self.num_groups = cfg.num_groups
        self.topk_groups = cfg.topk_groups
        self.group_score_experts = cfg.group_score_experts if cfg.num_groups > 1 else 1
        self.weight = normal_parameter((cfg.num_experts, hidden_size), init_std, "weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.fused = None
        if kernels.available() and self.num_groups == 1:
            self.fused = FusedRouter(self.top_k, self.score_func, self.norm_topk_prob, self.route_scale)

    def construct(self, x, expert_bias):
        logits = self.matmul(x.astype(ms.float32), self.weight)
        if self.fused is not None:
            topk_idx, topk_weight, probs, _ = self.fused(logits, expert_bias)
            return topk_idx, topk_weight, probs, logits
        if self.score_func == "softmax":
            scores = ops.softmax(logits, -1)
            probs = scores
        else:
            scores = ops.sigmoid(logits)
            probs = scores / (scores.sum(-1, keepdims=True) + 1e-20)
        choice_scores = scores + ops.stop_gradient(expert_bias)
        if self.num_groups > 1:
            choice_scores = self._keep_top_groups(choice_scores)
        _, topk_idx = ops.topk(choice_scores, self.top_k)
        topk_weight = ops.gather_elements(scores, 1, topk_idx)
        if self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(-1, keepdims=True) + 1e-20)
        if self.route_scale != 1.0:
            topk_weight = topk_weight * self.route_scale
        return topk_idx, topk_weight, probs, logits

    def _keep_top_groups(self, choice_scores):
        """Sets the scores outside each token's `topk_groups` best expert groups to -inf.

        A group's score is the sum of its best `moe.group_score_experts` expert scores: `top_k //
        topk_groups` (Megatron-Core) or `group_score_topk` (HF DeepSeek-V3 sums the top 2; the same
        for DeepSeek-V3's k=8, 4 groups, not for other shapes)."""
        num_tokens = choice_scores.shape[0]
        grouped = choice_scores.reshape(num_tokens, self.num_groups, -1)
        group_scores = ops.topk(grouped, self.group_score_experts)[0].sum(-1)
        _, top_groups = ops.topk(group_scores, self.topk_groups)
        group_mask = ops.one_hot(top_groups, self.num_groups, ops.ones((), ms.float32),
                                 ops.zeros((), ms.float32)).sum(1)
        expert_mask = ops.broadcast_to(group_mask.reshape(num_tokens, self.num_groups, 1), grouped.shape)
        return ops.masked_fill(choice_scores, expert_mask.reshape(num_tokens, -1) < 0.5, float("-inf"))
