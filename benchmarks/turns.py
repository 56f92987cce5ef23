"""Steps taken in turns by two benchmark processes, so that both see the same host.

This machine's speed drifts by 10-40 % over seconds (other guests on the physical host: a process's
own CPU time per step moves with it, so it is not stolen time but slower cores). Two benchmarks run
one after the other then compare different hosts. Taking turns step by step (A's step, B's step,
A's step, ...) puts both in every stretch of the drift; each side still times only its own steps.

Standard library only: `benchmarks/bench.py` uses it in this project's environment, `benchmarks/peer_turns.py`
in the peer's.

The side (a benchmark process) gets two inherited pipe ends in `MOETRAIN_BENCH_TURNS` ("read,write")
and calls `wait()` before each timed step, `done()` after it, and `wait()` once more after its last
step (so that its teardown does not overlap the other's last step). The referee (`Referee`) starts
each side and lets one side run at a time.
"""
from __future__ import annotations

import os
import subprocess
from typing import NamedTuple

ENV = "MOETRAIN_BENCH_TURNS"
READY, GO, DONE = b"r", b"g", b"d"


class Turns:
    """A side's end: `wait()` blocks until the referee gives it the turn, `done()` hands it back."""

    def __init__(self, spec: str):
        self._read, self._write = (int(fd) for fd in spec.split(","))

    @classmethod
    def from_env(cls) -> "Turns | None":
        spec = os.environ.get(ENV)
        return cls(spec) if spec else None

    def wait(self) -> None:
        os.write(self._write, READY)
        if os.read(self._read, 1) != GO:
            raise RuntimeError("benchmark turns: the referee closed the pipe")

    def done(self) -> None:
        os.write(self._write, DONE)


class NoTurns:
    """A process not run by a referee: its steps need no turn."""

    def wait(self) -> None:
        pass

    def done(self) -> None:
        pass


class Side(NamedTuple):
    proc: subprocess.Popen
    to_side: int        # the referee writes GO here
    from_side: int      # and reads READY and DONE here


class Referee:
    """Starts benchmark processes and lets them take their steps in turns, one process at a time."""

    def __init__(self):
        self.sides = []

    def start(self, command: list[str], **popen) -> subprocess.Popen:
        """Starts one side and waits until it is ready for its first step (its start-up runs alone)."""
        to_side_r, to_side_w = os.pipe()
        from_side_r, from_side_w = os.pipe()
        env = dict(popen.pop("env", None) or os.environ, **{ENV: f"{to_side_r},{from_side_w}"})
        proc = subprocess.Popen(command, env=env, pass_fds=(to_side_r, from_side_w), **popen)
        os.close(to_side_r)
        os.close(from_side_w)
        side = Side(proc, to_side_w, from_side_r)
        self.sides.append(side)
        self._expect(side, READY)
        return proc

    def _expect(self, side: Side, want: bytes) -> None:
        got = os.read(side.from_side, 1)
        if got != want:
            proc = side.proc
            raise RuntimeError(f"benchmark turns: {proc.args[1] if len(proc.args) > 1 else proc.args} sent {got!r} "
                               f"instead of {want!r} (exited with {proc.poll()}?)")

    def alternate(self, steps: int, block: int = 1) -> list[float]:
        """`steps` steps each, `block` steps a turn, the sides in start order; then releases every side
        at once to finish.

        Returns, per side, the CPU seconds it used while waiting (during the others' turns): its idle
        threads spinning would slow the other side, so this should be near zero."""
        waiting_cpu = [0.0] * len(self.sides)
        for first in range(0, steps, block):
            for i, side in enumerate(self.sides):
                before = [cpu_seconds(s.proc.pid) for s in self.sides]
                for _ in range(min(block, steps - first)):
                    os.write(side.to_side, GO)
                    self._expect(side, DONE)
                    self._expect(side, READY)     # the side is back at wait(): its bookkeeping is done too
                for j, s in enumerate(self.sides):
                    if j != i:
                        waiting_cpu[j] += cpu_seconds(s.proc.pid) - before[j]
        for side in self.sides:
            os.write(side.to_side, GO)
        for side in self.sides:
            os.close(side.to_side)
            os.close(side.from_side)
        self.sides = []
        return waiting_cpu


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc; 0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime
