"""Benchmark: what one collective call costs a rank inside a loop of compute, on this host.
Each rank runs the same loop, alternating, `--rounds` times: `--calls` pieces of compute (a
few matrix multiplies of about a tiny model's layer, so that the ranks reach each call at
about the same time, as a training step's ranks do), once without a collective and once with
an all-reduce of each size in --bytes after every piece, through the ledger's wrapper as the
scripts' collectives go. The difference over the calls is the cost of one call as a step
pays it: latency, bytes, the wrapper, and the ranks meeting (a rank descheduled for a moment
makes the others wait at the next call). tests/benchmarks/plan_vs_measured.py runs it at two
sizes to price plan.py's fixed cost per call (--call_overhead_us) and the bandwidth a step
sees. Rerun with

    python tests/benchmarks/call_cost.py --ranks 2 [--calls 200 --rounds 5 --bytes 4 65536]

Prints one JSON object: ranks, the sizes, the seconds per call at each (the fastest round of
each loop, the slowest rank's), and the loop without calls."""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def rank_main(a):
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    from infra.ledger import LEDGER
    dist.init_process_group("gloo")
    LEDGER.install()  # the scripts' wrapper around every collective
    world = dist.group.WORLD
    x, w = torch.randn(128, 128), torch.randn(128, 512)
    messages = [torch.ones(max(1, size // 4)) for size in a.bytes]
    done = torch.zeros(1)

    def loop(message):
        dist.all_reduce(done, group=world)  # start together
        t0 = time.perf_counter()
        for _ in range(a.calls):
            for _ in range(a.matmuls):
                x @ w
            if message is not None:
                dist.all_reduce(message, group=world)  # the call whose cost is measured
        dist.all_reduce(done, group=world)  # end together: the slowest rank's loop (in every loop)
        return time.perf_counter() - t0

    for message in messages:
        loop(message)  # warm-up: connections, allocations
    kinds = [None, *range(len(messages))]
    times = {kind: [] for kind in kinds}
    for i in range(a.rounds):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            times[kind].append(loop(None if kind is None else messages[kind]))
    without = min(times[None])
    if dist.get_rank() == 0:
        print(json.dumps(dict(ranks=dist.get_world_size(), calls=a.calls, without_s=without,
                              bytes=[m.numel() * 4 for m in messages],
                              seconds_per_call=[max(0.0, (min(times[k]) - without) / a.calls)
                                                for k in range(len(messages))])), flush=True)
    dist.destroy_process_group()


def measure(ranks, calls=200, rounds=5, nbytes=(4,), matmuls=1):
    """{ranks, bytes: [...], seconds_per_call: [...], ...} of `ranks` ranks on this host, one
    figure per message size in `nbytes` (the harness's launch)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from harness import launch
    run = launch(os.path.abspath(__file__), ["--rank_main", "--calls", calls, "--rounds", rounds, "--bytes", *nbytes,
                                             "--matmuls", matmuls],
                 nprocs=ranks, metrics=False, out_dir=False, timeout=600).ok()
    return json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bytes", type=int, nargs="+", default=[4], help="each all-reduce's message, one loop per size")
    p.add_argument("--matmuls", type=int, default=1, help="128x128 by 128x512 multiplies between two calls")
    p.add_argument("--rank_main", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_main:
        return rank_main(a)
    if a.ranks < 2 or a.calls < 1 or a.rounds < 1 or min(a.bytes) < 1 or a.matmuls < 0:
        p.exit(2, "error: --ranks must be at least 2, and --calls, --rounds, --bytes positive\n")
    print(json.dumps(measure(a.ranks, a.calls, a.rounds, a.bytes, a.matmuls)))


if __name__ == "__main__":
    main()
