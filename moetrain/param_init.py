"""Initial parameter values that do not depend on the parallel layout, and deferred construction.

Why: every rank must start from exactly the one-process model, and no rank may build what it will
not hold (a DeepSeek-V3 rank holds 1/300 of the model). So a parameter's initial value at global
index i is a pure function of `(seed, the parameter's full one-process name, i)`: a counter-based
generator (splitmix64 of the index, keyed by a hash of seed and name; Box-Muller on the 64 bits)
that yields any index range of a tensor directly. A tensor-parallel, expert-parallel or pipeline
slice then holds exactly the one-process values at its indices, whatever the layout.

    with deferred_parameters():             # Parameters get shapes but no memory
        model = Model(cfg)                  # (moetrain.build.build_model)
    ... mark slices (tp, ep, etp: moetrain.distributed.sharding.mark_shard), cut pipeline stages ...
    materialize(model, seed)                # each Parameter gets its own slice's values, and only those

Deferral uses MindSpore's own switch (`Parameter.init_param = False`, what the deprecated
`mindspore.nn.utils.no_init_parameters` sets; measured on 2.10 CPU: a 20 GB Parameter created
under it takes no memory, `has_init` stays True, and `set_data` of a slice then gives it data and
the slice's shape). Its own `init_data()` is not used: it draws the whole tensor from the global
seed. A Parameter created outside `deferred_parameters` is materialized at once as before, by
MindSpore's initializer and `ms.set_seed` (cells built directly in tests and tools).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Sequence, Tuple

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor
from mindspore.common.initializer import Normal, initializer

from moetrain.distributed.sharding import shard_spec

_RECIPE_ATTR = "moetrain_init"
_DEFERRING = [0]
_CHUNK = 1 << 16          # elements generated per pass: the temporaries stay in cache (~12 ns/element)
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _S40 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(40)
_LOW24 = np.uint64(0xFFFFFF)


@dataclass(frozen=True)
class InitRecipe:
    """How a parameter starts: "normal" (N(0, std^2)), "ones" or "zeros"."""
    kind: str = "normal"
    std: float = 0.02


@contextlib.contextmanager
def deferred_parameters():
    """Parameters created by `parameter(...)` inside the block get their shape but no memory until
    `materialize`; any other Parameter (a MindSpore layer's, a small tensor made from numpy) is
    created with its data as usual."""
    _DEFERRING[0] += 1
    try:
        yield
    finally:
        _DEFERRING[0] -= 1


def deferring() -> bool:
    return _DEFERRING[0] > 0


def parameter(shape, name: str, kind: str = "normal", std: float = 0.02) -> Parameter:
    """An fp32 Parameter that starts as `InitRecipe(kind, std)`: deferred (no memory) inside
    `deferred_parameters`, else drawn at once by MindSpore's initializer (seeded by `ms.set_seed`)."""
    init = {"normal": Normal(sigma=std), "ones": "ones", "zeros": "zeros"}[kind]
    saved = getattr(Parameter, "init_param", True)
    if deferring():       # MindSpore's switch, for this Parameter only (others, e.g. nn.Dense's, are unaffected)
        Parameter.init_param = False
    try:
        param = Parameter(initializer(init, tuple(int(d) for d in shape), ms.float32), name=name)
    finally:
        Parameter.init_param = saved
    setattr(param, _RECIPE_ATTR, InitRecipe(kind, std))
    return param


def is_deferred(param) -> bool:
    """True while `param` has a shape but no data (created deferred, not yet materialized)."""
    return bool(getattr(param, "has_init", False))


def global_shape(param) -> Tuple[int, ...]:
    """The one-process shape of `param` (its recorded slicing's, or its own)."""
    return shard_spec(param).global_shape


def held_region(param) -> Tuple[Tuple[int, int], ...]:
    """`[start, stop)` per axis of the global tensor that this rank's `param` holds."""
    spec = shard_spec(param)
    region = [(0, d) for d in spec.global_shape]
    for axis, index, count, _ in spec.slicings():
        size = spec.global_shape[axis] // count
        region[axis] = (index * size, (index + 1) * size)
    return tuple(region)


def key_of(seed: int, name: str) -> np.uint64:
    """The generator key of one parameter: a stable hash (not Python's salted `hash`) of seed and name."""
    return np.uint64(int.from_bytes(hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest(), "little"))


def _normal_into(out: np.ndarray, flat_index: np.ndarray, key: np.uint64, h: np.ndarray, t: np.ndarray,
                 f: np.ndarray) -> None:
    """`out[j]` = the standard normal at global flat index `flat_index[j]` (uint64) under `key`;
    `h`, `t`, `f`: scratch of the same length."""
    with np.errstate(over="ignore"):
        np.multiply(flat_index, _GOLDEN, out=h)
        h += key
        np.right_shift(h, _S30, out=t)
        h ^= t
        h *= _M1
        np.right_shift(h, _S27, out=t)
        h ^= t
        h *= _M2
        np.right_shift(h, _S31, out=t)
        h ^= t
    np.right_shift(h, _S40, out=t)                       # u1 in (0, 1] from the high 24 bits
    t += np.uint64(1)
    np.multiply(t, 2.0 ** -24, out=out, casting="unsafe")
    np.log(out, out=out)
    out *= np.float32(-2.0)
    np.sqrt(out, out=out)
    np.bitwise_and(h, _LOW24, out=t)                     # angle from the low 24 bits
    np.multiply(t, 2 * math.pi * 2.0 ** -24, out=f, casting="unsafe")
    np.cos(f, out=f)
    out *= f


def region_runs(shape: Sequence[int], region: Sequence[Tuple[int, int]]) -> Tuple[np.ndarray, int]:
    """The region of a C-order tensor as contiguous runs: `(global start of each run, in the
    region's C order; run length)`."""
    cut = [a for a, (lo, hi) in enumerate(region) if (lo, hi) != (0, shape[a])]
    if not cut:
        return np.zeros(1, np.uint64), int(np.prod(shape, dtype=np.int64))
    last = cut[-1]
    inner = int(np.prod(shape[last + 1:], dtype=np.int64))
    strides = [int(np.prod(shape[a + 1:], dtype=np.int64)) for a in range(len(shape))]
    starts = np.full((1,), region[last][0] * inner, np.uint64)
    for axis in range(last - 1, -1, -1):   # outer axes, innermost first
        lo, hi = region[axis]
        starts = (np.arange(lo, hi, dtype=np.uint64)[:, None] * np.uint64(strides[axis]) + starts[None, :]).reshape(-1)
    return starts, (region[last][1] - region[last][0]) * inner


def keyed_normal(seed: int, name: str, shape: Sequence[int], region: Sequence[Tuple[int, int]] = None,
                 std: float = 1.0) -> np.ndarray:
    """fp32 N(0, std^2) values of the global tensor `shape` named `name`, at `region` (`[start, stop)`
    per axis; None: all of it), shaped as the region. The same indices give the same values
    whatever region they are asked in."""
    shape = tuple(int(d) for d in shape)
    region = tuple((0, d) for d in shape) if region is None else tuple(region)
    out = np.empty(tuple(hi - lo for lo, hi in region), np.float32)
    flat = out.reshape(-1)
    if not flat.size:
        return out
    key = key_of(seed, name)
    starts, run = region_runs(shape, region)
    h, t = np.empty(_CHUNK, np.uint64), np.empty(_CHUNK, np.uint64)
    f, index = np.empty(_CHUNK, np.float32), np.empty(_CHUNK, np.uint64)
    pos = 0
    if run >= _CHUNK:
        for start in starts:
            for offset in range(0, run, _CHUNK):
                n = min(_CHUNK, run - offset)
                index[:n] = np.arange(int(start) + offset, int(start) + offset + n, dtype=np.uint64)
                _normal_into(flat[pos:pos + n], index[:n], key, h[:n], t[:n], f[:n])
                pos += n
    else:
        rows = _CHUNK // run
        along = np.arange(run, dtype=np.uint64)
        for first in range(0, len(starts), rows):
            block = starts[first:first + rows]
            n = len(block) * run
            np.add(block[:, None], along[None, :], out=index[:n].reshape(len(block), run))
            _normal_into(flat[pos:pos + n], index[:n], key, h[:n], t[:n], f[:n])
            pos += n
    if std != 1.0:
        out *= np.float32(std)
    return out


def initial_values(param, seed: int, region=None) -> np.ndarray:
    """The values `param` starts with at `region` of its global tensor (default: what this rank holds)."""
    recipe = getattr(param, _RECIPE_ATTR, None)
    if recipe is None:
        raise ValueError(f"{param.name}: created without an init recipe (moetrain.param_init.parameter)")
    region = held_region(param) if region is None else region
    shape = tuple(hi - lo for lo, hi in region)
    if recipe.kind == "normal":
        return keyed_normal(seed, param.name, global_shape(param), region, recipe.std)
    return np.full(shape, 1.0 if recipe.kind == "ones" else 0.0, np.float32)


def materialize(cells: Iterable, seed: int) -> int:
    """Give every deferred Parameter of `cells` its values: exactly this rank's slice (its
    `ShardSpec`) of the one-process tensor, generated directly (no whole tensor, no copy: the array
    becomes the Parameter's memory). Returns the bytes materialized."""
    total, seen = 0, set()
    for cell in cells:
        for param in cell.get_parameters():
            if id(param) in seen or not is_deferred(param):
                continue
            seen.add(id(param))
            if getattr(param, _RECIPE_ATTR, None) is None:   # a deferred Parameter made elsewhere
                param.init_data()
                continue
            values = initial_values(param, seed)
            param.set_data(Tensor.from_numpy(values))
            total += values.nbytes
    return total
