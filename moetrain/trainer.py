"""One trainer for every model.

One optimizer step (moetrain/parallel/parallelize.py assembles the pieces):
    grads, values = runner.train_step(micro_batches, scale)   forward + backward of every micro-batch of
                                                              this data-parallel rank (gradient
                                                              accumulation, or the pipeline schedule)
    grad_norm, finite = opt_step(grads, lr, step, inv_scale)  data-parallel reduction (ZeRO), unscale,
                                                              overflow check, clip, optimizer
    runner.update_expert_bias(load)                           aux-loss-free balancing, outside the gradient
then metrics (rank 0), evaluation and checkpoints at their intervals.
"""
from __future__ import annotations

import copy
import math
import os
import resource
import time
from typing import Dict, Optional, Tuple

import numpy as np

import mindspore as ms
from mindspore.profiler import ProfilerActivity

from moetrain.build import build_model, setup_device
from moetrain.checkpoint import distributed
from moetrain.checkpoint.initial import load_initial_weights
from moetrain.checkpoint.manager import CheckpointError, CheckpointSaveError
from moetrain.checkpoint.run_dir import last_good_checkpoint, start_run
from moetrain.config import Config, check_trainable, dump_config, validate
from moetrain.data import build_datasets, build_sampler, fetch
from moetrain.data.blend import evaluate_sources
from moetrain.devices import get_device
from moetrain.distributed import comm
from moetrain.distributed.topology import init_parallel, launched_world_size
from moetrain.faults import TrainerFaults
from moetrain.fileio import read_yaml
from moetrain.layout import LayoutError, check_config_layout
from moetrain.logger import MetricsLogger, print_rank0
from moetrain.modeling import summed_stats
from moetrain.moe import accounting
from moetrain.optim import lr_at
from moetrain.parallel.context_parallel import TokenCountError
from moetrain.parallel.data_parallel import reduce_host_values
from moetrain.parallel.parallelize import parallelize
from moetrain.planner.arch import Arch, apply_layout, flops_per_token
from moetrain.planner.search import choose_layout


class CompileError(RuntimeError):
    """The training step's graphs did not compile (or failed on their first run)."""


class LossScaler:
    """Static or dynamic loss scaling: a step whose gradients overflow is skipped and the
    scale halves; `scale_window` finite steps in a row double it."""

    def __init__(self, kind: str, initial: float, window: int, factor: float):
        self.kind = kind
        self.scale = initial if kind != "none" else 1.0
        self.window = window
        self.factor = factor
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        if self.kind != "dynamic":
            return
        if not finite:
            self.scale = max(1.0, self.scale / self.factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= self.factor
            self.good_steps = 0

    def state(self) -> Dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load(self, state: Dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]


def _init_parallel(cfg: Config):
    """Check the layout against the world size as launched (one process included), then create the
    process groups."""
    check_config_layout(cfg, world=launched_world_size())
    p = cfg.parallel
    ctx = init_parallel(dp=p.data_parallel, tp=p.model_parallel, pp=p.pipeline_stage, ep=p.expert_parallel,
                        etp=p.expert_tensor_parallel, cp=p.context_parallel, verbose=False)
    if ctx.world_size > 1:
        print_rank0(ctx.rank, f"moetrain.distributed: {ctx.world_size} ranks, dp={ctx.dp} tp={ctx.tp} pp={ctx.pp}"
                              + (f" cp={ctx.cp}" if ctx.cp > 1 else "") + f" ep={ctx.ep} etp={ctx.etp}, comm backend {comm.describe_backend()}")
    return ctx


def mfu_terms(cfg: Config, seq_length: int, world_size: int) -> Optional[Tuple[float, float]]:
    """`(model FLOPs per token, peak FLOP/s of the whole job)` for the `mfu` metric: FLOPs from
    `moetrain.planner.flops_per_token` (6 x active matmul params + attention), peak from the device
    profile (`moetrain.devices`; ranks of a shared CPU host share its peak). None when the planner
    does not model this model (e.g. the MNIST MLP) or device."""
    if not seq_length:
        return None
    try:
        device = get_device(cfg.train.device)
        peak = device.peak(cfg.precision.compute_dtype) * (1 if device.shared_host else world_size)
        return flops_per_token(cfg.model, seq_length), peak
    except (LayoutError, ValueError):
        return None


class ProfilerWindow:
    """`logging.profile_steps: [first, last]`: mindspore.Profiler over those optimizer steps
    (1-based, as `step` in metrics.jsonl), written to `<output_dir>/profile` and analysed when the
    window closes (per-op times: FRAMEWORK/cpu_op_type_info_*.csv on CPU)."""

    def __init__(self, steps, output_dir: str, device: str):
        self.first, self.last = steps if steps else (0, -1)
        self.path = os.path.join(output_dir, "profile")
        self.device = device
        self.profiler = None

    def before_step(self, step: int) -> None:
        if self.profiler is None and self.first <= step <= self.last:
            activities = [ProfilerActivity.CPU] + {"ascend": [ProfilerActivity.NPU],
                                                   "gpu": [ProfilerActivity.GPU]}.get(self.device, [])
            self.profiler = ms.Profiler(output_path=self.path, activities=activities)

    def after_step(self, step: int) -> None:
        if self.profiler is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler.analyse()
            self.profiler, self.first = None, self.last + 1   # one window per run


def resolve_auto_layout(cfg: Config, world_size: Optional[int] = None):
    """`parallel.mode: auto`: the layout `moetrain.planner.choose_layout` picks for the launched world
    size (dp/tp/pp/ep, ZeRO level, recompute, micro-batches), applied to a copy of `cfg` and
    validated again. Returns `(cfg, search)`; `search` is None for `mode: manual`."""
    if cfg.parallel.mode != "auto":
        return cfg, None
    world = world_size or launched_world_size()
    try:
        Arch.of(cfg.model)
    except LayoutError as exc:   # e.g. the MNIST MLP: data parallel is its only layout
        chosen = copy.deepcopy(cfg)
        chosen.parallel.mode, chosen.parallel.data_parallel = "manual", world
        if cfg.train.global_batch_size % (world * max(1, cfg.train.micro_batch_size)):
            chosen.train.micro_batch_size = 0   # the user's micro-batch does not divide: one per rank and step
        print(f"moetrain: parallel.mode=auto: {exc}; running data parallel over {world} rank(s)", flush=True)
        validate(chosen, f"{cfg.source} (parallel.mode=auto: data_parallel={world})")
        return chosen, None
    _, search = choose_layout(cfg, world)
    chosen = apply_layout(cfg, search.chosen.layout)
    validate(chosen, f"{cfg.source} (parallel.mode=auto chose {search.chosen.layout.describe()})")
    return chosen, search


class Trainer:
    def __init__(self, cfg: Config, resume: Optional[str] = None, overwrite: bool = False, preemption=None):
        """`preemption`: the `moetrain.faults.PreemptionFlag` `moetrain train` installed at its start (a
        signal during set-up stops the run before its first step, docs/faults.md); None: the trainer's own."""
        self._preemption = preemption
        check_trainable(cfg)        # planner-only values (docs/plan.md, "Published runs"): refused before any work
        cfg, self.layout_search = resolve_auto_layout(cfg)
        self.cfg = cfg
        t = cfg.train
        setup_device(t.device)
        self.pctx = _init_parallel(cfg)
        self.rank = self.pctx.rank
        self.out = t.output_dir
        self.ckpt_root = os.path.join(self.out, "checkpoints")
        # locks the output dir (refused if another live run holds it), refuses a used one without
        # --resume/--overwrite, picks the checkpoint and the run identity; writes nothing else yet
        self.run = start_run(self.out, resume, overwrite, self.pctx)
        resume_path = self.run.resume_path
        # MindSpore writes a failed compile's analysis (rank_N/om/analyze_fail.ir) under MS_OM_PATH,
        # by default the working directory: keep it with the run instead
        os.environ.setdefault("MS_OM_PATH", os.path.join(os.path.abspath(self.out), "logs", "compile"))
        self.faults = None
        try:
            self._build(cfg, resume_path)
            # a signal during set-up: stop here, before anything is written (every rank agrees)
            self.faults.stop_before_start(
                f"stopped by a signal during set-up, before the first step; nothing was written into {self.out}. "
                + (f"The checkpoint it was resuming from, {resume_path}, is unchanged: run the same command with "
                   f"--resume to continue" if resume_path else
                   "Nothing to resume: run the same command again (with --resume it starts again from step 0)"))
        except BaseException:       # refused: the folder is left as it was (an --overwrite'n run stays in place)
            if self.faults is not None:
                self.faults.close()
            self.run.release()
            raise
        # everything is validated: now move an overwritten run aside, write run.json, checkpoints/, logs/
        self.run.commit(self.pctx)
        self.is_logger = self.rank == 0
        if self.is_logger:
            dump_config(cfg, os.path.join(self.out, "resolved_config.yaml"), self.rank)
            if self.layout_search is not None:   # parallel.mode: auto: what was chosen, what was rejected and why
                with open(os.path.join(self.out, "layout_search.txt"), "w") as fh:
                    fh.write(str(self.layout_search) + "\n")
                print_rank0(self.rank, f"moetrain: parallel.mode=auto chose {self.layout_search.chosen.layout.describe()} "
                            f"(candidates and reasons: {self.out}/layout_search.txt)")
        self.logger = MetricsLogger(self.out, self.total_steps, self.is_logger, cfg.logging.tensorboard,
                                    cfg.logging.progress_bar, cfg.logging.log_interval, self.step)
        self.mfu_terms = mfu_terms(cfg, self.tokens_per_sample, self.pctx.world_size)
        self.profiler_window = ProfilerWindow(cfg.logging.profile_steps, self.out, t.device)
        print_rank0(self.rank, f"moetrain: model {cfg.model.name} with "
                    f"{sum(int(np.prod(p.shape)) for p in self.model.trainable_params()):,} parameters; "
                    f"{self.total_steps} steps of {t.global_batch_size} samples "
                    f"({self.n_micro} micro-batch(es) of {self.micro_batch_size} per rank, "
                    f"dp={self.pctx.dp}); output in {self.out}"
                    + (f"; resumed from {resume_path} at step {self.step}" if resume_path else "")
                    + (f"; weights from {cfg.checkpoint.load_path}" if cfg.checkpoint.load_path and not resume_path
                       else ""))

    def _build(self, cfg: Config, resume_path: Optional[str]) -> None:
        """Data, model, optimizer and the weights to start from: everything that can refuse the run
        before it writes into its output directory."""
        t = cfg.train
        self.train_set, self.eval_set = build_datasets(cfg)
        self.sampler = build_sampler(cfg, self.train_set)
        self.faults = TrainerFaults(cfg, self.pctx, lambda: last_good_checkpoint(self.out, self.run.run_id),
                                    self._preemption)
        self.sampler = self.faults.wrap_sampler(self.sampler)   # a rollback moves past the batches it skips
        self.total_steps = t.steps or math.ceil(t.epochs * self.sampler.steps_per_epoch)
        self.tokens_per_sample = getattr(self.train_set, "tokens_per_sample", 0)

        ms.set_seed(t.seed)
        # each rank constructs only its part (its stage's layers, deferred), then parallelize gives
        # each parameter exactly its slice of the one-process model's values (moetrain/param_init.py)
        self.parallel = parallelize(build_model(cfg, self.pctx), cfg, self.pctx, self.tokens_per_sample,
                                    rebuild=lambda chunk: build_model(cfg, self.pctx, chunk))   # model chunks
        self.model, self.opt_step, self.runner = self.parallel.model, self.parallel.opt_step, self.parallel.runner
        self.summed = summed_stats(self.parallel.specs)
        self.scaler = LossScaler(cfg.precision.loss_scale, cfg.precision.initial_loss_scale,
                                 cfg.precision.scale_window, cfg.precision.scale_factor)
        self.step = 0
        self.step_compiled = False   # set after the first step: its graphs compiled and ran
        self.n_micro = cfg.num_micro_batches
        self.micro_batch_size = cfg.micro_batch_size

        if resume_path:
            self.load(resume_path)
        elif cfg.checkpoint.load_path:   # new run from saved weights: step 0, fresh optimizer and schedule
            load_initial_weights(cfg.checkpoint.load_path, self._checkpoint_tensors(), cfg.to_dict()["model"],
                                 holds_whole_model=self.pctx.pp == 1, log=lambda line: print_rank0(self.rank, line))
        if resume_path and self.step >= self.total_steps:
            more = (f"train.steps above {self.step} (e.g. --set train.steps={self.step + max(1, self.total_steps)})"
                    if t.steps else f"train.epochs (now {t.epochs}: {self.total_steps} steps)")
            raise CheckpointError(
                f"--resume {resume_path}: the checkpoint is at step {self.step} and the run ends at step "
                f"{self.total_steps} ({'train.steps' if t.steps else 'train.epochs'}): there is nothing to train. To "
                f"train on, raise {more}; to use the model as it is, read the checkpoint (moetrain eval, forward, "
                f"convert consolidate)")

    # ------------------------------------------------------------------------------------------
    def _micro_batches(self, step: int):
        indices = self.sampler.rank_batch(step, self.pctx.dp_rank, self.pctx.dp)
        for m in range(self.n_micro):
            yield fetch(self.train_set, indices[m * self.micro_batch_size:(m + 1) * self.micro_batch_size])

    def train_step(self) -> Dict:
        """One optimizer step; returns the step's record (global-batch loss and stats)."""
        step = self.step
        ms.set_seed(self.cfg.train.seed + step)  # re-seed per step: exact resume of random ops
        lr = self.lr_at(step)
        scale = ms.Tensor(self.scaler.scale, ms.float32)
        start = time.perf_counter()
        grads, values = self.runner.train_step(list(self._micro_batches(step)), scale)
        dispatch = self._check_dispatch(values, f"step {step + 1}")   # before the optimizer applies a wrong step
        inv_scale = 1.0 / (self.scaler.scale * self.n_micro * self.pctx.dp_cp)   # gradients summed over dp x cp
        record = self._reduce_over_dp(values)
        if dispatch is not None:   # the rows one copy of the model computed, whatever the layout
            record["expert_rows"] = accounting.expert_rows_per_copy(dispatch, record["routed"])
        if self.faults.guard.rejects_loss(record["loss"]):   # a spike or non-finite loss: no update (all ranks agree)
            grad_norm, finite = float("nan"), False
        else:
            grad_norm, finite = self.opt_step(grads, lr, step + 1, inv_scale)
        applied = self.faults.guard.check(step + 1, record["loss"], grad_norm, finite) == "apply"
        if applied and "expert_load" in record:
            self.runner.update_expert_bias(record["expert_load"])
        self.scaler.update(finite)
        elapsed = time.perf_counter() - start
        self.step += 1
        record.update(step=self.step, lr=lr, grad_norm=grad_norm, step_time_s=elapsed)
        if self.cfg.precision.loss_scale != "none":
            record.update(loss_scale=self.scaler.scale, skipped=not finite)
        samples = self.cfg.train.global_batch_size
        if self.tokens_per_sample:
            record["tokens_per_s"] = samples * self.tokens_per_sample / elapsed
        else:
            record["samples_per_s"] = samples / elapsed
        if self.mfu_terms is not None:
            flops_per_token, peak = self.mfu_terms
            record["mfu"] = record["tokens_per_s"] * flops_per_token / peak
        record["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        return record

    def _first_step(self) -> Dict:
        """`train_step`, turning a failure while MindSpore compiles (or first runs) the step's graphs
        into an error that names the model, the layout, where the analysis went and what to try."""
        try:
            record = self.train_step()
        except (RuntimeError, TypeError, ValueError) as exc:
            if not self.cfg.train.jit or isinstance(exc, (accounting.DispatchInvariantError, TokenCountError)):
                raise
            raise CompileError(self._compile_failure(exc)) from exc
        self.step_compiled = True
        return record

    def _compile_failure(self, exc: BaseException) -> str:
        p, m = self.pctx, self.cfg.model
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        dumps = [os.path.join(root, f) for root, _, files in os.walk(os.environ.get("MS_OM_PATH", "."))
                 for f in files if f == "analyze_fail.ir"]
        return (f"the first training step of model {m.name!r} ({getattr(m, 'num_layers', '?')} layers) on layout "
                f"dp={p.dp} tp={p.tp} pp={p.pp} ep={p.ep}{f' cp={p.cp}' if p.cp > 1 else ''} "
                f"(ZeRO-{self.opt_step.level}, recompute="
                f"{self.cfg.parallel.recompute}) failed while MindSpore compiled or first ran its graphs: "
                f"{type(exc).__name__}: {first}"
                + (f"\n  MindSpore's analysis: {dumps[0]}" if dumps else "")
                + "\n  To narrow it down: --set train.jit=false (PyNative: no graph compile, slower), "
                  "MOETRAIN_DISABLE_KERNELS=1 (plain ops instead of the fused CPU kernels), or a smaller "
                  "model.num_layers.")

    def _check_dispatch(self, values: Dict, where: str, over_world: bool = True) -> Optional[np.ndarray]:
        """Stops the run when MoE dispatch lost rows (`moetrain.moe.accounting`): one host all-reduce
        of every layer's dispatch rows (`over_world`: every rank calls this; else this rank's dispatch
        stayed on this rank). Takes the terms out of `values`; returns their sums (None: no MoE)."""
        values.pop(accounting.LOAD_KEY, None)   # the dispatch buffers' sizing input, read by the runner
        rows = values.pop(accounting.KEY, None)
        if rows is None:
            return None
        p, capacities = self.pctx, self.runner.capacities_in_force()
        total = np.asarray(rows, np.float64)
        if over_world and p.world_size > 1:   # through comm: booked in its ledger like every collective
            flat = ms.Tensor(total.reshape(-1).astype(np.float32))
            total = comm.all_reduce(flat, p.group("world")).asnumpy().astype(np.float64).reshape(total.shape)
        layout = f"dp={p.dp} tp={p.tp} pp={p.pp} ep={p.ep} etp={p.etp}" + (f" cp={p.cp}" if p.cp > 1 else "")
        accounting.check_dispatch_rows(total, where, layout, capacities)
        return total

    def _reduce_over_dp(self, values) -> Dict:
        """Sum (counts) or average this rank's step values over the data-parallel ranks."""
        if self.pctx.dp_cp > 1:
            values = reduce_host_values(values, self.pctx, summed=self.summed)
        if "dropped" in values and "routed" in values:
            values["drop_rate"] = float(values["dropped"]) / max(1.0, float(values["routed"]))
        return {k: (float(v) if np.ndim(v) == 0 else v) for k, v in values.items()}

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.cfg.optimizer.lr, self.cfg.lr_schedule, self.total_steps)

    # ------------------------------------------------------------------------------------------
    def evaluate(self) -> Dict:
        """`eval_loss` (the next-token loss, without auxiliary losses; and `eval_accuracy`); for a
        blended eval set also `eval_loss/<source>`."""
        if self.eval_set is None:
            return {}
        return {"step": self.step, **evaluate_sources(self.eval_set, self._evaluate_dataset)}

    def _evaluate_dataset(self, dataset) -> Dict:
        self.model.set_train(False)
        batch_size = self.cfg.train.eval_batch_size or self.micro_batch_size
        n = len(dataset)
        if self.cfg.train.eval_max_batches:   # counted in global batches: the same samples on every layout
            n = min(n, self.cfg.train.eval_max_batches * self.cfg.train.global_batch_size)
        starts = list(range(0, n, batch_size))
        lockstep = self.parallel.forward_communicates_over_dp   # ep / global aux loss: every dp rank runs each forward
        # in lockstep every forward's collectives must match: a partial last batch is run by every dp
        # rank (equal shapes) and counted by the first, so every layout evaluates the same samples
        tail = starts.pop() if lockstep and n % batch_size else None
        if n == 0:
            raise ValueError("evaluation: the eval set holds no sample; give a larger eval set or set train.eval_interval=0")
        mine = starts[self.pctx.dp_rank::self.pctx.dp]          # evaluation shared among dp ranks
        # in lockstep a rank out of batches runs the first one again, uncounted
        rounds = -(-len(starts) // self.pctx.dp) if lockstep else len(mine)
        batches = [(mine[i], True) if i < len(mine) else (starts[0], False) for i in range(rounds)]
        if tail is not None:
            batches.append((tail, self.pctx.dp_rank == 0))
        loss_sum = correct = count = 0.0
        dispatch = {}
        for start, counted in batches:
            indices = np.arange(start, min(n, start + batch_size))
            loss, stats = self.runner.evaluate(fetch(dataset, indices))
            if accounting.KEY in stats:    # uncounted repeats are dispatched too: checked alike
                dispatch[accounting.KEY] = dispatch.get(accounting.KEY, 0) + np.asarray(stats[accounting.KEY], np.float64)
            if not counted:
                continue
            # the next-token loss: an MoE model's auxiliary losses (and MTP's) are not part of eval_loss
            loss_sum += float(stats.get("lm_loss", loss)) * len(indices)
            count += len(indices)
            if "correct" in stats:
                correct += float(stats["correct"])
        self.model.set_train(True)
        self._check_dispatch(dispatch, f"evaluation at step {self.step}", over_world=lockstep)
        totals = {"loss_sum": loss_sum, "correct": correct, "count": count}
        if self.pctx.dp_cp > 1:
            totals = reduce_host_values(totals, self.pctx, summed=tuple(totals))
        record = {"eval_loss": totals["loss_sum"] / max(1.0, totals["count"])}
        if hasattr(dataset, "labels"):
            record["eval_accuracy"] = totals["correct"] / max(1.0, totals["count"])
        return record

    # ------------------------------------------------------------------------------------------
    def _checkpoint_tensors(self):
        return distributed.local_tensors(self.model, self.opt_step, self.pctx)

    def save(self, final: bool = False) -> Optional[str]:
        """Every rank writes the shards it alone holds; rank 0 adds metadata.json and publishes the
        folder (see `moetrain.checkpoint.distributed`). Returns the checkpoint's path (None: it failed
        under `checkpoint.on_save_error: continue`). `final`: written synchronously and a failure raises
        CheckpointSaveError whatever on_save_error says (the run's last checkpoint, `_save_final`)."""
        if getattr(self, "_checkpointer", None) is None:
            self._checkpointer = distributed.ShardedCheckpointer(self.ckpt_root, self.pctx, self.cfg.checkpoint.keep_max,
                                                                 self.cfg.checkpoint.async_save,
                                                                 self.cfg.checkpoint.on_save_error)
        t = self.cfg.train
        metadata = {
            "format": distributed.FORMAT, "step": self.step, "run_id": self.run.run_id,
            "layout": distributed.layout_of(self.pctx, self.opt_step.level),
            "trainer_state": {"step": self.step, "loss_scale": self.scaler.state(), "seed": t.seed,
                              "global_batch_size": t.global_batch_size,
                              "consumed_samples": (self.step + self.sampler.offset) * t.global_batch_size,
                              "epoch": self.sampler.epoch_of(self.step), **self.faults.state(),
                              # the guard rejected this step: a rollback never returns to this checkpoint
                              "step_finite": self.faults.guard.last is None,
                              "moe_capacities": self.runner.capacity_state()},
            "config": self.cfg.to_dict()}
        self._save_attempted = self.step
        return self._checkpointer.save(self.step, self._checkpoint_tensors(), metadata,
                                       os.path.join(self.out, "resolved_config.yaml"), final=final)

    def _save_final(self) -> None:
        """The run's last checkpoint (at its end, or on SIGTERM). Under `checkpoint.on_save_error:
        continue` a failed save is retried once; a run that cannot save it fails with
        CheckpointSaveError (exit 74) instead of ending as if it had."""
        self.wait_for_checkpoint()
        if self._saved_step() == self.step:
            return
        if getattr(self, "_save_attempted", None) != self.step:    # (a failed save of this step is the first try)
            self.save()
            self.wait_for_checkpoint()
            if self._saved_step() == self.step:
                return
        print_rank0(self.rank, f"moetrain: the final checkpoint (step {self.step}) could not be written; trying "
                               f"once more (a run does not end without its last checkpoint)")
        try:
            self.save(final=True)
        except CheckpointSaveError as exc:
            raise CheckpointSaveError(f"the run's final checkpoint (step {self.step}) could not be written, even on a "
                                      f"second try: {exc}. The run ends with exit code 74; free space (or fix the "
                                      f"error) and resume from the last complete checkpoint") from exc

    def _saved_step(self) -> Optional[int]:
        checkpointer = getattr(self, "_checkpointer", None)
        return checkpointer.saved_step if checkpointer is not None else None

    def wait_for_checkpoint(self) -> None:
        """Finish a pending asynchronous save (`checkpoint.async_save`) and raise its error, if any."""
        if getattr(self, "_checkpointer", None) is not None:
            self._checkpointer.wait()

    def load(self, path: str) -> None:
        """Resume from `path`, saved on any layout: each tensor is reassembled and re-sliced for this rank."""
        reader = distributed.CheckpointReader(path)
        saved_model = (read_yaml(os.path.join(path, "config.yaml")) or {}).get("model", {})
        current = self.cfg.to_dict()["model"]
        diff = sorted(k for k in set(saved_model) | set(current)
                      if k != "compute_dtype" and saved_model.get(k) != current.get(k))
        if diff:
            raise CheckpointError(
                f"checkpoint {path} was saved with another model config; mismatching keys: "
                + ", ".join(f"model.{k} (checkpoint {saved_model.get(k)!r}, config {current.get(k)!r})" for k in diff))
        state = reader.trainer_state
        saved_batch = state.get("global_batch_size", self.cfg.train.global_batch_size)
        if saved_batch != self.cfg.train.global_batch_size:
            raise CheckpointError(
                f"checkpoint {path} was trained with train.global_batch_size={saved_batch}, the config says "
                f"{self.cfg.train.global_batch_size}: the data position and schedule are counted in steps of "
                f"that batch; resume with train.global_batch_size={saved_batch}")
        distributed.load_into(reader, self._checkpoint_tensors(), holds_whole_model=self.pctx.pp == 1)
        reader.close()
        self.step = reader.step
        if "loss_scale" in state:
            self.scaler.load(state["loss_scale"])
        self.faults.load_state(state)
        self.runner.load_capacity_state(state.get("moe_capacities"))   # exact continuation of the MoE dispatch
        if getattr(self, "_checkpointer", None) is not None:   # a rollback: this step's state is the one on disk
            self._checkpointer.saved_step = self.step

    # ------------------------------------------------------------------------------------------
    def fit(self) -> Dict:
        """Train to `total_steps`; returns the last train and eval records."""
        cfg = self.cfg
        last, last_eval = {}, {}
        save_steps, eval_interval = cfg.checkpoint.save_steps, cfg.train.eval_interval
        end = self.total_steps
        if cfg.train.stop_after:
            end = min(end, self.step + cfg.train.stop_after)
        self.faults.preemption.install()
        try:
            if self.step < end and self.faults.stop_requested(self.step):   # signalled since set-up: no step run
                self.profiler_window.close()
                self.logger.close()
                return {"train": last, "eval": last_eval, "preempted": True, "before_first_step": True}
            while self.step < end:
                self.profiler_window.before_step(self.step + 1)
                last = self.train_step() if self.step_compiled else self._first_step()
                self.profiler_window.after_step(self.step)
                if self.faults.after_step(self, last):   # rolled back to a checkpoint; raises TrainingHalted
                    continue
                self.logger.log(last)
                if eval_interval and self.step % eval_interval == 0 and self.step < end:
                    last_eval = self.evaluate()
                    self.logger.log(last_eval)
                if save_steps and self.step % save_steps == 0:
                    self.save()
                if self.step < end and self.faults.stop_requested(self.step):   # SIGTERM/SIGINT on any rank
                    self._save_final()      # unless this step was just saved
                    self.profiler_window.close()
                    self.logger.close()
                    return {"train": last, "eval": last_eval, "preempted": True}
            # (the signal handler stays: a signal from here on lets the run end as it would have)
            self.profiler_window.close()   # a window past the last step ends here
            if self.eval_set is not None:
                last_eval = self.evaluate()
                self.logger.log(last_eval)
            if cfg.checkpoint.save_at_end or (save_steps and self.step % save_steps == 0):
                self._save_final()      # retried once under on_save_error=continue; a run never ends without it
            self.wait_for_checkpoint()   # an asynchronous save is published before fit returns
            self.logger.close()
            return {"train": last, "eval": last_eval}
        finally:
            self.faults.close()
            self.run.release()          # the output directory is free for the next run
