"""Faults a long run meets, handled where the trainer reaches a step boundary (docs/faults.md).

- Preemption: SIGTERM or SIGINT sets a flag; at each step boundary the ranks all-reduce it, so
  every rank stops after the same step, saves a checkpoint and exits with EXIT_PREEMPTED.
- Numerical faults (runs without a loss scaler): a non-finite loss or gradient norm, or a loss
  above `train.loss_spike_factor` x its running mean, is skipped, rolled back or stops the run
  (`train.on_nonfinite`), each an `event: nonfinite` record in metrics.jsonl; past
  `train.nonfinite_limit` faults the run stops naming the step and the last good checkpoint.
- Progress heartbeats for the launcher's watchdog (which rank stopped at which step).

The trainer's hooks, in order (`TrainerFaults`): `wrap_sampler` once; per step
`guard.rejects_loss(loss)` and `guard.check(step, loss, grad_norm, finite)` around the optimizer
update, `after_step(trainer, record)` once the step is counted, `stop_requested(step)` after the
step's logging, evaluation and checkpoint; `state()` / `load_state()` with the trainer state.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
from typing import Dict, List, Optional, Sequence

import numpy as np

from moetrain.distributed.progress import ALIVE_INTERVAL_S, STATUS_DIR_ENV, write_alive, write_progress

# Exit codes (sysexits.h numbers where one fits). The launcher does not relaunch after these.
EXIT_BAD_INPUT = 2          # refused before work: config, data, output directory, checkpoint choice
EXIT_CANNOT_RUN = 3         # cannot run here: no such device (the launch scripts' pre-flight), or the step did not compile
EXIT_SAVE_FAILED = 74       # EX_IOERR: a checkpoint could not be written (on_save_error: stop; or the final one)
EXIT_PREEMPTED = 75         # EX_TEMPFAIL: stopped by SIGTERM/SIGINT after saving; rerun with --resume
EXIT_HALTED = 76            # numerical faults: train.on_nonfinite=stop, or past train.nonfinite_limit
EXIT_INVARIANT = 77         # an invariant of the run broke (e.g. MoE dispatch lost rows): a moetrain bug, not resumable
NO_RESTART_CODES = frozenset({0, EXIT_BAD_INPUT, EXIT_CANNOT_RUN, EXIT_SAVE_FAILED, EXIT_PREEMPTED, EXIT_HALTED,
                              EXIT_INVARIANT})

SPIKE_WINDOW = 100          # accepted losses in the running mean of the spike test
SPIKE_MIN_STEPS = 10        # accepted steps before a spike can be declared


class TrainingHalted(RuntimeError):
    """The run stopped on numerical faults; the message names the step and the last good checkpoint."""


# ------------------------------------------------------------------------------------------------
# Host values over all ranks (PyNative; a host sync, used at step boundaries only)
# ------------------------------------------------------------------------------------------------
_ALL_REDUCE_OPS: Dict[str, object] = {}


def world_sum(values: Sequence[float], pctx) -> np.ndarray:
    """Element-wise sum of `values` over every rank (float32 on the wire: exact for small integers)."""
    values = np.asarray(values, np.float32).reshape(-1)
    if pctx.world_size == 1:
        return values.astype(np.float64)
    # MindSpore only when there are ranks to sum over: the CLI imports this module for its exit codes
    import mindspore as ms
    from mindspore import ops
    from mindspore.ops import ReduceOp

    name = pctx.group("world").name
    if name not in _ALL_REDUCE_OPS:
        _ALL_REDUCE_OPS[name] = ops.AllReduce(ReduceOp.SUM, name)
    return _ALL_REDUCE_OPS[name](ms.Tensor(values)).asnumpy().astype(np.float64)


def broadcast_bytes(data: Optional[bytes], size: int, pctx) -> bytes:
    """Rank 0's `size` bytes on every rank (others pass None)."""
    values = np.zeros(size, np.float32)
    if pctx.rank == 0:
        values[:] = np.frombuffer(data, np.uint8)[:size]
    return bytes(world_sum(values, pctx).round().astype(np.uint8).tolist())


def failed_ranks(failed: bool, pctx) -> List[int]:
    """Every rank says whether it failed; all get the list of those that did (a collective)."""
    flags = np.zeros(pctx.world_size, np.float32)
    flags[pctx.rank] = float(failed)
    return [r for r, v in enumerate(world_sum(flags, pctx)) if v > 0]


# ------------------------------------------------------------------------------------------------
# Preemption
# ------------------------------------------------------------------------------------------------
class Preempted(RuntimeError):
    """Stopped by SIGTERM/SIGINT during set-up, before the first step: nothing was written (exit 75)."""


class PreemptionFlag:
    """SIGTERM / SIGINT set a flag instead of killing the process; a second SIGINT aborts
    (KeyboardInterrupt), so Ctrl-C twice still stops a run at once.

    `moetrain train` installs it first thing (before MindSpore is imported), so a signal at any
    moment of set-up or compile is a stop at the next check, never a kill (docs/faults.md)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> "PreemptionFlag":
        """Install (or re-assert, e.g. after a library replaced it) the handler; the handler found
        the first time is what `uninstall` restores."""
        for sig in self.SIGNALS:
            try:
                previous = signal.signal(sig, self._handle)
            except ValueError:      # not the main thread: leave the process's handlers alone
                continue
            # SA_RESTART: the signal may land on any of MindSpore's threads; without it a system call
            # that thread is in fails with EINTR, which native code need not expect (Python retries
            # its own calls either way, PEP 475)
            signal.siginterrupt(sig, False)
            self._previous.setdefault(sig, previous)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"moetrain: received {signal.Signals(signum).name}: stopping at the next step boundary after saving a "
              f"checkpoint (during set-up: before the first step, nothing to save), then exiting with code "
              f"{EXIT_PREEMPTED} (Ctrl-C again aborts without saving)", file=sys.stderr, flush=True)

    def agreed(self, pctx) -> bool:
        """Whether any rank was signalled; every rank gets the same answer (an all-reduce)."""
        local = 1.0 if self.signum is not None else 0.0
        return bool(world_sum([local], pctx)[0] > 0)


# ------------------------------------------------------------------------------------------------
# Numerical faults
# ------------------------------------------------------------------------------------------------
def _number(value):
    """JSON-safe float: non-finite values as strings ("nan", "inf")."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else str(value)


class NonFiniteGuard:
    """Decides what happens to an optimizer step from its loss and gradient norm.

    `check(step, loss, grad_norm, finite) -> "apply" | "skip" | "rollback" | "stop"` is called
    once per step before the update is applied, with the global-batch loss and the all-reduced
    gradient norm (identical on every rank, so every rank decides the same). Inactive under a loss
    scaler, whose own overflow handling skips the step ("apply" if finite else "skip").
    """

    def __init__(self, policy: str = "skip", limit: int = 10, spike_factor: float = 0.0, active: bool = True):
        self.policy, self.limit, self.spike_factor, self.active = policy, limit, spike_factor, active
        self.recent: List[float] = []          # accepted losses, for the running mean
        self.faults = 0                        # faults so far in this run
        self.last: Optional[Dict] = None       # the event of the last check (None: the step was fine)
        self.last_action = "apply"

    @classmethod
    def from_config(cls, cfg) -> "NonFiniteGuard":
        t = cfg.train
        return cls(t.on_nonfinite, t.nonfinite_limit, t.loss_spike_factor, cfg.precision.loss_scale == "none")

    def running_mean(self) -> Optional[float]:
        return float(np.mean(self.recent)) if len(self.recent) >= SPIKE_MIN_STEPS else None

    def diagnose(self, loss: float, grad_norm: Optional[float] = None, finite: bool = True) -> Optional[str]:
        """Why this step is a fault, or None."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        mean = self.running_mean()
        if self.spike_factor > 0 and mean is not None and loss > self.spike_factor * mean:
            return (f"loss spike: {loss:.4g} > train.loss_spike_factor ({self.spike_factor:g}) x the running mean "
                    f"{mean:.4g} of the last {len(self.recent)} steps")
        if not finite or (grad_norm is not None and not math.isfinite(grad_norm)):
            return f"non-finite gradients (norm {grad_norm})"
        return None

    def rejects_loss(self, loss: float) -> bool:
        """Whether the loss alone makes the step a fault (lets a trainer skip computing the update)."""
        return self.active and self.diagnose(loss) is not None

    def check(self, step: int, loss: float, grad_norm: Optional[float], finite: bool) -> str:
        self.last = None
        if not self.active:
            self.last_action = "apply" if finite else "skip"
            return self.last_action
        reason = self.diagnose(loss, grad_norm, finite)
        if reason is None:
            self.recent = (self.recent + [float(loss)])[-SPIKE_WINDOW:]
            self.last_action = "apply"
            return "apply"
        self.faults += 1
        action = self.policy if self.faults <= self.limit else "stop"
        self.last = {"step": step, "event": "nonfinite", "reason": reason, "action": action,
                     "faults": self.faults, "values": {"loss": _number(loss), "grad_norm": _number(grad_norm)}}
        self.last_action = action
        return action

    def state(self) -> Dict:
        return {"faults": self.faults, "recent": list(self.recent)}

    def load(self, state: Optional[Dict]) -> None:
        state = state or {}
        self.faults = int(state.get("faults", 0))
        self.recent = [float(v) for v in state.get("recent", [])]


class SkippingSampler:
    """A batch sampler whose step `s` reads the batch of step `s + offset`: a rollback moves
    `offset` past the batches it skips. Everything else is the wrapped sampler's."""

    def __init__(self, sampler, offset: int = 0):
        self.inner, self.offset = sampler, offset

    def rank_batch(self, step: int, dp_rank: int, dp_size: int):
        return self.inner.rank_batch(step + self.offset, dp_rank, dp_size)

    def global_batch(self, step: int):
        return self.inner.global_batch(step + self.offset)

    def epoch_of(self, step: int) -> int:
        return self.inner.epoch_of(step + self.offset)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# ------------------------------------------------------------------------------------------------
# What the trainer calls
# ------------------------------------------------------------------------------------------------
class TrainerFaults:
    def __init__(self, cfg, pctx, last_good_checkpoint, preemption: Optional[PreemptionFlag] = None):
        """`last_good_checkpoint()`: path of this run's latest complete checkpoint, or None.
        `preemption`: the flag `moetrain train` installed at its start (it keeps it past this run);
        None: a flag of this trainer's own, removed at `close()`."""
        self.pctx = pctx
        self.guard = NonFiniteGuard.from_config(cfg)
        self.sampler: Optional[SkippingSampler] = None
        self.last_good_checkpoint = last_good_checkpoint
        self.status_dir = os.environ.get(STATUS_DIR_ENV)
        self._liveness = self._start_liveness() if self.status_dir else None
        self._own_flag = preemption is None
        self.preemption = (preemption or PreemptionFlag()).install()   # (again: after MindSpore's set-up)

    def wrap_sampler(self, sampler) -> SkippingSampler:
        self.sampler = SkippingSampler(sampler)
        return self.sampler

    def beat(self, step: int, phase: str = "step") -> None:
        """Heartbeat for the launcher's watchdog (when launched by it)."""
        if self.status_dir:
            try:
                write_progress(self.status_dir, self.pctx.rank, step, phase)
            except OSError:
                pass    # the watchdog's information only; never stop training for it

    def _start_liveness(self):
        """The launcher's second report (besides the step heartbeats): a daemon thread rewrites
        `alive_<rank>.json` every few seconds, also while the main thread waits in a collective, so the
        launcher tells a stopped or frozen rank from the ranks waiting for it (docs/faults.md, "No hangs")."""
        stop, rank, folder = threading.Event(), self.pctx.rank, self.status_dir

        def beat():
            while True:
                try:
                    write_alive(folder, rank)
                except OSError:
                    pass
                if stop.wait(ALIVE_INTERVAL_S):
                    return

        threading.Thread(target=beat, name=f"moetrain-alive-{rank}", daemon=True).start()
        return stop

    # ---- checkpointed state --------------------------------------------------------------------
    def state(self) -> Dict:
        return {"data_offset": self.sampler.offset if self.sampler else 0, "nonfinite": self.guard.state()}

    def load_state(self, trainer_state: Dict) -> None:
        if self.sampler is not None:
            self.sampler.offset = int(trainer_state.get("data_offset", 0))
        self.guard.load(trainer_state.get("nonfinite"))

    # ---- step boundaries -----------------------------------------------------------------------
    def after_step(self, trainer, record: Dict) -> bool:
        """Act on the guard's decision for the step just counted. Returns True when the step was
        rolled back (the trainer's step moved back: do not log the record); raises TrainingHalted."""
        self.beat(trainer.step)
        action, event = self.guard.last_action, self.guard.last
        if event is None:                      # fine, or skipped by the loss scaler
            return False
        event = dict(event)
        good = None
        if action in ("rollback", "stop"):
            trainer.wait_for_checkpoint()
            good = self.last_good_checkpoint()
        if action == "rollback" and good is None:
            action = event["action"] = "skip"
            event["note"] = "no checkpoint of this run to roll back to yet: the update was skipped"
        if action == "skip":
            record["skipped"] = True
            trainer.logger.log(event)
            self._say(f"step {event['step']}: {event['reason']}; update skipped "
                      f"(fault {event['faults']} of at most {self.guard.limit})")
            return False
        if action == "rollback":
            self._rollback(trainer, event, good)
            return True
        trainer.logger.log(event)
        raise TrainingHalted(self._halt_message(trainer, event, good))

    def _rollback(self, trainer, event: Dict, checkpoint: str) -> None:
        fault_step, faults = trainer.step, self.guard.faults
        offset = self.sampler.offset if self.sampler else 0
        trainer.load(checkpoint)                          # restores step, weights, guard window, offset
        skipped = fault_step - trainer.step
        self.guard.faults = faults                        # faults count over the whole run
        if self.sampler is not None:
            self.sampler.offset = offset + skipped        # past the batches since the checkpoint
        trainer.logger.rewind(trainer.step)
        event.update(rolled_back_to=checkpoint, resumed_at_step=trainer.step, skipped_batches=skipped)
        trainer.logger.log(event)
        self._say(f"step {event['step']}: {event['reason']}; rolled back to {checkpoint} (step {trainer.step}) "
                  f"and skipped the {skipped} batch(es) since (fault {faults} of at most {self.guard.limit})")

    def _halt_message(self, trainer, event: Dict, good: Optional[str]) -> str:
        t = trainer.cfg.train
        why = ("train.on_nonfinite is stop" if t.on_nonfinite == "stop" or self.guard.faults <= self.guard.limit
               else f"{self.guard.faults} numerical faults exceed train.nonfinite_limit={self.guard.limit} "
                    f"(train.on_nonfinite={t.on_nonfinite})")
        where = (f"The last good checkpoint is {good}; after fixing the cause (e.g. a lower optimizer.lr, "
                 f"gradient clipping, other data) resume from it with --resume {good}" if good else
                 "No checkpoint of this run was saved before it (set checkpoint.save_steps to keep one).")
        return f"step {event['step']}: {event['reason']}; the run stops because {why}. {where}"

    def stop_requested(self, step: int) -> bool:
        """Whether the run stops here after a signal (a collective: call it on every rank at the
        same step boundary)."""
        self.beat(step)
        return self.preemption.agreed(self.pctx)

    def stop_before_start(self, message: str) -> None:
        """Raise Preempted(message) on every rank if any was signalled (a collective: call it on every
        rank at the same point of set-up, before the run writes anything)."""
        if self.preemption.agreed(self.pctx):
            raise Preempted(message)

    def close(self) -> None:
        if self._liveness is not None:
            self._liveness.set()
        if self._own_flag:
            self.preemption.uninstall()

    def _say(self, message: str) -> None:
        if self.pctx.rank == 0:
            print(f"moetrain: {message}", file=sys.stderr, flush=True)
