"""Worker: train from a config with overrides; rank r writes rank_r.json (losses, byte counts).

    python train_worker.py OUT_DIR CONFIG [key=value ...]     (under msrun, or alone)
"""
import json
import os
import sys

os.environ.setdefault("GLOG_v", "3")


def main():
    out_dir, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    from moetrain.config import load_config
    from moetrain.trainer import Trainer

    cfg = load_config(config, list(overrides) + [f"train.output_dir={os.path.join(out_dir, 'run')}"])
    trainer = Trainer(cfg)
    result = trainer.fit()
    record = {
        "rank": trainer.rank,
        "dp": trainer.pctx.dp,
        "optimizer_state_bytes": trainer.opt_step.optimizer_state_bytes(),
        "param_sizes": [int(p.size) for p in trainer.opt_step.params],
        "gradient_bytes_held": getattr(trainer.runner, "grad_bytes_held", None),
        "eval": result["eval"],
    }
    with open(os.path.join(out_dir, f"rank_{trainer.rank}.json"), "w") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main()
