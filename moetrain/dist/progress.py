"""The ranks' progress files that the launcher's watchdog reads (moetrain/dist/launch.py): where they
go (`STATUS_DIR_ENV`, set by the launcher's wrapper) and how a rank writes its heartbeat. Apart from
the launcher so that the trainer's fault handling (moetrain/faults.py), which the launcher imports
for its exit codes, can write them without importing the launcher."""
from __future__ import annotations

import json
import os
import time

STATUS_DIR_ENV = "MOETRAIN_STATUS_DIR"   # the wrapper tells its rank where to write progress


def write_json(path: str, obj) -> None:
    """`obj` as JSON at `path`, replaced atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def write_progress(status_dir: str, rank: int, step: int, phase: str) -> None:
    """A rank's heartbeat: the last step boundary it passed (the trainer writes one per step)."""
    write_json(os.path.join(status_dir, f"progress_{rank}.json"),
               {"rank": rank, "step": step, "phase": phase, "time": time.time(), "pid": os.getpid()})
