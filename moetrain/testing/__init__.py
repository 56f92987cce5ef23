"""Test doubles that ship with the package because commands use them: the contract backend's checked
CPU stand-ins for the native (Ascend / GPU) collectives (`contract`, `MOETRAIN_COMM_BACKEND=contract`,
so CI runs the native code path) and the one-rank stand-in collectives of `moetrain plan --dry-run`
(`solo`). Nothing here is a training code path."""
