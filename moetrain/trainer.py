"""One trainer for every model.

One optimizer step:
    for each micro-batch of this data-parallel rank:      (gradient accumulation)
        loss, stats, grads = grad_step(batch)              ms.jit: forward + value_and_grad
        accumulate grads
    grads = grad_sync(grads)                               data-parallel reduction (identity on 1 rank)
    grads, grad_norm, finite = prepare(grads)              unscale, overflow check, clip (ms.jit)
    if finite: optimizer(grads, lr, step)                  ms.jit; else the step is skipped (loss scaling)
    model.update_expert_bias(load)                         aux-loss-free balancing, outside the gradient
then metrics (rank 0), evaluation and checkpoints at their intervals.
"""
from __future__ import annotations

import math
import os
import resource
import time
from typing import Dict, Optional, Tuple

import numpy as np

from moetrain.config import Config, dump_config
from moetrain.logger import MetricsLogger, print_rank0

# Stats that add up over micro-batches and ranks; every other stat is averaged.
SUMMED_STATS = ("expert_load", "dropped", "routed", "expert_rows", "correct")


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


def setup_device(device: str) -> None:
    import mindspore as ms

    ms.set_context(mode=ms.PYNATIVE_MODE)
    target = {"cpu": "CPU", "ascend": "Ascend", "gpu": "GPU"}[device]
    try:
        ms.set_device(target)
    except RuntimeError:  # the runtime already started (an earlier trainer in this process)
        if ms.get_context("device_target") != target:
            raise


def build_model(cfg: Config):
    from moetrain.registry import get_model

    if hasattr(cfg.model, "compute_dtype"):
        cfg.model.compute_dtype = cfg.precision.compute_dtype
    return get_model(cfg.model.name).cls(cfg.model)


def _init_parallel(cfg: Config):
    from moetrain.parallel.topology import init_parallel

    p = cfg.parallel
    return init_parallel(dp=p.data_parallel, tp=p.model_parallel, pp=p.pipeline_stage, ep=p.expert_parallel)


def mfu_terms(cfg: Config, seq_length: int, world_size: int) -> Optional[Tuple[float, float]]:
    """`(model FLOPs per token, peak FLOP/s of the whole job)` for the `mfu` metric: FLOPs from
    `moetrain.plan.flops_per_token` (6 x active matmul params + attention), peak from the device
    profile (`moetrain.devices`; ranks of a shared CPU host share its peak). None when the planner
    does not model this model (e.g. the MNIST MLP) or device."""
    from moetrain.devices import get_device
    from moetrain.plan import LayoutError, flops_per_token

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
            import mindspore as ms
            from mindspore.profiler import ProfilerActivity

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
    """`parallel.mode: auto`: the layout `moetrain.plan.choose_layout` picks for the launched world
    size (dp/tp/pp/ep, ZeRO level, recompute, micro-batches), applied to a copy of `cfg` and
    validated again. Returns `(cfg, search)`; `search` is None for `mode: manual`."""
    if cfg.parallel.mode != "auto":
        return cfg, None
    import copy

    from moetrain.config import _validate as validate
    from moetrain.parallel.topology import launched_world_size
    from moetrain.plan import Arch, LayoutError, apply_layout, choose_layout

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
    def __init__(self, cfg: Config, resume: Optional[str] = None):
        import mindspore as ms
        from mindspore import nn, ops

        from moetrain.checkpoint import manager as ckpt
        from moetrain.moe.capacity import adaptive_steps
        from moetrain.data import GlobalBatchSampler, build_datasets
        from moetrain.parallel.data_parallel import OptimizerStep, accumulate
        from moetrain.parallel.expert_parallel import parallelize_moe
        from moetrain.parallel.plans import parallelize_model

        cfg, self.layout_search = resolve_auto_layout(cfg)
        self.cfg = cfg
        t = cfg.train
        setup_device(t.device)
        if cfg.parallel.pipeline_stage > 1:   # before any collective runs
            from moetrain.parallel.pipeline import allow_slow_neighbours

            allow_slow_neighbours()
        self.pctx = _init_parallel(cfg)
        self.rank = self.pctx.rank
        self.out = t.output_dir
        self.ckpt_root = os.path.join(self.out, "checkpoints")
        resume_path = ckpt.resolve_resume_path(resume, self.out) if resume is not None else None
        os.makedirs(self.ckpt_root, exist_ok=True)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)

        self.train_set, self.eval_set = build_datasets(cfg)
        self.sampler = GlobalBatchSampler(len(self.train_set), t.global_batch_size, t.seed, cfg.data.shuffle)
        self.total_steps = t.steps or math.ceil(t.epochs * self.sampler.steps_per_epoch)
        self.tokens_per_sample = getattr(self.train_set, "tokens_per_sample", 0)

        ms.set_seed(t.seed)
        # every rank builds the whole model (same seed, same weights), then keeps its tp slices
        self.model = parallelize_model(build_model(cfg), cfg, self.pctx)
        # MoE layers: keep this rank's E/ep experts, expert-parallel dispatcher, aux-loss scope
        self.forward_communicates_over_dp = parallelize_moe(self.model, cfg.parallel, self.pctx) > 0 and (
            self.pctx.ep > 1 or cfg.parallel.moe_aux_loss_scope == "global")
        if self.pctx.pp > 1:   # pipeline parallel: keep this rank's stage; the other layers are freed
            from moetrain.parallel.pipeline import build_pipeline_stage

            self.model = build_pipeline_stage(self.model, cfg, self.pctx)
        self.opt_step = OptimizerStep(self.model.trainable_params(), cfg.optimizer, cfg.parallel, self.pctx,
                                      cfg.optimizer.clip_grad_norm, t.jit)
        self.pipeline = None
        if self.pctx.pp > 1:   # runs the micro-batches through the stages (1F1B / GPipe)
            from moetrain.parallel.pipeline import Pipeline

            self.pipeline = Pipeline(self.model, self.opt_step, cfg, self.pctx, self.tokens_per_sample)
        self.scaler = LossScaler(cfg.precision.loss_scale, cfg.precision.initial_loss_scale,
                                 cfg.precision.scale_window, cfg.precision.scale_factor)
        self.step = 0
        self.n_micro = cfg.num_micro_batches
        self.micro_batch_size = cfg.micro_batch_size

        model, opt_step = self.model, self.opt_step
        # a bound method, not the object: once opt_step's own jitted methods have run, MindSpore 2.10
        # resolves the object as a function when a graph using it is compiled again (measured)
        flatten = opt_step.flatten

        def forward(scale, *batch):
            loss, stats = model(*batch)
            return loss * scale, loss, stats

        grad_fn = ms.value_and_grad(forward, None, opt_step.params, has_aux=True)

        # Jitted functions return tuples, never dicts: a dict output becomes Python-executed graph
        # nodes whose side effects make MindSpore 2.10's compile time exponential in depth.
        def grad_step(scale, *batch):
            (_, loss, stats), grads = grad_fn(scale, *batch)
            return loss, tuple(stats.keys()), tuple(stats.values()), flatten(grads)

        def evaluate(*batch):
            loss, stats = model(*batch)
            return loss, tuple(stats.keys()), tuple(stats.values())

        wrap = ms.jit if t.jit else (lambda fn: fn)
        # dropless MoE dispatch buffers sized from the routing counts, re-run on overflow
        self._grad_step, self._evaluate = adaptive_steps(self.model, self.pctx, wrap, grad_step, evaluate)
        self._accumulate = wrap(accumulate)

        if resume_path:
            self.load(resume_path)
        self.is_logger = self.rank == 0
        if self.is_logger:
            dump_config(cfg, os.path.join(self.out, "resolved_config.yaml"))
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
                    + (f"; resumed from {resume_path} at step {self.step}" if resume_path else ""))

    # ------------------------------------------------------------------------------------------
    def _micro_batches(self, step: int):
        from moetrain.data import fetch

        indices = self.sampler.rank_batch(step, self.pctx.dp_rank, self.pctx.dp)
        for m in range(self.n_micro):
            yield fetch(self.train_set, indices[m * self.micro_batch_size:(m + 1) * self.micro_batch_size])

    def train_step(self) -> Dict:
        """One optimizer step; returns the step's record (global-batch loss and stats)."""
        import mindspore as ms

        step = self.step
        ms.set_seed(self.cfg.train.seed + step)  # re-seed per step: exact resume of random ops
        lr = self.lr_at(step)
        scale = ms.Tensor(self.scaler.scale, ms.float32)
        start = time.perf_counter()
        if self.pipeline is not None:   # pipeline parallel: the schedule runs every micro-batch
            batches = [tuple(ms.Tensor(b) for b in batch) for batch in self._micro_batches(step)]
            grads, values = self.pipeline.train_step(batches, scale, SUMMED_STATS)
        else:
            grads, losses, stats = None, [], []
            for batch in self._micro_batches(step):
                loss, keys, values, micro_grads = self._grad_step(scale, *(ms.Tensor(b) for b in batch))
                grads = micro_grads if grads is None else self._accumulate(ms.mutable(grads), ms.mutable(micro_grads))
                losses.append(loss)
                stats.append(dict(zip(keys, values)))
        inv_scale = 1.0 / (self.scaler.scale * self.n_micro * self.pctx.dp)
        grad_norm, finite = self.opt_step(grads, lr, step + 1, inv_scale)
        record = self._reduce_stats(losses, stats) if self.pipeline is None else self._reduce_over_dp(values)
        if finite and hasattr(self.model, "update_expert_bias") and "expert_load" in record:
            self.model.update_expert_bias(np.asarray(record["expert_load"]))
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

    def _reduce_stats(self, losses, stats) -> Dict:
        """Average (or sum) micro-batch values, then over data-parallel ranks."""
        values = {"loss": np.mean([float(l) for l in losses])}
        for key in stats[0]:
            arrays = [s[key].asnumpy().astype(np.float64) for s in stats]
            values[key] = np.sum(arrays, 0) if key in SUMMED_STATS else np.mean(arrays, 0)
        return self._reduce_over_dp(values)

    def _reduce_over_dp(self, values) -> Dict:
        """Sum (SUMMED_STATS) or average this rank's step values over the data-parallel ranks."""
        if self.pctx.dp > 1:
            from moetrain.parallel.data_parallel import reduce_host_values

            values = reduce_host_values(values, self.pctx, summed=SUMMED_STATS)
        if "dropped" in values and "routed" in values:
            values["drop_rate"] = float(values["dropped"]) / max(1.0, float(values["routed"]))
        return {k: (float(v) if np.ndim(v) == 0 else v) for k, v in values.items()}

    def lr_at(self, step: int) -> float:
        from moetrain.optim import lr_at

        return lr_at(step, self.cfg.optimizer.lr, self.cfg.lr_schedule, self.total_steps)

    # ------------------------------------------------------------------------------------------
    def evaluate(self) -> Dict:
        import mindspore as ms

        from moetrain.data import fetch

        if self.eval_set is None:
            return {}
        self.model.set_train(False)
        batch_size = self.cfg.train.eval_batch_size or self.micro_batch_size
        n = len(self.eval_set)
        starts = list(range(0, n, batch_size))
        if self.cfg.train.eval_max_batches:
            starts = starts[:self.cfg.train.eval_max_batches]
        if self.forward_communicates_over_dp:   # ep / global aux loss: equal batch shapes and counts on all dp ranks
            starts = [s for s in starts if s + batch_size <= n]
            starts = starts[:len(starts) - len(starts) % self.pctx.dp]
        starts = starts[self.pctx.dp_rank::self.pctx.dp]  # evaluation shared among dp ranks
        loss_sum = correct = count = 0.0
        for start in starts:
            indices = np.arange(start, min(n, start + batch_size))
            batch = tuple(ms.Tensor(b) for b in fetch(self.eval_set, indices))
            if self.pipeline is not None:
                loss, stats = self.pipeline.evaluate_batch(batch), {}
            else:
                loss, keys, values = self._evaluate(*batch)
                stats = dict(zip(keys, values))
            loss_sum += float(loss) * len(indices)
            count += len(indices)
            if "correct" in stats:
                correct += float(stats["correct"])
        self.model.set_train(True)
        totals = {"loss_sum": loss_sum, "correct": correct, "count": count}
        if self.pctx.dp > 1:
            from moetrain.parallel.data_parallel import reduce_host_values

            totals = reduce_host_values(totals, self.pctx, summed=tuple(totals))
        record = {"step": self.step, "eval_loss": totals["loss_sum"] / max(1.0, totals["count"])}
        if hasattr(self.eval_set, "labels"):
            record["eval_accuracy"] = totals["correct"] / max(1.0, totals["count"])
        return record

    # ------------------------------------------------------------------------------------------
    def _checkpoint_tensors(self):
        from moetrain.checkpoint import distributed

        return distributed.local_tensors(self.model, self.opt_step, self.pctx)

    def save(self) -> str:
        """Every rank writes the shards it alone holds; rank 0 adds metadata.json and publishes the
        folder (see `moetrain.checkpoint.distributed`). Returns the checkpoint's path."""
        from moetrain.checkpoint import distributed

        if getattr(self, "_checkpointer", None) is None:
            self._checkpointer = distributed.ShardedCheckpointer(self.ckpt_root, self.pctx, self.cfg.checkpoint.keep_max,
                                                                 self.cfg.checkpoint.async_save)
        t = self.cfg.train
        metadata = {
            "format": distributed.FORMAT, "step": self.step,
            "layout": distributed.layout_of(self.pctx, self.opt_step.level),
            "trainer_state": {"step": self.step, "loss_scale": self.scaler.state(), "seed": t.seed,
                              "global_batch_size": t.global_batch_size,
                              "consumed_samples": self.step * t.global_batch_size,
                              "epoch": self.sampler.epoch_of(self.step)},
            "config": self.cfg.to_dict()}
        return self._checkpointer.save(self.step, self._checkpoint_tensors(), metadata,
                                       os.path.join(self.out, "resolved_config.yaml"))

    def wait_for_checkpoint(self) -> None:
        """Finish a pending asynchronous save (`checkpoint.async_save`) and raise its error, if any."""
        if getattr(self, "_checkpointer", None) is not None:
            self._checkpointer.wait()

    def load(self, path: str) -> None:
        """Resume from `path`, saved on any layout: each tensor is reassembled and re-sliced for this rank."""
        import yaml

        from moetrain.checkpoint import distributed
        from moetrain.checkpoint.manager import CheckpointError

        reader = distributed.CheckpointReader(path)
        with open(os.path.join(path, "config.yaml")) as fh:
            saved_model = (yaml.safe_load(fh) or {}).get("model", {})
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

    # ------------------------------------------------------------------------------------------
    def fit(self) -> Dict:
        """Train to `total_steps`; returns the last train and eval records."""
        cfg = self.cfg
        last, last_eval = {}, {}
        save_steps, eval_interval = cfg.checkpoint.save_steps, cfg.train.eval_interval
        end = self.total_steps
        if cfg.train.stop_after:
            end = min(end, self.step + cfg.train.stop_after)
        while self.step < end:
            self.profiler_window.before_step(self.step + 1)
            last = self.train_step()
            self.profiler_window.after_step(self.step)
            self.logger.log(last)
            if eval_interval and self.step % eval_interval == 0 and self.step < end:
                last_eval = self.evaluate()
                self.logger.log(last_eval)
            if save_steps and self.step % save_steps == 0:
                self.save()
        self.profiler_window.close()   # a window past the last step ends here
        if self.eval_set is not None:
            last_eval = self.evaluate()
            self.logger.log(last_eval)
        if cfg.checkpoint.save_at_end and not (save_steps and self.step % save_steps == 0):
            self.save()
        self.wait_for_checkpoint()   # an asynchronous save is published before fit returns
        self.logger.close()
        return {"train": last, "eval": last_eval}
