"""Parallel strategies over the `moetrain.distributed` primitives: data parallelism and ZeRO
(`data_parallel`), tensor + sequence parallelism (`tensor_parallel`, with the per-family `plans`),
pipeline parallelism (`pipeline`) and expert parallelism (`expert_parallel`)."""
