"""Worker of tests/test_pipeline.py: train from a config under msrun; every rank writes
rank_<r>.json (its coordinates, activations held in flight, bytes sent to its neighbours, step
times) and rank_<r>.npz (its stage's parameters after training).

    python pipeline_worker.py OUT_DIR CONFIG [key=value ...]
"""
import json
import os
import sys

os.environ.setdefault("GLOG_v", "3")


def main():
    out_dir, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    import numpy as np

    from moetrain.config import load_config
    from moetrain.trainer import Trainer

    cfg = load_config(config, list(overrides) + [f"train.output_dir={os.path.join(out_dir, 'run')}"])
    trainer = Trainer(cfg)
    result = trainer.fit()
    pipeline, pctx = (trainer.runner if trainer.pctx.pp > 1 else None), trainer.pctx
    record = {
        "rank": pctx.rank, "pp_rank": pctx.pp_rank, "dp_rank": pctx.dp_rank, "pp": pctx.pp,
        "num_micro_batches": trainer.n_micro,
        "peak_in_flight": pipeline.peak_in_flight,
        "step_bytes_sent": pipeline.step_bytes_sent,
        "stage_layers": [trainer.model.start, trainer.model.end],
        "eval": result["eval"],
        "step_time_s": result["train"].get("step_time_s"),
    }
    with open(os.path.join(out_dir, f"rank_{pctx.rank}.json"), "w") as fh:
        json.dump(record, fh)
    np.savez(os.path.join(out_dir, f"rank_{pctx.rank}.npz"),
             **{p.name: p.asnumpy() for p in trainer.model.get_parameters()})


if __name__ == "__main__":
    main()
