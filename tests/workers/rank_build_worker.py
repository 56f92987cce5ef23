"""Build one rank of a model far larger than this machine (tests/test_rank_build.py): only that
rank's part is constructed and materialized. Prints one JSON line: the rank's own parameter bytes,
the planner's independent count for its stage, the whole model's parameters, and the process's
resident memory before the build (the runtime) and at its peak."""
import json
import sys


def main(config: str, rank: int, sets):
    import numpy as np
    from moetrain.build import build_model, setup_device
    from moetrain.config import load_config
    from moetrain.testing.solo import SoloComm
    from moetrain.distributed.topology import ParallelContext
    from moetrain.layout import Layout, check_config_layout
    from moetrain.parallel.expert_parallel import parallelize_moe
    from moetrain.planner.dryrun import rss_bytes
    from moetrain.parallel.pipeline import build_pipeline_stage
    from moetrain.parallel.plans import parallelize_model
    from moetrain.planner.arch import Job, count_parameters
    from moetrain.planner.costs import plan_layout

    cfg = load_config(config, sets)
    layout = check_config_layout(cfg)
    pctx = ParallelContext.build(layout.world, rank, layout.dp, layout.tp, layout.pp, layout.ep, layout.etp,
                                 layout.cp)
    planned = plan_layout(Job.of(cfg), Layout.of(cfg), "cpu", layout.world).stages[pctx.pp_rank].memory["weights"]
    setup_device("cpu")
    with SoloComm():
        before = rss_bytes()["VmRSS"]
        model = build_model(cfg, pctx)
        parallelize_model(model, cfg, pctx)
        parallelize_moe(model, cfg.parallel, pctx)
        stage = build_pipeline_stage(model, cfg, pctx) if pctx.pp > 1 else model
        del model
        params = list(stage.get_parameters())
        own = sum(int(np.prod(p.shape)) * p.itemsize for p in params)
        deferred = [p.name for p in params if p.has_init]
    print(json.dumps({"own_bytes": own, "planned_weight_bytes": planned, "whole_params": count_parameters(cfg.model)[0],
                      "rss_before": before, "peak_rss": rss_bytes()["VmHWM"], "deferred_left": deferred,
                      "params": len(params)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
