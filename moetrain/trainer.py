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
import time
from typing import Dict, Optional, Tuple

import numpy as np

from moetrain.config import Config, dump_config
from moetrain.logger import MetricsLogger, print_rank0

# Stats that add up over micro-batches and ranks; every other stat is averaged.
SUMMED_STATS = ("expert_load", "dropped", "routed", "correct")


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


class Trainer:
    def __init__(self, cfg: Config, resume: Optional[str] = None):
        import mindspore as ms
        from mindspore import nn, ops

        from moetrain.checkpoint import manager as ckpt
        from moetrain.data import GlobalBatchSampler, build_datasets
        from moetrain.parallel.data_parallel import OptimizerStep

        self.cfg = cfg
        t = cfg.train
        setup_device(t.device)
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
        self.model = build_model(cfg)
        self.opt_step = OptimizerStep(self.model.trainable_params(), cfg.optimizer, cfg.parallel, self.pctx,
                                      cfg.optimizer.clip_grad_norm, t.jit)
        self.scaler = LossScaler(cfg.precision.loss_scale, cfg.precision.initial_loss_scale,
                                 cfg.precision.scale_window, cfg.precision.scale_factor)
        self.step = 0
        self.n_micro = cfg.num_micro_batches
        self.micro_batch_size = cfg.micro_batch_size

        model = self.model

        def forward(scale, *batch):
            loss, stats = model(*batch)
            return loss * scale, loss, stats

        grad_fn = ms.value_and_grad(forward, None, self.opt_step.params, has_aux=True)

        def grad_step(scale, *batch):
            (_, loss, stats), grads = grad_fn(scale, *batch)
            return loss, stats, grads

        def accumulate(acc, grads):
            return tuple(a + g for a, g in zip(acc, grads))

        def evaluate(*batch):
            return model(*batch)

        wrap = ms.jit if t.jit else (lambda fn: fn)
        self._grad_step, self._accumulate, self._evaluate = wrap(grad_step), wrap(accumulate), wrap(evaluate)

        if resume_path:
            self.load(resume_path)
        self.is_logger = self.rank == 0
        if self.is_logger:
            dump_config(cfg, os.path.join(self.out, "resolved_config.yaml"))
        self.logger = MetricsLogger(self.out, self.total_steps, self.is_logger, cfg.logging.tensorboard,
                                    cfg.logging.progress_bar, cfg.logging.log_interval, self.step)
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
        grads, losses, stats = None, [], []
        for batch in self._micro_batches(step):
            loss, micro_stats, micro_grads = self._grad_step(scale, *(ms.Tensor(b) for b in batch))
            grads = micro_grads if grads is None else self._accumulate(ms.mutable(grads), ms.mutable(micro_grads))
            losses.append(loss)
            stats.append(micro_stats)
        inv_scale = 1.0 / (self.scaler.scale * self.n_micro * self.pctx.dp)
        grad_norm, finite = self.opt_step(grads, lr, step + 1, inv_scale)
        record = self._reduce_stats(losses, stats)
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
        return record

    def _reduce_stats(self, losses, stats) -> Dict:
        """Average (or sum) micro-batch values, then over data-parallel ranks."""
        values = {"loss": np.mean([float(l) for l in losses])}
        for key in stats[0]:
            arrays = [s[key].asnumpy().astype(np.float64) for s in stats]
            values[key] = np.sum(arrays, 0) if key in SUMMED_STATS else np.mean(arrays, 0)
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
        starts = starts[self.pctx.dp_rank::self.pctx.dp]  # evaluation shared among dp ranks
        loss_sum = correct = count = 0.0
        for start in starts:
            indices = np.arange(start, min(n, start + batch_size))
            loss, stats = self._evaluate(*(ms.Tensor(b) for b in fetch(self.eval_set, indices)))
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
    def _optimizer_file(self) -> str:
        """ZeRO shards differ per rank; otherwise every rank holds the same optimizer state."""
        return f"optimizer-rank{self.rank:05d}.safetensors" if self.opt_step.level else "optimizer.safetensors"

    def save(self) -> str:
        """All ranks write into one temporary folder; rank 0 publishes it after a barrier."""
        from moetrain.checkpoint import manager as ckpt
        from moetrain.parallel import comm

        distributed = self.pctx.world_size > 1
        writer = ckpt.CheckpointWriter(self.ckpt_root, self.step, suffix="job" if distributed else None,
                                       create=self.rank == 0)
        if distributed:
            comm.barrier()
        if self.rank == 0:
            writer.tensors("model.safetensors", ckpt.params_to_numpy(self.model.get_parameters()))
            writer.json("trainer_state.json", {
                "step": self.step, "loss_scale": self.scaler.state(), "seed": self.cfg.train.seed,
                "consumed_samples": self.step * self.cfg.train.global_batch_size,
                "epoch": self.sampler.epoch_of(self.step), "world_size": self.pctx.world_size,
                "optimizer_shard": self.opt_step.level})
            writer.copy("config.yaml", os.path.join(self.out, "resolved_config.yaml"))
        if self.rank == 0 or self.opt_step.level:
            writer.tensors(self._optimizer_file(), ckpt.params_to_numpy(self.opt_step.state_parameters()))
        path = os.path.join(self.ckpt_root, writer.name)
        if distributed:
            comm.barrier()
        if self.rank == 0:
            path = writer.commit()
            ckpt.prune_checkpoints(self.ckpt_root, self.cfg.checkpoint.keep_max)
        if distributed:
            comm.barrier()
        return path

    def load(self, path: str) -> None:
        import yaml

        from moetrain.checkpoint import manager as ckpt

        ckpt.verify_checkpoint(path)
        with open(os.path.join(path, "config.yaml")) as fh:
            saved_model = yaml.safe_load(fh).get("model", {})
        current = self.cfg.to_dict()["model"]
        diff = sorted(k for k in set(saved_model) | set(current)
                      if k != "compute_dtype" and saved_model.get(k) != current.get(k))
        if diff:
            raise ckpt.CheckpointError(
                f"checkpoint {path} was saved with another model config; mismatching keys: "
                + ", ".join(f"model.{k} (checkpoint {saved_model.get(k)!r}, config {current.get(k)!r})" for k in diff))
        ckpt.assign_from_numpy(self.model.get_parameters(), ckpt.read_tensors(path, "model.safetensors"),
                               f"{path}/model.safetensors")
        state = ckpt.read_json(path, "trainer_state.json")
        if (state.get("world_size", 1), state.get("optimizer_shard", 0)) != (self.pctx.world_size, self.opt_step.level) \
                and self.opt_step.level + state.get("optimizer_shard", 0) > 0:
            raise ckpt.CheckpointError(
                f"{path} holds ZeRO-{state.get('optimizer_shard', 0)} optimizer shards of {state.get('world_size', 1)} "
                f"ranks; resuming with ZeRO-{self.opt_step.level} on {self.pctx.world_size} ranks needs resharding, "
                f"which is not available yet: resume with the saved layout")
        optimizer_file = self._optimizer_file()
        ckpt.assign_from_numpy(self.opt_step.state_parameters(), ckpt.read_tensors(path, optimizer_file),
                               f"{path}/{optimizer_file}")
        self.step = state["step"]
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
            last = self.train_step()
            self.logger.log(last)
            if eval_interval and self.step % eval_interval == 0 and self.step < end:
                last_eval = self.evaluate()
                self.logger.log(last_eval)
            if save_steps and self.step % save_steps == 0:
                self.save()
        if self.eval_set is not None:
            last_eval = self.evaluate()
            self.logger.log(last_eval)
        if cfg.checkpoint.save_at_end and not (save_steps and self.step % save_steps == 0):
            self.save()
        self.logger.close()
        return {"train": last, "eval": last_eval}
