"""Which MindSpore versions moetrain runs on, and the one place that tells them apart.

On Ascend the MindSpore version is tied to the installed CANN, so moetrain installs beside the
MindSpore a cluster already has: pyproject.toml declares a range (`mindspore>=2.7.0,<2.11`), not a
pin. Every check of the MindSpore version goes through this module (tests/test_compat.py looks for
others); what differs between the versions of the range is gated here:

* the oneDNN library bundled in the wheel, which the CPU kernels link (`onednn_library`):
  `libdnnl.so.2` in 2.7 and 2.8, `libdnnl.so.3` in 2.9 and 2.10 (the same `dnnl_sgemm` entry point);
* AllReduce in CPU sub-groups (`cpu_subgroup_collectives`): from 2.8; 2.7's CPU kernel takes only
  the world group, so there multi-process CPU runs need layouts whose every group is one rank or
  all of them (checked by `moetrain.distributed.topology.init_parallel`). Ascend and GPU are unaffected.

CI runs the whole suite on the newest version and `tests/oldest_subset.txt` on OLDEST in a
virtualenv of its own (`.ci/run`, docs/architecture.md "Supported MindSpore versions").
The version is read from the installed package's metadata, so checking it does not import MindSpore.
"""
from __future__ import annotations

import os
import re
import warnings
from importlib import metadata
from typing import Optional, Tuple

OLDEST = "2.7.0"             # the oldest supported release; pyproject.toml's lower bound, tested in CI
FIRST_UNSUPPORTED = "2.11"   # pyproject.toml's upper bound (exclusive)


def parse_version(text: str) -> Tuple[int, int, int]:
    """(major, minor, patch) of a version string: "2.7.1.post1" -> (2, 7, 1), "2.8.0rc1" -> (2, 8, 0)."""
    match = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"not a version number: {text!r}")
    return tuple(int(part or 0) for part in match.groups())   # type: ignore[return-value]


def mindspore_version_string() -> Optional[str]:
    """The installed MindSpore's version as the package states it, or None when it is not installed."""
    for name in ("mindspore", "mindspore-dev"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def mindspore_version() -> Tuple[int, int, int]:
    """(major, minor, patch) of the installed MindSpore; (0, 0, 0) when it is not installed."""
    text = mindspore_version_string()
    return parse_version(text) if text else (0, 0, 0)


def at_least(version: str, installed: Optional[Tuple[int, int, int]] = None) -> bool:
    """Whether the installed MindSpore (or `installed`) is `version` or newer: the one version test."""
    return (installed or mindspore_version()) >= parse_version(version)


def unsupported_mindspore(text: Optional[str] = None) -> Optional[str]:
    """One line saying why the installed MindSpore (or version `text`) cannot run moetrain, or None.

    Older than OLDEST is refused (untested, and older releases lack ops moetrain uses). Newer than
    the range gives a warning only: an untested release may well work."""
    text = text if text is not None else mindspore_version_string()
    if text is None:
        return None                   # not installed: the first `import mindspore` says so
    version = parse_version(text)
    supported = f"moetrain supports mindspore {OLDEST} up to {FIRST_UNSUPPORTED} (exclusive)"
    if version < parse_version(OLDEST):
        return (f"mindspore {text} is installed but {supported}: install the newest release of that range "
                f"your CANN supports, e.g. pip install 'mindspore>={OLDEST},<{FIRST_UNSUPPORTED}'")
    if version >= parse_version(FIRST_UNSUPPORTED):
        warnings.warn(f"mindspore {text} is newer than the releases moetrain is tested on ({supported}); "
                      f"if something fails, pip install 'mindspore<{FIRST_UNSUPPORTED}'", RuntimeWarning, stacklevel=2)
    return None


def cpu_subgroup_collectives(installed: Optional[Tuple[int, int, int]] = None) -> bool:
    """Whether MindSpore's CPU backend runs AllReduce in groups made with `create_group`: from 2.8 on.
    2.7's CPU AllReduce kernel refuses any other group at its first call ("AllReduce only support
    mccl_world_group on CPU, but got <group>"; measured with 4 msrun ranks, 2.7.0 and 2.8.0)."""
    return at_least("2.8.0", installed)


ONEDNN_BY_VERSION = ((parse_version("2.9.0"), "libdnnl.so.3"), ((0, 0, 0), "libdnnl.so.2"))  # newest first


def onednn_library(lib_dir: str, installed: Optional[Tuple[int, int, int]] = None) -> str:
    """File name of the oneDNN library in MindSpore's `lib_dir` that the CPU kernels link: 2.7 and
    2.8 bundle oneDNN 2 (`libdnnl.so.2`), 2.9 and 2.10 oneDNN 3 (`libdnnl.so.3`); both export the
    `dnnl_sgemm` the kernels call, with the same signature, so a build that bundles the other one
    is linked against that. Raises FileNotFoundError naming the file when there is neither."""
    version = installed or mindspore_version()
    expected = next(name for since, name in ONEDNN_BY_VERSION if version >= since)
    for name in (expected, *(n for _, n in ONEDNN_BY_VERSION if n != expected)):
        if os.path.isfile(os.path.join(lib_dir, name)):
            return name
    raise FileNotFoundError(f"{expected} not found in {lib_dir} (this MindSpore build has no oneDNN)")
