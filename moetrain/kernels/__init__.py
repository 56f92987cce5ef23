"""Fused CPU kernels (MindSpore AOT custom ops) and their builder.

The C++ sources next to this file are compiled once per source version with the system C++
compiler into a cache folder (`$MOETRAIN_KERNEL_CACHE`, default `~/.cache/moetrain/kernels`) and
linked against the oneDNN library that ships with MindSpore, whose `dnnl_sgemm` does the matrix
products. `available()` says whether the kernels can be used here (CPU device target, a compiler,
the library); callers fall back to plain MindSpore ops when it is False, so nothing depends on a
compiler being installed. `MOETRAIN_DISABLE_KERNELS=1` turns them off (for A/B measurements).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import mindspore

from moetrain import compat

HERE = os.path.dirname(os.path.abspath(__file__))
# source -> extra compiler flags. The elementwise kernels need -ffast-math for vectorised expf and
# are built for this CPU (-march=native; the CPU model is part of the cache key).
ELEMENTWISE_FLAGS = ("-march=native", "-ffast-math")
# The optimizer's passes are built without -ffast-math: its vectorised sqrt and division would be
# approximations (rsqrt + a Newton step) in the SIMD body and exact in the scalar tail, so an
# element's update would depend on where a task or a ZeRO shard boundary falls.
EXACT_FLAGS = ("-march=native", "-fno-math-errno")
# The GEMM drivers' own loops are integer work (copies, bf16 conversions): built for this CPU, exact.
GEMM_FLAGS = ("-march=native",)
SOURCES = {"grouped_gemm.cc": GEMM_FLAGS, "linear.cc": GEMM_FLAGS, "swiglu.cc": ELEMENTWISE_FLAGS, "rmsnorm.cc": ELEMENTWISE_FLAGS,
           "attention.cc": ELEMENTWISE_FLAGS, "lm_head_loss.cc": ELEMENTWISE_FLAGS, "router.cc": ELEMENTWISE_FLAGS,
           "adamw.cc": EXACT_FLAGS, "permute.cc": ELEMENTWISE_FLAGS, "pool.cc": (), "bf16.cc": ELEMENTWISE_FLAGS,
           "block_attention.cc": ELEMENTWISE_FLAGS}
HEADERS = ("common.h", "bf16.h")
# -z nodelete: the library stays mapped until the process ends, whoever dlcloses it (MindSpore does
# when a custom op's kernel is destroyed): its thread pool's workers (common.h) sleep inside its code
# for the life of the process.
LINK_FLAGS = ("-Wl,-z,nodelete",)


class KernelBuildError(RuntimeError):
    pass


def _mindspore_lib_dir() -> str:
    return os.path.join(os.path.dirname(mindspore.__file__), "lib")


def _cache_dir() -> str:
    return os.environ.get("MOETRAIN_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moetrain",
                                                                    "kernels")


@functools.lru_cache(maxsize=None)
def library_path() -> str:
    """Path of the compiled kernel library, building it first if this source version has no build yet.
    Raises KernelBuildError (with the compiler output) when it cannot be built."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX or install g++)")
    lib_dir = _mindspore_lib_dir()
    include_dir = os.path.join(os.path.dirname(lib_dir), "include")   # type_id.h: MindSpore's dtype ids
    try:
        onednn = compat.onednn_library(lib_dir)   # the soname differs between MindSpore versions
    except FileNotFoundError as error:
        raise KernelBuildError(str(error)) from None
    digest = hashlib.sha256(f"{compat.mindspore_version_string()} {compiler} {_cpu_model()} {SOURCES} {LINK_FLAGS}"
                            .encode())
    for name in (*SOURCES, *HEADERS):
        with open(os.path.join(HERE, name), "rb") as fh:
            digest.update(fh.read())
    target = os.path.join(_cache_dir(), f"moetrain_kernels_{digest.hexdigest()[:16]}.so")
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # Build in a private folder, then rename: concurrent builders (data-parallel workers) are safe.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as build_dir:
        objects = []
        for name, flags in SOURCES.items():
            objects.append(os.path.join(build_dir, name + ".o"))
            _run([compiler, "-O3", "-std=c++17", "-fPIC", "-pthread", *flags, f"-I{include_dir}", "-c",
                  os.path.join(HERE, name), "-o", objects[-1]])
        library = os.path.join(build_dir, "kernels.so")
        _run([compiler, "-shared", "-pthread", *LINK_FLAGS, "-o", library, *objects, f"-L{lib_dir}", f"-l:{onednn}",
              f"-Wl,-rpath,{lib_dir}"])
        os.replace(library, target)
    return target


def _run(command) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:   # e.g. CXX names a compiler that does not exist
        raise KernelBuildError(f"cannot run {command[0]!r}: {error}") from error
    if result.returncode != 0:
        raise KernelBuildError(f"building the moetrain CPU kernels failed:\n{' '.join(command)}\n{result.stderr}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when the kernels can run here: CPU target, not disabled, and the library builds.

    Any build failure (no compiler, a compiler or linker error, an unwritable cache folder) makes
    this False with one warning that says why: the callers then run the plain MindSpore ops."""
    if os.environ.get("MOETRAIN_DISABLE_KERNELS", "0") not in ("", "0"):
        return False
    if mindspore.get_context("device_target") != "CPU":
        return False
    try:
        ctypes.CDLL(library_path())   # a library that builds but cannot load (a missing symbol) fails here
    except Exception as error:   # noqa: BLE001 - whatever broke the build, the plain ops still work
        warnings.warn(f"moetrain CPU kernels unavailable, using plain MindSpore ops (slower): "
                      f"{type(error).__name__}: {error}. Set MOETRAIN_DISABLE_KERNELS=1 to silence this.",
                      RuntimeWarning, stacklevel=2)
        return False
    return True
