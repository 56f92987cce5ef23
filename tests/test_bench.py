"""Speed work of issue 8: the exact dropless MoE layout against the padded-block one, the step
metrics (mfu, peak RSS), the profiler window, and benchmarks/bench.py (the kernels: tests/test_kernels.py)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_device("CPU")   # as the trainer does: a later set_device("CPU") is then a no-op
    return mindspore


# ----------------------------------------------------------------------------------------------
# The exact dropless MoE layout (the kernels themselves: tests/test_kernels.py)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_exact_dropless_layout_equals_capacity_layout(ms, kernel_ops, jit):
    """Same weights, same routing: the rows layout (grouped GEMM kernel, padding rows skipped) and
    the capacity layout (batched matmul) give the same output and gradients."""
    from moetrain.moe.config import MoEConfig
    from moetrain.moe.layer import MoELayer

    cfg = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=16, aux_loss_coeff=0.01)
    ms.set_seed(0)
    layer = MoELayer(12, cfg)
    assert (layer.experts.compute, layer.dispatcher.layout) == ("kernel", "rows")   # the default here
    x = ms.Tensor(np.random.default_rng(2).standard_normal((2, 15, 12)).astype(np.float32))
    params = layer.trainable_params()

    def run(compute, layout):
        layer.experts.compute, layer.dispatcher.layout = compute, layout

        def loss(inputs):
            y, stats = layer(inputs)
            return (y * y).sum() + layer.weighted_aux(stats), stats["expert_rows"]

        grad_fn = ms.value_and_grad(loss, 0, params, has_aux=True)
        (value, rows), (dx, dparams) = (ms.jit(grad_fn) if jit else grad_fn)(x)
        return float(rows.asnumpy()), [value.asnumpy(), dx.asnumpy()] + [g.asnumpy() for g in dparams]

    (exact_rows, exact), (capacity_rows, capacity) = run("kernel", "rows"), run("bmm", "capacity")
    assert exact_rows == 2 * 15 * 2 and capacity_rows == 4 * 2 * 15      # routed rows; E x T at the bound
    for name, a, b in zip(["loss", "dx"] + [p.name for p in params], exact, capacity):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------------------------
# Trainer metrics and the profiler window
# ----------------------------------------------------------------------------------------------

def tiny_lm_config(tmp_path, **logging):
    from moetrain.config import config_from_dict
    from benchmarks.bench import write_random_shard

    shard = str(tmp_path / "tokens")
    write_random_shard(shard, 64, 4000)
    return config_from_dict({
        "model": {"name": "moe_gpt", "vocab_size": 64, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                  "ffn_hidden_size": 32, "seq_length": 16, "moe": {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 8}},
        "data": {"type": "lm", "path": shard},
        "train": {"steps": 3, "global_batch_size": 4, "output_dir": str(tmp_path / "run")},
        "checkpoint": {"save_at_end": False},
        "logging": {"tensorboard": False, "progress_bar": False, **logging}})


def flops_per_token_by_hand(m) -> float:
    """6 x (LM head + per layer q,k,v,o + router + top_k experts' three matrices) + 12 L a d S."""
    head_dim = m.hidden_size // m.num_heads
    attention = m.hidden_size * head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
    per_layer = attention + m.moe.num_experts * m.hidden_size + 3 * m.hidden_size * m.moe.ffn_hidden_size * m.moe.top_k
    matmul_params = m.vocab_size * m.hidden_size + m.num_layers * per_layer
    return 6 * matmul_params + 12 * m.num_layers * m.num_heads * head_dim * m.seq_length


def test_profiler_window_and_step_metrics(ms, tmp_path):
    from moetrain.devices import get_device
    from moetrain.trainer import Trainer

    cfg = tiny_lm_config(tmp_path, profile_steps=[2, 3])
    Trainer(cfg).fit()
    profile_dir = tmp_path / "run" / "profile"
    tables = list(profile_dir.glob("*/FRAMEWORK/cpu_op_type_info_*.csv"))
    assert tables, f"no per-op table under {profile_dir}: {sorted(p.name for p in profile_dir.rglob('*'))}"
    assert "MatMul" in tables[0].read_text()
    with open(tmp_path / "run" / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    peak = get_device("cpu").peak("float32")
    for record in records:
        expected = record["tokens_per_s"] * flops_per_token_by_hand(cfg.model) / peak
        assert record["mfu"] == pytest.approx(expected, rel=1e-9)
        assert 0 < record["mfu"] <= 1     # against the peak measured on this host (moetrain.devices.host_fp32_peak)
        assert 400 < record["peak_rss_mb"] < 20000            # MindSpore alone takes ~410 MB


def test_profile_steps_validated(tmp_path):
    from moetrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"logging.profile_steps.*1 <= first <= last"):
        tiny_lm_config(tmp_path, profile_steps=[3, 2])


# ----------------------------------------------------------------------------------------------
# benchmarks/bench.py
# ----------------------------------------------------------------------------------------------

def test_bench_prints_one_sane_json_line(ms, tmp_path):
    from moetrain.config import model_config_from_dict
    from benchmarks.bench import model_section, parse_args
    from benchmarks.turns import Referee

    argv = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "32", "--experts", "4",
            "--topk", "2", "--vocab", "128", "--seq", "32", "--batch", "2", "--steps", "3", "--warmup", "1",
            "--peak-matmul-size", "512"]
    # run as benchmarks/bench_vs_peer.py runs it: its 4 steps in turns with a (stand-in) peer's 4
    (tmp_path / "fake_peer.py").write_text(FAKE_PEER)
    referee, outs = Referee(), [open(tmp_path / f"{i}.{kind}", "w+") for i in (0, 1) for kind in ("out", "err")]
    bench = referee.start([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), *argv],
                          stdout=outs[0], stderr=outs[1], cwd=ROOT)
    peer = referee.start([sys.executable, os.path.join(ROOT, "benchmarks", "peer_turns.py"), str(tmp_path / "fake_peer.py"),
                          "--steps", "3", "--warmup", "1"], stdout=outs[2], stderr=outs[3], cwd=ROOT)
    waiting_cpu = referee.alternate(4, block=2)
    for f in outs:
        f.close()
    assert bench.wait(timeout=600) == 0 and peer.wait(timeout=60) == 0, (tmp_path / "0.err").read_text()[-3000:]
    assert len(json.loads((tmp_path / "1.out").read_text())["spans"]) == 4 and min(waiting_cpu) >= 0
    lines = (tmp_path / "0.out").read_text().strip().splitlines()
    assert len(lines) == 1, (tmp_path / "0.out").read_text()[-3000:]
    result = json.loads(lines[0])
    assert result["config"]["model"] == "moe_gpt" and result["config"]["experts"] == 4
    for key in ("tokens_per_s", "step_ms_median", "cpu_ms_median", "peak_gflops", "peak_rss_mb"):
        assert result[key] > 0, key
    assert 0 < result["mfu"] <= 1
    assert result["step_ms_min"] <= result["step_ms_median"] <= result["step_ms_max"]
    assert len(result["step_ms_all"]) == 3 and result["step_ms_median"] in result["step_ms_all"]
    # compilation reported apart from the step: the first step is the compile plus about one step
    assert result["first_step_s"] >= result["compile_s"] > 0      # equal when the step rounds to 0.00 s
    assert result["compile_s"] == pytest.approx(result["first_step_s"] - result["step_ms_median"] / 1e3, abs=0.011)
    # the fields agree with each other and with a FLOP count made by hand
    tokens = 2 * 32
    # step_ms_median is printed to 0.1 ms: bound tokens/s by the two ends of that rounding interval
    low, high = (tokens / ((result["step_ms_median"] + d) / 1e3) for d in (0.05, -0.05))
    assert low - 0.1 <= result["tokens_per_s"] <= high + 0.1, (result["tokens_per_s"], low, high)
    model = model_config_from_dict(model_section(parse_args(argv)))
    flops = flops_per_token_by_hand(model) * result["tokens_per_s"]
    assert result["model_gflops_per_s"] == pytest.approx(flops / 1e9, rel=2e-2, abs=0.01)
    assert result["mfu"] == pytest.approx(flops / (result["peak_gflops"] * 1e9), rel=2e-2, abs=2e-4)
    assert np.isfinite(result["loss_first"]) and result["drop_rate"] == 0.0


# ----------------------------------------------------------------------------------------------
# benchmarks/bench_ranks.py (one host, several ranks; its runs are a benchmark, not a test)
# ----------------------------------------------------------------------------------------------

def test_bench_ranks_reads_the_steps_after_warm_up(tmp_path):
    from benchmarks.bench_ranks import median_tokens_per_s

    records = [{"step": 1, "tokens_per_s": 1.0}, {"step": 2, "tokens_per_s": 2.0}, {"step": 3, "tokens_per_s": 30.0},
               {"step": 3, "eval_loss": 5.0},          # an eval record: no tokens_per_s
               {"step": 4, "tokens_per_s": 10.0}, {"step": 5, "tokens_per_s": 20.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert median_tokens_per_s(str(tmp_path), skip=2) == 20.0        # steps 3, 4, 5: 30, 10, 20
    assert median_tokens_per_s(str(tmp_path), skip=0) == 10.0        # 1, 2, 30, 10, 20
    with pytest.raises(SystemExit, match="no tokens_per_s after step 5"):
        median_tokens_per_s(str(tmp_path), skip=5)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_ranks.py"), "--steps", "3", "--skip", "5"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--steps (3) must exceed --skip (5)" in proc.stderr


# ----------------------------------------------------------------------------------------------
# benchmarks/turns.py: two benchmark processes taking their steps in turns (benchmarks/bench_vs_peer.py)
# ----------------------------------------------------------------------------------------------

# A stand-in for ../shared/peer-bench/hf_moe_bench.py with its timing loop (the one benchmarks/peer_turns.py
# wraps): it busy-works each step and prints the clock's readings around every step.
FAKE_PEER = '''
import argparse, json, time

def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--extra-clock-read", action="store_true")
    return p.parse_args(argv)

def main(argv=None):
    args = parse_args(argv)
    spans = []
    t_all = time.perf_counter()
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        while time.perf_counter_ns() - int(t0 * 1e9) < 30e6:
            pass
        if args.extra_clock_read:
            time.perf_counter()
        spans.append([t0, time.perf_counter()])
    wall = time.perf_counter() - t_all
    print(json.dumps({"side": "peer", "spans": spans, "wall": wall}))
'''

# This project's side, as benchmarks/bench.py takes its turns.
OWN_SIDE = '''
import json, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks.turns import Turns
turns, spans = Turns.from_env(), []
for i in range(int(sys.argv[2])):
    turns.wait()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.02:
        pass
    spans.append([t0, time.perf_counter()])
    turns.done()
turns.wait()
print(json.dumps({"side": "own", "spans": spans}))
'''


def test_turns_run_one_step_at_a_time_and_wrap_the_peer_clock_unchanged(tmp_path):
    from benchmarks.bench_vs_peer import run_in_turns

    (tmp_path / "fake_peer.py").write_text(FAKE_PEER)
    (tmp_path / "own_side.py").write_text(OWN_SIDE)
    peer = [sys.executable, os.path.join(ROOT, "benchmarks", "peer_turns.py"), str(tmp_path / "fake_peer.py"),
            "--steps", "4", "--warmup", "1"]
    own = [sys.executable, str(tmp_path / "own_side.py"), ROOT, "5"]
    for (first, second), block in (((own, peer), 1), ((peer, own), 2)):
        results = run_in_turns([first, second], steps=5, block=block)
        assert [r["side"] for r in results] == (["own", "peer"] if first is own else ["peer", "own"])
        spans = sorted((start, end, r["side"]) for r in results for start, end in r["spans"])
        assert len(spans) == 10
        # turns of `block` steps (the last one shorter), the first side first, no step overlapping the next
        turns = [results[0]["side"]] * block + [results[1]["side"]] * block
        expected = turns * 2 + [results[0]["side"], results[1]["side"]] if block == 2 else turns * 5
        assert [side for _, _, side in spans] == expected
        assert all(end <= nxt_start for (_, end, _), (nxt_start, _, _) in zip(spans, spans[1:]))
        peer_result = results[[r["side"] for r in results].index("peer")]
        assert all(end - start >= 0.03 for start, end in peer_result["spans"])   # its own steps, not the waits
        assert peer_result["wall"] >= 0.03 * 5 + 0.02 * 4        # its whole loop included the other's turns
        assert all(r["cpu_s_while_waiting"] >= 0 for r in results)

    # a script whose timing loop reads the clock differently is refused, not measured wrongly
    with pytest.raises((RuntimeError, SystemExit)):
        run_in_turns([own, peer + ["--extra-clock-read"]], steps=5)


def test_bench_vs_peer_compares_steps_that_follow_a_step_of_the_same_side():
    from benchmarks.bench_vs_peer import TURN, paired_ratio, warm_steps_ms

    assert TURN == 4
    # warm-up 4 = one turn, so timed steps 0, 4, 8, 12 start turns; warm-up 2: timed steps 2, 6 do
    assert warm_steps_ms({"step_ms_all": list(range(16))}, 4) == [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15]
    assert warm_steps_ms({"step_ms_all": list(range(8))}, 2) == [0, 1, 3, 4, 5, 7]
    assert paired_ratio([100.0, 200.0, 400.0], [150.0, 200.0, 1000.0]) == 1.5
