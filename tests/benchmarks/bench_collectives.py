"""Benchmark: the raw collectives of one data-parallel step, at the sizes bench.py's model
sends, side by side on the same ranks: what 03_ddp.py and DDP send (one all-reduce of the
fp32 gradients, in DDP's two buckets: the first 1 MiB, then the rest), what
04_zero.py --stage 1 sends (a reduce-scatter of each unit's gradients, then an all-gather of
each unit's parameters) and what ZeroRedundancyOptimizer sends instead of the all-gather (a
broadcast of every parameter from the rank that updated it). Each pattern is issued as the
scripts issue it (every message asynchronously, then one wait for all), the patterns
interleaved round by round so that the machine's load falls on all of them alike. Rerun with

    python tests/benchmarks/bench_collectives.py                  # 2 ranks, bench.py's model
    python tests/benchmarks/bench_collectives.py --ranks 4 --rounds 30

Prints the median and the range over the rounds of each pattern's milliseconds, on rank 0.
On gloo a reduce-scatter is emulated (ProcessGroupGloo.cpp: the input cloned, all-reduced,
this rank's chunk copied out), so it costs an all-reduce of the same input and a copy; its
list form (`dist.reduce_scatter(shard, list(flat.chunk(N)))`, a different path in gloo) is
timed beside it. On NCCL it is the other way round: the list form is the one that copies,
into a new flat buffer (ProcessGroupNCCL's newLikeFlat), and the tensor form is NCCL's own."""

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def unit_sizes(n_layer, n_embd, block_size, vocab_size):
    """Elements of 04's units (the root: embeddings and the final norm; then each block),
    and of every parameter, from common.param_shapes (no model made)."""
    sys.path.insert(0, ROOT)
    from common import GPTConfig, param_shapes
    config = GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size, vocab_size=vocab_size,
                       dropout=0.0, bias=False)  # bench.py's model (the shakespeare preset's bias)
    shapes = param_shapes(config)
    units = [0] * (n_layer + 1)
    for name, shape in shapes.items():
        units[int(name.split(".")[2]) + 1 if name.startswith("transformer.h.") else 0] += math.prod(shape)
    return units, [math.prod(shape) for shape in shapes.values()]


def rank_main(a):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    units, params = unit_sizes(a.n_layer, a.n_embd, a.block_size, 65)
    psi = sum(units)
    first = (2**20) // 4  # DDP's first bucket: 1 MiB of fp32
    ddp = [torch.randn(first), torch.randn(psi - first)]
    padded = [-(-u // world) * world for u in units]
    zero_in = [torch.randn(n) for n in padded]
    zero_shard = [torch.empty(n // world) for n in padded]
    zero_full = [torch.empty(n) for n in padded]
    params = [torch.randn(n) for n in params]

    def all_reduce():  # 03 and DDP: the gradients' buckets
        return [dist.all_reduce(t, group=group, async_op=True) for t in ddp]

    def reduce_scatter():  # 04 stage 1: each unit's gradients, rank r keeps shard r
        return [dist.reduce_scatter_tensor(s, t, group=group, async_op=True) for s, t in zip(zero_shard, zero_in)]

    def reduce_scatter_list():  # the same, in the list form (gloo: another path, see the docstring)
        return [dist.reduce_scatter(s, list(t.chunk(world)), group=group, async_op=True)
                for s, t in zip(zero_shard, zero_in)]

    def all_gather():  # 04 stage 1-2 after the step: each unit's parameters from every rank's shard
        return [dist.all_gather_into_tensor(f, s.clone(), group=group, async_op=True)
                for f, s in zip(zero_full, zero_shard)]

    def broadcast():  # ZeroRedundancyOptimizer: every parameter from the rank that owns it
        return [dist.broadcast(p, group=group, group_src=i % world, async_op=True) for i, p in enumerate(params)]

    patterns = {"all_reduce (DDP, 03)": all_reduce, "reduce_scatter (04 s1)": reduce_scatter,
                "reduce_scatter, list form": reduce_scatter_list,
                "all_gather (04 s1)": all_gather, "broadcast (ZeroRedundancyOptimizer)": broadcast}
    times = {name: [] for name in patterns}
    for round_ in range(a.rounds + 2):
        for name, issue in patterns.items():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for handle in issue():
                handle.wait()
            if round_ >= 2:  # the first two rounds warm the connections up
                times[name].append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        print(f"{world} ranks, Ψ = {psi:,} fp32 ({psi * 4 / 2**20:.1f} MiB), units {units}, {len(params)} parameters; "
              f"ms over {a.rounds} rounds")
        for name, ts in times.items():
            print(f"  {name:38s} median {statistics.median(ts):6.2f}   range {min(ts):6.2f} - {max(ts):6.2f}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--rank_main", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_main:
        return rank_main(a)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from harness import launch
    run = launch(os.path.abspath(__file__), ["--rank_main", "--ranks", a.ranks, "--rounds", a.rounds,
                                             "--n_layer", a.n_layer, "--n_embd", a.n_embd, "--block_size", a.block_size],
                 nprocs=a.ranks, metrics=False, out_dir=False, env={"OMP_NUM_THREADS": "1"}, timeout=600)
    print(run.stdout, end="")
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
