"""moetrain: Mixture-of-Experts training on MindSpore with explicit SPMD parallelism."""
__version__ = "0.1.0"
