"""Contract backend: CPU stand-ins for the MindSpore primitives that comm's native path calls.

`MOETRAIN_COMM_BACKEND=contract` runs the NATIVE code path of `moetrain.distributed.comm` (the Ascend/GPU
branches and `PairLink`'s Send/Receive) on CPU: comm instantiates its primitives from this module
instead of `mindspore.ops` (`comm.primitives()`), and each class here has the constructor and call
convention of its MindSpore 2.10 namesake, computes exactly what that primitive is documented to
compute, and refuses what the real one would refuse or silently get wrong. Everything is built
from the one collective MindSpore has on CPU sub-groups, a SUM AllReduce, over the named group.

What the stand-ins hold the call sites to (MindSpore 2.10 docs and `ops/operations/comm_ops.py`):

* groups: the communicator must exist (`register_group`, called by `topology.init_parallel` for
  every group it creates and for the world) and contain this rank;
* platforms ("Supported Platforms"): AlltoAll and AlltoAllV are Ascend only, AllGather,
  ReduceScatter, Broadcast, Send and Receive Ascend and GPU; the target is
  `MOETRAIN_CONTRACT_TARGET` (Ascend, default, or GPU), so the GPU path can be run too;
* ranks: Broadcast's `root_rank`, Send's `dest_rank` and Receive's `src_rank` are ranks IN the
  group. (Broadcast's docstring says "global rank", but the kernels hand it to HcclBroadcast /
  ncclBroadcast as the communicator rank, and MindSpore's own `mint.distributed.broadcast`,
  `comm_func.broadcast/send/recv/reduce/scatter` all convert with `get_group_rank_from_world_rank`
  before building the primitive; they coincide only on the world group);
* shapes and axes: AllGather concatenates along axis 0 (`(n*x1, x2, ...)`); ReduceScatter splits
  axis 0, which must divide by the group size; AlltoAll splits `split_dim` into `split_count`
  (= group size) blocks, block j to rank j, and concatenates along `concat_dim` in source order;
  AlltoAllV takes a 1-D input and per-rank element counts (times `block_size`; a tuple, list or
  1-D integer Tensor: Tensor lists in PyNative only, a new kernel each call) and returns the
  received elements flattened, or a tensor of shape `()` whose value means nothing when it
  receives nothing; Broadcast takes and returns a tuple of tensors; Receive returns its declared
  shape and dtype;
* dtypes: AllGather's `check_collective_target_dtype` table (target dependent) and Receive's
  accepted types;
* agreement across ranks (PyNative, where the stand-ins run eagerly): every rank of the group must
  call the same op with the same shape, dtype and attributes (the docs: "tensors must have the same
  shape and format in all processes"); AlltoAllV's counts must match (rank i sends rank j what j
  expects from i); a Send must meet a Receive with the same tag, shape and dtype from the right
  peer (two Sends facing each other would deadlock on a device). Each call first all-reduces a
  small header of these facts; a mismatch, or a rank whose own arguments were refused, raises on
  every rank of the group, so a bad call fails fast instead of hanging. Inside `ms.jit` the local
  checks run at compile time; cross-rank agreement is not checked there (no host round trip in a
  graph), and AlltoAllV needs the same largest count on every rank (its CPU buffer is sized by it).

Values: data movement adds exact zeros (x + 0 == x), so results are bitwise those of the real op;
float32/float16 travel as they are, bfloat16 through float32 (exact), int32 as two float32 halves
(exact for groups up to 32 ranks). Other dtypes are refused (no exact CPU reference).

Other modules (e.g. MoE operators) plug into the same switch with `comm.backend_name() ==
"contract"` and `check_platform` (see docs/parallel_engine.md, "Contract backend").
"""
from __future__ import annotations

import collections
import functools
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype
from mindspore.communication import GlobalComm, get_rank
from mindspore.ops import ReduceOp

TARGETS = ("Ascend", "GPU")
PLATFORMS = {   # MindSpore 2.10 "Supported Platforms" of each primitive (CPU aside)
    "AllReduce": ("Ascend", "GPU"), "AllGather": ("Ascend", "GPU"), "ReduceScatter": ("Ascend", "GPU"),
    "AlltoAll": ("Ascend",), "AlltoAllV": ("Ascend",), "Broadcast": ("Ascend", "GPU"),
    "Send": ("Ascend", "GPU"), "Receive": ("Ascend", "GPU"),
}
# AllGather's dtype check (comm_ops.check_collective_target_dtype): GPU has its own list
_GATHER_DTYPES = {
    "Ascend": (mstype.int8, mstype.int32, mstype.float16, mstype.float32, mstype.bfloat16),
    "GPU": (mstype.bool_, mstype.int8, mstype.int32, mstype.int64, mstype.uint32, mstype.uint64,
            mstype.float16, mstype.float32, mstype.float64),
}
_RECEIVE_DTYPES = (mstype.float16, mstype.float32, mstype.float64, mstype.bfloat16, mstype.int8, mstype.int16,
                   mstype.int32, mstype.int64, mstype.uint8, mstype.uint16, mstype.uint32, mstype.uint64)
_INT_DTYPES = (mstype.int32, mstype.int64)
_CARRIED = {mstype.float32: "direct", mstype.float16: "direct", mstype.bfloat16: "f32", mstype.int32: "split"}
_DTYPE_CODES = (mstype.float32, mstype.float16, mstype.bfloat16, mstype.int32, mstype.int8, mstype.int16,
                mstype.int64, mstype.float64, mstype.uint8, mstype.uint16, mstype.uint32, mstype.uint64, mstype.bool_)
_OPCODES = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "AlltoAllV", "Broadcast", "Send", "Receive")
_MAX_DIMS, _MAX_ATTRS = 8, 6
_SPLIT = 4096   # ints travel as (v // 4096, v % 4096): exact in float32 up to 2**36


# stand-ins constructed per op name in this process (evidence of which native path ran; tests read it)
CONSTRUCTED: collections.Counter = collections.Counter()


class ContractError(ValueError):
    """A call that the real primitive would refuse, or compute wrongly without saying so."""


# ---------------------------------------------------------------------------------------------
# Registry, target, platform
# ---------------------------------------------------------------------------------------------
_GROUPS: Dict[str, Tuple[int, ...]] = {}


def register_group(name: str, ranks: Sequence[int]) -> None:
    """Record a communicator and its member ranks (global, ascending); topology calls this for
    every group it creates and for the world group."""
    _GROUPS[name] = tuple(int(r) for r in ranks)


def group_ranks(name: str) -> Tuple[int, ...]:
    if not isinstance(name, str):
        raise TypeError(f"contract: group must be a str (the communicator name), got {type(name).__name__}")
    if name not in _GROUPS:
        raise ContractError(f"contract: communicator {name!r} does not exist; known: {sorted(_GROUPS)}. "
                            f"Groups are created by moetrain.distributed.topology.init_parallel")
    return _GROUPS[name]


def target() -> str:
    """The device whose native path the contract stands in for: MOETRAIN_CONTRACT_TARGET."""
    name = os.environ.get("MOETRAIN_CONTRACT_TARGET", "Ascend")
    if name not in TARGETS:
        raise ValueError(f"MOETRAIN_CONTRACT_TARGET={name!r}: use one of {TARGETS}")
    return name


def check_platform(op: str, platforms: Sequence[str]) -> None:
    """Refuse an op whose documented platforms exclude the contract target (for any stand-in,
    e.g. MoE operators: `check_platform("ops.grouped_matmul", ("Ascend",))`)."""
    if target() not in platforms:
        raise ContractError(f"{op} is documented for {'/'.join(platforms)} only (MindSpore 2.10 'Supported "
                            f"Platforms'), but the native path for {target()} calls it "
                            f"(MOETRAIN_CONTRACT_TARGET={target()})")


@functools.lru_cache(maxsize=None)
def _my_rank() -> int:
    return get_rank()


def _position(name: str, members: Tuple[int, ...], what: str) -> int:
    me = _my_rank()
    if me not in members:
        raise ContractError(f"{what}: this process (global rank {me}) is not a member of communicator {name!r} "
                            f"(ranks {members})")
    return members.index(me)


def _check_dtype(what: str, dtype) -> str:
    if dtype not in _CARRIED:
        raise NotImplementedError(f"{what}: no exact CPU reference for dtype {dtype} (carried: "
                                  f"{[str(d) for d in _CARRIED]})")
    return _CARRIED[dtype]


# ---------------------------------------------------------------------------------------------
# Kernels: the exact computation on CPU, one Cell per (op, group, shape, dtype, attributes),
# built in Python (also while ms.jit compiles, where their checks raise at compile time)
# ---------------------------------------------------------------------------------------------
def _slot(x, pos: int, n: int):
    """[n, *x.shape] with x in row `pos` and exact zeros elsewhere."""
    return ops.Pad(((pos, n - 1 - pos),) + ((0, 0),) * len(x.shape))(ops.ExpandDims()(x, 0))


def _take(x, index: int, axis: int):
    """Slice `index` of `axis`, the axis removed."""
    return ops.Squeeze(axis)(ops.Split(axis, x.shape[axis])(x)[index])


class _Kernel(nn.Cell):
    def __init__(self, group: str, n: int, pos: int, dtype):
        super().__init__()
        self.n, self.pos, self.dtype = n, pos, dtype
        self.carrier = _check_dtype("contract", dtype)
        self.sum = ops.AllReduce(ReduceOp.SUM, group)

    def reduce(self, x):
        """Exact SUM all-reduce of x in its own dtype (CPU AllReduce takes float32/float16 only)."""
        if self.carrier == "direct":
            return self.sum(x)
        if self.carrier == "f32":
            return ops.cast(self.sum(ops.cast(x, mstype.float32)), self.dtype)
        high = ops.floor_divide(x, _SPLIT)
        low = x - high * _SPLIT
        high = ops.cast(self.sum(ops.cast(high, mstype.float32)), mstype.int32)
        return high * _SPLIT + ops.cast(self.sum(ops.cast(low, mstype.float32)), mstype.int32)


class _AllReduceKernel(_Kernel):
    def __init__(self, group, n, pos, dtype, op):
        super().__init__(group, n, pos, dtype)
        self.plain = op == ReduceOp.SUM
        self.other = ops.AllReduce(op, group)

    def construct(self, x):
        if self.plain:
            return self.reduce(x)
        return self.other(x)


class _AllGatherKernel(_Kernel):
    def construct(self, x):
        y = self.reduce(_slot(x, self.pos, self.n))
        return ops.Reshape()(y, (self.n * x.shape[0],) + x.shape[1:])


class _ReduceScatterKernel(_Kernel):
    def construct(self, x):
        return ops.Split(0, self.n)(self.reduce(x))[self.pos]


class _AlltoAllKernel(_Kernel):
    def __init__(self, group, n, pos, dtype, split_dim, concat_dim):
        super().__init__(group, n, pos, dtype)
        self.split_dim, self.concat_dim = split_dim, concat_dim

    def construct(self, x):
        outbox = ops.Stack(0)(ops.Split(self.split_dim, self.n)(x))       # [dst, block]
        everything = self.reduce(_slot(outbox, self.pos, self.n))          # [src, dst, block]
        inbox = _take(everything, self.pos, 1)                              # [src, block]
        blocks = ()
        for src in range(self.n):
            blocks = blocks + (_take(inbox, src, 0),)
        return ops.Concat(self.concat_dim)(blocks)


class _AlltoAllVKernel(_Kernel):
    """Counts in elements (block_size folded in); `capacity`: the largest count in the group."""

    def __init__(self, group, n, pos, dtype, send, recv, capacity):
        super().__init__(group, n, pos, dtype)
        self.capacity, self.received = capacity, sum(recv)
        pad, start, outbox = sum(send), 0, []
        for count in send:
            outbox += list(range(start, start + count)) + [pad] * (capacity - count)
            start += count
        inbox = [src * capacity + k for src, count in enumerate(recv) for k in range(count)]
        self.outbox = Tensor(np.array(outbox, np.int32))
        # nothing received: documented output shape (), its value meaningless (here one buffer
        # element); the same ops either way, so every rank's graph has the same structure
        self.inbox = Tensor(np.array(inbox or [0], np.int32))
        self.out_shape = (self.received,) if self.received else ()

    def construct(self, x):
        padded = ops.Concat(0)((x, ops.Zeros()((1,), x.dtype)))
        outbox = ops.Reshape()(ops.Gather()(padded, self.outbox, 0), (self.n, self.capacity))
        inbox = _take(self.reduce(_slot(outbox, self.pos, self.n)), self.pos, 1)   # [src, capacity]
        flat = ops.Reshape()(inbox, (self.n * self.capacity,))
        return ops.Reshape()(ops.Gather()(flat, self.inbox, 0), self.out_shape)


class _BroadcastKernel(_Kernel):
    def __init__(self, group, n, pos, dtype, root):
        super().__init__(group, n, pos, dtype)
        self.root = root

    def construct(self, x):
        mine = _take(_slot(x, 0 if self.pos == self.root else 1, 2), 0, 0)   # x or exact zeros
        return self.reduce(mine)


class _SendKernel(_Kernel):
    """The pair communicator's all-reduce with the receiver contributing zeros."""

    def construct(self, x):
        return ops.depend(x, self.reduce(x))


class _ReceiveKernel(_Kernel):
    def __init__(self, group, n, pos, dtype, shape):
        super().__init__(group, n, pos, dtype)
        self.shape = tuple(shape)

    def construct(self):
        return self.reduce(ops.Zeros()(self.shape, self.dtype))


_KERNELS = {"AllReduce": _AllReduceKernel, "AllGather": _AllGatherKernel, "ReduceScatter": _ReduceScatterKernel,
            "AlltoAll": _AlltoAllKernel, "AlltoAllV": _AlltoAllVKernel, "Broadcast": _BroadcastKernel,
            "Send": _SendKernel, "Receive": _ReceiveKernel}


def _normalize_dim(what: str, dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ContractError(f"{what}: dimension {dim} is out of range for a {ndim}-d input")
    return dim % ndim


def _validated(op: str, group: str, shape: tuple, dtype, params: tuple) -> tuple:
    """Local checks of one call (Python, also at jit compile time); the kernel's extra arguments."""
    what = f"contract {op} on {group!r}"
    members = group_ranks(group)
    n = len(members)
    shape = tuple(shape)
    if op == "AllGather" and dtype not in _GATHER_DTYPES[target()]:
        raise TypeError(f"{what}: dtype {dtype} is not accepted on {target()} (accepted: "
                        f"{[str(d) for d in _GATHER_DTYPES[target()]]})")
    _check_dtype(what, dtype)   # what the CPU reference can carry exactly (after the documented checks)
    if op == "AllGather" and not shape:
        raise ContractError(f"{what}: the input needs at least one dimension (output (n*x1, x2, ...))")
    if op == "ReduceScatter" and (not shape or shape[0] % n):
        raise ContractError(f"{what}: the first dimension of shape {shape} must be divisible by the group size {n}")
    if op == "AllReduce":
        if params[0] != ReduceOp.SUM and _CARRIED[dtype] != "direct":
            raise NotImplementedError(f"{what}: {params[0]} has a CPU reference for float16/float32 only")
        return params
    if op in ("AllGather", "ReduceScatter", "Send"):
        return ()
    if op == "Receive":
        return (shape,)
    if op == "AlltoAll":
        split_count, split_dim, concat_dim = params
        if split_count != n:
            raise ContractError(f"{what}: split_count {split_count} != group size {n} (block j goes to rank j)")
        split_dim = _normalize_dim(what, split_dim, len(shape))
        concat_dim = _normalize_dim(what, concat_dim, len(shape))
        if shape[split_dim] % split_count:
            raise ContractError(f"{what}: dimension {split_dim} of shape {shape} is not divisible by "
                                f"split_count {split_count}")
        return split_dim, concat_dim
    if op == "AlltoAllV":
        block_size, send, recv = params
        if len(shape) != 1:
            raise ContractError(f"{what}: the input must be flattened to 1-D, got shape {shape}")
        for label, counts in (("send_numel_list", send), ("recv_numel_list", recv)):
            if len(counts) != n or any(int(c) != c or c < 0 for c in counts):
                raise ContractError(f"{what}: {label} must hold {n} non-negative ints (one per rank), got {counts}")
        if sum(send) * block_size != shape[0]:
            raise ContractError(f"{what}: send_numel_list {tuple(send)} x block_size {block_size} = "
                                f"{sum(send) * block_size} elements, but the input has {shape[0]}")
        return tuple(c * block_size for c in send), tuple(c * block_size for c in recv)
    if op == "Broadcast":
        (root,) = params
        if not 0 <= root < n:
            raise ContractError(f"{what}: root_rank {root} is not a rank of the group (0..{n - 1}, ranks IN the "
                                f"group: global ranks {members}); MindSpore hands root_rank to HcclBroadcast/"
                                f"ncclBroadcast as the communicator rank")
        return (root,)
    raise ContractError(f"contract: unknown op {op}")


@functools.lru_cache(maxsize=None)
def _kernel(op: str, group: str, shape: tuple, dtype, params: tuple, capacity: int = -1):
    """The checked kernel of one call; AlltoAllV's `capacity` is the group's largest count (known
    in PyNative after the header exchange; under jit this rank's own largest count)."""
    extra = _validated(op, group, shape, dtype, params)
    members = group_ranks(group)
    pos = _position(group, members, f"contract {op}")
    if op == "AlltoAllV":
        send, recv = extra
        extra = (send, recv, capacity if capacity >= 0 else max(send + recv))
    return _KERNELS[op](group, len(members), pos, dtype, *extra)


# ---------------------------------------------------------------------------------------------
# Agreement across the ranks of a group (PyNative): one small all-reduced header per call
# ---------------------------------------------------------------------------------------------
def _fields(op: str, shape, dtype, attrs: Sequence[int] = (), counts: Sequence[int] = (), n: int = 0) -> List[int]:
    """Fixed-width header of one call: op, dtype, ndim, dims, attributes, then 2n counts."""
    shape = tuple(shape)
    if len(shape) > _MAX_DIMS or len(attrs) > _MAX_ATTRS:
        raise ContractError(f"contract {op}: more than {_MAX_DIMS} dimensions or {_MAX_ATTRS} attributes")
    code = _DTYPE_CODES.index(dtype) if dtype in _DTYPE_CODES else len(_DTYPE_CODES)
    counts = list(counts) + [0] * (2 * n - len(counts))
    return ([_OPCODES.index(op), code, len(shape)] + list(shape) + [0] * (_MAX_DIMS - len(shape))
            + list(attrs) + [0] * (_MAX_ATTRS - len(attrs)) + counts)


def _blank(n: int) -> List[int]:
    return [0] * (3 + _MAX_DIMS + _MAX_ATTRS + 2 * n)


@functools.lru_cache(maxsize=None)
def _header_sum(group: str):
    return ops.AllReduce(ReduceOp.SUM, group)


def _agree(group: str, fields: List[int], error: Optional[BaseException], what: str) -> np.ndarray:
    """All-reduce every member's header; raise this rank's own error, or one naming the ranks
    that refused theirs, on every rank alike. Returns [n, fields] of ints."""
    members = group_ranks(group)
    pos = _position(group, members, what)
    values = np.asarray([2 if error is not None else 1] + list(fields), np.int64)
    buffer = np.zeros((len(members), len(values), 2), np.float32)
    buffer[pos, :, 0], buffer[pos, :, 1] = values // _SPLIT, values % _SPLIT
    summed = _header_sum(group)(Tensor(buffer)).asnumpy().astype(np.int64)
    table = summed[..., 0] * _SPLIT + summed[..., 1]
    if error is not None:
        raise error
    refused = [members[i] for i in range(len(members)) if table[i, 0] != 1]
    if refused:
        raise ContractError(f"{what}: global rank(s) {refused} of communicator {group!r} refused their arguments "
                            f"(their error is in their own log)")
    return table[:, 1:]


def _tensor(row: np.ndarray) -> str:
    ndim = int(row[2])
    dtype = _DTYPE_CODES[row[1]] if row[1] < len(_DTYPE_CODES) else "?"
    return f"shape {tuple(int(d) for d in row[3:3 + ndim])} dtype {dtype}"


def _describe(row: np.ndarray) -> str:
    return f"{_OPCODES[row[0]]} {_tensor(row)}"


def _attrs(row: np.ndarray) -> Tuple[int, ...]:
    start = 3 + _MAX_DIMS
    return tuple(int(a) for a in row[start:start + _MAX_ATTRS])


def _require_same(table: np.ndarray, members, group: str, what: str) -> None:
    keys = [tuple(row[:3 + _MAX_DIMS + _MAX_ATTRS]) for row in table]
    if len(set(keys)) > 1:
        calls = "; ".join(f"rank {members[i]}: {_describe(row)} attrs {_attrs(row)}" for i, row in enumerate(table))
        raise ContractError(f"{what}: the ranks of communicator {group!r} disagree ({calls}); every rank must call "
                            f"the same op with the same shape, dtype and attributes")


# ---------------------------------------------------------------------------------------------
# The stand-ins (constructor and call convention of the MindSpore primitives)
# ---------------------------------------------------------------------------------------------
class _Primitive(nn.Cell):
    """`group=None` is the world communicator, resolved when the stand-in is built (MindSpore's
    signatures default to `GlobalComm.WORLD_COMM_GROUP` evaluated at import, which on CPU is
    "hccl_world_group" until `init()` renames it "mccl_world_group").

    PyNative: `__call__` checks the call locally and across the group, then runs the kernel.
    Under ms.jit only `construct` is compiled: local checks at compile time, then the kernel."""

    op = ""

    def __init__(self, group):
        super().__init__()
        check_platform(f"ops.{self.op}", PLATFORMS[self.op])
        CONSTRUCTED[self.op] += 1
        self.group = GlobalComm.WORLD_COMM_GROUP if group is None else group
        self.members = group_ranks(self.group)
        self.rank_in_group = _position(self.group, self.members, f"ops.{self.op}")
        self.what = f"contract ops.{self.op} on {self.group!r} (global ranks {self.members})"

    def params(self) -> tuple:
        """The call's attributes, part of the kernel's key."""
        return ()

    def header_attrs(self) -> tuple:
        """The attributes every rank must agree on, as ints."""
        return self.params()

    def __call__(self, x):
        error, fields = None, _blank(len(self.members))
        try:
            _kernel(self.op, self.group, tuple(x.shape), x.dtype, self.params())
            fields = _fields(self.op, x.shape, x.dtype, self.header_attrs(), n=len(self.members))
        except (ValueError, TypeError, NotImplementedError) as exc:
            error = exc
        table = _agree(self.group, fields, error, self.what)
        _require_same(table, self.members, self.group, self.what)
        return _kernel(self.op, self.group, tuple(x.shape), x.dtype, self.params())(x)

    def construct(self, x):
        return _kernel(self.op, self.group, x.shape, x.dtype, self.params())(x)


_REDUCE_OPS = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD)


class AllReduce(_Primitive):
    op = "AllReduce"

    def __init__(self, op=ReduceOp.SUM, group=None):
        if op not in _REDUCE_OPS:
            raise TypeError(f"contract ops.AllReduce: op must be one of {_REDUCE_OPS}, got {op!r}")
        super().__init__(group)
        self.reduce_op = op

    def params(self):
        return (self.reduce_op,)

    def header_attrs(self):
        return (_REDUCE_OPS.index(self.reduce_op),)


class AllGather(_Primitive):
    op = "AllGather"

    def __init__(self, group=None):
        super().__init__(group)


class ReduceScatter(_Primitive):
    op = "ReduceScatter"

    def __init__(self, op=ReduceOp.SUM, group=None):
        super().__init__(group)
        if op != ReduceOp.SUM:
            raise NotImplementedError(f"{self.what}: only ReduceOp.SUM has a CPU reference here")


class AlltoAll(_Primitive):
    op = "AlltoAll"

    def __init__(self, split_count, split_dim, concat_dim, group=None):
        for name, value in (("split_count", split_count), ("split_dim", split_dim), ("concat_dim", concat_dim)):
            if not isinstance(value, int):
                raise TypeError(f"contract ops.AlltoAll: {name} must be an int, got {value!r}")
        super().__init__(group)
        self.split_count, self.split_dim, self.concat_dim = split_count, split_dim, concat_dim

    def params(self):
        return (self.split_count, self.split_dim, self.concat_dim)


class Broadcast(_Primitive):
    op = "Broadcast"

    def __init__(self, root_rank, group=None):
        if not isinstance(root_rank, int):
            raise TypeError(f"contract ops.Broadcast: root_rank must be an int, got {root_rank!r}")
        super().__init__(group)
        self.root_rank = root_rank

    def params(self):
        return (self.root_rank,)

    def _check_tuple(self, input_x):
        if not isinstance(input_x, tuple) or not input_x:
            raise TypeError(f"{self.what}: input_x must be a non-empty tuple of tensors (documented "
                            f"'tuple[Tensor]'), got {type(input_x).__name__}")

    def __call__(self, input_x):
        self._check_tuple(input_x)
        return tuple(super(Broadcast, self).__call__(x) for x in input_x)

    def construct(self, input_x):
        outputs = ()
        for x in input_x:
            outputs = outputs + (_kernel(self.op, self.group, x.shape, x.dtype, self.params())(x),)
        return outputs


class AlltoAllV(_Primitive):
    op = "AlltoAllV"

    def __init__(self, group=None, block_size=1):
        if not isinstance(block_size, int) or block_size < 1:
            raise TypeError(f"contract ops.AlltoAllV: block_size must be a positive int, got {block_size!r}")
        super().__init__(group)
        self.block_size = block_size

    def _counts(self, counts, label: str) -> tuple:
        """The list as Python ints; a Tensor list (device-side counts) must be 1-D of an integer dtype."""
        if isinstance(counts, Tensor):
            if len(counts.shape) != 1 or counts.dtype not in _INT_DTYPES:
                raise ContractError(f"{self.what}: {label} as a Tensor must be 1-D of an integer dtype, got shape "
                                    f"{tuple(counts.shape)} dtype {counts.dtype}")
            counts = counts.asnumpy().tolist()
        return tuple(int(c) for c in counts)

    def __call__(self, x, send_numel_list, recv_numel_list):
        n, error, fields = len(self.members), None, _blank(len(self.members))
        send = recv = ()
        try:
            send = self._counts(send_numel_list, "send_numel_list")
            recv = self._counts(recv_numel_list, "recv_numel_list")
            params = (self.block_size, send, recv)
            _validated(self.op, self.group, tuple(x.shape), x.dtype, params)
            fields = _fields(self.op, (), x.dtype, (self.block_size,), send + recv, n)
        except (ValueError, TypeError, NotImplementedError) as exc:
            error = exc
        table = _agree(self.group, fields, error, self.what)
        _require_same(table, self.members, self.group, self.what)
        start = 3 + _MAX_DIMS + _MAX_ATTRS
        sent, expected = table[:, start:start + n], table[:, start + n:start + 2 * n]   # [i, j]
        if (sent != expected.T).any():
            bad = [(self.members[i], self.members[j], int(sent[i, j]), int(expected[j, i]))
                   for i in range(n) for j in range(n) if sent[i, j] != expected[j, i]]
            raise ContractError(f"{self.what}: counts disagree (global src, dst, sent, expected): {bad}; rank j's "
                                f"recv_numel_list[i] must equal rank i's send_numel_list[j]")
        capacity = int(max(sent.max(), 0)) * self.block_size
        # Tensor lists: counts change every call (a dynamic output length), so the kernel is not cached
        build = _kernel.__wrapped__ if isinstance(send_numel_list, Tensor) else _kernel
        return build(self.op, self.group, tuple(x.shape), x.dtype, params, capacity)(x)

    def construct(self, x, send_numel_list, recv_numel_list):
        if isinstance(send_numel_list, Tensor) or isinstance(recv_numel_list, Tensor):
            # TypeError: graph mode raises only Python's own exception types
            raise TypeError(f"{self.what}: Tensor numel lists give a dynamic output length, which the "
                            f"contract computes in PyNative only (train.jit: false)")
        params = (self.block_size, tuple(send_numel_list), tuple(recv_numel_list))
        return _kernel(self.op, self.group, x.shape, x.dtype, params)(x)


# ---------------------------------------------------------------------------------------------
# Point-to-point: carried by the 2-rank communicator of the two peers
# ---------------------------------------------------------------------------------------------
def _pair(group: str, peer_in_group: int, what: str) -> Tuple[str, int, int]:
    """(pair communicator, my global rank, the peer's global rank)."""
    members = group_ranks(group)
    if not isinstance(peer_in_group, int) or not 0 <= peer_in_group < len(members):
        raise ContractError(f"{what}: peer rank {peer_in_group!r} is not a rank of {group!r} (0..{len(members) - 1}, "
                            f"ranks IN the group: global ranks {members})")
    me, peer = _my_rank(), members[peer_in_group]
    if peer == me:
        raise ContractError(f"{what}: the peer is this rank itself (global rank {me})")
    pair = tuple(sorted((me, peer)))
    names = [name for name, ranks in _GROUPS.items() if ranks == pair]
    if not names:
        raise ContractError(f"{what}: no communicator holds exactly global ranks {pair}; the contract carries "
                            f"Send/Receive over the pair's 2-rank group (topology creates pp_next/pp_prev)")
    return names[0], me, peer


class _PointToPoint(nn.Cell):
    op = ""

    def __init__(self, sr_tag, peer, group, group_back):
        super().__init__()
        check_platform(f"ops.{self.op}", PLATFORMS[self.op])
        CONSTRUCTED[self.op] += 1
        for name, value in (("sr_tag", sr_tag), ("peer rank", peer)):
            if not isinstance(value, int):
                raise TypeError(f"contract ops.{self.op}: {name} must be an int, got {value!r}")
        self.group = GlobalComm.WORLD_COMM_GROUP if group is None else group
        self.what = f"contract ops.{self.op}(sr_tag={sr_tag}) on {self.group!r}"
        self.tag, self.peer = sr_tag, peer
        group_ranks(GlobalComm.WORLD_COMM_GROUP if group_back is None else group_back)

    def _meet(self, shape, dtype) -> str:
        """Check this side against the other one; returns the pair communicator."""
        error, pair = None, None
        try:
            pair, me, peer = _pair(self.group, self.peer, self.what)
            _check_dtype(self.what, dtype)
            fields = _fields(self.op, shape, dtype, (self.tag, me, peer), n=2)
        except (ValueError, TypeError, NotImplementedError) as exc:
            if pair is None:
                raise
            error, fields = exc, _blank(2)
        table = _agree(pair, fields, error, self.what)
        ops_seen = sorted(_OPCODES[row[0]] for row in table)
        if ops_seen != ["Receive", "Send"]:
            raise ContractError(f"{self.what}: the two ranks of {pair!r} called {ops_seen}; a Send must meet a "
                                f"Receive (facing Sends or Receives deadlock on a device)")
        send = table[[_OPCODES[row[0]] for row in table].index("Send")]
        recv = table[[_OPCODES[row[0]] for row in table].index("Receive")]
        (s_tag, s_me, s_peer), (r_tag, r_me, r_peer) = _attrs(send)[:3], _attrs(recv)[:3]
        if s_tag != r_tag or s_peer != r_me or r_peer != s_me:
            raise ContractError(f"{self.what}: Send(sr_tag={s_tag}, from {s_me} to {s_peer}) does not match "
                                f"Receive(sr_tag={r_tag}, at {r_me} from {r_peer})")
        if tuple(send[1:3 + _MAX_DIMS]) != tuple(recv[1:3 + _MAX_DIMS]):
            raise ContractError(f"{self.what}: Send of {_tensor(send)} but Receive declared {_tensor(recv)}")
        return pair


class Send(_PointToPoint):
    op = "Send"

    def __init__(self, sr_tag, dest_rank, group=None,
                 group_back=None):
        super().__init__(sr_tag, dest_rank, group, group_back)

    def __call__(self, x):
        pair = self._meet(tuple(x.shape), x.dtype)
        return _kernel("Send", pair, tuple(x.shape), x.dtype, ())(x)

    def construct(self, x):
        return _kernel("Send", _pair(self.group, self.peer, self.what)[0], x.shape, x.dtype, ())(x)


class Receive(_PointToPoint):
    op = "Receive"

    def __init__(self, sr_tag, src_rank, shape, dtype, group=None,
                 group_back=None):
        super().__init__(sr_tag, src_rank, group, group_back)
        if dtype not in _RECEIVE_DTYPES:
            raise TypeError(f"{self.what}: dtype {dtype} is not accepted (accepted: {[str(d) for d in _RECEIVE_DTYPES]})")
        self.shape, self.dtype = tuple(int(d) for d in shape), dtype

    def __call__(self):
        pair = self._meet(self.shape, self.dtype)
        return _kernel("Receive", pair, self.shape, self.dtype, ())()

    def construct(self):
        return _kernel("Receive", _pair(self.group, self.peer, self.what)[0], self.shape, self.dtype, ())()
