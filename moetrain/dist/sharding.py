"""Where a rank's local Parameter sits in the global (single-device) tensor.

Every parallelisation that slices a parameter (tensor-parallel linears and vocabulary, expert
parallel expert tensors) records a `ShardSpec` on it with `mark_shard`. Checkpoints save each
shard with its spec, so any layout can be reassembled into the global tensor and re-sliced for
another layout; the optimizer uses `replicas` to count each gradient once in the global norm.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import numpy as np

_ATTR = "moetrain_shard"
MASTER_PREFIX = "zero_master."   # ZeRO's fp32 masters: their buffers and checkpoint keys


@dataclass(frozen=True)
class ShardSpec:
    global_shape: Tuple[int, ...]
    axis: Optional[int] = None      # None: the parameter is not sliced
    index: int = 0                  # which slice this rank holds
    count: int = 1                  # number of equal slices along `axis`
    group_kind: str = ""            # group the slices are spread over ("tp", "ep")

    def local_shape(self) -> Tuple[int, ...]:
        if self.axis is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.axis] //= self.count
        return tuple(shape)

    def slice_of(self, global_array: np.ndarray) -> np.ndarray:
        if self.axis is None:
            return global_array
        return np.split(global_array, self.count, axis=self.axis)[self.index]


def mark_shard(param, global_shape, axis: Optional[int], index: int, count: int, group_kind: str) -> None:
    if axis is not None and global_shape[axis] % count:
        raise ValueError(f"{param.name}: dimension {axis} of {tuple(global_shape)} is not divisible by {count}")
    setattr(param, _ATTR, ShardSpec(tuple(int(d) for d in global_shape), axis, index, count, group_kind))


def shard_spec(param) -> ShardSpec:
    return getattr(param, _ATTR, None) or ShardSpec(tuple(int(d) for d in param.shape))


def assemble(pieces: Iterable[Tuple[ShardSpec, np.ndarray]]) -> np.ndarray:
    """The global tensor from all slices of one parameter (duplicates allowed)."""
    pieces = list(pieces)
    spec = pieces[0][0]
    if spec.axis is None:
        return pieces[0][1]
    by_index = {s.index: a for s, a in pieces}
    missing = sorted(set(range(spec.count)) - set(by_index))
    if missing:
        raise ValueError(f"shards {missing} of {spec.count} are missing")
    return np.concatenate([by_index[i] for i in range(spec.count)], axis=spec.axis)


# ---------------------------------------------------------------------------------------------
# Roles: marked where a parameter is created or parallelized, read everywhere else (no name matching)
# ---------------------------------------------------------------------------------------------
_ROLE_ATTR = "moetrain_role"


@dataclass(frozen=True)
class ParamRole:
    expert: bool = False               # a routed expert's weight: replicas are the edp group, not dp
    sequence_parallel: bool = False    # used on this rank's sequence chunk only: gradient summed over tp
    tied_group: str = ""               # group kind of the ranks that hold this same (tied) parameter


def param_role(param) -> ParamRole:
    return getattr(param, _ROLE_ATTR, None) or ParamRole()


def mark_role(param, **changes) -> None:
    """Set role fields on `param` (e.g. `mark_role(w, expert=True)`), keeping the others."""
    setattr(param, _ROLE_ATTR, dataclasses.replace(param_role(param), **changes))


def reduction_group_kind(param) -> str:
    """The data-parallel group whose ranks hold replicas of `param` and sum its gradient."""
    return "edp" if param_role(param).expert else "dp"
