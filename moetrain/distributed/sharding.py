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
    # further slicings on other axes, (axis, index, count, group_kind) each: an expert tensor split over
    # ep along its expert axis and over etp along its FFN axis
    extra: Tuple[Tuple[int, int, int, str], ...] = ()

    def slicings(self) -> Tuple[Tuple[int, int, int, str], ...]:
        """Every (axis, index, count, group_kind) this piece is cut by (distinct axes)."""
        first = () if self.axis is None else ((self.axis, self.index, self.count, self.group_kind),)
        return first + tuple(self.extra)

    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.global_shape)
        for axis, _, count, _ in self.slicings():
            shape[axis] //= count
        return tuple(shape)

    def slice_of(self, global_array: np.ndarray) -> np.ndarray:
        for axis, index, count, _ in self.slicings():
            global_array = np.split(global_array, count, axis=axis)[index]
        return global_array

    def sliced_over(self, group_kind: str) -> bool:
        return any(kind == group_kind for _, _, _, kind in self.slicings())


def mark_shard(param, global_shape, axis: Optional[int], index: int, count: int, group_kind: str) -> None:
    if axis is not None and global_shape[axis] % count:
        raise ValueError(f"{param.name}: dimension {axis} of {tuple(global_shape)} is not divisible by {count}")
    setattr(param, _ATTR, ShardSpec(tuple(int(d) for d in global_shape), axis, index, count, group_kind))


def mark_further_shard(param, axis: int, index: int, count: int, group_kind: str) -> None:
    """Record one more slicing of an already sliced `param`, on another axis (expert tensor parallel
    after expert parallel)."""
    spec = shard_spec(param)
    if any(a == axis for a, _, _, _ in spec.slicings()) or spec.global_shape[axis] % count:
        raise ValueError(f"{param.name}: cannot slice dimension {axis} of {spec.global_shape} into {count} "
                         f"again ({spec})")
    setattr(param, _ATTR, dataclasses.replace(spec, extra=spec.extra + ((axis, index, count, group_kind),)))


def shard_spec(param) -> ShardSpec:
    return getattr(param, _ATTR, None) or ShardSpec(tuple(int(d) for d in param.shape))


def assemble(pieces: Iterable[Tuple[ShardSpec, np.ndarray]]) -> np.ndarray:
    """The global tensor from all slices of one parameter (duplicates allowed)."""
    pieces = list(pieces)
    spec = pieces[0][0]
    if not spec.slicings():
        return pieces[0][1]
    out = np.zeros(spec.global_shape, pieces[0][1].dtype)
    covered = np.zeros(spec.global_shape, bool)
    for s, value in pieces:
        region = [slice(None)] * len(s.global_shape)
        for axis, index, count, _ in s.slicings():
            size = s.global_shape[axis] // count
            region[axis] = slice(index * size, (index + 1) * size)
        out[tuple(region)] = value
        covered[tuple(region)] = True
    if not covered.all():
        raise ValueError(f"shards of {spec.global_shape} ({spec}) are missing")
    return out


# ---------------------------------------------------------------------------------------------
# Roles: marked where a parameter is created or parallelized, read everywhere else (no name matching)
# ---------------------------------------------------------------------------------------------
_ROLE_ATTR = "moetrain_role"


@dataclass(frozen=True)
class ParamRole:
    expert: bool = False               # a routed expert's weight: replicas are the edp group, not dp
    sequence_parallel: bool = False    # gradient partial over tp (used on this rank's sequence chunk, or
                                       # feeding only its heads): summed over tp
    tied_group: str = ""               # group kind of the ranks that hold this same (tied) parameter
    lm_head: bool = False              # the LM head's weight: its gradient is complete when the backward
                                       # begins, wherever it sits in the model's order (ZeRO-2's first bucket)


def param_role(param) -> ParamRole:
    return getattr(param, _ROLE_ATTR, None) or ParamRole()


def mark_role(param, **changes) -> None:
    """Set role fields on `param` (e.g. `mark_role(w, expert=True)`), keeping the others."""
    setattr(param, _ROLE_ATTR, dataclasses.replace(param_role(param), **changes))


def reduction_group_kind(param) -> str:
    """The data-parallel group whose ranks hold replicas of `param` and sum its gradient."""
    return "edp" if param_role(param).expert else "dp"


def tp_copies(spec: ShardSpec, group_kind: str, pctx) -> int:
    """Tensor-parallel ranks holding the same piece besides its reduction group: tp for a tensor
    replicated over tp, 1 for one sliced over tp, and 1 for expert tensors of a folded layout (their
    edp group already spans the tp ranks that hold the same experts, moetrain/distributed/topology.py)."""
    if spec.sliced_over("tp") or (group_kind == "edp" and pctx.expert_folded):
        return 1
    return pctx.tp
