"""The dispatch invariant (moetrain/moe/accounting.py) on one process: the check itself, and a real
run through `moetrain train` whose dispatch buffers a test-only hook undersizes (the expert
buffer of the batched-matmul layout, kernels off), stopped with the named error and exit code 77
before any step is applied. The same on dp4.ep4 is in tests/test_expert_parallel.py."""
import os
import subprocess
import sys

import numpy as np
import pytest

from moetrain.moe.accounting import DispatchInvariantError, check_dispatch_rows, expert_rows_per_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_balanced_rows_pass_and_a_lost_row_names_the_layer():
    check_dispatch_rows(np.array([[512, 512, 0, 512], [512, 500, 12, 512]]), "step 3", "dp=1", None)   # capacity drops
    with pytest.raises(DispatchInvariantError, match=r"at step 3: MoE layer 1 dispatched 512 rows, its experts "
                                                     r"computed 511 and dropped 0 \(\+1 rows unaccounted"):
        check_dispatch_rows(np.array([[512, 512, 0, 512], [512, 511, 0, 512]]), "step 3", "dp=1", {"expert_capacity": 7})
    with pytest.raises(DispatchInvariantError, match=r"computed 513 .*-1 rows unaccounted.*capacities in force: "
                                                     r"the static bound"):
        check_dispatch_rows(np.array([[512, 513, 0, 513]]), "step 3", "dp=1", None)


def test_expert_rows_count_each_row_once_whatever_the_copies():
    # two copies of every row (e.g. expert-tensor-parallel peers), 1,024 routed
    rows = np.array([[1024, 1024, 0, 1024], [1024, 1024, 0, 1024]])
    assert expert_rows_per_copy(rows, 1024) == 1024
    assert expert_rows_per_copy(np.array([[512, 512, 0, 640]]), 512) == 640     # a padded GEMM layout


HOOKED_RUN = """
import sys
import numpy as np
from moetrain import cli
from moetrain.moe import capacity

original_update = capacity.CapacityController.update

def update(self, loads):   # test-only hook: half the need, overflows never re-run
    for field, need in self.needed(loads).items():
        self._set(field, capacity._capacity(np.maximum(1, need // 2)))
    return False

capacity.CapacityController.update = update
capacity.CapacityController.prime = lambda self, tokens, prior=2.0: [self._set(f, 1) for f in self.fields]
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_undersized_buffers_stop_the_run_with_exit_code_77(tmp_path):
    out = tmp_path / "run"
    sets = ["model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1", "model.ffn_hidden_size=64",
            "model.seq_length=16", "model.moe.ffn_hidden_size=32", "model.num_layers=2", "train.steps=2", "train.global_batch_size=4",
            f"train.output_dir={out}", "logging.tensorboard=false", "logging.progress_bar=false"]
    proc = subprocess.run([sys.executable, "-c", HOOKED_RUN, "train", os.path.join(ROOT, "configs", "moe_tiny.yaml"),
                           *[a for s in sets for a in ("--set", s)]], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MOETRAIN_DISABLE_KERNELS": "1"}, timeout=300)
    assert proc.returncode == 77, proc.stderr[-3000:]
    assert "moetrain: dispatch invariant broken at step 1: MoE layer 0 dispatched 128 rows" in proc.stderr, proc.stderr
    assert "capacities in force: {'expert_capacity': 1}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "metrics.jsonl").exists() or "grad_norm" not in (out / "metrics.jsonl").read_text()
