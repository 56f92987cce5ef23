"""Runs the peer benchmark (../shared/peer-bench/hf_moe_bench.py) unchanged, its steps taken in turns.

    /tmp/peerenv/bin/python benchmarks/peer_turns.py PEER_SCRIPT [its arguments]

with `MOETRAIN_BENCH_TURNS` set by `benchmarks/turns.Referee` (benchmarks/bench_vs_peer.py does this). The peer
times each step between two `time.perf_counter()` calls:

    t_all = time.perf_counter()            # call 0
    for i in range(n_steps):
        t0 = time.perf_counter()           # calls 1, 3, 5, ...: wait for the turn, then read the clock
        ... forward, backward, AdamW ...
        dt = time.perf_counter() - t0      # calls 2, 4, 6, ...: read the clock, then hand the turn back
    wall_all = time.perf_counter() - t_all # call 2 n + 1: the final wait

so the script's own module gets a `time` whose `perf_counter` takes the turns at exactly those calls,
outside the timed window; everything else is the real `time` module. The peer's `wall_s_all_steps`
then includes the waits; its per-step figures do not.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time as real_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from turns import Turns  # noqa: E402


class TurnClock:
    def __init__(self, turns: Turns):
        self._turns, self.calls = turns, 0

    def perf_counter(self) -> float:
        call, self.calls = self.calls, self.calls + 1
        if call == 0:
            return real_time.perf_counter()
        if call % 2 == 1:                       # a step starts, or (call 2 n + 1) the steps are over
            self._turns.wait()
            return real_time.perf_counter()
        now = real_time.perf_counter()          # a step ended
        self._turns.done()
        return now

    def __getattr__(self, name):
        return getattr(real_time, name)


def main() -> int:
    script, argv = sys.argv[1], sys.argv[2:]
    turns = Turns.from_env()
    if turns is None:
        raise SystemExit(f"{__file__}: MOETRAIN_BENCH_TURNS is not set (run it through benchmarks/turns.Referee)")
    spec = importlib.util.spec_from_file_location("peer_bench", script)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    if getattr(peer, "time", None) is not real_time:
        raise SystemExit(f"{script}: expected it to `import time` at module level (the clock this wraps)")
    clock = peer.time = TurnClock(turns)
    peer_args = peer.parse_args(argv)
    steps = peer_args.warmup + peer_args.steps
    sys.argv = [script, *argv]
    peer.main(argv)
    if clock.calls != 2 * steps + 2:    # the pattern above, or the turns were not the steps
        raise SystemExit(f"{script}: perf_counter was called {clock.calls} times for {steps} steps, "
                         f"not {2 * steps + 2}: its timing loop is not the one benchmarks/peer_turns.py wraps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
