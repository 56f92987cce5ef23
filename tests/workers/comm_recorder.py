"""Test-only recorder of the communication primitives a rank really calls (PyNative).

It wraps `__call__` of `mindspore.ops.AllReduce` (what the emulation calls) and of the contract
stand-ins (what the native path calls) and records, per call, the primitive, its communicator, the
group size and this rank's place in it (asked from MindSpore, not from moetrain), the shape and
dtype of every tensor that entered it, and the attributes that decide the traffic (root, counts).
`native_bytes` / `emulated_bytes` turn these records into bytes with textbook formulas of their own
(ring algorithms on the recorded buffers, not comm's code), which tests/test_comm.py and
tests/test_contract_training.py compare with comm's ledger. Jitted graphs never call `__call__`, so only PyNative calls are seen.
"""
import contextlib

import numpy as np

CONTRACT_PRIMS = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "AlltoAllV", "Broadcast", "Send", "Receive")


class Recorder:
    def __init__(self):
        self.entries, self.backward = None, False

    @contextlib.contextmanager
    def recording(self):
        """Record the calls made inside the block; those after `backward_starts()` are tagged backward."""
        self.entries, self.backward = [], False
        try:
            yield self.entries
        finally:
            self.entries = None

    def backward_starts(self):
        """Call where the forward ends (e.g. at the end of the loss function, PyNative)."""
        self.backward = True

    def install(self):
        from mindspore import ops

        from moetrain.testing import contract

        self._wrap(ops.AllReduce, "mindspore", "AllReduce")
        for name in CONTRACT_PRIMS:
            self._wrap(getattr(contract, name), "contract", name)

    def _wrap(self, cls, source, name):
        original, recorder = cls.__call__, self

        def __call__(prim, *args):
            if recorder.entries is not None:
                recorder.entries.append(dict(describe(source, name, prim, args), backward=recorder.backward))
            return original(prim, *args)

        cls.__call__ = __call__


def _tensor(t):
    return {"shape": [int(d) for d in t.shape], "dtype": str(t.asnumpy().dtype)}


def describe(source, name, prim, args):
    from mindspore.communication import get_group_size, get_rank

    group = prim.group if source == "contract" else prim.get_attr_dict()["group"]
    entry = {"source": source, "prim": name, "group": group, "n": get_group_size(group),
             "rank": get_rank(group), "tensors": []}
    if name == "Broadcast":
        entry["tensors"] = [_tensor(t) for t in args[0]]
        entry["root"] = prim.root_rank
    elif name == "Receive":
        entry["tensors"] = []
    else:
        entry["tensors"] = [_tensor(args[0])]
    if name == "AlltoAllV":
        entry["send"] = [int(c) for c in np.asarray(args[1]).reshape(-1)]
        entry["block_size"] = prim.block_size
    return entry


# ---------------------------------------------------------------------------------------------
# textbook byte counts of one recorded call (bytes this rank sends)
# ---------------------------------------------------------------------------------------------
def tensor_bytes(t):
    return int(np.prod(t["shape"], dtype=np.int64)) * np.dtype(t["dtype"]).itemsize


def native_bytes(call):
    n, r, prim = call["n"], call["rank"], call["prim"]
    size = sum(tensor_bytes(t) for t in call["tensors"])
    if prim == "AllReduce":          # ring: reduce-scatter then all-gather, 2(n-1) chunks of S/n
        return 2 * (n - 1) / n * size
    if prim == "AllGather":          # ring: this rank's shard and n-2 others' are passed on
        return (n - 1) * size
    if prim in ("ReduceScatter", "AlltoAll"):   # every chunk but its own leaves the rank once
        return (n - 1) / n * size
    if prim == "AlltoAllV":          # the elements addressed to other ranks
        itemsize = np.dtype(call["tensors"][0]["dtype"]).itemsize
        return itemsize * call["block_size"] * sum(c for j, c in enumerate(call["send"]) if j != r)
    if prim == "Broadcast":          # ring from the root: everyone but the root's predecessor forwards
        return 0 if r == (call["root"] - 1) % n else size
    if prim == "Send":
        return size
    if prim == "Receive":
        return 0
    raise ValueError(prim)


def emulated_bytes(call):
    assert call["prim"] == "AllReduce", call
    n = call["n"]
    return 2 * (n - 1) / n * sum(tensor_bytes(t) for t in call["tensors"])
