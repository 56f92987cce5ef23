"""Worker of tests/test_parallel_3d.py and tests/test_pipeline.py: train one or more runs with the
real Trainer (`fit`: metrics.jsonl, evaluation) in this process, one after another.

    python tests/workers/train_runs_worker.py OUT_DIR RUN [RUN ...]
    RUN = NAME:CONFIG:key=value,key=value,...      (CONFIG relative to the repository root)

Works under msrun (several runs in one job: MindSpore starts its communication once per process,
so runs after the first reuse the device setting and the communicators of an earlier run with the
same layout) and alone (one process). Each run trains into OUT_DIR/NAME (rank 0 writes
metrics.jsonl); every rank writes OUT_DIR/NAME/rank_<r>.json (coordinates, pipeline facts, the
shard spec of every parameter, its last step record) and OUT_DIR/NAME/rank_<r>.npz (its parameters
after training).
"""
import json
import os
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
    from moetrain.dist import topology
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
        key = (p.data_parallel, p.model_parallel, p.pipeline_stage, p.expert_parallel)
        if key in contexts:
            return contexts[key]
        if not contexts:
            ctx = topology.init_parallel(dp=key[0], tp=key[1], pp=key[2], ep=key[3], verbose=False)
        else:
            from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank

            ctx = topology.ParallelContext.build(get_group_size(), get_rank(), *key).with_world_name(
                GlobalComm.WORLD_COMM_GROUP)
            for name, ranks in ctx.communicators_to_create():
                if name not in created:
                    create_group(name, list(ranks))
        created.update(name for name, _ in ctx.communicators_to_create())
        contexts[key] = ctx
        return ctx

    trainer_module._init_parallel, trainer_module.setup_device = init_once, setup_device_once


def main():
    out_dir, runs = sys.argv[1], sys.argv[2:]
    from moetrain import trainer as trainer_module
    from moetrain.config import load_config
    from moetrain.dist.sharding import shard_spec
    from moetrain.parallel.tensor_parallel import is_sequence_parallel

    reuse_parallel_context(trainer_module)
    for run in runs:
        name, config, overrides = run.split(":", 2)
        run_dir = os.path.join(out_dir, name)
        cfg = load_config(os.path.join(ROOT, config),
                          [o for o in overrides.split(",") if o] + [f"train.output_dir={run_dir}"])
        start = time.perf_counter()
        trainer = trainer_module.Trainer(cfg)
        result = trainer.fit()
        seconds = time.perf_counter() - start
        pctx, pipeline, model = trainer.pctx, (trainer.runner if trainer.pctx.pp > 1 else None), trainer.model
        params = list(model.get_parameters())    # expert_bias too (moved by the balancing step)
        record = {
            "rank": pctx.rank, "dp_rank": pctx.dp_rank, "tp_rank": pctx.tp_rank, "pp_rank": pctx.pp_rank,
            "ep_rank": pctx.ep_rank, "num_micro_batches": trainer.n_micro, "seconds": seconds,
            "shards": {p.name: [list(shard_spec(p).global_shape), shard_spec(p).axis, shard_spec(p).index,
                                shard_spec(p).count, shard_spec(p).group_kind] for p in params},
            "shapes": {p.name: list(p.shape) for p in params},
            "summed_over_tp": [p.name for p in params if is_sequence_parallel(p)],
            "zero_level": trainer.opt_step.level,
            "optimizer_state_bytes": trainer.opt_step.optimizer_state_bytes(),
            "train": {k: plain(v) for k, v in result["train"].items()},
            "eval": result["eval"],
        }
        if pipeline is not None:
            record.update(peak_in_flight=pipeline.peak_in_flight, step_bytes_sent=pipeline.step_bytes_sent,
                          stage_layers=[model.start, model.end])
        with open(os.path.join(run_dir, f"rank_{pctx.rank}.json"), "w") as fh:
            json.dump(record, fh)
        np.savez(os.path.join(run_dir, f"rank_{pctx.rank}.npz"), **{p.name: p.asnumpy() for p in params})
        if pctx.rank == 0:
            print(f"{name}: {seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
