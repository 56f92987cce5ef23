"""MoE hyper-parameters (the `moe` block of a model config), validated on construction.

Importing this module does not import MindSpore, so configs can be parsed and checked cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    ffn_hidden_size: int = 512          # per routed expert
    num_shared_experts: int = 0         # DeepSeek shared experts, fused into one SwiGLU MLP
    shared_ffn_hidden_size: int = 0     # 0 -> num_shared_experts * ffn_hidden_size
    score_func: str = "softmax"         # softmax | sigmoid
    norm_topk_prob: bool = True         # renormalise the top-k weights to sum to 1
    route_scale: float = 1.0
    num_groups: int = 1                 # group-limited routing (DeepSeek n_group); 1 = off
    topk_groups: int = 1                # groups kept per token
    group_score_topk: int = 0           # a group's score: sum of its best this-many expert scores;
                                        # 0: top_k // topk_groups (Megatron-Core), 2: DeepSeek-V3 (HF)
    aux_loss_coeff: float = 0.01        # Switch/GShard load-balancing loss
    seq_aux_loss_coeff: float = 0.0     # sequence-level aux loss (DeepSeek-V2/V3)
    z_loss_coeff: float = 0.0           # router z-loss (ST-MoE)
    bias_update_rate: float = 0.0       # >0: aux-loss-free balancing (DeepSeek-V3) with a per-expert bias
    capacity_factor: float = 0.0        # 0 -> dropless; >0 -> fixed capacity, tokens beyond it dropped

    def __post_init__(self):
        for key in ("num_experts", "top_k", "ffn_hidden_size", "num_groups", "topk_groups"):
            _require_int(self, key, minimum=1)
        for key in ("num_shared_experts", "shared_ffn_hidden_size", "group_score_topk"):
            _require_int(self, key, minimum=0)
        for key in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "bias_update_rate", "capacity_factor"):
            _require(_is_number(getattr(self, key)) and getattr(self, key) >= 0, key,
                     f"must be a number >= 0, got {getattr(self, key)!r}")
        _require(_is_number(self.route_scale) and self.route_scale > 0, "route_scale",
                 f"must be a number > 0, got {self.route_scale!r}")
        _require(isinstance(self.norm_topk_prob, bool), "norm_topk_prob",
                 f"must be true or false, got {self.norm_topk_prob!r}")
        _require(self.top_k <= self.num_experts, "top_k",
                 f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        _require(self.score_func in SCORE_FUNCS, "score_func", f"{self.score_func!r} is not one of {SCORE_FUNCS}")
        _require(self.shared_ffn_hidden_size == 0 or self.num_shared_experts > 0, "shared_ffn_hidden_size",
                 f"is {self.shared_ffn_hidden_size} but num_shared_experts is 0; set num_shared_experts >= 1 "
                 f"to enable shared experts, or leave shared_ffn_hidden_size at 0")
        self._check_groups()

    def _check_groups(self) -> None:
        _require(self.num_experts % self.num_groups == 0, "num_groups",
                 f"num_experts ({self.num_experts}) must be divisible by num_groups ({self.num_groups})")
        _require(self.topk_groups <= self.num_groups, "topk_groups",
                 f"topk_groups ({self.topk_groups}) cannot exceed num_groups ({self.num_groups})")
        if self.num_groups == 1:
            return
        # A group is scored by the sum of its best top_k // topk_groups experts (Megatron-Core).
        _require(self.group_score_topk > 0 or self.top_k >= self.topk_groups, "topk_groups",
                 f"group-limited routing scores a group by its top (top_k // topk_groups) experts, so "
                 f"topk_groups ({self.topk_groups}) cannot exceed top_k ({self.top_k}); or set "
                 f"group_score_topk")
        _require(self.group_score_topk <= self.experts_per_group, "group_score_topk",
                 f"{self.group_score_topk} exceeds the {self.experts_per_group} experts of a group")
        kept_experts = self.topk_groups * self.experts_per_group
        _require(self.top_k <= kept_experts, "top_k",
                 f"top_k ({self.top_k}) exceeds the {kept_experts} experts in the {self.topk_groups} kept "
                 f"groups ({self.experts_per_group} experts per group); raise topk_groups")

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.num_groups

    @property
    def group_score_experts(self) -> int:
        """How many of a group's best expert scores add up to the group's score."""
        return self.group_score_topk or self.top_k // self.topk_groups

    @property
    def shared_hidden_size(self) -> int:
        """FFN width of the fused shared-expert MLP (0 when there are no shared experts)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_ffn_hidden_size or self.num_shared_experts * self.ffn_hidden_size


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_int(cfg: MoEConfig, key: str, minimum: int) -> None:
    value = getattr(cfg, key)
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key,
             f"must be an integer >= {minimum}, got {value!r}")


def _require(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ValueError(f"moe.{key}: {why}")
