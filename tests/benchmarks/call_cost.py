"""Benchmark: what one collective call costs a rank inside a loop of compute, on this host.
Each rank runs the same loop, alternating, `--rounds` times: `--calls` pieces of compute (a
few matrix multiplies of about a tiny model's layer, so that the ranks reach each call at
about the same time, as a training step's ranks do), once without a collective and once with
a collective of each size in --bytes after every piece (--op: an all-reduce, or a
reduce-scatter, all-gather or all-to-all (10's dispatch, equal splits) of that whole buffer, or a
ring's exchange of it, 09's step:
send to the next rank of the group, receive from the one before; several --op in one launch,
their loops interleaved, so that their costs per byte compare on a host whose load moves),
through the ledger's wrapper as the scripts' collectives go. With --group G below the ranks, each call meets G ranks: the ranks
run as n/G groups of G consecutive ranks at once (a pipeline's pairs, 08's TP pairs), so that
the host carries the same n ranks as the layout whose calls meet G. The difference over the
calls is the cost of one call as a step pays it: latency, bytes, the wrapper, and the ranks meeting (a rank descheduled for a moment
makes the others wait at the next call). tests/benchmarks/plan_vs_measured.py runs it at two
sizes, at each group size a layout's calls meet, to price plan.py's fixed cost per call by
group size (--call_overhead_us G:US ...) and the bandwidth a step sees. Rerun with

    python tests/benchmarks/call_cost.py --ranks 2 [--calls 200 --rounds 5 --bytes 4 65536]
    python tests/benchmarks/call_cost.py --ranks 4 --group 2
    python tests/benchmarks/call_cost.py --ranks 2 --op reduce_scatter_tensor --bytes 1048576 6553600
    python tests/benchmarks/call_cost.py --ranks 4 --op all_reduce reduce_scatter_tensor all_gather_into_tensor \
        --bytes 65536 1048576

Prints one JSON object: ranks, group, op (the first --op), the sizes, the seconds per call at
each (the fastest round of each loop, the slowest rank's) of the first --op, by_op: the same
for every --op, and the loop without calls."""

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
    n, rank = dist.get_world_size(), dist.get_rank()
    a.group = a.group or n
    group = world
    if a.group < n:  # n/G groups of G consecutive ranks; every rank makes each group, in the same order
        group = [dist.new_group(list(range(i, i + a.group))) for i in range(0, n, a.group)][rank // a.group]
    x, w = torch.randn(128, 128), torch.randn(128, 512)
    messages = [torch.ones(max(a.group, size // 4 // a.group * a.group)) for size in a.bytes]  # g equal shards
    done = torch.zeros(1)
    inbox = {m.numel(): torch.empty_like(m) for m in messages}  # a ring exchange's (an all-to-all's) receive buffers
    g = dist.get_world_size(group)

    def post(op, full):  # `full`: the all-reduce's message, the reduce-scatter's input, the all-gather's output
        if op == "all_reduce":
            dist.all_reduce(full, group=group)
        elif op == "ring_exchange":  # 09's ring step: to the next rank, from the one before, one batch
            ring = dist.get_process_group_ranks(group)
            at = ring.index(rank)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, ring[(at + 1) % g], group=group),
                                                dist.P2POp(dist.irecv, inbox[full.numel()], ring[at - 1], group=group)]):
                work.wait()
        elif op == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(torch.empty(full.numel() // g), full, group=group)
        elif op == "all_to_all_single":  # 10's dispatch and combine, equal splits: a g-th of it to each rank
            dist.all_to_all_single(inbox[full.numel()], full, group=group)
        else:
            dist.all_gather_into_tensor(full, torch.ones(full.numel() // g), group=group)

    def loop(kind):
        dist.all_reduce(done, group=world)  # start together
        t0 = time.perf_counter()
        for _ in range(a.calls):
            for _ in range(a.matmuls):
                x @ w
            if kind is not None:
                post(kind[0], messages[kind[1]])  # the call whose cost is measured: G ranks meet
        dist.all_reduce(done, group=world)  # end together: the slowest rank's loop (in every loop)
        return time.perf_counter() - t0

    kinds = [None, *((op, i) for op in a.op for i in range(len(messages)))]
    for kind in kinds[1:]:
        loop(kind)  # warm-up: connections, allocations
    times = {kind: [] for kind in kinds}
    for i in range(a.rounds):
        for kind in (kinds if i % 2 == 0 else kinds[::-1]):
            times[kind].append(loop(kind))
    without = min(times[None])
    by_op = {op: [max(0.0, (min(times[op, i]) - without) / a.calls) for i in range(len(messages))] for op in a.op}
    if dist.get_rank() == 0:
        print(json.dumps(dict(ranks=n, group=a.group, op=a.op[0], calls=a.calls, without_s=without,
                              bytes=[m.numel() * 4 for m in messages], seconds_per_call=by_op[a.op[0]],
                              by_op=by_op)), flush=True)
    dist.destroy_process_group()


def measure(ranks, calls=200, rounds=5, nbytes=(4,), matmuls=1, group=None, op=("all_reduce",)):
    """{ranks, group, bytes: [...], seconds_per_call: [...], by_op: {op: [...]}, ...} of
    `ranks` ranks on this host, each call meeting `group` of them (default: all), one figure
    per message size in `nbytes` and per collective in `op` (the harness's launch)."""
    sys.path.insert(0, os.path.dirname(HERE))
    from harness import launch
    run = launch(os.path.abspath(__file__), ["--rank_main", "--calls", calls, "--rounds", rounds, "--bytes", *nbytes,
                                             "--matmuls", matmuls, "--group", group or ranks, "--op",
                                             *([op] if isinstance(op, str) else op)],
                 nprocs=ranks, metrics=False, out_dir=False, timeout=600).ok()
    return json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bytes", type=int, nargs="+", default=[4], help="each all-reduce's message, one loop per size")
    p.add_argument("--matmuls", type=int, default=1, help="128x128 by 128x512 multiplies between two calls")
    p.add_argument("--group", type=int, default=None, help="the ranks each call meets (default: all): "
                   "at least 2, dividing --ranks")
    p.add_argument("--op", nargs="+", default=["all_reduce"],
                   choices=["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single",
                            "ring_exchange"],
                   help="the collectives timed, each once; --bytes is its whole buffer (the reduce-scatter's "
                        "input, the all-gather's output, the all-to-all's input, a g-th to each rank of the group; "
                        "ring_exchange: the message each rank sends to the next "
                        "rank of its group and receives from the one before, in one batch, as 09's ring does)")
    p.add_argument("--rank_main", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_main:
        return rank_main(a)
    if a.ranks < 2 or a.calls < 1 or a.rounds < 1 or min(a.bytes) < 1 or a.matmuls < 0:
        p.exit(2, "error: --ranks must be at least 2, and --calls, --rounds, --bytes positive\n")
    if len(set(a.op)) < len(a.op):
        p.exit(2, f"error: --op names each collective once, got {' '.join(a.op)}\n")
    if a.group is not None and not (2 <= a.group <= a.ranks and a.ranks % a.group == 0):
        p.exit(2, f"error: --group must be at least 2 and divide --ranks {a.ranks}, got {a.group}\n")
    print(json.dumps(measure(a.ranks, a.calls, a.rounds, a.bytes, a.matmuls, a.group, a.op)))


if __name__ == "__main__":
    main()
