"""Worker of tests/test_parallel_3d.py, test_pipeline.py and test_families_parallel.py: train one or
more runs with the real Trainer (`fit`: metrics.jsonl, evaluation) in this process, one after another.

    python tests/workers/train_runs_worker.py OUT_DIR RUN [RUN ...]
    RUN = NAME:CONFIG:key=value,key=value,...      (CONFIG relative to the repository root, or absolute;
                                                    a value may be a list: key=[1,2])

`resume=CHECKPOINT_DIR` among the overrides resumes that run from a checkpoint (`--resume DIR`).

An override whose key starts with MOETRAIN_ sets that environment variable for the run instead
(e.g. MOETRAIN_CONTRACT_TARGET=GPU: the contract backend's target is read per op, so runs of one
job can take different native paths); the previous value is restored after the run. The override
`+record_primitives` records the primitives the native path calls during `fit` (tests/workers/
comm_recorder.py; PyNative, so with train.jit=false) beside the comm ledger's totals: the rank file
gets `primitive_calls` and `ledger`.

Works under msrun (several runs in one job: MindSpore starts its communication once per process,
so runs after the first reuse the device setting and the communicators of an earlier run with the
same layout) and alone (one process). Each run trains into OUT_DIR/NAME (rank 0 writes
metrics.jsonl); every rank writes OUT_DIR/NAME/rank_<r>.json (coordinates, pipeline facts, the
shard spec of every parameter, its last step record) and OUT_DIR/NAME/rank_<r>.npz (its parameters
after training).
"""
import contextlib
import json
import os
import re
import sys
import time

import numpy as np

os.environ.setdefault("GLOG_v", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def plain(value):
    return np.asarray(value).tolist() if isinstance(value, np.ndarray) else value


def reuse_parallel_context(trainer_module):
    """Let several Trainers run one after another in this process (also under msrun): MindSpore starts
    its device and communication once per process, so later runs reuse the device setting and the
    communicators of an earlier run with the same members."""
    from moetrain.distributed import topology
    from moetrain.layout import check_config_layout

    contexts = {}
    setup_device = trainer_module.setup_device

    def setup_device_once(device):
        if not contexts:
            setup_device(device)

    created = set()   # communicators are named after their members: a later layout reuses them

    def init_once(cfg):
        check_config_layout(cfg, world=topology.launched_world_size())
        p = cfg.parallel
        key = (p.data_parallel, p.model_parallel, p.pipeline_stage, p.expert_parallel, p.expert_tensor_parallel,
               p.context_parallel)
        if key in contexts:
            return contexts[key]
        if not contexts:
            ctx = topology.init_parallel(dp=key[0], tp=key[1], pp=key[2], ep=key[3], etp=key[4], cp=key[5],
                                         verbose=False)
        else:
            from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank

            ctx = topology.ParallelContext.build(get_group_size(), get_rank(), *key).with_world_name(
                GlobalComm.WORLD_COMM_GROUP)
            from moetrain.testing import contract

            for name, ranks in ctx.communicators_to_create():
                if name not in created:
                    create_group(name, list(ranks))
                contract.register_group(name, ranks)
        created.update(name for name, _ in ctx.communicators_to_create())
        contexts[key] = ctx
        return ctx

    trainer_module._init_parallel, trainer_module.setup_device = init_once, setup_device_once


_RECORDER = []


@contextlib.contextmanager
def recorded(wanted: bool):
    """The primitive calls made inside the block (comm_recorder, installed on first use), or nothing."""
    if not wanted:
        yield []
        return
    if not _RECORDER:
        from comm_recorder import Recorder

        _RECORDER.append(Recorder())
        _RECORDER[0].install()
    with _RECORDER[0].recording() as calls:
        yield calls


def _capacity_record(runner):
    """The adaptive capacities' calls, re-runs (one per overflow) and sets in force / largest, or None
    when nothing sizes them (the bound)."""
    step = getattr(runner, "_grad_step", None)
    if getattr(step, "controller", None) is not None:
        calls, reruns = step.calls, step.reruns
    elif getattr(runner, "capacities", None) is not None:      # a pipeline's per-step capacities
        calls, reruns = runner.capacities.steps, runner.capacities.reruns
    else:
        return None
    return {"calls": calls, "reruns": reruns, "in_force": runner.capacities_in_force(),
            "largest": runner.capacities_largest()}


def main():
    out_dir, runs = sys.argv[1], sys.argv[2:]
    from moetrain import trainer as trainer_module
    from moetrain.config import load_config
    from moetrain.distributed import comm
    from moetrain.testing import contract
    from moetrain.distributed.sharding import shard_spec
    from moetrain.parallel.tensor_parallel import is_sequence_parallel

    reuse_parallel_context(trainer_module)
    for run in runs:
        name, config, overrides = run.split(":", 2)
        run_dir = os.path.join(out_dir, name)
        overrides = [o for o in re.split(r",(?![^\[]*\])", overrides) if o]     # not the commas of a [list]
        env = dict(o.split("=", 1) for o in overrides if o.startswith("MOETRAIN_"))
        record_calls = "+record_primitives" in overrides
        resume = next((o[len("resume="):] for o in overrides if o.startswith("resume=")), None)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        cfg = load_config(os.path.join(ROOT, config),
                          [o for o in overrides if not o.startswith(("MOETRAIN_", "+", "resume="))]
                          + [f"train.output_dir={run_dir}"])
        # each run builds its own collective cells (comm caches them per call signature): a run's
        # contract_primitives are what it constructed, not what an earlier run of the job left cached
        comm.clear_op_cache()
        start, cpu_start, built = time.perf_counter(), time.process_time(), dict(contract.CONSTRUCTED)
        trainer = trainer_module.Trainer(cfg, resume=resume)
        with recorded(record_calls) as calls, comm.CommLedger() as ledger:
            result = trainer.fit()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        traffic = {"primitive_calls": [c for c in calls if c["source"] == "contract"],
                   "ledger": {"native": ledger.bytes_by_group(backward=True),
                              "emulated": ledger.bytes_by_group(backward=True, emulated=True)}} if record_calls else {}
        backend = {"comm_backend": comm.backend_name(), "native_target": comm.native_target(),
                   "contract_primitives": {op: count - built.get(op, 0) for op, count in contract.CONSTRUCTED.items()
                                           if count > built.get(op, 0)}}
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
        pctx, pipeline, model = trainer.pctx, (trainer.runner if trainer.pctx.pp > 1 else None), trainer.model
        params = list(model.get_parameters())    # expert_bias too (moved by the balancing step)
        record = {
            "rank": pctx.rank, "dp_rank": pctx.dp_rank, "tp_rank": pctx.tp_rank, "pp_rank": pctx.pp_rank,
            "ep_rank": pctx.ep_rank, "etp_rank": pctx.etp_rank, "cp_rank": pctx.cp_rank,
            "num_micro_batches": trainer.n_micro,
            "context_parallel_layers": sum(getattr(c, "context_parallel", None) is not None
                                           for _, c in model.cells_and_names()),
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,      # this rank's CPU time for the run (compiles included)
            "shards": {p.name: [list(shard_spec(p).global_shape), shard_spec(p).axis, shard_spec(p).index,
                                shard_spec(p).count, shard_spec(p).group_kind] for p in params},
            "shard_extra": {p.name: [list(e) for e in shard_spec(p).extra] for p in params if shard_spec(p).extra},
            "shapes": {p.name: list(p.shape) for p in params},
            "summed_over_tp": [p.name for p in params if is_sequence_parallel(p)],
            "zero_level": trainer.opt_step.level,
            "optimizer_state_bytes": trainer.opt_step.optimizer_state_bytes(),
            "param_sizes": [int(p.size) for p in trainer.opt_step.params],
            "gradient_bytes_held": getattr(trainer.runner, "grad_bytes_held", None),
            # adaptive dispatch buffers (moetrain/moe/capacity.py AdaptiveStep): re-run calls, graphs compiled
            "dispatch_reruns": getattr(getattr(trainer.runner, "_grad_step", None), "reruns", None),
            "dispatch_graphs": len(getattr(getattr(trainer.runner, "_grad_step", None), "compiled", ())) or None,
            "dp": pctx.dp,
            # the adaptive dispatch capacities (moetrain/moe/capacity.py): calls, overflow re-runs, the sets
            "capacity": _capacity_record(trainer.runner),
            "train": {k: plain(v) for k, v in result["train"].items()},
            "eval": result["eval"],
            **backend,
            **traffic,
        }
        if pipeline is not None:
            record.update(peak_in_flight=pipeline.peak_in_flight, step_bytes_sent=pipeline.step_bytes_sent,
                          stage_layers=([list(r) for r in model.layer_ranges] if hasattr(model, "layer_ranges")
                                        else [model.start, model.end]),      # model chunks: every chunk's
                          step_wait_s=pipeline.step_wait_s, step_seconds=pipeline.step_seconds)
        with open(os.path.join(run_dir, f"rank_{pctx.rank}.json"), "w") as fh:
            json.dump(record, fh)
        np.savez(os.path.join(run_dir, f"rank_{pctx.rank}.npz"), **{p.name: p.asnumpy() for p in params})
        if pctx.rank == 0:
            print(f"{name}: {seconds:.1f} s, {cpu_seconds:.1f} CPU s", flush=True)


if __name__ == "__main__":
    main()
