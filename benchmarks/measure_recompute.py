"""Activation memory of one training step under each recompute policy (`parallel.recompute`).

    python benchmarks/measure_recompute.py [--model moe_gpt] [--hidden 128] [--layers 2] [--heads 8]
        [--seq 256] [--batch 4,12] [--policies none,selective,full] [--modes jit,pynative] [--json]

Every (mode, policy, batch) runs in a fresh process that builds the model, applies the policy's
plan (moetrain/parallel/plans.py), then runs one forward + backward and reports how far the peak
RSS (VmHWM) rose above the RSS before the step. MindSpore's CPU memory pool keeps what it reserved,
so that rise is the step's peak working set: activations, backward temporaries and, under jit, the
compiler's. With two batch sizes the slope (MB per sample) is the activation memory alone, free of
the fixed costs. Gradients are compared with the "none" run of the same mode and batch.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def memory_mb():
    status = open("/proc/self/status").read()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) / 1024 for key in ("VmRSS", "VmHWM")}


def model_config(args):
    from moetrain.config import model_config_from_dict

    raw = dict(name=args.model, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
               num_heads=args.heads, num_kv_heads=args.heads, ffn_hidden_size=2 * args.hidden, seq_length=args.seq)
    if args.model == "moe_gpt":
        raw["moe"] = dict(num_experts=8, top_k=2, ffn_hidden_size=2 * args.hidden)
    return model_config_from_dict(raw)


def child(args) -> None:
    """One measurement; prints a JSON line, writes the gradients to args.grads."""
    import mindspore as ms

    from moetrain.parallel.plans import RECOMPUTE_PLANS, apply_recompute
    from moetrain.registry import get_model

    ms.set_device("CPU")
    ms.set_seed(0)
    model = get_model(args.model).cls(model_config(args))
    if args.policy != "none":
        apply_recompute(model, RECOMPUTE_PLANS[args.model][args.policy])
    rng = np.random.default_rng(0)
    ids, labels = (ms.Tensor(rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)) for _ in range(2))

    def loss_fn(input_ids, targets):
        return model(input_ids, targets)[0]

    step = ms.value_and_grad(loss_fn, None, model.trainable_params())
    if args.mode == "jit":
        step = ms.jit(step)
    before = memory_mb()["VmRSS"]
    loss, grads = step(ids, labels)
    np.savez(args.grads, *[g.asnumpy() for g in grads])
    print(json.dumps({"loss": float(loss), "step_peak_mb": memory_mb()["VmHWM"] - before}))


def measure(args, mode: str, policy: str, batch: int, grads_path: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--policy", policy,
           "--batch-size", str(batch), "--grads", grads_path]
    for key in ("model", "hidden", "layers", "heads", "seq", "vocab"):
        cmd += [f"--{key}", str(getattr(args, key))]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"}, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"measurement {mode}/{policy}/batch {batch} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="moe_gpt", choices=["gpt", "moe_gpt"])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", default="4,12", help="comma-separated batch sizes (two or more give MB/sample)")
    ap.add_argument("--policies", default="none,selective,full")
    ap.add_argument("--modes", default="jit,pynative")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, dest="batch_size", help=argparse.SUPPRESS)
    ap.add_argument("--grads", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.batch = args.batch_size
        child(args)
        return 0

    batches = [int(b) for b in args.batch.split(",")]
    policies = args.policies.split(",")
    if policies[0] != "none":
        ap.error("--policies must start with none (the gradient reference)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            for policy in policies:
                row = {"step_peak_mb": {}, "max_grad_diff": 0.0}
                for batch in batches:
                    grads = os.path.join(tmp, f"{mode}_{policy}_{batch}.npz")
                    row["step_peak_mb"][batch] = measure(args, mode, policy, batch, grads)["step_peak_mb"]
                    reference, got = np.load(os.path.join(tmp, f"{mode}_none_{batch}.npz")), np.load(grads)
                    row["max_grad_diff"] = max(row["max_grad_diff"], *(float(np.abs(reference[k] - got[k]).max())
                                                                       for k in reference.files))
                if len(batches) > 1:
                    row["mb_per_sample"] = ((row["step_peak_mb"][batches[-1]] - row["step_peak_mb"][batches[0]])
                                            / (batches[-1] - batches[0]))
                results[f"{mode}/{policy}"] = row
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{args.model}: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
          f"vocab {args.vocab}; peak RSS rise over one forward+backward (MB)")
    print(f"{'mode/policy':<20}" + "".join(f"{'batch ' + str(b):>12}" for b in batches)
          + (f"{'MB/sample':>12}" if len(batches) > 1 else "") + f"{'grad diff':>12}")
    for key, row in results.items():
        print(f"{key:<20}" + "".join(f"{row['step_peak_mb'][b]:>12.0f}" for b in batches)
              + (f"{row['mb_per_sample']:>12.1f}" if "mb_per_sample" in row else "") + f"{row['max_grad_diff']:>12.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
