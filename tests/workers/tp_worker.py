"""Worker of tests/test_tensor_parallel.py, started by msrun on every rank.

    python tests/workers/tp_worker.py OUT_DIR --dp D --tp T [--layers] [--run NAME:KEY=VALUE,KEY=VALUE ...]

--layers: the parallel layers (column/row-parallel linear, vocabulary-parallel embedding and
cross-entropy, with and without sequence parallel) on seeded inputs, in PyNative and under ms.jit;
writes this rank's outputs and gradients to OUT_DIR/rank_<r>.npz for the test to assemble and
compare with numpy.
--run: a short training run of the Trainer (CONFIG with the overrides after the second colon) into
OUT_DIR/NAME: rank 0 writes metrics.jsonl, every rank rank_<r>.json (its parameter shapes and the
parameters whose gradients are summed over tp). Runs go one after another in this process.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# Shapes of the layer checks (shared with the test through `layer_case`).
BATCH, SEQ, HIDDEN, FFN, VOCAB = 2, 8, 12, 16, 20


def layer_case():
    """The global tensors every rank (and the test's numpy reference) starts from."""
    rng = np.random.default_rng(7)
    f32 = np.float32
    return {
        "x": rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(f32),
        "w_col": (0.3 * rng.standard_normal((FFN, HIDDEN))).astype(f32),
        "w_row": (0.3 * rng.standard_normal((HIDDEN, FFN))).astype(f32),
        "probe": rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(f32),      # loss = sum(y * probe)
        "emb": rng.standard_normal((VOCAB, HIDDEN)).astype(f32),
        "ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
        "logits": (3.0 * rng.standard_normal((BATCH, SEQ, VOCAB))).astype(f32),
        "labels": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
    }


def chunk(array, axis, group):
    return np.split(array, group.size, axis=axis)[group.rank_in_group]


def run_layers(pctx, out_dir):
    import mindspore as ms
    from mindspore import Tensor

    from moetrain.layers import CrossEntropy, Embedding, Linear
    from moetrain.parallel.tensor_parallel import (SEQUENCE_AXIS, ColumnParallelLinear, RowParallelLinear,
                                                   VocabParallelCrossEntropy, VocabParallelEmbedding)

    group = pctx.group("tp")
    case = layer_case()
    results = {}

    def linear(weight, name):
        layer = Linear(weight.shape[1], weight.shape[0])
        layer.weight.set_data(Tensor(weight))
        layer.weight.name = name    # jit needs unique parameter names
        return layer

    for mode in ("pynative", "jit"):
        wrap = ms.jit if mode == "jit" else (lambda fn: fn)
        for sp in (False, True):
            tag = f"{mode}_{'sp' if sp else 'tp'}"
            col = ColumnParallelLinear.from_linear(linear(case["w_col"], "w_col"), group, entry="sequence" if sp else "copy")
            row = RowParallelLinear.from_linear(linear(case["w_row"], "w_row"), group, exit="sequence" if sp else "reduce")
            x = case["x"]
            probe = case["probe"]
            if sp:   # sequence-split stream: each rank holds its chunk of x and of the loss probe
                x, probe = chunk(x, SEQUENCE_AXIS, group), chunk(probe, SEQUENCE_AXIS, group)
            probe_t = Tensor(probe)

            def mlp_loss(x_in):
                hidden = col(x_in)
                return (row(hidden) * probe_t).sum(), hidden

            grad = wrap(ms.value_and_grad(mlp_loss, 0, [col.weight, row.weight], has_aux=True))
            (loss, hidden), (dx, (dw_col, dw_row)) = grad(Tensor(x))
            results.update({f"{tag}_mlp_loss": loss.asnumpy(), f"{tag}_col_out": hidden.asnumpy(),
                            f"{tag}_dx": dx.asnumpy(), f"{tag}_dw_col": dw_col.asnumpy(),
                            f"{tag}_dw_row": dw_row.asnumpy()})

            embedding = Embedding(VOCAB, HIDDEN)
            embedding.weight.set_data(Tensor(case["emb"]))
            VocabParallelEmbedding.from_embedding(embedding, group, exit="sequence" if sp else "reduce")

            def embed_loss(ids):
                vectors = embedding(ids)
                return (vectors * probe_t).sum(), vectors

            egrad = wrap(ms.value_and_grad(embed_loss, None, [embedding.weight], has_aux=True))
            (loss, vectors), (dw_emb,) = egrad(Tensor(case["ids"]))
            results.update({f"{tag}_emb_out": vectors.asnumpy(), f"{tag}_emb_loss": loss.asnumpy(),
                            f"{tag}_dw_emb": dw_emb.asnumpy()})

        cross_entropy = VocabParallelCrossEntropy.from_cross_entropy(CrossEntropy(), pctx.group("tp"))

        def ce_loss(logits, labels):
            return cross_entropy(logits, labels)

        cgrad = wrap(ms.value_and_grad(ce_loss, 0))
        loss, dlogits = cgrad(Tensor(chunk(case["logits"], -1, group)), Tensor(case["labels"]))
        results.update({f"{mode}_ce_loss": loss.asnumpy(), f"{mode}_dlogits": dlogits.asnumpy()})
    np.savez(os.path.join(out_dir, f"rank_{pctx.rank}.npz"), **results)


def run_training(name, overrides, out_dir, config_path):
    from moetrain.config import load_config
    from moetrain.parallel.tensor_parallel import is_sequence_parallel
    from moetrain.trainer import Trainer

    run_dir = os.path.join(out_dir, name)
    cfg = load_config(config_path, overrides + [f"train.output_dir={run_dir}"])
    start = time.perf_counter()
    trainer = Trainer(cfg)
    trainer.fit()
    params = trainer.model.trainable_params()
    with open(os.path.join(run_dir, f"rank_{trainer.rank}.json"), "w") as fh:
        json.dump({"shapes": {p.name: list(p.shape) for p in params},
                   "summed_over_tp": [p.name for p in params if is_sequence_parallel(p)],
                   "seconds": time.perf_counter() - start}, fh)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--layers", action="store_true")
    ap.add_argument("--run", action="append", default=[], metavar="NAME:CONFIG:KEY=VALUE,...")
    args = ap.parse_args()

    import mindspore as ms

    ms.set_device("CPU", 0)   # explicit id: init() keeps it, so each Trainer's set_device("CPU") agrees
    from moetrain.distributed.topology import init_parallel

    pctx = init_parallel(dp=args.dp, tp=args.tp, verbose=False)
    if args.layers:
        start = time.perf_counter()
        run_layers(pctx, args.out_dir)
        if pctx.rank == 0:
            print(f"layers: {time.perf_counter() - start:.1f} s", flush=True)
    for spec in args.run:
        name, config, overrides = spec.split(":", 2)
        run_training(name, [o for o in overrides.split(",") if o], args.out_dir, os.path.join(ROOT, config))


if __name__ == "__main__":
    main()
