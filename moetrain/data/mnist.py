"""MNIST from the original idx files (no download: the folder is given by `data.path`)."""
from __future__ import annotations

import os

import numpy as np

_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _read_idx(path: str, magic: int) -> np.ndarray:
    with open(path, "rb") as fh:
        header = np.frombuffer(fh.read(4), dtype=">u4")[0]
        if header != magic:
            raise ValueError(f"{path}: not an MNIST idx file (magic {header:#x}, expected {magic:#x})")
        ndim = magic & 0xFF
        shape = tuple(int(d) for d in np.frombuffer(fh.read(4 * ndim), dtype=">u4"))
        data = np.frombuffer(fh.read(), dtype=np.uint8)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: truncated ({data.size} bytes of data, header says {shape})")
    return data.reshape(shape)


class MnistDataset:
    """`(image[784] float32 normalised, label int32)` samples of one split."""

    MEAN, STD = 0.1307, 0.3081

    def __init__(self, folder: str, split: str = "train"):
        images_name, labels_name = _FILES[split]
        paths = [os.path.join(folder, images_name), os.path.join(folder, labels_name)]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"MNIST {split} files not found: {missing}. Set data.path to the folder holding the "
                f"uncompressed idx files (e.g. ../shared/data/mnist)")
        images = _read_idx(paths[0], 0x803).reshape(-1, 784)
        self.labels = _read_idx(paths[1], 0x801).astype(np.int32)
        if len(images) != len(self.labels):
            raise ValueError(f"{folder}: {len(images)} images but {len(self.labels)} labels")
        self.images = ((images.astype(np.float32) / 255.0) - self.MEAN) / self.STD

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], self.labels[i]

    def batch(self, indices):
        return self.images[indices], self.labels[indices]
