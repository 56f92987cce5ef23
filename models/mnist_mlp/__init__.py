"""The MNIST MLP family ("mnist_mlp"): data parallelism only, nothing to split or convert."""
from moetrain.family import Family
from moetrain.registry import register_family

from moetrain.models.mnist_mlp.model import MnistMLP, MnistMLPConfig

FAMILY = register_family(Family(name="mnist_mlp", config=MnistMLPConfig, model=MnistMLP))
