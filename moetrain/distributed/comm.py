"""Differentiable collectives on topology `Group`s, usable in PyNative and inside `ms.jit`.

Two families, both with hand-written backwards (`nn.Cell.bprop`):

* Collectives whose backward is the true derivative of the SUM of all ranks' losses:
  `all_reduce` (bwd all_reduce), `all_gather` (bwd reduce_scatter), `reduce_scatter`
  (bwd all_gather), `all_to_all` (bwd the reverse all_to_all), `all_to_all_v` and
  `all_to_all_v_dynamic` (counts as device Tensors; Ascend only) (bwd with the counts swapped),
  `broadcast` (bwd: the sum of every rank's gradient lands on the source, zero elsewhere).
* Megatron tensor-parallel region mappings, for a loss that is replicated over the group:
  `copy_to_region` (fwd identity, bwd all-reduce), `reduce_from_region` (fwd all-reduce, bwd
  identity), `scatter_to_region` / `gather_from_region` along an axis, and for sequence parallelism
  `reduce_scatter_to_sequence` (bwd all-gather) / `gather_from_sequence` (bwd reduce-scatter).

On a group of one rank every op is the identity and nothing is added to the graph.

Same graph on every rank: under `ms.jit`, independent collectives run in an order MindSpore picks
from the graph, so ranks whose graphs differ can issue them in different orders and deadlock
(measured). The emulation therefore builds identical ops on every rank (only constants such as
pad widths and slice indices differ), so every rank schedules the same graph the same way. Callers
must not branch on the rank around collectives inside a jitted function, and where two collectives
of one graph do not depend on each other through data, the caller orders them with `ops.depend`
(e.g. the expert-parallel counts before the tokens). No side effect (Parameter update, Python call)
is put into graphs for ordering or counting: MindSpore 2.10's scheduler links side effects with a
recursion that grows exponentially with their number (tp2 GPT grad step 1.8/3.9/13 s for 1/2/3
layers with an in-graph byte counter, 2.9 s for 3 layers without: docs/performance.md).

Backends (`backend_name()`, `MOETRAIN_COMM_BACKEND=auto|emulated|native|contract`):
* emulated (CPU default): MindSpore has AllReduce in CPU sub-groups but no AllGather /
  ReduceScatter / AlltoAll / Send / Receive there, so every op is derived from a SUM AllReduce in
  the group: each rank writes its contribution into its own slot of a zero buffer, the AllReduce
  assembles all slots everywhere, each rank reads what it needs. Values equal the native ops
  exactly (x + 0 == x).
* native (Ascend/GPU default): the MindSpore primitives. AlltoAll/AlltoAllV are Ascend-only, so on
  GPU `all_to_all(_v)` gather the outboxes with AllGather instead. UNVERIFIED on a device.
* contract: the native code path on CPU, its primitives taken from `moetrain.testing.contract`
  (checked CPU references of the documented semantics) instead of `mindspore.ops`;
  `MOETRAIN_CONTRACT_TARGET=Ascend|GPU` picks which device's path. `primitives()` is the one place
  that choice is made.

Byte counters (`CommLedger`): each op books, when it EXECUTES in PyNative, the bytes this rank
sends, per group kind; its backward volume is booked when its backward executes (so collectives
whose input needs no gradient book no backward bytes). Columns: forward and backward, each for
what the native path of `native_target()` sends (ring algorithms: all_reduce 2(n-1)/n·S,
all_gather (n-1)·S_shard, reduce_scatter (n-1)/n·S, Ascend all_to_all (n-1)/n·S, all_to_all_v the
rows for other ranks, broadcast S per forwarding rank; on GPU the gathered outboxes, padding
included) and for what the CPU emulation all-reduces (2(n-1)/n·buffer). Jitted graphs book nothing
(see "Same graph on every rank"): measure a step with `train.jit: false` or in PyNative; the ops and
buffers are the same. tests/test_comm.py checks both columns against the buffers that entered the
primitives.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype
from mindspore.ops import ReduceOp

from mindspore.common.api import _pynative_executor
from mindspore.communication import GlobalComm, get_group_size

from moetrain.testing import contract
from moetrain.distributed.topology import Group
from moetrain.env import env_choice

COUNTER_KINDS = ("world", "tp", "dp", "cp", "pp", "ep", "edp", "embedding", "other")
COUNTER_COLUMNS = ("fwd_native", "fwd_emulated", "bwd_native", "bwd_emulated")


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------
BACKENDS = ("emulated", "native", "contract")


def backend_name() -> str:
    """'emulated' (derived from AllReduce; CPU), 'native' (MindSpore primitives; Ascend/GPU) or
    'contract' (the native code path on CPU, each primitive a checked reference: moetrain.testing.contract)."""
    forced = env_choice("MOETRAIN_COMM_BACKEND", BACKENDS)
    if forced != "auto":
        return forced
    return "emulated" if ms.get_context("device_target") == "CPU" else "native"


def native_target() -> str:
    """The device of the native path: the real one with the native backend; otherwise the one the
    contract stands in for and the ledger's native column describes (MOETRAIN_CONTRACT_TARGET,
    Ascend by default)."""
    if backend_name() == "native":
        return ms.get_context("device_target")
    return contract.target()


def describe_backend() -> str:
    """'emulated', or the backend and the device of its native path, e.g. 'contract (Ascend path)'."""
    backend = backend_name()
    return backend if backend == "emulated" else f"{backend} ({native_target()} path)"


def primitives():
    """Where comm (and any module with a native path) takes its MindSpore primitives from:
    `mindspore.ops`, or the contract's checked CPU stand-ins with the same names and signatures."""
    if backend_name() == "contract":
        return contract
    return ops


# ---------------------------------------------------------------------------------------------
# Byte counters (host side; PyNative execution only)
# ---------------------------------------------------------------------------------------------
_TOTALS = np.zeros((len(COUNTER_KINDS), len(COUNTER_COLUMNS)), np.float64)


def _ring(n: int, nbytes: float) -> float:
    """Bytes one rank sends in a ring all-reduce of `nbytes`."""
    return 2.0 * (n - 1) / n * nbytes


def _book(kind: str, native: float, emulated: float, backward: bool) -> None:
    row = COUNTER_KINDS.index(kind) if kind in COUNTER_KINDS else len(COUNTER_KINDS) - 1
    col = 2 if backward else 0
    _TOTALS[row, col] += native
    _TOTALS[row, col + 1] += emulated


class CommLedger:
    """Bytes this rank sends in the comm ops EXECUTED in PyNative inside the block, per group kind.

        with comm.CommLedger() as ledger:
            loss, grads = grad_fn(batch)           # PyNative (train.jit: false): ops book as they run
        ledger.bytes_by_group(backward=True)       # {'tp': ..., 'ep': ...}, native volume

    Backward bytes are booked when an op's backward runs. Jitted graphs book nothing: run the step
    to be measured without `ms.jit` (same ops, same buffers).
    """

    def __enter__(self) -> "CommLedger":
        self._start = _TOTALS.copy()
        self._delta = None
        return self

    def __exit__(self, *exc) -> None:
        self._delta = _TOTALS - self._start

    def _table(self) -> np.ndarray:
        if self._delta is None:
            raise RuntimeError("CommLedger is read before its `with` block has ended; read it after the block")
        return self._delta

    def bytes_by_group(self, *, backward: bool, emulated: bool = False) -> Dict[str, int]:
        """Bytes per group kind of the forward ops, plus their backward if `backward`; `emulated=True`
        gives what the CPU emulation moved instead of the native algorithms' volume."""
        table = self._table()
        cols = [1 if emulated else 0] + ([3 if emulated else 2] if backward else [])
        return {kind: int(round(table[i, cols].sum())) for i, kind in enumerate(COUNTER_KINDS)
                if table[i, cols].sum() > 0}

    def summary(self) -> str:
        table = self._table()
        lines = [f"{'group':<10}" + "".join(f"{c:>15}" for c in COUNTER_COLUMNS)]
        for i, kind in enumerate(COUNTER_KINDS):
            if table[i].any():
                lines.append(f"{kind:<10}" + "".join(f"{int(v):>15,}" for v in table[i]))
        return "\n".join(lines)


class _BackwardBooking(nn.Cell):
    """Identity whose backward books `op`'s backward traffic: placed after an op in PyNative only
    (by `_GroupOp.__call__`, which jitted graphs never call), so it runs exactly when the op's
    own backward runs."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        self.op.book(backward=True)
        return (dout,)


def _recording_grad() -> bool:
    return _pynative_executor.requires_grad()


# ---------------------------------------------------------------------------------------------
# Shape helpers (graph-safe: shapes and ranks are compile-time constants). They use primitives
# (ops.Split, ops.Squeeze, ...) because the functional forms (ops.split, ops.squeeze, ops.zeros)
# fail inside a custom bprop under ms.jit in MindSpore 2.10 ("The func graph is empty").
# ---------------------------------------------------------------------------------------------
def _zeros(shape, dtype):
    return ops.Zeros()(shape, dtype)


def _slot_buffer(x, slot: int, n: int):
    """[n, *x.shape], x in row `slot`, exact zeros elsewhere (zero padding: no 0*x, which would
    turn an inf into nan in every slot). The ops are the same on every rank, only the pad widths
    differ: see "Same graph on every rank" in the module notes."""
    pads = ((slot, n - 1 - slot),) + ((0, 0),) * len(x.shape)
    return ops.Pad(pads)(ops.ExpandDims()(x, 0))


def _keep_if(x, keep: bool):
    """x, or exact zeros of its shape, through the same ops either way."""
    return _row(_slot_buffer(x, 0 if keep else 1, 2), 0, 0)


def _merge_leading(y, axis: int):
    """[n, d0, ..., d_axis, ...] -> the n blocks concatenated along `axis` of the block."""
    ndim = len(y.shape)
    perm = tuple(range(1, axis + 1)) + (0,) + tuple(range(axis + 1, ndim))
    y = ops.Transpose()(y, perm)
    shape = y.shape
    return ops.Reshape()(y, shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2:])


def _split_leading(x, axis: int, n: int):
    """Inverse of `_merge_leading`: n equal chunks along `axis` stacked on a new leading axis."""
    shape = x.shape
    y = ops.Reshape()(x, shape[:axis] + (n, shape[axis] // n) + shape[axis + 1:])
    perm = (axis,) + tuple(range(axis)) + tuple(range(axis + 1, len(shape) + 1))
    return ops.Transpose()(y, perm)


def _chunk(x, axis: int, n: int, index: int):
    return ops.Split(axis, n)(x)[index]


def _row(everything, index: int, axis: int):
    """Slice `index` of `axis`, that axis removed."""
    return ops.Squeeze(axis)(ops.Split(axis, everything.shape[axis])(everything)[index])


# ---------------------------------------------------------------------------------------------
# Op cells: one per (op, group, input shape and dtype, parameters), built in Python (also when
# first met while `ms.jit` compiles), so validation and byte formulas are plain Python.
# construct = forward, bprop = the adjoint.
# ---------------------------------------------------------------------------------------------
class _GroupOp(nn.Cell):
    def __init__(self, group: Group, shape, dtype):
        super().__init__()
        self.n, self.rank = group.size, group.rank_in_group
        self.where = f"{group.kind} group {group.ranks}"
        self.native = backend_name() != "emulated"   # native, or contract: the same code path
        self.target = native_target()
        prims = primitives()
        self.sum = prims.AllReduce(ReduceOp.SUM, group.name)
        if self.native:  # on a device UNVERIFIED; on CPU exercised through the contract backend
            self.gather_prim = prims.AllGather(group.name)
            self.scatter_prim = prims.ReduceScatter(ReduceOp.SUM, group.name)
        self.shape = tuple(shape)
        self.itemsize = mstype.type_size_in_bytes(dtype)
        self.nbytes = float(np.prod(self.shape, dtype=np.int64)) * self.itemsize
        self.kind = group.kind

    def _set_traffic(self, fwd: Tuple[float, float], bwd: Tuple[float, float]) -> None:
        """(native, emulated) bytes this rank sends in one forward / one backward execution; native:
        the native path of `self.target`, whichever backend runs (the ledger has both columns)."""
        self.traffic = (fwd, bwd)

    def book(self, backward: bool = False) -> None:
        native, emulated = self.traffic[1 if backward else 0]
        _book(self.kind, native, emulated, backward)

    def __call__(self, *args):
        # PyNative only: a jitted graph inlines `construct` and never calls this.
        self.book()
        out = super().__call__(*args)
        if _recording_grad():
            out = _BackwardBooking(self)(out)
        return out

    def _axis(self, what: str, axis: int, divisible: bool = False) -> int:
        ndim = len(self.shape)
        if not -ndim <= axis < ndim:
            raise ValueError(f"{what}: axis {axis} is out of range for a tensor of shape {self.shape}")
        axis %= ndim
        if divisible and self.shape[axis] % self.n:
            raise ValueError(f"{what}: dimension {axis} of shape {self.shape} is not divisible by the "
                             f"{self.n} ranks of the {self.where}; pad it or choose sizes that divide evenly")
        return axis

    def _gather_rows(self, x):
        """[n, *x.shape]: every rank's x, in rank order (AllGather concatenates along axis 0)."""
        if self.native:
            return self.gather_prim(ops.ExpandDims()(x, 0))
        return self.sum(_slot_buffer(x, self.rank, self.n))

    def _all_gather(self, x, axis: int):
        if self.native and axis == 0:
            return self.gather_prim(x)
        return _merge_leading(self._gather_rows(x), axis)

    def _reduce_scatter(self, x, axis: int):
        if self.native:
            if axis == 0:
                return self.scatter_prim(x)
            return _row(self.scatter_prim(_split_leading(x, axis, self.n)), 0, 0)
        return _chunk(self.sum(x), axis, self.n, self.rank)

    def _only_on(self, x, rank: int):
        return _keep_if(x, self.rank == rank)


class _AllReduce(_GroupOp):
    def __init__(self, group, shape, dtype):
        super().__init__(group, shape, dtype)
        ring = _ring(self.n, self.nbytes)
        self._set_traffic((ring, ring), (ring, ring))

    def construct(self, x):
        return self.sum(x)

    def bprop(self, x, out, dout):
        return (self.sum(dout),)


class _AllGather(_GroupOp):
    def __init__(self, group, shape, dtype, axis):
        super().__init__(group, shape, dtype)
        self.axis = self._axis("all_gather", axis)
        n, size = self.n, self.nbytes   # size: the local shard
        self._set_traffic(((n - 1) * size, _ring(n, n * size)), ((n - 1) * size, _ring(n, n * size)))

    def construct(self, x):
        return self._all_gather(x, self.axis)

    def bprop(self, x, out, dout):
        return (self._reduce_scatter(dout, self.axis),)


class _ReduceScatter(_GroupOp):
    def __init__(self, group, shape, dtype, axis):
        super().__init__(group, shape, dtype)
        self.axis = self._axis("reduce_scatter", axis, divisible=True)
        n, size = self.n, self.nbytes   # size: the full input; the backward gathers size/n shards
        self._set_traffic(((n - 1) / n * size, _ring(n, size)), ((n - 1) / n * size, _ring(n, size)))

    def construct(self, x):
        return self._reduce_scatter(x, self.axis)

    def bprop(self, x, out, dout):
        return (self._all_gather(dout, self.axis),)


class _AllToAll(_GroupOp):
    def __init__(self, group, shape, dtype, split_axis, concat_axis):
        super().__init__(group, shape, dtype)
        self.split_axis = self._axis("all_to_all", split_axis, divisible=True)
        self.concat_axis = self._axis("all_to_all", concat_axis)
        # AlltoAll is Ascend-only: elsewhere the [dst, size/n] outbox of every rank is gathered
        # (AllGather on GPU, the AllReduce emulation on CPU) and each rank keeps its column
        self.direct = self.native and self.target == "Ascend"
        n, size = self.n, self.nbytes
        native = (n - 1) / n * size if self.target == "Ascend" else (n - 1) * size
        self._set_traffic((native, _ring(n, n * size)), (native, _ring(n, n * size)))
        if self.direct:  # UNVERIFIED on Ascend
            prims = primitives()
            self.forward_prim = prims.AlltoAll(n, self.split_axis, self.concat_axis, group.name)
            self.backward_prim = prims.AlltoAll(n, self.concat_axis, self.split_axis, group.name)

    def _exchange(self, x, split_axis, concat_axis):
        # everything[src, dst] = chunk `dst` of rank `src`; column `rank` is my inbox
        everything = self._gather_rows(_split_leading(x, split_axis, self.n))
        return _merge_leading(_row(everything, self.rank, 1), concat_axis)

    def construct(self, x):
        if self.direct:
            return self.forward_prim(x)
        return self._exchange(x, self.split_axis, self.concat_axis)

    def bprop(self, x, out, dout):
        if self.direct:
            return (self.backward_prim(dout),)
        return (self._exchange(dout, self.concat_axis, self.split_axis),)


class _AllToAllV(_GroupOp):
    def __init__(self, group, shape, dtype, send_counts, recv_counts, max_count):
        super().__init__(group, shape, dtype)
        n, me = self.n, self.rank
        if len(self.shape) == 0:
            raise ValueError("all_to_all_v: x must have a leading row axis, got a scalar")
        if len(send_counts) != n or len(recv_counts) != n:
            raise ValueError(f"all_to_all_v: need {n} send and {n} recv counts for the {self.where}, "
                             f"got {len(send_counts)} and {len(recv_counts)}")
        if min(send_counts + recv_counts) < 0:
            raise ValueError(f"all_to_all_v: counts must be >= 0, got send {send_counts} recv {recv_counts}")
        if sum(send_counts) != self.shape[0]:
            raise ValueError(f"all_to_all_v: send_counts {send_counts} sum to {sum(send_counts)} but x has "
                             f"{self.shape[0]} rows")
        if send_counts[me] != recv_counts[me]:
            raise ValueError(f"all_to_all_v: rank {me} of the {self.where} sends {send_counts[me]} rows to "
                             f"itself but expects {recv_counts[me]}")
        largest = max(send_counts + recv_counts)
        self.capacity = largest if max_count is None else int(max_count)
        if self.capacity < largest:
            raise ValueError(f"all_to_all_v: max_count={max_count} is below this rank's largest count {largest}")
        self.send_counts, self.recv_counts = send_counts, recv_counts
        self.forward_plan = self._plan(send_counts, recv_counts)
        self.backward_plan = self._plan(recv_counts, send_counts)
        row_elems = int(np.prod(self.shape[1:], dtype=np.int64))
        row = float(row_elems * self.itemsize)
        buffer = n * self.capacity * row   # one rank's [n, max_count, ...] outbox
        # AlltoAllV is Ascend-only: elsewhere the padded outboxes are gathered (GPU: AllGather)
        self.use_native_v = self.native and self.target == "Ascend"
        if self.target == "Ascend":
            native = (sum(c for j, c in enumerate(send_counts) if j != me) * row,
                      sum(c for i, c in enumerate(recv_counts) if i != me) * row)
        else:
            native = ((n - 1) * buffer, (n - 1) * buffer)
        self._set_traffic((native[0], _ring(n, n * buffer)), (native[1], _ring(n, n * buffer)))
        self.rest = tuple(self.shape[1:])
        if self.use_native_v:  # UNVERIFIED on Ascend
            self.prim = primitives().AlltoAllV(group.name)
            self.send_numel = [c * row_elems for c in send_counts]
            self.recv_numel = [c * row_elems for c in recv_counts]
            self.sent_rows, self.received_rows = sum(send_counts), sum(recv_counts)
            self.sent_elements, self.received_elements = sum(self.send_numel), sum(self.recv_numel)

    def _plan(self, send_counts, recv_counts):
        """Row indices, built once in Python: which input rows fill the [n, capacity] outbox (the
        appended zero row pads), and which inbox rows form the output."""
        pad_row, start, outbox = sum(send_counts), 0, []
        for count in send_counts:
            outbox += list(range(start, start + count)) + [pad_row] * (self.capacity - count)
            start += count
        inbox = [src * self.capacity + k for src, count in enumerate(recv_counts) for k in range(count)]
        return Tensor(np.array(outbox, np.int32)), Tensor(np.array(inbox, np.int32))

    def _exchange(self, x, plan):
        rest = x.shape[1:]
        padded = ops.Concat(0)((x, _zeros((1,) + rest, x.dtype)))
        outbox = ops.Reshape()(ops.Gather()(padded, plan[0], 0), (self.n, self.capacity) + rest)
        inbox = _row(self._gather_rows(outbox), self.rank, 1)   # [src, capacity, ...]
        return ops.Gather()(ops.Reshape()(inbox, (self.n * self.capacity,) + rest), plan[1], 0)

    def _exchange_v(self, x, send_numel, recv_numel, elements: int, rows: int):
        """AlltoAllV of the flattened `elements`; `rows` arrive. AlltoAllV returns shape () when
        nothing arrives (documented), so its output is flattened and cut to the expected length:
        the same ops on every rank whatever arrives (see "Same graph on every rank")."""
        y = ops.Reshape()(self.prim(ops.Reshape()(x, (elements,)), send_numel, recv_numel), (-1,))
        arrived = rows * int(np.prod(self.rest, dtype=np.int64))
        return ops.Reshape()(y[:arrived], (rows,) + self.rest)    # not Slice: it refuses inputs over 2 GiB

    def construct(self, x):
        if self.use_native_v:
            return self._exchange_v(x, self.send_numel, self.recv_numel, self.sent_elements, self.received_rows)
        return self._exchange(x, self.forward_plan)

    def bprop(self, x, out, dout):
        if self.use_native_v:
            return (self._exchange_v(dout, self.recv_numel, self.send_numel, self.received_elements,
                                     self.sent_rows),)
        return (self._exchange(dout, self.backward_plan),)


class _CallTraffic:
    """The bytes of ONE call of an op whose volume depends on its input values (device-side
    counts): booked by that call and by its own backward, whatever other calls do meanwhile."""

    def __init__(self, kind: str, fwd: Tuple[float, float], bwd: Tuple[float, float]):
        self.kind, self.traffic = kind, (fwd, bwd)

    def book(self, backward: bool = False) -> None:
        native, emulated = self.traffic[1 if backward else 0]
        _book(self.kind, native, emulated, backward)


class _AllToAllVDynamic(_GroupOp):
    """`all_to_all_v_dynamic`: Ascend's AlltoAllV with Tensor split sizes, `block_size` = the
    elements of one row, so the lists count rows. `shape` is one row's shape. Input `[S + 1, *row]`
    (the rows to send, then a spare row that stays), output `[R + 1, *row]` (the rows received, then
    a zero spare row): never empty, whatever the routing (MindSpore's CPU backward fails on empty
    tensors, measured; AlltoAllV returns shape () when nothing arrives). The ledger books each
    call's rows to other ranks, read from its counts in PyNative (a host read); no CPU emulation
    exists (Ascend path only), so the emulated column stays 0."""

    def __init__(self, group, shape, dtype):
        super().__init__(group, shape, dtype)       # self.nbytes: one row
        if not (self.native and self.target == "Ascend"):
            raise ValueError(f"all_to_all_v_dynamic needs Ascend's AlltoAllV (comm backend native on Ascend, or "
                             f"contract with MOETRAIN_CONTRACT_TARGET=Ascend); this process runs backend "
                             f"{backend_name()!r} for {self.target}: use all_to_all_v with host counts")
        self.row_elements = int(np.prod(self.shape, dtype=np.int64))
        self.prim = primitives().AlltoAllV(group.name, self.row_elements)   # UNVERIFIED on Ascend

    def __call__(self, x, send_rows, recv_rows):
        send, recv = send_rows.asnumpy().reshape(-1), recv_rows.asnumpy().reshape(-1)
        others = lambda counts: float(counts.sum() - counts[self.rank]) * self.nbytes   # noqa: E731
        call = _CallTraffic(self.kind, (others(send), 0.0), (others(recv), 0.0))
        call.book()
        out = nn.Cell.__call__(self, x, send_rows, recv_rows)
        if _recording_grad():
            out = _BackwardBooking(call)(out)
        return out

    def _exchange(self, x, send_rows, recv_rows):
        ndim = len(self.shape) + 1                   # all rows but the spare (no row count: dynamic shapes)
        sent = ops.Reshape()(ops.StridedSlice()(x, (0,) * ndim, (-1,) + self.shape, (1,) * ndim), (-1,))
        received = self.prim(sent, send_rows, recv_rows)
        if len(received.shape) == 0:        # documented: nothing arrived, the value means nothing
            received = _zeros((0,), x.dtype)
        spare = _zeros((self.row_elements,), x.dtype)
        return ops.Reshape()(ops.Concat(0)((received, spare)), (-1,) + self.shape)

    def construct(self, x, send_rows, recv_rows):
        return self._exchange(x, send_rows, recv_rows)

    def bprop(self, x, send_rows, recv_rows, out, dout):
        return (self._exchange(dout, recv_rows, send_rows), ops.ZerosLike()(send_rows),
                ops.ZerosLike()(recv_rows))


class _Broadcast(_GroupOp):
    def __init__(self, group, shape, dtype, src):
        super().__init__(group, shape, dtype)
        if not 0 <= src < self.n:
            raise ValueError(f"broadcast: source rank {src} is not a rank of the {self.where} "
                             f"(ranks in the group: 0..{self.n - 1})")
        self.src = src
        n, size = self.n, self.nbytes
        # forward: a ring broadcast, every rank but the source's predecessor passes S on;
        # backward: an all-reduce of the gradients (kept on the source)
        forwards = 0.0 if self.rank == (src - 1) % n else size
        self._set_traffic((forwards, _ring(n, size)), (_ring(n, size), _ring(n, size)))
        if self.native:
            # root_rank is the rank IN the group: the kernels hand it to HcclBroadcast/ncclBroadcast
            # as the communicator rank, and MindSpore's own broadcast() converts a global rank with
            # get_group_rank_from_world_rank first (the docstring's "global rank" holds only on the
            # world group)
            self.prim = primitives().Broadcast(src, group.name)

    def construct(self, x):
        if self.native:
            return self.prim((x,))[0]
        return self.sum(self._only_on(x, self.src))

    def bprop(self, x, out, dout):
        return (self._only_on(self.sum(dout), self.src),)


class _CopyToRegion(_GroupOp):
    def __init__(self, group, shape, dtype):
        super().__init__(group, shape, dtype)
        ring = _ring(self.n, self.nbytes)
        self._set_traffic((0.0, 0.0), (ring, ring))

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.sum(dout),)


class _ReduceFromRegion(_GroupOp):
    def __init__(self, group, shape, dtype):
        super().__init__(group, shape, dtype)
        ring = _ring(self.n, self.nbytes)
        self._set_traffic((ring, ring), (0.0, 0.0))

    def construct(self, x):
        return self.sum(x)

    def bprop(self, x, out, dout):
        return (dout,)


class _ScatterToRegion(_GroupOp):
    def __init__(self, group, shape, dtype, axis):
        super().__init__(group, shape, dtype)
        self.axis = self._axis("scatter_to_region", axis, divisible=True)
        n, size = self.n, self.nbytes   # the backward gathers the size/n gradient chunks
        self._set_traffic((0.0, 0.0), ((n - 1) / n * size, _ring(n, size)))

    def construct(self, x):
        return _chunk(x, self.axis, self.n, self.rank)

    def bprop(self, x, out, dout):
        return (self._all_gather(dout, self.axis),)


class _GatherFromRegion(_GroupOp):
    def __init__(self, group, shape, dtype, axis):
        super().__init__(group, shape, dtype)
        self.axis = self._axis("gather_from_region", axis)
        n, size = self.n, self.nbytes
        self._set_traffic(((n - 1) * size, _ring(n, n * size)), (0.0, 0.0))

    def construct(self, x):
        return self._all_gather(x, self.axis)

    def bprop(self, x, out, dout):
        return (_chunk(dout, self.axis, self.n, self.rank),)


_OP_CELLS = {cls.__name__: cls for cls in (_AllReduce, _AllGather, _ReduceScatter, _AllToAll, _AllToAllV,
                                            _AllToAllVDynamic,
                                            _Broadcast, _CopyToRegion, _ReduceFromRegion,
                                            _ScatterToRegion, _GatherFromRegion)}


@functools.lru_cache(maxsize=None)
def _cached_op(backend: str, target: str, op: str, group: Group, shape, dtype, params):
    return _OP_CELLS[op](group, shape, dtype, *params)


def clear_op_cache() -> None:
    """Forget the cached collective cells (a test process that runs several jobs, e.g. per backend)."""
    _cached_op.cache_clear()


def _op_for_backend(op: str, group: Group, shape, dtype, params=()):
    return _cached_op(backend_name(), native_target(), op, group, tuple(shape), dtype, tuple(params))


# The cell of one call signature on the current backend, cached so PyNative calls stay cheap.
# Under ms.jit this must run as Python while the graph is parsed: MindSpore parses plain Python
# functions into the graph but interprets C callables such as functools.partial (and lru_cache
# wrappers). The op is named by a string because passing a class object through that path fails
# in MindSpore 2.10 (KeyError '__input_0__').
_op = functools.partial(_op_for_backend)


def _run(cell: _GroupOp, x):
    return cell(x)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------
def all_reduce(x, group: Group):
    """Sum over the group. Backward: all_reduce of the gradients."""
    if group.size == 1:
        return x
    return _run(_op("_AllReduce", group, x.shape, x.dtype), x)


def all_gather(x, group: Group, axis: int = 0):
    """Concatenate every rank's `x` along `axis` in rank order. Backward: reduce_scatter."""
    if group.size == 1:
        return x
    return _run(_op("_AllGather", group, x.shape, x.dtype, (axis,)), x)


def reduce_scatter(x, group: Group, axis: int = 0):
    """Sum over the group; rank i keeps chunk i along `axis`. Backward: all_gather."""
    if group.size == 1:
        return x
    return _run(_op("_ReduceScatter", group, x.shape, x.dtype, (axis,)), x)


def all_to_all(x, group: Group, split_axis: int = 0, concat_axis: int = 0):
    """Chunk j of `x` along split_axis goes to rank j; the received chunks are concatenated along
    concat_axis in source-rank order. Backward: the reverse all_to_all."""
    if group.size == 1:
        return x
    return _run(_op("_AllToAll", group, x.shape, x.dtype, (split_axis, concat_axis)), x)


def all_to_all_v(x, send_counts: Sequence[int], recv_counts: Sequence[int], group: Group,
                 max_count: Optional[int] = None):
    """Rows ``x[sum(send_counts[:j]) : ... + send_counts[j]]`` go to rank j; the rows from rank i
    arrive in source order, recv_counts[i] of them. Counts are Python ints (static shapes).
    Backward: the same exchange with the counts swapped.

    The CPU emulation all-reduces an [n, n, max_count, ...] buffer whose shape must agree on all
    ranks: `max_count` is the largest count anywhere in the group. By default it is the largest of
    this rank's own counts, which is right whenever every rank has the same largest count.
    """
    if group.size == 1:
        return x
    counts = (tuple(send_counts), tuple(recv_counts), max_count)
    return _run(_op("_AllToAllV", group, x.shape, x.dtype, counts), x)


def all_to_all_v_raw(x, send_counts: Sequence[int], recv_counts: Sequence[int], group: Group,
                     max_count: Optional[int] = None):
    """`all_to_all_v`'s exchange without a backward of its own, for the inside of a cell with a
    hand-written bprop (moetrain/parallel/context_parallel.py's ring, which passes K|V round again in
    its backward): under ms.jit, MindSpore 2.10 cannot call a cell that has a bprop from inside another
    cell's bprop ("Illegal AnfNode for evaluating"), nor a function that does ("The func graph is
    empty"), so the op's `construct` runs inline. Call it from a cell without a bprop of its own, on a
    group of 2 or more ranks, the counts as tuples: the function has one return statement (measured:
    with an early return for one rank MindSpore drops it inside a bprop, "The func graph is empty").
    Books no bytes in the ledger (the caller's traffic is the planner's to count)."""
    return _op("_AllToAllV", group, x.shape, x.dtype, (send_counts, recv_counts, max_count)).construct(x)


def all_to_all_v_dynamic(x, send_rows, recv_rows, group: Group):
    """`all_to_all_v` with split sizes known only on the device (Megatron's all_to_all_single with
    counts exchanged first): `send_rows`/`recv_rows` `[n]` int Tensors (rows to / from each rank),
    `x [S + 1, *row]` the `S = sum(send_rows)` rows in destination order then one spare row (not
    sent); returns `[R + 1, *row]`, the `R = sum(recv_rows)` rows in source order then a zero spare
    row. Exactly the counted rows travel: Ascend's AlltoAllV with Tensor counts (native, or the
    contract in PyNative). Backward: the same exchange with the counts swapped."""
    if group.size == 1:
        return x
    return _op("_AllToAllVDynamic", group, x.shape[1:], x.dtype)(x, send_rows, recv_rows)


def broadcast(x, src_rank_in_group: int, group: Group):
    """Every rank gets the tensor of rank `src_rank_in_group`. Backward: the gradients of all ranks
    summed onto the source, zero on the others."""
    if group.size == 1:
        return x
    return _run(_op("_Broadcast", group, x.shape, x.dtype, (src_rank_in_group,)), x)


def copy_to_region(x, group: Group):
    """Megatron f: identity forward, all-reduce of the gradients backward (column-parallel input)."""
    if group.size == 1:
        return x
    return _run(_op("_CopyToRegion", group, x.shape, x.dtype), x)


def reduce_from_region(x, group: Group):
    """Megatron g: all-reduce forward, identity backward (row-parallel output)."""
    if group.size == 1:
        return x
    return _run(_op("_ReduceFromRegion", group, x.shape, x.dtype), x)


def scatter_to_region(x, group: Group, axis: int = -1):
    """Keep this rank's chunk along `axis`; backward all-gathers the gradient chunks."""
    if group.size == 1:
        return x
    return _run(_op("_ScatterToRegion", group, x.shape, x.dtype, (axis,)), x)


def gather_from_region(x, group: Group, axis: int = -1):
    """All-gather along `axis`; backward keeps this rank's chunk of the replicated gradient."""
    if group.size == 1:
        return x
    return _run(_op("_GatherFromRegion", group, x.shape, x.dtype, (axis,)), x)


def reduce_scatter_to_sequence(x, group: Group, axis: int = 0):
    """Sequence parallel: sum the partial outputs, keep this rank's sequence chunk; backward all-gathers."""
    return reduce_scatter(x, group, axis)


def gather_from_sequence(x, group: Group, axis: int = 0):
    """Sequence parallel: gather the whole sequence; backward reduce-scatters (the consumer is a
    tensor-parallel layer whose per-rank input gradients are partial sums)."""
    return all_gather(x, group, axis)


class PairLink:
    """Point-to-point between the two ranks of a pipeline link, driven from the host (PyNative).

    `group`: this rank and its neighbour; `lower`: this rank is the lower stage. Both ranks call
    `exchange` with matching roles (the pipeline schedules pair them, see moetrain/parallel/pipeline.py).
    * native and contract: Send/Receive on the world communicator (rank in group == global rank
      there); the lower stage sends before it receives and the upper stage receives before it
      sends, so a two-way exchange cannot deadlock without batched point-to-point.
    * emulated (CPU: no Send/Receive there, and `mint.distributed.send/recv` fail under msrun in
      MindSpore 2.10, measured: docs/parallel_engine.md): one SUM all-reduce on the pair group; a
      two-way exchange is one `[2, *shape]` buffer, slot 0 the lower stage's tensor, slot 1 the upper's.
    Every exchange books its bytes in the ledger (kind "pp": native, the payload this rank sends;
    emulated, the ring all-reduce of the buffer)."""

    def __init__(self, group: Group, lower: bool):
        if group.size != 2:
            raise ValueError(f"PairLink needs a 2-rank group, got the {group.kind} group {group.ranks}")
        self.group, self.lower = group, lower
        self.slot = 0 if lower else 1
        self.peer = group.ranks[1 - self.slot]
        self.native = backend_name() != "emulated"   # native, or contract: the same code path
        self.sum = ops.AllReduce(ReduceOp.SUM, group.name)
        self._prims: Dict[tuple, object] = {}

    def _native_prims(self, shape, dtype):
        key = (tuple(shape), dtype)
        if key not in self._prims:
            prims = primitives()
            out_tag, in_tag = (0, 1) if self.lower else (1, 0)     # lower -> upper is tag 0
            # on the world group, rank in group == global rank. group_back is passed too: its default
            # is GlobalComm.WORLD_COMM_GROUP read when mindspore.ops is imported, i.e. "hccl_world_group"
            # before init() names the GPU ("nccl_world_group") or CPU ("mccl_world_group") world
            world = GlobalComm.WORLD_COMM_GROUP
            self._prims[key] = (prims.Send(out_tag, self.peer, group=world, group_back=world),
                                prims.Receive(in_tag, self.peer, list(shape), dtype, group=world, group_back=world))
        return self._prims[key]

    def exchange(self, payload, recv_shape=None, dtype=ms.float32):
        """Send `payload` (or nothing) and receive a tensor of `recv_shape` (or nothing)."""
        shape = tuple(payload.shape) if payload is not None else tuple(recv_shape)
        nbytes = float(np.prod(shape, dtype=np.int64)) * mstype.type_size_in_bytes(dtype)
        two_way = payload is not None and recv_shape is not None
        _book("pp", nbytes if payload is not None else 0.0, _ring(2, 2 * nbytes if two_way else nbytes), False)
        if self.native:
            send, receive = self._native_prims(shape, dtype)
            received = None
            if not self.lower and recv_shape is not None:
                received = receive()
            if payload is not None:
                send(payload)
            if self.lower and recv_shape is not None:
                received = receive()
            return received
        if two_way:
            zeros = ops.zeros(shape, dtype)
            pair = (payload, zeros) if self.slot == 0 else (zeros, payload)
            return self.sum(ops.stack(pair))[1 - self.slot]
        if payload is not None:
            self.sum(payload)
            return None
        return self.sum(ops.zeros(shape, dtype))


def barrier(group: Optional[Group] = None) -> None:
    """Block until every rank of `group` (default: the world) gets here. PyNative only (host sync)."""
    if group is None:
        if not GlobalComm.INITED or get_group_size() == 1:
            return
        name, kind, n = GlobalComm.WORLD_COMM_GROUP, "world", get_group_size()
    elif group.size == 1:
        return
    else:
        name, kind, n = group.name, group.kind, group.size
    _book(kind, _ring(n, 4), _ring(n, 4), False)   # one float32 all-reduced, like any other traffic
    primitives().AllReduce(ReduceOp.SUM, name)(Tensor(np.ones(1, np.float32))).asnumpy()
