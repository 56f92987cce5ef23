"""The ranks' progress files that the launcher's watchdog reads (moetrain/distributed/launch.py): where they
go (`STATUS_DIR_ENV`, set by the launcher's wrapper) and how a rank writes its heartbeat. Apart from
the launcher so that the trainer's fault handling (moetrain/faults.py), which the launcher imports
for its exit codes, can write them without importing the launcher."""
from __future__ import annotations

import json
import os
import time

STATUS_DIR_ENV = "MOETRAIN_STATUS_DIR"   # the wrapper tells its rank where to write progress
ALIVE_INTERVAL_S = 2.0                   # a rank's liveness beat (moetrain/faults.py writes it from a thread)


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


def write_alive(status_dir: str, rank: int) -> None:
    """A rank's liveness beat (a thread of the trainer, every ALIVE_INTERVAL_S): it goes on while the
    rank computes or waits in a collective, and stops when the process is stopped, frozen or dead."""
    write_json(os.path.join(status_dir, f"alive_{rank}.json"), {"rank": rank, "time": time.time(), "pid": os.getpid()})
