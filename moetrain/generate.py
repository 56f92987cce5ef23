"""`moetrain generate MODEL --prompt TEXT`: text generation with a key/value cache.

    moetrain generate runs/moe_tiny/checkpoints/step_00000400 --prompt "In the beginning" --max-new-tokens 40
    moetrain generate MODEL --prompt "And God said" --prompt "Blessed are" --temperature 0.8 --top-p 0.9 --seed 1
    moetrain generate MODEL --input ids.npy --output out.npy --temperature 0     # token ids in and out
    moetrain generate MODEL --prompt "In the beginning God" --max-new-tokens 0   # the prompt's per-token loss

MODEL is a training checkpoint (saved on any layout), a run folder (its latest checkpoint), or a model
directory (`moetrain convert hf-import | upcycle | consolidate` output). The tokenizer is `--tokenizer`,
else the one the run trained with (`data.tokenizer` in the checkpoint's config.yaml), else a
tokenizer.json / tokenizer.model inside MODEL.

Decoding is incremental: the prompt is run once (prefill), then one token per forward, each attending
to the cache (`moetrain.kv_cache`; the models' `decode` methods, PyNative). Prompts of unequal length
are batched by left-padding; each row gets exactly what it would alone. A row stops at the tokenizer's
EOS (`--eos-id` to override, -1 never). `--temperature 0` is greedy; otherwise the logits are divided by
the temperature, cut to the `--top-k` best and to the smallest set whose probability reaches `--top-p`,
and sampled (`--seed` for reproducible draws).

For scripts: `generate_ids(model, prompt_ids [B, P], max_new_tokens, ...) -> [B, P + N]` and
`cached_logits(model, ids) -> [B, S, V]` (every position's logits through prefill + incremental decode).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from moetrain.checkpoint.manager import CheckpointError, latest_checkpoint
from moetrain.checkpoint.model_dir import load_model
from moetrain.data.tokenizer import load_tokenizer
from moetrain.distributed.topology import cpu_ops_on_calling_thread
from moetrain.forward import read_token_ids


# ------------------------------------------------------------------------------------------------
# The decoding loop
# ------------------------------------------------------------------------------------------------
def _ids_tensor(ids):
    import mindspore as ms   # MindSpore after the arguments parse (main): --help answers at once

    return ms.Tensor(np.ascontiguousarray(ids, dtype=np.int32))


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0):
    """`(ids [B, P] int32, pad [B])`: the prompts right-aligned, row b after `pad[b]` columns of `pad_id`."""
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
    return ids, np.array([width - n for n in lengths], np.int64)


def check_fits(lengths: Sequence[int], max_new_tokens: int, max_positions: int) -> None:
    """One-line ValueError when a prompt (plus the new tokens) needs more positions than the model has."""
    if min(lengths) < 1:
        raise ValueError(f"prompt {lengths.index(min(lengths)) + 1} is empty: generation needs at least one token")
    longest = int(np.argmax(lengths))
    need = lengths[longest] + max_new_tokens
    if need > max_positions:
        which = f"prompt {longest + 1} of {len(lengths)}" if len(lengths) > 1 else "the prompt"
        room = max_positions - lengths[longest]
        fix = (f"use --max-new-tokens {room} or less, or a shorter prompt" if room > 0 else "shorten the prompt")
        raise ValueError(f"{which} has {lengths[longest]} tokens; with --max-new-tokens {max_new_tokens} that is "
                         f"{need} positions, but the model has {max_positions} (model.seq_length): {fix}")


def cached_logits(model, ids, prefill: int = 1) -> np.ndarray:
    """fp32 logits `[B, S, V]` of `ids [B, S]` through the cache: the first `prefill` tokens in one
    call, then one call per token (what generation runs; equal to `model.logits(ids)`)."""
    ids = np.asarray(ids)
    model.set_train(False)
    cache = model.new_cache(ids.shape[0])
    out = [model.decode(_ids_tensor(ids[:, :prefill]), cache).asnumpy()]
    for col in range(prefill, ids.shape[1]):
        out.append(model.decode(_ids_tensor(ids[:, col:col + 1]), cache).asnumpy())
    return np.concatenate(out, axis=1)


def _full_last_logits(model, ids: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """No cache: the whole sequences through `model.logits`, the last column's logits `[B, V]`.
    Left padding becomes its own document, and positions restart after it (packed-document context)."""
    if not pad.any():
        return model.logits(_ids_tensor(ids)).asnumpy()[:, -1]
    columns = np.arange(ids.shape[1])[None, :]
    documents = (columns >= pad[:, None]).astype(np.int32)
    positions = np.maximum(columns - pad[:, None], 0).astype(np.int32)
    return model.logits(_ids_tensor(ids), _ids_tensor(documents), _ids_tensor(positions)).asnumpy()[:, -1]


def sample_next(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Next token of every row of `logits [B, V]`: argmax at temperature 0 (the first of equal
    maxima); else softmax(logits / temperature) cut to the `top_k` largest (0: all) and then to the
    smallest set of largest probabilities reaching `top_p` (1: all), renormalised and sampled."""
    if temperature == 0:
        return logits.argmax(-1).astype(np.int64)
    rng = rng if rng is not None else np.random.default_rng()
    x = logits.astype(np.float64) / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(x, vocab - top_k, axis=-1)[:, vocab - top_k:vocab - top_k + 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(-x, axis=-1, kind="stable")
        sorted_x = np.take_along_axis(x, order, -1)
        probs = np.exp(sorted_x - sorted_x[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, -1) - probs               # probability of the better tokens
        drop = np.zeros_like(x, dtype=bool)
        np.put_along_axis(drop, order, before >= top_p, -1)  # the best token is always kept
        x = np.where(drop, -np.inf, x)
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    draws = rng.random(len(x))
    return np.minimum((np.cumsum(probs, -1) < draws[:, None]).sum(-1), vocab - 1).astype(np.int64)


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, eos_id: Optional[int] = None,
             on_token: Optional[Callable[[np.ndarray, np.ndarray], None]] = None,
             use_cache: bool = True) -> List[np.ndarray]:
    """The new tokens of every prompt (lists of int ids, any lengths): a list of int arrays, each
    `max_new_tokens` long, or shorter where the row produced `eos_id` (kept, last).

    `on_token(tokens [B], live [B])` after each step (`live`: rows still generating before it).
    `use_cache=False` runs the whole sequence through `model.logits` for every new token instead
    (the reference the cache is tested and benchmarked against)."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    prompts = [list(map(int, p)) for p in prompts]
    check_fits([len(p) for p in prompts], max_new_tokens, model.max_positions)
    ids, pad = left_pad(prompts)
    batch = len(prompts)
    rng = np.random.default_rng(seed)
    model.set_train(False)
    new = np.zeros((batch, max_new_tokens), np.int64)
    done = np.full(batch, max_new_tokens)                  # tokens each row produced
    live = np.ones(batch, bool)
    if max_new_tokens == 0:
        return [new[row, :0] for row in range(batch)]
    if use_cache:
        cache = model.new_cache(batch, pad)
        logits = model.decode(_ids_tensor(ids), cache, last_only=True).asnumpy()[:, -1]
    else:
        logits = _full_last_logits(model, ids, pad)
    for step in range(max_new_tokens):
        tokens = sample_next(logits, temperature, top_k, top_p, rng)
        if eos_id is not None:
            tokens = np.where(live, tokens, eos_id)
        new[:, step] = tokens
        if on_token is not None:
            on_token(tokens, live.copy())
        if eos_id is not None:
            ended = live & (tokens == eos_id)
            done[ended] = step + 1
            live &= ~ended
        if step + 1 == max_new_tokens or not live.any():
            break
        if use_cache:
            logits = model.decode(_ids_tensor(tokens[:, None]), cache, last_only=True).asnumpy()[:, -1]
        else:
            ids = np.concatenate([ids, tokens[:, None].astype(np.int32)], axis=1)
            logits = _full_last_logits(model, ids, pad)
    return [new[row, :done[row]] for row in range(batch)]


def generate_ids(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Optional[int] = None, eos_id: Optional[int] = None,
                 pad_id: Optional[int] = None, use_cache: bool = True) -> np.ndarray:
    """`prompt_ids [B, P]` int (or `[P]`) -> `[B, P + N]` int64: each prompt and its continuation (as
    transformers' `generate`, greedy at temperature 0). Without `eos_id` every row gets N tokens;
    with it, a row ends at its EOS and the columns after it hold `pad_id` (default: `eos_id`)."""
    prompt_ids = np.asarray(prompt_ids)
    if prompt_ids.ndim == 1:
        prompt_ids = prompt_ids[None, :]
    rows = generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id, use_cache=use_cache)
    out = np.full((len(prompt_ids), prompt_ids.shape[1] + max_new_tokens),
                  eos_id if pad_id is None and eos_id is not None else (pad_id or 0), np.int64)
    out[:, :prompt_ids.shape[1]] = prompt_ids
    for row, tokens in enumerate(rows):
        out[row, prompt_ids.shape[1]:prompt_ids.shape[1] + len(tokens)] = tokens
    return out


def prompt_losses(model, prompts: Sequence[Sequence[int]]) -> List[np.ndarray]:
    """Next-token cross-entropy (nats) of every prompt token after the first: a list of `[len - 1]`
    float64 arrays; their mean is the model's `lm_loss` on `(prompt[:-1], prompt[1:])`. One prefill."""
    prompts = [list(map(int, p)) for p in prompts]
    check_fits([len(p) for p in prompts], 0, model.max_positions)
    ids, pad = left_pad(prompts)
    model.set_train(False)
    logits = model.decode(_ids_tensor(ids), model.new_cache(len(prompts), pad)).asnumpy().astype(np.float64)
    out = []
    for row, prompt in enumerate(prompts):
        row_logits = logits[row, pad[row]:pad[row] + len(prompt) - 1]
        row_logits = row_logits - row_logits.max(-1, keepdims=True)
        log_probs = row_logits - np.log(np.exp(row_logits).sum(-1, keepdims=True))
        out.append(-log_probs[np.arange(len(prompt) - 1), prompt[1:]])
    return out


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def resolve_model_path(path: str) -> str:
    """A run folder stands for its latest complete checkpoint; anything else is itself."""
    ckpts = os.path.join(path, "checkpoints")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isdir(ckpts):
        latest = latest_checkpoint(ckpts)
        if latest is None:
            raise FileNotFoundError(f"{path!r} is a run folder without a complete checkpoint in {ckpts}")
        print(f"moetrain generate: using {latest}", file=sys.stderr)
        return latest
    return path


def find_tokenizer(model_path: str, config: dict, override: Optional[str] = None):
    """`(tokenizer or None, why none)`: `override`, else a tokenizer.json / tokenizer.model inside
    `model_path` (a training checkpoint keeps a copy of its run's; an imported model its own), else
    the run's `data.tokenizer` (as given, or relative to `model_path`)."""
    if override:
        return load_tokenizer(override), ""
    for name in ("tokenizer.json", "tokenizer.model"):
        if os.path.isfile(os.path.join(model_path, name)):
            return load_tokenizer(os.path.join(model_path, name)), ""
    named = ((config.get("data") or {}).get("tokenizer") or "") if isinstance(config, dict) else ""
    if named:
        for candidate in (named, os.path.join(model_path, named)):
            if os.path.exists(candidate):
                return load_tokenizer(candidate), ""
    why = (f"its config.yaml names data.tokenizer {named!r}, which does not exist here" if named else
           "its config.yaml names no data.tokenizer")
    return None, f"{why} and {model_path!r} holds no tokenizer.json or tokenizer.model"


class _Printer:
    """Writes each row's text as it grows: one prompt streams token by token; several are printed
    whole, one a line, when they are done. Text is the decoded (prompt + new ids) past the decoded
    prompt, so pieces that join across tokens (leading spaces, multi-byte characters) come out right."""

    def __init__(self, prompts: Sequence[Sequence[int]], texts: Sequence[str], tokenizer, eos_id, out=None):
        self.prompts, self.texts, self.tok, self.eos_id = prompts, texts, tokenizer, eos_id
        self.out = out or sys.stdout
        self.new: List[List[int]] = [[] for _ in prompts]
        self.shown = [""] * len(prompts)
        self.stream = len(prompts) == 1
        if self.stream:
            self.out.write(self.texts[0])
            self.out.flush()

    def continuation(self, row: int) -> str:
        ids = [t for t in self.new[row] if t != self.eos_id and (self.tok is None or t < self.tok.vocab_size)]
        if self.tok is None:
            return "".join(f" {t}" for t in ids)
        prompt_text = self.tok.decode(self.prompts[row])
        whole = self.tok.decode(list(self.prompts[row]) + ids)
        return whole[len(prompt_text):] if whole.startswith(prompt_text) else self.tok.decode(ids)

    def __call__(self, tokens: np.ndarray, live: np.ndarray) -> None:
        for row in np.nonzero(live)[0]:
            self.new[row].append(int(tokens[row]))
        if self.stream:
            text = self.continuation(0)
            if text.endswith("\ufffd"):        # a character cut between tokens: wait for the rest
                return
            self.out.write(text[len(self.shown[0]):])
            self.out.flush()
            self.shown[0] = text

    def finish(self) -> None:
        if self.stream:
            text = self.continuation(0)
            self.out.write(text[len(self.shown[0]):] + "\n")
        else:
            for row in range(len(self.prompts)):
                self.out.write(f"[{row + 1}] {self.texts[row]}{self.continuation(row)}\n")
        self.out.flush()


def _print_losses(prompts, losses, tokenizer, out=None) -> None:
    out = out or sys.stdout
    for row, (prompt, loss) in enumerate(zip(prompts, losses)):
        out.write(f"prompt {row + 1}: {len(prompt)} tokens\n")
        out.write(f"  {'pos':>5}  {'token':>6}  {'loss':>8}  piece\n")
        for pos in range(1, len(prompt)):
            piece = repr(tokenizer.id_to_piece(prompt[pos])) if tokenizer is not None else ""
            out.write(f"  {pos:>5}  {prompt[pos]:>6}  {loss[pos - 1]:>8.4f}  {piece}\n")
        if len(loss):
            mean = float(np.mean(loss))
            out.write(f"  mean loss {mean:.4f} nats/token over {len(loss)} predicted tokens "
                      f"(perplexity {np.exp(mean):.2f})\n")
        else:
            out.write("  (one token: nothing to predict)\n")
    out.flush()


def _read_prompts(args, tokenizer, why_none: str, model_path: str, vocab_size: int):
    """`(prompts as id lists, their display texts)` from --prompt / --prompt-file or --input."""
    texts = list(args.prompt or [])
    for path in args.prompt_file or []:
        with open(path, encoding="utf-8") as fh:
            texts.append(fh.read().rstrip("\n"))
    if args.input:
        ids = read_token_ids(args.input, vocab_size)
        prompts = [list(map(int, row)) for row in ids]
        shown = [tokenizer.decode([t for t in p if t < tokenizer.vocab_size]) if tokenizer is not None
                 else " ".join(map(str, p)) for p in prompts]
        return prompts, shown
    if tokenizer is None:
        raise ValueError(f"text prompts need a tokenizer, and none was found for {model_path!r}: {why_none}; "
                         f"pass --tokenizer PATH (a sentencepiece .model or tokenizer.json), or token ids with "
                         f"--input ids.npy")
    prompts = [tokenizer.encode(t) for t in texts]
    for row, prompt in enumerate(prompts):
        if prompt and max(prompt) >= vocab_size:
            raise ValueError(f"the tokenizer {tokenizer.name!r} gives id {max(prompt)} for prompt {row + 1}, beyond "
                             f"the model's vocabulary ({vocab_size}): is it the tokenizer this model was trained with?")
    return prompts, texts


def run_generate(args, out=None) -> np.ndarray:
    """The command: load, read prompts, generate (or score at --max-new-tokens 0), print, write."""
    for key, ok, what in (("temperature", args.temperature >= 0, ">= 0 (0: greedy)"),
                          ("top_k", args.top_k >= 0, ">= 0 (0: off)"),
                          ("top_p", 0 < args.top_p <= 1, "in (0, 1] (1: off)"),
                          ("max_new_tokens", args.max_new_tokens is None or args.max_new_tokens >= 0, ">= 0")):
        if not ok:
            raise ValueError(f"--{key.replace('_', '-')} must be {what}, got {getattr(args, key)}")
    texts_given = bool(args.prompt or args.prompt_file)
    if texts_given == bool(args.input):
        raise ValueError("give text prompts (--prompt / --prompt-file) or token ids (--input), not both" if texts_given
                         else "nothing to generate from: give --prompt TEXT, --prompt-file FILE or --input ids.npy")
    model_path = resolve_model_path(args.model)
    model, config = load_model(model_path)
    tokenizer, why_none = find_tokenizer(model_path, config, args.tokenizer)
    vocab_size = config["model"]["vocab_size"]
    prompts, texts = _read_prompts(args, tokenizer, why_none, model_path, vocab_size)
    eos_id = args.eos_id if args.eos_id is not None else (tokenizer.eos_id if tokenizer is not None else -1)
    eos_id = None if eos_id < 0 else eos_id
    max_new = args.max_new_tokens
    if max_new is None:   # default: 64, or what fits
        max_new = max(0, min(64, model.max_positions - max(len(p) for p in prompts)))
    check_fits([len(p) for p in prompts], max_new, model.max_positions)
    if max_new == 0:
        _print_losses(prompts, prompt_losses(model, prompts), tokenizer, out)
        rows = [[] for _ in prompts]
    else:
        printer = _Printer(prompts, texts, tokenizer, eos_id, out)
        start = time.perf_counter()
        rows = generate(model, prompts, max_new, args.temperature, args.top_k, args.top_p, args.seed, eos_id,
                        on_token=printer, use_cache=not args.no_cache)
        seconds = time.perf_counter() - start
        printer.finish()
        produced = sum(len(r) for r in rows)
        print(f"moetrain generate: {produced} tokens in {seconds:.2f} s ({produced / seconds:.1f} tokens/s, "
              f"{len(prompts)} row{'s' if len(prompts) > 1 else ''}, prefill included)", file=sys.stderr)
    width = max(len(p) + len(r) for p, r in zip(prompts, rows))
    pad_id = eos_id if eos_id is not None else 0
    result = np.full((len(prompts), width), pad_id, np.int64)
    for row, (prompt, new) in enumerate(zip(prompts, rows)):
        result[row, :len(prompt) + len(new)] = list(prompt) + list(new)
    if args.output:
        np.save(args.output, result.astype(np.int32))
        print(f"moetrain generate: wrote {args.output}: token ids {list(result.shape)} int32 (prompt + "
              f"continuation{', right-padded with ' + str(pad_id) if any(len(p) + len(r) < width for p, r in zip(prompts, rows)) else ''})",
              file=sys.stderr)
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moetrain generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL_OR_CHECKPOINT",
                    help="training checkpoint (any layout), run folder, or model directory")
    ap.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    ap.add_argument("--prompt-file", action="append", metavar="FILE", help="a file whose text is one prompt (repeatable)")
    ap.add_argument("--input", metavar="IDS.npy", help="int token ids [batch, length] (or [length]) as prompts")
    ap.add_argument("--output", metavar="IDS.npy", help="write prompt + continuation token ids [batch, length] int32")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens to generate per prompt (default 64, or what fits the model's positions); "
                         "0: print the prompt's per-token loss instead")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set reaching this probability (1: all)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the sampling (reproducible draws)")
    ap.add_argument("--tokenizer", metavar="PATH", help="sentencepiece .model or tokenizer.json (default: the run's)")
    ap.add_argument("--eos-id", type=int, default=None, help="token that ends a row (default: the tokenizer's; -1: none)")
    ap.add_argument("--no-cache", action="store_true", help="run the whole sequence for every new token (reference)")
    ap.add_argument("--device", default="CPU", help="MindSpore device target (CPU, GPU, Ascend)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms   # (see _ids_tensor)

    ms.set_device(args.device)
    cpu_ops_on_calling_thread()      # decoding is op by op: a spinning dispatch queue costs ~5x on 2 cores
    try:
        run_generate(args)
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        sys.stdout.flush()
        print(f"moetrain generate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
