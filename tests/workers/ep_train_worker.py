"""Worker of tests/test_expert_parallel.py: train one or more runs of the same config in this
process and write every step's record (loss, expert loads, drops, ...) of this rank.

    python tests/workers/ep_train_worker.py OUT_DIR CONFIG RUN [RUN ...]
    RUN = name:key=value,key=value,...      (overrides of CONFIG for that run)

The override `+undersize` is a test-only hook: after every call the dispatch buffers are set to half
of what the routing needs and overflows are not re-run, so rows are lost (from the first call on when
`parallel.moe_capacity_prior` is below the need); the run must stop with the dispatch invariant's
error, which this worker records as the run's last record.

(or `train_runs` from another worker of the same job: tests/workers/ep_layer_worker.py)
Under msrun (one job, several runs: MindSpore starts its communication once per process) or
alone (one process). Writes OUT_DIR/rank_<r>.json = {run name: [step records]}; a record holds
the trainer's step record, this rank's bytes per group kind in that step ("bytes"; PyNative only),
and where the dispatch buffers are managed, their capacities after the step and the calls / re-runs
of the step function so far.
"""
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("GLOG_v", "3")


def main():
    train_runs(sys.argv[1], sys.argv[2], sys.argv[3:])


def train_runs(out_dir, config, runs, contexts=None):
    """Train `runs` in this process; `contexts` {(dp, tp, pp, ep): ParallelContext} already
    initialised by the caller (e.g. the layer worker of the same msrun job) are reused."""
    from moetrain import trainer as trainer_module
    from moetrain.config import load_config
    from moetrain.distributed import comm, topology
    from moetrain.moe.accounting import DispatchInvariantError

    # Runs after the first reuse the device setting and the communicators of an earlier run with
    # the same layout: after init() MindSpore refuses set_device again and a group name twice.
    contexts = {} if contexts is None else contexts
    setup_device = trainer_module.setup_device

    def setup_device_once(device):
        if not contexts:
            setup_device(device)

    def init_once(cfg):
        p = cfg.parallel
        key = (p.data_parallel, p.model_parallel, p.pipeline_stage, p.expert_parallel)
        if key not in contexts:
            contexts[key] = topology.init_parallel(dp=key[0], tp=key[1], pp=key[2], ep=key[3], verbose=False)
        return contexts[key]

    trainer_module._init_parallel, trainer_module.setup_device = init_once, setup_device_once
    results, rank = {}, 0
    for run in runs:
        name, _, overrides = run.partition(":")
        overrides = [o for o in overrides.split(",") if o]
        undersize = "+undersize" in overrides
        cfg = load_config(config, [o for o in overrides if o != "+undersize"]
                          + [f"train.output_dir={os.path.join(out_dir, name)}"])
        cpu_start = time.process_time()
        trainer = trainer_module.Trainer(cfg)
        rank = trainer.rank
        if undersize:
            undersize_capacities(trainer.runner._grad_step.controller)
        records = []
        while trainer.step < trainer.total_steps:
            try:
                with comm.CommLedger() as ledger:
                    record = trainer.train_step()
            except DispatchInvariantError as exc:
                records.append({"error": type(exc).__name__, "message": str(exc), "steps_applied": trainer.step})
                break
            record = {k: (np.asarray(v).tolist() if isinstance(v, np.ndarray) else v) for k, v in record.items()}
            record["bytes"] = {"native": ledger.bytes_by_group(backward=True),
                               "emulated": ledger.bytes_by_group(backward=True, emulated=True)}
            step_fn = trainer.runner._grad_step   # an AdaptiveStep when the dispatch buffers are managed
            if hasattr(step_fn, "controller"):
                record["capacities"] = [{f: getattr(d, f) for f in d.capacity_fields()}
                                        for d in step_fn.controller.dispatchers]
                record["calls"], record["reruns"] = step_fn.calls, step_fn.reruns
            records.append(record)
        trainer.logger.close()
        results[name] = records
        records[-1]["cpu_seconds"] = time.process_time() - cpu_start     # this rank's CPU time for the run
        print(f"rank {rank}: {name} done, {records[-1].get('step_time_s', 0):.2f} s last step, "
              f"{records[-1]['cpu_seconds']:.1f} CPU s", flush=True)
        with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as fh:   # after every run: partial results survive
            json.dump(results, fh)


def undersize_capacities(controller) -> None:
    """The `+undersize` hook: every update sets each capacity to half the need and reports no overflow."""
    from moetrain.moe.capacity import _capacity

    def update(loads):
        for field, need in controller.needed(loads).items():
            controller._set(field, _capacity(np.maximum(1, need // 2)))
        return False

    controller.update = update


if __name__ == "__main__":
    main()
