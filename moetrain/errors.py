"""One error path for every command-line entry point (`moetrain ...`, the user tools in tools/).

An expected error (bad input: a missing, misplaced or damaged file, a bad option value, a config
that cannot run) becomes one message on stderr, `PROG: error: what, where, how to fix`, and exit
code 2 (docs/faults.md). Anything else is a moetrain bug and keeps its traceback. Standard library
only: every layer may use it.
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Callable, Optional, Sequence

EXIT_BAD_INPUT = 2          # the same number as moetrain.faults.EXIT_BAD_INPUT (faults imports numpy)

_OS_HINTS = {
    errno.ENOENT: "it does not exist: check the path",
    errno.EISDIR: "it is a folder, a file was expected: name the file inside it",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EACCES: "permission denied: check the file's permissions, or choose another path",
    errno.EPERM: "operation not permitted: check the file's permissions, or choose another path",
    errno.EROFS: "the filesystem is read-only: choose a writable path",
    errno.ENOSPC: "no space left on the device: free space, or choose another path",
    errno.EEXIST: "it already exists: choose a new path",
}


_EXPECTED = [ValueError, OSError]


def register_expected(cls: type) -> type:
    """Declare another exception class bad input (moetrain.checkpoint.manager registers CheckpointError,
    a RuntimeError: named, not the whole class). Registered where it is defined, so this module
    imports nothing of moetrain."""
    if cls not in _EXPECTED:
        _EXPECTED.append(cls)
    return cls


def expected_errors() -> tuple:
    """The exception classes that are bad input, not bugs: ValueError (ConfigError, DataError,
    LayoutError, OutputDirError, OutputExistsError, JSON and Unicode decoding), OSError (missing
    files, folders in place of files, permissions, full disks) and the registered ones (CheckpointError)."""
    return tuple(_EXPECTED)


def describe(exc: BaseException) -> str:
    """The message of an expected error, with the file and a fix where Python's own says neither."""
    if isinstance(exc, OSError) and exc.filename is not None and (exc.strerror or "") in str(exc):
        where = os.fsdecode(exc.filename)
        hint = _OS_HINTS.get(exc.errno, exc.strerror or type(exc).__name__)
        if exc.filename2 is not None:
            where += f" -> {os.fsdecode(exc.filename2)}"
        return f"{where}: {hint} ({exc.strerror or type(exc).__name__})"
    if isinstance(exc, UnicodeDecodeError):
        return (f"not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset {exc.start} ({exc.reason}); give a "
                f"UTF-8 text file")
    text = str(exc).strip() or type(exc).__name__
    return text


def run_main(prog: str, main: Callable[[Optional[Sequence[str]]], object], argv: Optional[Sequence[str]] = None,
             exit_code: Callable[[object], int] = lambda result: 0) -> int:
    """Call `main(argv)`; an expected error becomes `PROG: error: ...` on stderr and exit 2. Returns
    the exit code (`exit_code(result)` when main returns; argparse's own errors exit 2 as usual)."""
    try:
        result = main(argv)
    except expected_errors() as exc:
        print(f"{prog}: error: {describe(exc)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return exit_code(result)
