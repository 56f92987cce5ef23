"""One process standing in for rank R of a larger world: every collective of `moetrain.distributed.comm`
replaced by a local function that returns what R would receive, shape for shape, if every other
rank sent exactly what R sends ("a symmetric world"). No communicator is needed, so the real
parallel code (tensor / sequence slicing, the expert split and dispatch, the pipeline cut, ZeRO's
flat buffers) runs unchanged in one CPU process at the shapes rank R would have.

    with SoloComm() as solo:            # before the model is parallelized: PairLinks are built there
        pm = parallelize(model, cfg, ParallelContext.build(world, rank, dp, tp, pp, ep))
        pm.runner.train_step(batches, scale)
    solo.records                        # (op, group kind, bytes in, bytes out) of every PyNative call

    op                      returns (x on rank R, group of n, R's index r)
    all_reduce, broadcast   x
    all_gather(axis)        n copies of x along axis
    reduce_scatter(axis)    chunk r of x along axis
    all_to_all(s, c)        x's n chunks along s, concatenated along c (from source j: R's chunk j)
    all_to_all_v(_raw)      per source j, the first min(send_j, recv_j) rows R sends j, zero-padded
                            to recv_j
    copy_to_region, reduce_from_region   x
    scatter_to_region / gather_from_region, the sequence-parallel pair: as reduce_scatter / all_gather
    PairLink.exchange       zeros of the expected shape (pipeline neighbours)
    barrier                 nothing

Values are not those of a real run (sums are not summed); shapes, dtypes and the buffers each op
creates are. Gradients flow through the stand-ins as through any local op (their backward is
autodiff's), so a backward has the same shapes too.

How it plugs in: entering the context replaces the public functions of `moetrain.distributed.comm` and
`comm.PairLink`, in that module and in every loaded module that imported them by name
(`from moetrain.distributed.comm import PairLink`); leaving restores them. A collective that is not
covered (a new public function of comm) reaches `comm._op`, which is replaced by one that raises,
so the dry run fails loudly instead of waiting for a peer that does not exist.
"""
from __future__ import annotations

import functools
import sys
from typing import List, Optional, Sequence, Tuple

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype

from moetrain.distributed import comm
from moetrain.distributed.topology import Group

# comm's public collectives; each maps to one of the stand-in kinds below
REPLACED = {"all_reduce": "identity", "broadcast": "identity", "copy_to_region": "identity",
            "reduce_from_region": "identity", "all_gather": "gather", "gather_from_region": "gather",
            "gather_from_sequence": "gather", "reduce_scatter": "scatter", "scatter_to_region": "scatter",
            "reduce_scatter_to_sequence": "scatter", "all_to_all": "all_to_all", "all_to_all_v": "all_to_all_v",
            "all_to_all_v_raw": "all_to_all_v"}

_RECORDS: List[Tuple[str, str, int, int]] = []
_ACTIVE: List["SoloComm"] = []


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * mstype.type_size_in_bytes(dtype)


class _SoloOp(nn.Cell):
    """One stand-in per (op, group, input shape and dtype, parameters), built in Python (also while
    ms.jit parses a graph, like comm's own op cells); `construct` is graph code."""

    def __init__(self, op: str, kind: str, group: Group, shape, dtype, params=()):
        super().__init__()
        self.op, self.kind, self.group_kind = op, kind, group.kind
        self.n, self.rank = group.size, group.rank_in_group
        self.shape = tuple(shape)
        ndim = len(self.shape)
        out = list(self.shape)
        if kind in ("gather", "scatter"):
            axis = params[0] if params else 0
            if not -ndim <= axis < ndim:
                raise ValueError(f"{op}: axis {axis} is out of range for a tensor of shape {self.shape}")
            self.axis = axis % ndim
            if kind == "scatter" and self.shape[self.axis] % self.n:
                raise ValueError(f"{op}: dimension {self.axis} of shape {self.shape} is not divisible by the "
                                 f"{self.n} ranks of the {group.kind} group")
            out[self.axis] = out[self.axis] * self.n if kind == "gather" else out[self.axis] // self.n
        elif kind == "all_to_all":
            self.split_axis, self.concat_axis = (a % ndim for a in params)
            if self.shape[self.split_axis] % self.n:
                raise ValueError(f"{op}: dimension {self.split_axis} of shape {self.shape} is not divisible by "
                                 f"the {self.n} ranks of the {group.kind} group")
            out[self.split_axis] //= self.n
            out[self.concat_axis] *= self.n
        elif kind == "all_to_all_v":
            send, recv = tuple(params[0]), tuple(params[1])
            if len(send) != self.n or len(recv) != self.n or sum(send) != self.shape[0]:
                raise ValueError(f"{op}: {self.n} send and recv counts summing to the {self.shape[0]} rows of x "
                                 f"are needed, got send {send} recv {recv}")
            starts = np.cumsum((0,) + send[:-1])
            pad_row = self.shape[0]
            rows = [int(starts[j]) + k if k < send[j] else pad_row for j in range(self.n) for k in range(recv[j])]
            self.rows = Tensor(np.array(rows, np.int32))
            out[0] = sum(recv)
        self.out_shape = tuple(out)
        self.in_bytes, self.out_bytes = _nbytes(self.shape, dtype), _nbytes(self.out_shape, dtype)

    def __call__(self, *args):
        # PyNative only (a jitted graph inlines construct): what this rank's op took in and gave out
        _RECORDS.append((self.op, self.group_kind, self.in_bytes, self.out_bytes))
        return super().__call__(*args)

    def construct(self, x):
        if self.kind == "identity":
            return x
        if self.kind == "gather":
            return ops.Concat(self.axis)((x,) * self.n)
        if self.kind == "scatter":
            return ops.Split(self.axis, self.n)(x)[self.rank]
        if self.kind == "all_to_all":
            if self.split_axis == self.concat_axis:
                return x
            return ops.Concat(self.concat_axis)(ops.Split(self.split_axis, self.n)(x))
        padded = ops.Concat(0)((x, ops.Zeros()((1,) + x.shape[1:], x.dtype)))
        return ops.Gather()(padded, self.rows, 0)


@functools.lru_cache(maxsize=None)
def _solo_op(op: str, group: Group, shape, dtype, params=()):
    return _SoloOp(op, REPLACED[op], group, shape, dtype, params)


def _stand_in(op: str):
    """The stand-in for comm.`op`, with comm's signature (positional and keyword)."""
    def identity(x, group: Group):
        if group.size == 1:
            return x
        return _solo_op(op, group, x.shape, x.dtype)(x)

    def along_axis(x, group: Group, axis: int = 0):
        if group.size == 1:
            return x
        return _solo_op(op, group, x.shape, x.dtype, (axis,))(x)

    def along_last_axis(x, group: Group, axis: int = -1):
        if group.size == 1:
            return x
        return _solo_op(op, group, x.shape, x.dtype, (axis,))(x)

    def all_to_all(x, group: Group, split_axis: int = 0, concat_axis: int = 0):
        if group.size == 1:
            return x
        return _solo_op(op, group, x.shape, x.dtype, (split_axis, concat_axis))(x)

    def all_to_all_v(x, send_counts: Sequence[int], recv_counts: Sequence[int], group: Group,
                     max_count: Optional[int] = None):
        if group.size == 1:
            return x
        return _solo_op(op, group, x.shape, x.dtype, (tuple(send_counts), tuple(recv_counts)))(x)

    def all_to_all_v_raw(x, send_counts: Sequence[int], recv_counts: Sequence[int], group: Group,
                         max_count: Optional[int] = None):
        # one return statement, as comm's (it runs inside a hand-written bprop)
        return _solo_op(op, group, x.shape, x.dtype, (send_counts, recv_counts))(x)

    def broadcast(x, src_rank_in_group: int, group: Group):
        if group.size == 1:
            return x
        return _solo_op(op, group, x.shape, x.dtype)(x)

    if op == "broadcast":
        return broadcast
    if op == "all_to_all_v_raw":
        return all_to_all_v_raw
    if op in ("scatter_to_region", "gather_from_region"):
        return along_last_axis
    return {"identity": identity, "gather": along_axis, "scatter": along_axis, "all_to_all": all_to_all,
            "all_to_all_v": all_to_all_v}[REPLACED[op]]


class SoloPairLink:
    """`comm.PairLink` for one process: the neighbour's tensor is zeros of the expected shape."""

    def __init__(self, group: Group, lower: bool):
        if group.size != 2:
            raise ValueError(f"PairLink needs a 2-rank group, got the {group.kind} group {group.ranks}")
        self.group, self.lower = group, lower

    def exchange(self, payload, recv_shape=None, dtype=ms.float32):
        shape = tuple(payload.shape) if payload is not None else tuple(recv_shape)
        sent = _nbytes(shape, dtype) if payload is not None else 0
        _RECORDS.append(("pair_link", "pp", sent, _nbytes(shape, dtype) if recv_shape is not None else 0))
        return None if recv_shape is None else ops.zeros(tuple(recv_shape), dtype)


def _uncovered(op, *args, **kwargs):
    raise RuntimeError(f"the dry run's solo stand-in (moetrain/testing/solo.py) does not cover comm op {op!r}: "
                       f"add it to REPLACED there")


def _barrier(group=None) -> None:
    return None


class SoloComm:
    """Context manager: comm's collectives replaced by the local stand-ins (see the module notes).
    `records`: `(op, group kind, bytes in, bytes out)` of every stand-in call executed in PyNative
    inside the block (a jitted graph records nothing)."""

    def __init__(self):
        self.records: List[Tuple[str, str, int, int]] = []
        self._saved = []

    def __enter__(self) -> "SoloComm":
        if _ACTIVE:
            raise RuntimeError("SoloComm is already active; nest nothing inside it")
        replacements = {name: _stand_in(name) for name in REPLACED}
        replacements.update(PairLink=SoloPairLink, barrier=_barrier, _op=_uncovered)
        originals = {name: getattr(comm, name) for name in replacements if hasattr(comm, name)}
        by_identity = {id(obj): name for name, obj in originals.items() if name != "_op"}
        for module in list(sys.modules.values()):
            names = vars(module) if module is not None else {}
            for attr, value in list(names.items()):
                name = "_op" if module is comm and attr == "_op" else by_identity.get(id(value))
                if name is not None and (module is comm or attr == name):
                    self._saved.append((module, attr, value))
                    setattr(module, attr, replacements[name])
        self._start = len(_RECORDS)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, value in reversed(self._saved):
            setattr(module, attr, value)
        self._saved.clear()
        self.records = _RECORDS[self._start:]
        del _RECORDS[self._start:]
        _ACTIVE.remove(self)

    def calls(self) -> List[Tuple[str, str, int, int]]:
        """The records so far (inside the block too)."""
        return list(_RECORDS[self._start:]) if self in _ACTIVE else list(self.records)
