"""Reading Hugging Face safetensors checkpoints into fp32 numpy, FP8 block-quantized ones included.

Own reader, not `safetensors.numpy`: numpy has no bfloat16 or float8, which published checkpoints use.
Widening bf16/fp16 to fp32 is exact; FP8 (E4M3, DeepSeek-V3's `quantization_config` with
`weight_block_size [128, 128]`) is decoded exactly and multiplied by its per-block
`<name>_scale_inv` (fp32 `[ceil(out/128), ceil(in/128)]`), which is consumed by the dequantization.
"""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

_FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"


def _e4m3_table() -> np.ndarray:
    """The fp32 value of each of the 256 E4M3 (OCP "fn": no infinities, S.1111.111 is NaN) bytes."""
    byte = np.arange(256)
    sign = np.where(byte >> 7, -1.0, 1.0)
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where((exponent == 15) & (mantissa == 7), np.nan, value)
    return (sign * value).astype(np.float32)


E4M3_TO_FP32 = _e4m3_table()


MAX_HEADER_BYTES = 100 << 20      # the safetensors format's own limit on the JSON header


def read_header(path: str) -> Tuple[Dict, int]:
    """(the JSON header, its length in bytes) of a .safetensors file. A file that is not one (too
    short, a header length past the file or the format's 100 MB limit, a header that is not a JSON
    object of tensors) is a ValueError naming the file, read without allocating the claimed length."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes: shorter than its 8-byte header length)")
        header_len = struct.unpack("<Q", head)[0]
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: not a safetensors file, or truncated: its header length says {header_len} "
                             f"bytes, the file has {size - 8} after it (limit {MAX_HEADER_BYTES})")
        raw = fh.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not a safetensors file: its header is not UTF-8 JSON ({exc})") from None
    bad = [n for n, info in (header.items() if isinstance(header, dict) else [])
           if n != "__metadata__" and not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= set(info))]
    if not isinstance(header, dict) or bad:
        raise ValueError(f"{path}: not a safetensors file: its header is not a map of tensors with dtype, shape "
                         f"and data_offsets" + (f" (e.g. {bad[0]!r})" if bad else ""))
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= size - 8 - header_len:
            raise ValueError(f"{path}: tensor {name!r} lies at bytes {start}..{end} of the data, but the file holds "
                             f"{size - 8 - header_len}: the file is truncated or damaged")
    return header, header_len


def _decode(raw: np.ndarray, info: Dict, path: str, name: str, keep_fp8: bool) -> np.ndarray:
    """One tensor's bytes `raw` (uint8) as a new fp32 array of its shape (FP8: raw uint8 with `keep_fp8`)."""
    dtype = info["dtype"]
    if dtype == "BF16":   # the top half of an fp32: widen exactly
        array = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype in _FLOAT_DTYPES:
        array = raw.view(np.dtype(_FLOAT_DTYPES[dtype]).newbyteorder("<")).astype(np.float32)
    elif dtype == FP8_DTYPE:
        array = np.array(raw) if keep_fp8 else E4M3_TO_FP32[raw]
    else:
        raise ValueError(_dtype_error(path, name, dtype))
    try:
        return array.reshape(info["shape"])
    except (ValueError, TypeError):
        raise ValueError(f"{path}: tensor {name!r} holds {array.size} values, not its shape {info['shape']} "
                         f"(the file is damaged)") from None


def _dtype_error(path: str, name: str, dtype: str) -> str:
    return (f"{path}: tensor {name!r} has dtype {dtype}; hf-import reads F32, F16, BF16, F64 and "
            f"block-quantized {FP8_DTYPE} weights")


def read_safetensors(path: str, keep_fp8: bool = False) -> Dict[str, np.ndarray]:
    """All tensors of a .safetensors file as fp32 arrays (FP8 ones as their raw uint8 bytes with
    `keep_fp8`, for `dequantize_fp8_blocks`; decoded without block scales otherwise)."""
    header, header_len = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        tensors[name] = _decode(data[start:end], info, path, name, keep_fp8)
    return tensors


def checkpoint_files(hf_dir: str) -> Sequence[str]:
    """The safetensors files of a checkpoint: those the index lists, or every *.safetensors."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is damaged: expected a JSON object with a weight_map of tensor -> file "
                             f"({type(exc).__name__}: {exc})") from None
        missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not there: {missing}")
        return [os.path.join(hf_dir, f) for f in files]
    paths = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"{hf_dir!r} has no *.safetensors weights (PyTorch .bin checkpoints are not "
                                f"supported: re-save them with safetensors)")
    return paths


def dequantize_fp8_blocks(tensors: Dict[str, np.ndarray], fp8_names: Sequence[str],
                          block_size: Sequence[int]) -> Dict[str, np.ndarray]:
    """`w = e4m3(q) * scale_inv[i // bo, j // bi]` for every FP8 weight; its scale tensor is consumed.

    An FP8 weight without a scale, or a scale without its weight, is an error naming the tensor."""
    out = {name: value for name, value in tensors.items() if name not in fp8_names}
    for name in fp8_names:
        scale_name = name + SCALE_SUFFIX
        if scale_name not in tensors:
            raise ValueError(f"FP8 tensor {name!r} has no {scale_name!r}: cannot dequantize it")
        _check_fp8_shapes(name, tensors[name].shape, tensors[scale_name].shape, block_size)
        out[name] = dequantize_fp8(tensors[name], tensors[scale_name], block_size)
        del out[scale_name]
    orphans = sorted(n for n in out if n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] not in fp8_names)
    if orphans:
        raise ValueError(f"scale tensors without an FP8 weight: {orphans[:10]} (is the checkpoint complete?)")
    return out


def _check_fp8_shapes(name: str, shape, scale_shape, block_size: Sequence[int]) -> None:
    """An FP8 weight is 2-D and its scale has one value per block: else a ValueError naming both."""
    block_out, block_in = block_size
    if len(shape) != 2:
        raise ValueError(f"FP8 tensor {name!r} has shape {tuple(shape)}; block dequantization handles 2-D weights")
    rows, cols = shape
    expected = (-(-rows // block_out), -(-cols // block_in))
    if tuple(scale_shape) != expected:
        raise ValueError(f"{name + SCALE_SUFFIX!r} has shape {tuple(scale_shape)}, expected {expected} for {name!r} "
                         f"{tuple(shape)} in blocks of {block_out}x{block_in}")


def dequantize_fp8(q: np.ndarray, scale: np.ndarray, block_size: Sequence[int]) -> np.ndarray:
    """One FP8 weight (raw E4M3 bytes `q`) times its per-block `scale` (shapes checked by the caller)."""
    block_out, block_in = block_size
    rows, cols = q.shape
    per_element = np.repeat(np.repeat(np.asarray(scale, np.float32), block_out, 0), block_in, 1)[:rows, :cols]
    return E4M3_TO_FP32[q] * per_element


def fp8_block_size(quantization: Optional[dict]) -> Sequence[int]:
    """The `[rows, cols]` blocks of a config.json `quantization_config` that hf-import can dequantize;
    anything else is a ValueError naming the key."""
    quantization = quantization or {}
    if quantization.get("quant_method") != "fp8" or quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"config.json quantization_config {quantization!r}: hf-import dequantizes fp8 block-quantized "
                         f"weights (quant_method: fp8, e4m3) only")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json quantization_config.fmt={quantization['fmt']!r}: only e4m3 is supported")
    block = quantization.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ValueError(f"config.json quantization_config.weight_block_size={block!r}: expected [rows, cols]")
    return block


def load_hf_weights(hf_dir: str, quantization: Optional[dict] = None) -> Dict[str, np.ndarray]:
    """Every tensor of the checkpoint in `hf_dir`, fp32, all at once (the whole model in memory:
    `HFSource` reads one at a time); FP8 weights dequantized with `quantization` (the config.json
    `quantization_config`: `quant_method: fp8`, `weight_block_size`)."""
    weights, fp8_names = {}, []
    for path in checkpoint_files(hf_dir):
        header, _ = read_header(path)
        fp8_names += [n for n, info in header.items() if n != "__metadata__" and info["dtype"] == FP8_DTYPE]
        weights.update(read_safetensors(path, keep_fp8=True))
    if not fp8_names and not quantization:
        return weights
    return dequantize_fp8_blocks(weights, fp8_names, fp8_block_size(quantization))


class HFSource:
    """The tensors of the checkpoint in `hf_dir`, read one at a time: the shard headers give every
    name, dtype and shape up front (and every error they can show: a damaged file, a dtype hf-import
    cannot read, an FP8 weight without its scale or of the wrong shape, before any tensor is read);
    `get(name)` then reads that one tensor's bytes from its shard (a memory map) as a new fp32 array,
    an FP8 weight dequantized with its block scales. Why: hf-import of a published checkpoint (1.3 TB
    of DeepSeek-V3 in fp32) must never hold the whole model (`moetrain.checkpoint.hf.hf_import`).

    Own reader rather than safetensors' `safe_open`: its numpy framework has no bfloat16 or float8,
    which published checkpoints use; the memory map is just as lazy."""

    def __init__(self, hf_dir: str, quantization: Optional[dict] = None):
        self._where: Dict[str, Tuple[str, Dict, int]] = {}      # name -> (file, header entry, data offset)
        for path in checkpoint_files(hf_dir):
            header, header_len = read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _FLOAT_DTYPES and info["dtype"] not in ("BF16", FP8_DTYPE):
                    raise ValueError(_dtype_error(path, name, info["dtype"]))
                self._where[name] = (path, info, 8 + header_len)
        fp8 = [n for n, (_, info, _) in self._where.items() if info["dtype"] == FP8_DTYPE]
        self._block = fp8_block_size(quantization) if fp8 or quantization else None
        for name in fp8:
            if name + SCALE_SUFFIX not in self._where:
                raise ValueError(f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r}: cannot dequantize it")
            _check_fp8_shapes(name, self.shape(name), self.shape(name + SCALE_SUFFIX), self._block)
        self._fp8 = set(fp8)
        scales = {n + SCALE_SUFFIX for n in fp8}
        orphans = sorted(n for n in self._where if n.endswith(SCALE_SUFFIX) and n not in scales) if self._block else []
        if orphans:
            raise ValueError(f"scale tensors without an FP8 weight: {orphans[:10]} (is the checkpoint complete?)")
        self.names = frozenset(n for n in self._where if n not in scales)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def keys(self):
        return self.names

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def _raw(self, name: str, keep_fp8: bool) -> np.ndarray:
        path, info, offset = self._where[name]
        start, end = info["data_offsets"]
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=offset + start, shape=(end - start,)) \
            if end > start else np.zeros(0, np.uint8)
        return _decode(data, info, path, name, keep_fp8)

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as a new fp32 array (nothing else of the checkpoint is read)."""
        if name not in self.names:
            raise KeyError(name)
        if name in self._fp8:
            return dequantize_fp8(self._raw(name, True), self._raw(name + SCALE_SUFFIX, False), self._block)
        return self._raw(name, False)
