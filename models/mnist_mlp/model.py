"""784-512-512-10 MLP on MNIST: the sanity model of the classic MindSpore example."""
from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

from moetrain.modeling import SUM, StatSpec


@dataclass
class MnistMLPConfig:
    name: str = "mnist_mlp"
    input_size: int = 784
    hidden_size: int = 512
    num_hidden_layers: int = 2
    num_classes: int = 10
    compute_dtype: str = "float32"

    def __post_init__(self):
        if self.num_hidden_layers < 1 or self.hidden_size < 1:
            raise ValueError("num_hidden_layers and hidden_size must be >= 1")


class MnistMLP(nn.Cell):
    def __init__(self, cfg: MnistMLPConfig):
        super().__init__()
        sizes = [cfg.input_size] + [cfg.hidden_size] * cfg.num_hidden_layers
        self.hidden = nn.CellList([nn.Dense(i, o, activation="relu") for i, o in zip(sizes[:-1], sizes[1:])])
        self.head = nn.Dense(sizes[-1], cfg.num_classes)
        self.dtype = getattr(ms, cfg.compute_dtype)
        if self.dtype != ms.float32:
            self.to_float(self.dtype)
        self.xent = ops.SparseSoftmaxCrossEntropyWithLogits()

    def stat_specs(self):
        return {"correct": StatSpec(SUM)}      # correct predictions add up over micro-batches and ranks

    def logits(self, images):
        x = images
        for layer in self.hidden:
            x = layer(x)
        return self.head(x).astype(ms.float32)

    def construct(self, images, labels):
        logits = self.logits(images)
        loss = self.xent(logits, labels)
        correct = (ops.argmax(logits, -1).astype(ms.int32) == labels).astype(ms.float32).sum()
        return loss, {"correct": correct}
