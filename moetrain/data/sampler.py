"""Deterministic, resumable, layout-independent batch sampling.

The global batch of step `s` is a pure function of (seed, s): epoch `e = s // steps_per_epoch`
draws a permutation from `seed + e`, and step `s` takes the next `global_batch_size` indices.
A data-parallel rank takes a contiguous slice of that global batch, a micro-batch a slice of
that. So the samples a step sees do not depend on dp/tp/pp, and resuming needs only the step.
`moetrain.data.blend.BlendedBatchSampler` does the same for a weighted blend of corpora.
"""
from __future__ import annotations

import numpy as np


class BatchSampler:
    """Slices a global batch among data-parallel ranks; subclasses define `global_batch(step)`,
    `steps_per_epoch` and `global_batch_size`."""

    def __init__(self, global_batch_size: int):
        self.global_batch_size = global_batch_size

    def global_batch(self, step: int) -> np.ndarray:
        raise NotImplementedError

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """This data-parallel rank's contiguous slice of the global batch."""
        if self.global_batch_size % dp_size:
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by {dp_size} data-parallel ranks")
        per_rank = self.global_batch_size // dp_size
        return self.global_batch(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank]


class GlobalBatchSampler(BatchSampler):
    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0, shuffle: bool = True):
        if num_samples < global_batch_size:
            raise ValueError(
                f"dataset has {num_samples} samples, fewer than one global batch of "
                f"{global_batch_size}; use more data or a smaller train.global_batch_size")
        super().__init__(global_batch_size)
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.steps_per_epoch = num_samples // global_batch_size  # the remainder is dropped
        self._perm_epoch = -1
        self._perm = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            if self.shuffle:
                self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, step: int) -> np.ndarray:
        """Sample indices of the global batch at 0-based `step`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch_size
        return self._permutation(epoch)[start:start + self.global_batch_size]


def collate(dataset, indices) -> tuple:
    """Stack the samples `dataset[i]` (tuples of numpy arrays) into batch arrays."""
    samples = [dataset[int(i)] for i in indices]
    return tuple(np.stack(field) for field in zip(*samples))
