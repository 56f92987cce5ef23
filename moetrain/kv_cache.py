"""The key/value cache of incremental decoding (`moetrain generate`, `moetrain/generate.py`).

Decoding runs in PyNative through the models' `decode` methods (plain Python beside the training
`construct`s, which they leave alone): the prompt is run once (prefill), then one token per call,
each call attending to what the earlier calls left in the cache.

    cache = model.new_cache(batch, pad)        # pad[b]: left-padding columns of row b
    logits = model.decode(ids [B, S], cache)   # S new columns for every row; the cache grows by S

The cache holds, per layer, whatever that layer's attention keeps (`layers[i]`, a tuple of
tensors over the T columns so far): K (after RoPE) and V, head-major `[B, n_kv, T, head_dim]`, for
grouped-query attention (`moetrain.layers.Attention.decode`, Qwen3's q/k-norm variant included);
the normed compressed latent `[B, T, kv_lora_rank]` and the rotary key `[B, T, qk_rope_head_dim]`
for MLA (`moetrain.models.deepseek_v3.MultiHeadLatentAttention.decode`). Rows of unequal length share one
cache by left-padding: row b's first `pad[b]` columns are padding that no query sees, and its real
token at column j sits at position `j - pad[b]`, so each row gets the positions and the attention
it would have alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import numpy as np

import mindspore as ms

MASKED = -1e9   # additive mask of a hidden key, as the training attention's: finite, so never NaN


@dataclass
class DecodeStep:
    """What every layer needs for one call: `positions [B, S]` (host ints: the RoPE position of each
    new token) and `hidden`: None (one new column and no padding: every cached key is visible) or a
    host bool `[B, S, T]`, key t hidden from query s, over the T = cached + S keys. Device tensors
    derived from them are made once per step and shared by the layers (`shared`)."""

    positions: np.ndarray
    hidden: Optional[np.ndarray]
    cache: dict = field(default_factory=dict)

    def shared(self, key, make):
        """`make()`, computed once per step for every layer that asks with the same `key` (the RoPE
        rotations at the step's positions, the mask)."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def group_mask(self, group: int):
        """None, or the additive fp32 mask `[B, 1, group * S, T]` of scores whose rows are `group`
        query heads of S tokens each (`CausalAttention.attend_cached`)."""
        if self.hidden is None:
            return None

        def make():
            mask = np.where(self.hidden, np.float32(MASKED), np.float32(0))
            return ms.Tensor(np.tile(mask[:, None], (1, 1, group, 1)))
        return self.shared(("mask", group), make)


class KVCache:
    """Per-layer decoding state of a batch of `batch` rows, `max_positions` the model's positions.

    `layers[i]` is None before the first call, then what layer i's attention `decode` returned.
    `length` counts the columns held (padding included)."""

    def __init__(self, num_layers: int, batch: int, max_positions: int, pad: Optional[Sequence[int]] = None):
        self.layers: List[Any] = [None] * num_layers
        self.pad = np.zeros(batch, np.int64) if pad is None else np.asarray(pad, np.int64).reshape(-1)
        if self.pad.shape != (batch,) or (self.pad < 0).any():
            raise ValueError(f"KVCache: pad must be {batch} non-negative counts, got {list(self.pad)}")
        self.batch, self.max_positions, self.length = batch, max_positions, 0

    def begin(self, num_new: int) -> DecodeStep:
        """Positions and mask of the next `num_new` columns (the layers then extend their entries)."""
        columns = np.arange(self.length, self.length + num_new)
        positions = columns[None, :] - self.pad[:, None]                     # [B, S]; < 0 on padding
        top = int(positions.max())
        if top >= self.max_positions:
            raise ValueError(f"decoding position {top} is beyond the model's positions (model.seq_length="
                             f"{self.max_positions}): the prompt plus the new tokens must fit in {self.max_positions}")
        keys = np.arange(self.length + num_new)
        hidden = (keys[None, None, :] > columns[None, :, None]) | (keys[None, None, :] < self.pad[:, None, None])
        return DecodeStep(np.maximum(positions, 0), hidden if hidden.any() else None)

    def commit(self, num_new: int) -> None:
        self.length += num_new
