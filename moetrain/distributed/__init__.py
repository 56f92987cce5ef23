"""Distributed primitives: who is who (`topology`: layout coordinates and process groups), how ranks
talk (`comm`: the collectives, native or derived on CPU, with a byte ledger), where a parameter's
piece sits and what role it plays (`sharding`), and how the processes are started and watched
(`launch`). The parallel strategies that use them live in `moetrain.parallel`."""
