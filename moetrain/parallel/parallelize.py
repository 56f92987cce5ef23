"""`parallelize(model, cfg, pctx)`: the one place a built single-device model becomes this rank's
part of the parallel job, with its optimizer step and step runner.

    tensor + sequence parallel, recompute   plans.parallelize_model (the family's plan)
    expert parallel                         expert_parallel.parallelize_moe (E/ep experts, dispatcher)
    context parallel                        context_parallel.parallelize_context (attention over the
                                            split sequence) and its runner (each rank's tokens)
    pipeline parallel                       pipeline.Pipeline (cut to this rank's stage)
    data parallel + ZeRO                    data_parallel.OptimizerStep (flat buffers, reductions)
    step runner                             runner.MicroBatchRunner or the Pipeline: the same interface
"""
from __future__ import annotations

from dataclasses import dataclass

from moetrain.modeling import stat_specs_of
from moetrain.parallel.context_parallel import ContextParallelRunner, parallelize_context
from moetrain.parallel.data_parallel import OptimizerStep
from moetrain.parallel.expert_parallel import parallelize_moe
from moetrain.parallel.pipeline import Pipeline, allow_slow_neighbours
from moetrain.parallel.plans import parallelize_model
from moetrain.parallel.runner import MicroBatchRunner
from moetrain.param_init import materialize


@dataclass
class ParallelModel:
    model: object                    # this rank's cells (the whole model, or its pipeline stage)
    opt_step: OptimizerStep
    runner: object                   # MicroBatchRunner or Pipeline
    specs: dict                      # the whole model's stat specs (how each stat reduces)
    forward_communicates_over_dp: bool   # the forward runs dp collectives (ep, global aux loss)


def parallelize(model, cfg, pctx, seq_length: int = 0, rebuild=None) -> ParallelModel:
    """`model`: this rank's part as `moetrain.build.build_model(cfg, pctx)` constructs it (deferred
    parameters; with pp > 1 only the layers of the stage's first chunk), or a whole model built
    and materialized. Returns this rank's part of it, the optimizer step over its parameters and
    the step runner. The slicing (tp, ep, etp) is recorded first, the pipeline cut made, and only
    then are the deferred parameters given their values: each exactly its slice of the
    one-process model (`moetrain.param_init`). `seq_length`: tokens per sample (the pipeline's
    activation shape). `rebuild(c)`: model chunk c of this stage, for the further chunks of
    interleaved 1F1B and ZB-V."""
    p = cfg.parallel
    specs = stat_specs_of(model)
    parallelize_model(model, cfg, pctx)
    moe_layers = parallelize_moe(model, p, pctx)
    parallelize_context(model, cfg, pctx)
    over_dp = moe_layers > 0 and (pctx.ep > 1 or p.moe_aux_loss_scope == "global")
    optimizer = (cfg.optimizer, p, pctx, cfg.optimizer.clip_grad_norm, cfg.train.jit)
    if pctx.pp > 1:
        allow_slow_neighbours()
        def more_models(chunk):
            another = rebuild(chunk)
            parallelize_model(another, cfg, pctx)
            parallelize_moe(another, p, pctx)
            parallelize_context(another, cfg, pctx)
            return another

        # context parallel: the stages pass this rank's 1/cp of each sequence
        pipeline = Pipeline(model, specs, cfg, pctx, (seq_length or cfg.model.seq_length) // pctx.cp,
                            more_models if rebuild is not None else None)   # cuts, then materializes
        opt_step = OptimizerStep(pipeline.stage.trainable_params(), *optimizer)
        runner = pipeline.bind(opt_step)
        if pctx.cp > 1:
            runner = ContextParallelRunner(runner, pctx, cfg.train.global_batch_size * (seq_length or cfg.model.seq_length),
                                           getattr(model, "label_lookahead", 0))
        return ParallelModel(pipeline.stage, opt_step, runner, specs, over_dp)
    materialize([model], cfg.train.seed)
    opt_step = OptimizerStep(model.trainable_params(), *optimizer)
    runner = MicroBatchRunner(model, opt_step, specs, cfg.train.jit, pctx, p.moe_capacity, p.moe_capacity_prior)
    if pctx.cp > 1:
        runner = ContextParallelRunner(runner, pctx, cfg.train.global_batch_size * (seq_length or cfg.model.seq_length),
                                       getattr(model, "label_lookahead", 0))
    return ParallelModel(model, opt_step, runner, specs, over_dp)
