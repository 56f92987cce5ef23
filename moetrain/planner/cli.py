"""`moetrain plan CONFIG [--world N] [--device NAME] [--search] [--dry-run] [--set K=V ...]` and the
launcher's pre-flight (`explain_cannot_run_here`: the plan of a config this machine cannot run)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional, Sequence

from moetrain.config import ConfigError, infer_data_parallel, load_config
from moetrain.layout import LayoutError
from moetrain.planner.report import format_plan, format_search, plan_json
from moetrain.planner.search import choose_layout, plan

CPU_CONFIG = "configs/moe_tiny_8p.yaml"


def load_plan_config(path: str, overrides: Sequence[str] = ()):
    """The config to plan (`load_config`; kept as the planner's entry point)."""
    return load_config(path, overrides)


def device_available(backend: str) -> bool:
    """Whether this machine has the `train.device` backend (without importing MindSpore)."""
    if backend == "cpu":
        return True
    if backend == "ascend":
        return bool(os.environ.get("ASCEND_HOME_PATH")) or shutil.which("npu-smi") is not None
    if backend == "gpu":
        return shutil.which("nvidia-smi") is not None
    return False


def explain_cannot_run_here(cfg) -> Optional[str]:
    """None when this machine has `cfg`'s device; otherwise the plan of the config and why it
    cannot start here (the launcher prints it instead of starting workers)."""
    backend = cfg.train.device
    if device_available(backend):
        return None
    try:
        table = format_plan(plan(cfg))
    except (LayoutError, ValueError) as exc:
        table = f"(no plan: {exc})"
    probe = {"ascend": "no ASCEND_HOME_PATH and no npu-smi", "gpu": "no nvidia-smi"}.get(backend, "unknown device")
    return (f"{table}\n\n{cfg.source or 'this config'} is laid out for train.device: {backend}, which this "
            f"machine does not have ({probe}); the plan above is what it would cost there. To train on this "
            f"CPU machine use {CPU_CONFIG}.")


def main(argv=None) -> int:
    """`moetrain plan CONFIG [--world N] [--device NAME] [--search] [--set K=V ...]`.
    Exit status: 0 fits, 1 does not fit, 2 bad config or layout."""
    ap = argparse.ArgumentParser(prog="moetrain plan", description="parameters, FLOPs, memory, communication "
                                 "and step time of a config's layout; --search picks the best layout")
    ap.add_argument("config")
    ap.add_argument("--world", type=int, default=None, help="number of devices (default: dp x tp x pp x cp of the config)")
    ap.add_argument("--device", default=None, help="device profile: ascend910b, gpu_a100, gpu_h100, cpu "
                    "(default: from train.device)")
    ap.add_argument("--search", action="store_true", help="search the layouts of --world devices")
    ap.add_argument("--keep", default="", metavar="KEYS", help="with --search: hold these layout keys at the "
                    "config's values (comma-separated: tp, pp, ep, zero, recompute, micro, sp, schedule, fold, cp), a "
                    "smaller search for large worlds")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    dry = ap.add_argument_group("dry run (moetrain/planner/dryrun.py): one rank built and run on this CPU, measured")
    dry.add_argument("--dry-run", action="store_true", help="build rank --rank of the layout at full width, run "
                     "one step, print planned against measured bytes per category")
    dry.add_argument("--rank", type=int, default=0, help="the rank to build (default 0)")
    dry.add_argument("--json", action="store_true", help="one JSON object: the plan (tokens_per_s_per_device, "
                     "model_tflops_per_device, mfu, ...); with --dry-run: planned and measured")
    dry.add_argument("--seq", type=int, default=None, help="with --dry-run: run this many tokens per sequence "
                     "(default: the config's, shortened to fit this machine)")
    dry.add_argument("--layers", type=int, default=None, help="with --dry-run: build the first N layers at full "
                     "width (default: all, fewer where the plan is over 2 GiB); planned is for the same model")
    args = ap.parse_args(argv)
    for flag, value, least in (("--world", args.world, 1), ("--rank", args.rank, 0), ("--seq", args.seq, 1),
                               ("--layers", args.layers, 1)):
        if value is not None and value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    try:
        cfg = load_plan_config(args.config, args.set)
        searched = args.search or cfg.parallel.mode == "auto"     # the search sets dp itself (and may refuse it)
        if args.world and cfg.parallel.data_parallel_inferred and not searched:   # as a launch of --world would
            infer_data_parallel(cfg, cfg.source, args.world)
        if args.dry_run:
            # the dry run builds the model: MindSpore stays off the path of the plain plan
            from moetrain.planner.dryrun import dry_run, format_dry_run

            result = dry_run(cfg, args.rank, args.seq, layers=args.layers)
            print(result.to_json() if args.json else format_dry_run(result))
            return 0
        if args.search:
            p = cfg.parallel
            world = args.world or p.data_parallel * p.model_parallel * p.pipeline_stage * p.context_parallel
            keep = tuple(k.strip() for k in args.keep.split(",") if k.strip())
            _, search = choose_layout(cfg, world, args.device, options=True, keep=keep)
            if not args.json:
                print(format_search(search))
                print()
            result = search.chosen
        else:
            result = plan(cfg, args.world, args.device)
        print(plan_json(result) if args.json else format_plan(result))
    except (ConfigError, LayoutError, ValueError) as exc:
        print(f"moetrain plan: error: {exc}", file=sys.stderr)
        return 2
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
