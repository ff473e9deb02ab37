"""02_collectives.py: the collectives every strategy is built from, shown, checked, timed.

Each operation runs on small tensors; rank 0 prints what every rank held before and after,
and every rank checks its result against the definition. Under mpiexec the same operation
also runs through mpi4py on numpy buffers, so both APIs stand side by side. Rank r starts
with x_r = [10r, 10r+1, ..., 10r+N-1] (N = world size), so you can read the tables:

    all_reduce      every rank gets  Σ_r x_r                              (DDP: gradients)
    reduce          rank 0 gets      Σ_r x_r
    broadcast       every rank gets  x_0                                  (initial weights)
    all_gather      every rank gets  [x_0 | x_1 | ... | x_{N-1}]          (ZeRO-3/FSDP: params)
    gather          rank 0 gets      [x_0 | x_1 | ... | x_{N-1}]
    scatter         rank r gets      chunk r of rank 0's buffer
    reduce_scatter  rank r gets      chunk r of Σ_s x_s                   (ZeRO-2/FSDP: grads)
    all_to_all      rank r gets      [chunk r of x_0 | chunk r of x_1 | ...]  (MoE, Ulysses)
    send/recv       rank r gets      x_{r-1} (a ring shift)               (pipeline stages)
    barrier         nobody leaves before everybody has arrived

        all_reduce, N = 3                         reduce_scatter, N = 3
    before          after                     before            after
    r0 [0 1 2]      [30 33 36]                r0 [0  1  2]      [30]
    r1 [10 11 12]   [30 33 36]                r1 [10 11 12]     [33]
    r2 [20 21 22]   [30 33 36]                r2 [20 21 22]     [36]

The ring all-reduce, written here by hand from send/recv, is the algorithm behind NCCL's and
gloo's large all-reduces (Patarasuk & Yuan 2009). Cut the buffer of S bytes into N chunks.
Reduce-scatter phase: N-1 steps; in each, every rank sends one chunk to its right neighbour
and adds the chunk arriving from its left; afterwards rank r holds the full sum of chunk
r+1. All-gather phase: N-1 more steps pass the finished chunks around the ring. Every rank
sends 2(N-1) chunks of S/N bytes: 2(N-1)/N · S, which tends to 2S however many ranks there
are. That is why all-reduce costs about twice an all-gather or a reduce-scatter, each
(N-1)/N · S, and why ZeRO-2 (reduce-scatter + all-gather) moves no more than DDP.

Bandwidth, in nccl-tests' conventions (S = the size column, t = time per operation):
    algbw = S / t;  busbw = algbw · factor, the per-link traffic that you compare with the
    hardware: all_reduce 2(N-1)/N, all_gather and reduce_scatter and all_to_all (N-1)/N,
    broadcast 1. S is the buffer for all_reduce/broadcast, the output of all_gather, the
    input of reduce_scatter and all_to_all.

Before a job, the doctor (`--doctor`, see doctor() below) asks whether the allocation is
healthy: every rank's environment against what its facility documents (launcher, mpi4py,
device, CPU binding, backend, network plugin and libfabric settings), a matmul and a
host-to-device copy timed on every rank (a straggler is named), and the all_reduce sweep
inside and across nodes fitted to the ring's alpha-beta model, which `plan.py --measured`
then prices layouts with. It exits 0 when healthy, 2 with one line per problem.

Run:

    mpiexec -n 4 python 02_collectives.py                 # show and check every collective
    torchrun --standalone --nproc_per_node 8 02_collectives.py --bench --metrics bench.jsonl
    mpiexec -n 8 --ppn 4 python 02_collectives.py --doctor --json doctor.json   # before the job

Any world size >= 1 (send/recv needs 2 ranks and says so). gloo on CPU, nccl/xccl on GPUs.
Where a backend lacks reduce_scatter (gloo before torch 2.6), it falls back to all_reduce
followed by taking this rank's chunk: the same result at twice the traffic.
"""

import datetime
import importlib.util
import json
import math
import os
import re
import socket
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from common import base_parser, check, detect_launcher, log, mpi_comm, say, synchronize, teardown, xpu_backend


MAX_BYTES = 16 * 2**30  # the largest message a sweep may ask for: more than one GPU holds
SWEEP_BYTES = {"cpu": 16 * 2**20, "accelerator": 2**30}  # a sweep's largest message unless --max_bytes


def sweep_max_bytes(args, device):
    """The largest message of a sweep: --max_bytes, else 1 GiB on GPUs, 16 MiB on a CPU."""
    return args.max_bytes or SWEEP_BYTES["accelerator" if device.type in ("cuda", "xpu") else "cpu"]


def add_flags(parser):
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "xpu", "mps", "cpu"])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    parser.add_argument("--bench", action="store_true", help="time a sweep of message sizes")
    parser.add_argument("--min_bytes", type=int, default=1024)
    parser.add_argument("--max_bytes", type=int, default=None,
                        help="largest message (default: 16 MiB on CPU, 1 GiB on GPUs)")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per size")
    parser.add_argument("--metrics", default=None, help="JSONL: one row per (operation, size)")
    g = parser.add_argument_group("the doctor: is this allocation healthy? (see doctor())")
    g.add_argument("--doctor", action="store_true",
                   help="check the environment of every rank, time every GPU, sweep the links inside and across "
                        "nodes; exit 0 when healthy, 2 with one line per problem")
    g.add_argument("--machine", default=None, choices=sorted(DOCUMENTED),
                   help="the facility whose documented settings to check (default: recognised from the environment)")
    g.add_argument("--json", default=None, help="write everything the doctor saw and measured to this file")
    g.add_argument("--straggler_margin", type=float, default=STRAGGLER_MARGIN,
                   help="a rank or node this much slower than the median of the others is a straggler")
    return parser


# ---------------------------------------------------------------------------------------
# The hand-written ring all-reduce
# ---------------------------------------------------------------------------------------

def ring_all_reduce(tensor, group):
    """Sum `tensor` across the ranks of `group` in place with 2(N-1) neighbour exchanges.
    The neighbours are numbered inside the group (group_peer), so the ring works the same in
    any subgroup of a bigger job."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return tensor
    chunks = list(tensor.view(-1).tensor_split(n))  # views into tensor
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send_chunk, recv_into):
        # send one chunk right while receiving one from the left: posted together, so the
        # ring cannot deadlock (every rank would otherwise wait in send for its neighbour)
        ops = [dist.P2POp(dist.isend, send_chunk, group=group, group_peer=right),
               dist.P2POp(dist.irecv, recv_into, group=group, group_peer=left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    # reduce-scatter phase: at step s, send chunk r-s, add the incoming chunk r-s-1
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        exchange(chunks[(rank - s) % n], incoming)
        chunks[(rank - s - 1) % n] += incoming
    # now chunk r+1 is complete here; all-gather phase: pass the complete chunks on
    for s in range(n - 1):
        exchange(chunks[(rank - s + 1) % n], chunks[(rank - s) % n])
    return tensor


def reduce_scatter(output, input, group):
    """reduce_scatter_tensor, with the documented fallback for backends that lack it."""
    try:
        dist.reduce_scatter_tensor(output, input, group=group)  # rank r gets chunk r of the sum
    except (RuntimeError, NotImplementedError):  # e.g. gloo before torch 2.6
        total = input.clone()
        dist.all_reduce(total, group=group)  # everyone gets the whole sum (twice the traffic) ...
        output.copy_(total.view(dist.get_world_size(group), -1)[dist.get_rank(group)])  # ... keeps its chunk


# ---------------------------------------------------------------------------------------
# Show and check each collective
# ---------------------------------------------------------------------------------------

def start_values(rank, n, device, rows=1):
    """x_r = [10r, 10r+1, ..., 10r+N·rows-1], float32 (exact sums)."""
    return torch.arange(n * rows, dtype=torch.float32, device=device) + 10 * rank


def show(env, group, name, before, after, ok, mpi_ok):
    """Gather every rank's before/after and verdict to rank 0 and print one table."""
    row = (fmt(before), fmt(after), ok, mpi_ok)
    rows = [None] * env.world_size
    dist.all_gather_object(rows, row, group=group)  # just for display
    width = max(len(r[0]) for r in rows)
    lines = [f"{name}:"]
    for rank, (b, a, _, _) in enumerate(rows):
        lines.append(f"  rank {rank}  {b:<{width}}  ->  {a}")
    verdicts = [r[2] for r in rows]
    mpi = {r[3] for r in rows}
    mpi_text = "" if mpi == {None} else ("; mpi4py agrees" if mpi == {True} else "; mpi4py DIFFERS")
    lines.append(f"  {'ok' if all(verdicts) else 'WRONG on ranks ' + str([i for i, v in enumerate(verdicts) if not v])}"
                 f"{mpi_text}")
    log(env, "\n".join(lines))
    return all(verdicts) and False not in mpi


def fmt(value):
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return " | ".join(fmt(v) for v in value)
    return "[" + " ".join(f"{v:g}" for v in value.tolist()) + "]"


def run_checks(env, world):
    """Every collective once over `world` (every call names its group, as in the training
    scripts; the ranks below are its ranks), checked against its definition; returns the
    failures."""
    n, r, dev = env.world_size, env.rank, env.device
    comm = mpi_comm()
    x = lambda rank=r: start_values(rank, n, dev)
    total = sum(start_values(s, n, "cpu") for s in range(n)).to(dev)
    np_x = start_values(r, n, "cpu").numpy()
    failures = []

    def record(name, before, after, ok, mpi_ok=None):
        if not show(env, world, name, before, after, ok, mpi_ok):
            failures.append(name)

    # all_reduce: everyone gets the sum
    t = x()
    dist.all_reduce(t, group=world)  # sum of every rank's x_r, result on every rank
    mpi_ok = None
    if comm:
        out = np.empty_like(np_x)
        comm.Allreduce(np_x, out)  # mpi4py: buffers are numpy arrays; op defaults to SUM
        mpi_ok = np.array_equal(out, t.cpu().numpy())
    record("all_reduce (sum)", x(), t, torch.equal(t, total), mpi_ok)

    # reduce: only the destination gets the sum
    t = x()
    dist.reduce(t, group=world, group_dst=0)  # the sum lands on rank 0; other ranks' buffers are scratch
    if comm:
        out = np.empty_like(np_x) if r == 0 else None
        comm.Reduce(np_x, out, root=0)
        mpi_ok = bool(np.array_equal(out, t.cpu().numpy())) if r == 0 else True
    record("reduce (sum to rank 0)", x(), t if r == 0 else None, r != 0 or torch.equal(t, total), mpi_ok)

    # broadcast: everyone gets rank 0's tensor
    t = x()
    dist.broadcast(t, group=world, group_src=0)  # rank 0's x_0 overwrites everyone's
    if comm:
        buf = np_x.copy()
        comm.Bcast(buf, root=0)
        mpi_ok = np.array_equal(buf, t.cpu().numpy())
    record("broadcast (from rank 0)", x(), t, torch.equal(t, x(0)), mpi_ok)

    # all_gather, list form and into one tensor
    parts = [torch.empty(n, device=dev) for _ in range(n)]
    dist.all_gather(parts, x(), group=world)  # parts[s] = x_s on every rank
    ok = all(torch.equal(parts[s], x(s)) for s in range(n))
    flat = torch.empty(n * n, device=dev)
    dist.all_gather_into_tensor(flat, x(), group=world)  # the same, concatenated in one buffer
    ok = ok and torch.equal(flat, torch.cat([x(s) for s in range(n)]))
    if comm:
        out = np.empty(n * n, dtype=np.float32)
        comm.Allgather(np_x, out)
        mpi_ok = np.array_equal(out, flat.cpu().numpy())
    record("all_gather (list and into one tensor)", x(), flat, ok, mpi_ok)

    # gather: only the destination gets the list
    parts = [torch.empty(n, device=dev) for _ in range(n)] if r == 0 else None
    dist.gather(x(), parts, group=world, group_dst=0)  # rank 0 receives x_s from every rank s
    if comm:
        out = np.empty(n * n, dtype=np.float32) if r == 0 else None
        comm.Gather(np_x, out, root=0)
        mpi_ok = bool(np.array_equal(out, torch.cat(parts).cpu().numpy())) if r == 0 else True
    record("gather (to rank 0)", x(), parts, r != 0 or all(torch.equal(parts[s], x(s)) for s in range(n)), mpi_ok)

    # scatter: rank 0's buffer is cut into N pieces, piece r goes to rank r
    pieces = [torch.full((2,), 100.0 + s, device=dev) for s in range(n)] if r == 0 else None
    t = torch.zeros(2, device=dev)
    dist.scatter(t, pieces, group=world, group_src=0)  # rank r receives rank 0's pieces[r]
    if comm:
        send = np.repeat(100.0 + np.arange(n, dtype=np.float32), 2) if r == 0 else None
        out = np.empty(2, dtype=np.float32)
        comm.Scatter(send, out, root=0)
        mpi_ok = np.array_equal(out, t.cpu().numpy())
    record("scatter (from rank 0)", pieces, t, torch.equal(t, torch.full((2,), 100.0 + r, device=dev)), mpi_ok)

    # reduce_scatter: rank r gets chunk r of the sum (2 elements per chunk)
    xs = start_values(r, n, dev, rows=2)
    t = torch.empty(2, device=dev)
    reduce_scatter(t, xs, world)
    expected = sum(start_values(s, n, "cpu", rows=2) for s in range(n)).view(n, 2)[r].to(dev)
    if comm:
        out = np.empty(2, dtype=np.float32)
        comm.Reduce_scatter_block(xs.cpu().numpy(), out)
        mpi_ok = np.array_equal(out, t.cpu().numpy())
    record("reduce_scatter (sum, chunk r to rank r)", xs, t, torch.equal(t, expected), mpi_ok)

    # all_to_all: rank r sends its chunk s to rank s, and receives chunk r of everyone's
    t = torch.empty(n, device=dev)
    dist.all_to_all_single(t, x(), group=world)  # out[s] = x_s[r]: a transpose across ranks
    parts = [torch.empty(1, device=dev) for _ in range(n)]
    dist.all_to_all(parts, list(x().split(1)), group=world)  # the list form, the same exchange
    expected = torch.stack([x(s)[r] for s in range(n)])
    ok = torch.equal(t, expected) and torch.equal(torch.cat(parts), expected)
    if comm:
        out = np.empty(n, dtype=np.float32)
        comm.Alltoall(np_x, out)
        mpi_ok = np.array_equal(out, t.cpu().numpy())
    record("all_to_all (single and list)", x(), t, ok, mpi_ok)

    # send/recv: a ring shift, first with blocking calls ordered by parity, then batched
    if n == 1:
        log(env, "send/recv: needs at least 2 ranks (skipped)")
    else:
        right, left = (r + 1) % n, (r - 1) % n
        got = torch.empty(n, device=dev)
        if r % 2 == 0:  # even ranks send first and odd ranks receive first: no deadlock
            dist.send(x(), group=world, group_dst=right)
            dist.recv(got, group=world, group_src=left)
        else:
            dist.recv(got, group=world, group_src=left)
            dist.send(x(), group=world, group_dst=right)
        batched = torch.empty(n, device=dev)
        ops = [dist.P2POp(dist.isend, x(), group=world, group_peer=right),
               dist.P2POp(dist.irecv, batched, group=world, group_peer=left)]
        for request in dist.batch_isend_irecv(ops):  # both posted at once, any order is safe
            request.wait()
        if comm:
            out = np.empty_like(np_x)
            comm.Sendrecv(np_x, dest=right, recvbuf=out, source=left)
            mpi_ok = np.array_equal(out, got.cpu().numpy())
        record("send/recv and batch_isend_irecv (ring shift right)", x(), got,
               torch.equal(got, x(left)) and torch.equal(batched, x(left)), mpi_ok)

    # barrier: rank r arrives r·0.1 s late; rank 0 must wait for the last one
    time.sleep(0.1 * r)
    t0 = time.perf_counter()
    dist.barrier(group=world)  # nobody continues until all have arrived
    waited = time.perf_counter() - t0
    if comm:
        comm.Barrier()
    expected_wait = 0.1 * (n - 1 - r)
    record("barrier (rank r arrives 0.1·r s late)", None, torch.tensor([round(waited, 2)]),
           waited >= 0.8 * expected_wait)

    # the hand-written ring all-reduce equals dist.all_reduce, also for sizes not divisible by N
    ok = True
    for numel in (1, n, 7 * n + 3, 1000):
        t = torch.arange(numel, dtype=torch.float32, device=dev) * (r + 1)
        reference = t.clone()
        dist.all_reduce(reference, group=world)
        ok = ok and torch.equal(ring_all_reduce(t, world), reference)
    record("ring all_reduce by hand (sizes 1, N, 7N+3, 1000)", x(), ring_all_reduce(x(), world), ok)
    return failures


# ---------------------------------------------------------------------------------------
# Bandwidth sweep
# ---------------------------------------------------------------------------------------

def bus_factor(op, n):
    return {"all_reduce": 2 * (n - 1) / n, "ring_all_reduce": 2 * (n - 1) / n, "broadcast": 1.0,
            "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}[op]


def bench(env, args, world):
    n, dev = env.world_size, env.device
    max_bytes = sweep_max_bytes(args, dev)
    sizes, size = [], args.min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    ops = {
        "all_reduce": lambda b: lambda: dist.all_reduce(b["full"], group=world),
        "all_gather": lambda b: lambda: dist.all_gather_into_tensor(b["full"], b["chunk"], group=world),
        "reduce_scatter": lambda b: lambda: reduce_scatter(b["chunk"], b["full"], world),
        "broadcast": lambda b: lambda: dist.broadcast(b["full"], group=world, group_src=0),
        "all_to_all": lambda b: lambda: dist.all_to_all_single(b["out"], b["full"], group=world),
        "ring_all_reduce": lambda b: lambda: ring_all_reduce(b["full"], world),
    }
    log(env, f"{'operation':<16} {'size':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    rows = []
    for name, make in ops.items():
        for size in sizes:
            numel = max(n, size // 4 // n * n)  # float32, a multiple of N
            buffers = {"full": torch.ones(numel, device=dev), "chunk": torch.ones(numel // n, device=dev),
                       "out": torch.empty(numel, device=dev)}
            op = make(buffers)
            for _ in range(2):  # warm-up: connections, algorithm selection
                op()
            synchronize(env)
            dist.barrier(group=world)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                op()
            synchronize(env)
            seconds = torch.tensor([(time.perf_counter() - t0) / args.iters], device=dev)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=world)  # the slowest rank's time
            seconds = seconds.item()
            nbytes = numel * 4
            algbw = nbytes / seconds / 1e9
            row = dict(op=name, bytes=nbytes, world_size=n, ranks_per_node=env.launch.local_world_size,
                       time_us=seconds * 1e6, algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(name, n),
                       backend=env.backend)
            rows.append(row)
            log(env, f"{name:<16} {nbytes:>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} {row['busbw_GBps']:>11.3f}")
    return rows


# ---------------------------------------------------------------------------------------
# The doctor: is this allocation healthy, and what do its links really do?
# ---------------------------------------------------------------------------------------
#
# What goes wrong first on a real allocation is rarely the strategy: mpi4py built against
# another MPI, a rank that sees the wrong GPU or runs on the far socket, a network plugin
# that is not loaded (RCCL then talks TCP sockets between nodes), a libfabric setting that
# hangs, a slow node. `--doctor` checks all of that in three passes, each rank reporting to
# rank 0, which prints one line per problem:
#
#   environment   per rank, a pure function of (environment variables, what the rank sees):
#                 check_environment(); and per node, across its ranks: check_nodes()
#   hardware      a matmul and a host-to-device copy timed on every rank (best of --iters);
#                 a rank, or a node, slower than the median of the others by more than
#                 --straggler_margin is a straggler: stragglers()
#   network       the all_reduce sweep of --bench inside each node and across nodes (one
#                 group per node; one group per local rank across the nodes), each link
#                 type fitted to the ring's alpha-beta model, the one plan.py prices with:
#
#                     t(S) = 2(g-1)·alpha + 2(g-1)/g · S / beta      (fit_link())
#
#                 alpha: the latency of one ring step; beta: the bandwidth of the link, the
#                 bus bandwidth of a large message. A link below LINK_FRACTION of its
#                 datasheet figure (plan.MACHINES) is a problem. `plan.py --measured
#                 FILE` prices layouts with these alpha and beta instead of the datasheet's.

STRAGGLER_MARGIN = 0.2  # 20% slower than the median of the others
LINK_FRACTION = 0.25    # a link below a quarter of its datasheet bandwidth: TCP sockets, a missing plugin
RESERVED = object()     # marks a documented value that must stay unset

# What each facility documents (jobs/README.md gives the pages; jobs/*.sh set these). For
# each machine: how it is recognised, the module that brings torch, the backend, how many
# devices one rank should see, the launch line that binds ranks to cores, the CPUs next to
# each device (sysfs's local_cpulist is read first; these tables stand in where it is
# missing), reserved cores, and the variables to check: name -> (good values, why, fix).
DOCUMENTED = {
    "polaris": dict(
        site="ALCF Polaris", module="module use /soft/modulefiles; module load conda; conda activate",
        backends=("nccl",), devices_per_rank=1,
        launch="mpiexec --ppn 4 --depth 8 --cpu-bind depth jobs/polaris_gpu_affinity.sh python ...",
        gpu_fix="launch through jobs/polaris_gpu_affinity.sh (CUDA_VISIBLE_DEVICES = 3 - local rank, ALCF's "
                "set_affinity_gpu_polaris.sh)",
        # ALCF "Polaris Device Affinity Information": GPU g sits on NUMA domain 3 - g
        device_cpus={0: "24-31,56-63", 1: "16-23,48-55", 2: "8-15,40-47", 3: "0-7,32-39"},
        reserved_cores="", plugin="libnccl-net",
        # ALCF's NCCL page puts the plugin on the path itself; its sentence saying the conda module
        # sets these variables has been commented out since 2024-11-07 (jobs/README.md)
        plugin_fix="export LD_LIBRARY_PATH=/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:/soft/libraries/hwloc/lib/:"
                   "$LD_LIBRARY_PATH, as ALCF's NCCL page does (jobs/polaris.sh does)",
        multi_node={"NCCL_NET": (("AWS Libfabric",), "NCCL over libfabric, never TCP sockets (ALCF's NCCL page)")},
        # the page's remedy when the plugin hangs a pipeline job: these four unset (NCCL_PLUGIN=off)
        plugin_off=("NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "NCCL_COLLNET_ENABLE", "NCCL_NET"),
        recommended=["NCCL_NET_GDR_LEVEL=PHB", "NCCL_CROSS_NIC=1", "NCCL_COLLNET_ENABLE=1",
                     "FI_CXI_DISABLE_HOST_REGISTER=1", "FI_MR_CACHE_MONITOR=userfaultfd",
                     "FI_CXI_DEFAULT_CQ_SIZE=131072"]),
    "aurora": dict(
        site="ALCF Aurora", module="module load frameworks", backends=("xccl", "ccl"), devices_per_rank=12,
        launch="mpiexec --ppn 12 --cpu-bind list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79",
        gpu_fix="export ZE_FLAT_DEVICE_HIERARCHY=FLAT (one device per tile; the frameworks module's default) and "
                "no per-rank ZE_AFFINITY_MASK",
        # 2 sockets of 52 cores (+104: their hyperthreads); GPUs 0-2 (tiles 0-5) on socket 0
        device_cpus={t: ("0-51,104-155" if t < 6 else "52-103,156-207") for t in range(12)},
        # "Since March 31, 2025, cores 0 (104) and 52 (156) ... reserved for system services"
        # (ALCF's running-jobs page; argonne-lcf/user-guides #836)
        reserved_cores="0,52,104,156", plugin=None, plugin_fix="",
        # the oneCCL page's "Minimal set", "essential for functionality for training workloads";
        # its userfaultfd, not the tuning list's FI_MR_CACHE_MONITOR=disabled (jobs/aurora.sh)
        multi_node={"CCL_PROCESS_LAUNCHER": (("pmix",), "oneCCL learns the ranks from PALS' PMIx"),
                    "CCL_ATL_TRANSPORT": (("mpi",), "oneCCL moves data across nodes over MPI"),
                    "FI_MR_CACHE_MONITOR": (("userfaultfd",), "the oneCCL page's minimal set"),
                    "CCL_KVS_MODE": (("mpi",), "oneCCL's key-value store bootstraps over MPI")},
        recommended=["CCL_KVS_USE_MPI_RANKS=1", "CCL_CONFIGURATION=cpu_gpu_dpcpp", "FI_CXI_RX_MATCH_MODE=hybrid"]),
    "frontier": dict(
        site="OLCF Frontier", module="module load rocm/$ROCM_VERSION rccl-net-plugin (your ROCm PyTorch environment)",
        backends=("nccl",), devices_per_rank=1,
        launch="srun -N n -n N -c7 --gpus-per-task=1 --gpu-bind=closest python ...",
        gpu_fix="srun ... -c7 --gpus-per-task=1 --gpu-bind=closest (each task then sees its own GCD as device 0)",
        device_cpus={}, reserved_cores="", plugin="librccl-net",
        plugin_fix="module load rccl-net-plugin after rocm, or set NCCL_NET_PLUGIN to your librccl-net.so "
                   "(jobs/frontier.sh: RCCL_NET_PLUGIN_DIR)",
        multi_node={"NCCL_NET": (("OFI",), "RCCL stops if the plugin is not initialised, instead of falling back "
                                           "to TCP sockets (OLCF's PyTorch page)")},
        single_node={"NCCL_NET": (("Socket", None), "the network is not configured for single-node jobs and the "
                                                    "plugin will not initialise (OLCF)")},
        recommended=["NCCL_CROSS_NIC=1", "NCCL_NET_GDR_LEVEL=PHB", "HSA_FORCE_FINE_GRAIN_PCIE=1",
                     "FI_CXI_DISABLE_HOST_REGISTER=1", "FI_CXI_DEFAULT_CQ_SIZE=131072", "FI_CXI_DEFAULT_TX_SIZE=2048",
                     "FI_CXI_RX_MATCH_MODE=hybrid"]),
    "perlmutter": dict(
        site="NERSC Perlmutter", module="module load pytorch", backends=("nccl",), devices_per_rank=None,
        launch="srun --ntasks-per-node 4 -c 32 --cpu-bind=cores --gpus-per-node 4 --gpu-bind=none python ... "
               "with CUDA_VISIBLE_DEVICES=3,2,1,0",
        gpu_fix="export CUDA_VISIBLE_DEVICES=3,2,1,0 (NERSC's scripts: the GPU order that matches Slurm's default "
                "CPU binding)",
        # one 64-core EPYC in 4 NUMA domains of 16 cores; GPU g next to domain 3 - g (jobs/README.md)
        device_cpus={g: f"{16 * (3 - g)}-{16 * (3 - g) + 15},{64 + 16 * (3 - g)}-{64 + 16 * (3 - g) + 15}"
                     for g in range(4)},
        reserved_cores="", plugin=None, plugin_fix="", multi_node={},
        recommended=["FI_MR_CACHE_MONITOR=userfaultfd"]),
}

# How a machine is recognised: (variable, text it contains, machine), first match wins. The
# module system and the schedulers name the cluster; PBS_O_HOST is the login node.
RECOGNISE = [("NERSC_HOST", "perlmutter", "perlmutter"), ("SLURM_CLUSTER_NAME", "perlmutter", "perlmutter"),
             ("LMOD_SYSTEM_NAME", "perlmutter", "perlmutter"), ("SLURM_CLUSTER_NAME", "frontier", "frontier"),
             ("LMOD_SYSTEM_NAME", "frontier", "frontier"), ("PBS_O_HOST", "polaris", "polaris"),
             ("PBS_O_HOST", "aurora", "aurora"), ("HOSTNAME", ".polaris.alcf", "polaris"),
             ("HOSTNAME", ".aurora.alcf", "aurora"), ("HOSTNAME", "frontier", "frontier")]


def recognise_machine(environ, hostname=""):
    """(machine or None, how it was recognised): from the schedulers' and the module system's
    variables, then the host name."""
    seen = dict(environ, HOSTNAME=environ.get("HOSTNAME") or hostname)
    for variable, text, machine in RECOGNISE:
        if text in seen.get(variable, "").lower():
            return machine, f"{variable}={seen[variable]}"
    return None, "no PBS/Slurm cluster name, module system or host name that names one of " + ", ".join(DOCUMENTED)


def cpu_set(text):
    """'0-7,32-39' -> {0, ..., 7, 32, ..., 39} (a cpulist, as Linux and the launchers write them)."""
    cpus = set()
    for part in filter(None, str(text).replace(" ", "").split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def cpu_ranges(text, limit=None):
    """'0-7,32-39' -> [(0, 7), (32, 39)] without building the sets (a typo's 0-99999999999 costs
    nothing); None when it is not a cpulist, or names a CPU at or beyond `limit`."""
    runs = []
    for part in filter(None, str(text).replace(" ", "").split(",")):
        low, _, high = part.partition("-")
        if not (low.isdigit() and (high or low).isdigit()) or int(high or low) < int(low):
            return None
        runs.append((int(low), int(high or low)))
    return None if limit is not None and any(high >= limit for _, high in runs) else runs


def shown(value, width=60):
    """An environment value as a line shows it: escaped, and cut when long."""
    text = ascii(value)[1:-1]
    return text if len(text) <= width else text[:width] + f"... ({len(value)} characters)"


def environment_count(environ, name):
    """A whole number from the environment (None: unset); anything else stops the doctor with
    one line naming the variable, on every rank."""
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    check(value.strip().isdigit(), f"{name}={shown(value)} in the environment is not a whole number: "
          "unset it, or give the number of nodes of the job")
    return int(value)


WARNING = "warning: "  # a line check_environment returns that is said, but is no problem (exit 0)


def cpu_list(cpus):
    """The inverse of cpu_set: {0, 1, 2, 5} -> '0-2,5'."""
    runs, cpus = [], sorted(cpus)
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs) or "none"


def find_library(environ, prefix):
    """The first `prefix*.so` on LD_LIBRARY_PATH (or NCCL_NET_PLUGIN's file), or None."""
    plugin = environ.get("NCCL_NET_PLUGIN", "")
    if os.path.basename(plugin).startswith(prefix) and os.path.isfile(plugin):
        return plugin
    for folder in filter(None, environ.get("LD_LIBRARY_PATH", "").split(":")):
        try:
            found = sorted(f for f in os.listdir(folder) if f.startswith(prefix) and ".so" in f)
        except OSError:
            continue
        if found:
            return os.path.join(folder, found[0])
    return None


def local_facts(environ, launch):
    """What this rank sees before any process group exists: its launcher's variables, what
    mpi4py's MPI says (under mpiexec), its CPU binding, the torch backends and accelerators,
    the network plugins on its library path."""
    facts = dict(host=socket.gethostname(), launcher=launch.kind, rank=launch.rank, world_size=launch.world_size,
                 local_rank=launch.local_rank, local_world_size=launch.local_world_size, cpus=os.cpu_count(),
                 affinity=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                 torch=torch.__version__, hip=getattr(torch.version, "hip", None), mpi=None,
                 libraries={p: find_library(environ, p) for p in ("librccl-net", "libnccl-net")})
    nodefile = environ.get("PBS_NODEFILE")
    if nodefile and os.path.isfile(nodefile):
        with open(nodefile) as f:
            facts["pbs_nodes"] = len({line.strip() for line in f if line.strip()})
    if launch.kind == "mpi":
        try:
            from mpi4py import MPI  # MPI_Init: under mpiexec only, as common.setup does
            facts["mpi"] = dict(size=MPI.COMM_WORLD.Get_size(), rank=MPI.COMM_WORLD.Get_rank(),
                                library=" ".join(MPI.Get_library_version().split())[:60])
        except ImportError as e:
            facts["mpi"] = dict(error=str(e))
    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    facts["accelerators"] = dict(cuda=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                                 xpu=torch.xpu.device_count() if xpu else 0)
    facts["backends"] = dict(nccl=dist.is_nccl_available(), gloo=dist.is_gloo_available(),
                             xccl=bool(getattr(dist, "is_xccl_available", lambda: False)()),
                             ccl=importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None)
    return facts


def device_facts(environ, device):
    """The device this rank computes on: its index, name, the physical device behind it (the
    visible-devices variable's entry), a unique id, and the CPUs next to it (sysfs)."""
    info = dict(type=device.type, index=device.index, name=None, physical=None, uid=None, near_cpus=None)
    if device.type not in ("cuda", "xpu"):
        return info
    module = torch.cuda if device.type == "cuda" else torch.xpu
    props = module.get_device_properties(device)
    info["name"] = props.name
    visible = next((environ[v] for v in ("ZE_AFFINITY_MASK", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                                         "CUDA_VISIBLE_DEVICES") if environ.get(v)), None)
    entries = visible.split(",") if visible else None
    physical = entries[device.index] if entries and device.index < len(entries) else str(device.index)
    info["physical"] = int(physical) if physical.isdigit() else physical
    info["uid"] = str(getattr(props, "uuid", "") or physical)
    if hasattr(props, "pci_bus_id"):  # the CPUs on the device's NUMA domain, as the kernel knows them
        address = f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        try:
            with open(f"/sys/bus/pci/devices/{address}/local_cpulist") as f:
                info["near_cpus"] = f.read().strip()
        except OSError:
            pass
    return info


def _known_bad_monitor(environ, machine):
    """libfabric's memory-registration cache monitor: memhooks can hang RCCL and NCCL over the
    CXI provider (HPE's guidance, olcf-user-docs #947); on Frontier an unset one was memhooks."""
    value = environ.get("FI_MR_CACHE_MONITOR")
    if value == "memhooks":
        return ("FI_MR_CACHE_MONITOR=memhooks can hang RCCL/NCCL on Slingshot (olcf-user-docs #947): export "
                f"FI_MR_CACHE_MONITOR={'kdreg2' if machine == 'frontier' else 'userfaultfd'}")
    if value is None and machine == "frontier":
        return ("FI_MR_CACHE_MONITOR is unset (libfabric's default was memhooks, which can hang RCCL: "
                "olcf-user-docs #947): export FI_MR_CACHE_MONITOR=kdreg2")
    return None


def check_environment(environ, facts, machine=None):
    """The problems one rank's environment has, one line each naming what to set or load: a
    pure function of the environment variables and of what the rank saw (local_facts, plus
    `device` from device_facts), so that recorded environments can be checked anywhere."""
    doc = DOCUMENTED.get(machine, {})
    problems = []
    job = environ.get("PBS_JOBID") or environ.get("SLURM_JOB_ID")
    nodes = facts.get("nodes") or environment_count(environ, "SLURM_JOB_NUM_NODES") or \
        environment_count(environ, "SLURM_NNODES") or facts.get("pbs_nodes") or 1
    # the launcher: one process in a multi-node allocation trains on one GPU of one node
    if facts["launcher"] == "single" and job and nodes > 1:
        problems.append(f"one process in a {nodes}-node job: launch with {doc.get('launch', 'mpiexec or srun')}")
    # mpi4py against the launcher's MPI: built against another MPI, every rank is rank 0 of 1
    mpi = facts.get("mpi")
    if mpi and "error" in mpi and not environ.get("SLURM_PROCID"):
        problems.append(f"launched by mpiexec but mpi4py does not import ({mpi['error']}): "
                        "MPICC=cc pip install --no-binary mpi4py mpi4py, against this MPI")
    elif mpi and "size" in mpi and (mpi["size"], mpi["rank"]) != (facts["world_size"], facts["rank"]):
        # common.setup then meets through Slurm's variables or MASTER_ADDR/PORT, as training does
        # (facts["rendezvous"]: the launcher it fell back to): said, but the job runs
        fallback = {"slurm": "Slurm's variables", "env": "MASTER_ADDR and MASTER_PORT"}.get(facts.get("rendezvous"))
        line = (f"mpi4py's MPI ({mpi['library']}) sees rank {mpi['rank']} of {mpi['size']} where the "
                f"launcher started rank {facts['rank']} of {facts['world_size']}: mpi4py is built against "
                "another MPI; rebuild it against the launcher's: "
                "MPICC=cc pip install --force-reinstall --no-binary mpi4py mpi4py")
        problems.append(WARNING + line + f" (the ranks met through {fallback} instead, as training does)"
                        if fallback else line)
    elif mpi and "library" in mpi:
        family = "Open MPI" if "OMPI_COMM_WORLD_RANK" in environ else "MPICH" if (
            "PMI_RANK" in environ or "PALS_RANKID" in environ) else None
        if family == "Open MPI" and "open mpi" not in mpi["library"].lower() or \
                family == "MPICH" and "open mpi" in mpi["library"].lower():
            problems.append(f"the launcher is {family}'s but mpi4py's MPI is {mpi['library']}: rebuild mpi4py "
                            "against the launcher's MPI (MPICC=cc pip install --no-binary mpi4py mpi4py)")
    # the device: an accelerator, of the expected kind, as many visible as the facility binds
    accelerators = facts["accelerators"]
    device = facts.get("device") or {}
    if job and not any(accelerators.values()):
        problems.append(f"no GPU visible to torch {facts['torch']} in batch job {job}: "
                        f"{doc.get('module', 'load the facility PyTorch module')} (a CPU torch cannot see one)")
    want = doc.get("devices_per_rank")
    seen = accelerators["cuda"] or accelerators["xpu"]
    if want and seen and seen != want:
        problems.append(f"each rank sees {seen} device(s) where {doc['site']} gives it {want}: {doc['gpu_fix']}")
    wanted_backends = doc.get("backends") or ({"cuda": ("nccl",), "xpu": ("xccl", "ccl")}.get(device.get("type")))
    if wanted_backends and device.get("type") in ("cuda", "xpu") and not any(facts["backends"].get(b)
                                                                               for b in wanted_backends):
        problems.append(f"torch has no {' or '.join(wanted_backends)} backend for its {device['type']} devices: "
                        f"{doc.get('module', 'install a PyTorch built with it')}")
    # CPU binding: bound at all, next to the device, clear of reserved cores and of oneCCL's workers
    affinity = set(facts["affinity"] or [])
    all_cpus = set(range(facts["cpus"] or 0))
    local = facts.get("local_world_size") or 1
    if machine and affinity and affinity >= all_cpus and local > 1:
        problems.append(f"not bound to cores (may run on any of the {len(all_cpus)} CPUs, next to another "
                        f"rank's GPU): launch with {doc['launch']}")
    else:
        near = device.get("near_cpus") or doc.get("device_cpus", {}).get(device.get("physical"))
        if near and affinity and not affinity <= cpu_set(near):
            problems.append(f"runs on CPUs {cpu_list(affinity)}, not next to its device {device.get('physical')} "
                            f"(CPUs {near}): bind as {doc.get('launch', 'the facility documents')}")
    reserved = cpu_set(doc.get("reserved_cores", ""))
    if affinity & reserved:
        problems.append(f"bound to reserved core(s) {cpu_list(affinity & reserved)} (kept for system services on "
                        f"{doc['site']} since 31 March 2025, user-guides #836): {doc['launch']}")
    workers = environ.get("CCL_WORKER_AFFINITY")
    if workers is not None and machine == "aurora" and workers.strip() not in ("", "auto"):
        # counted range by range, never built: a typo's 0-99999999999 is a line, not a MemoryError
        runs = cpu_ranges(workers, limit=max(facts["cpus"] or 0, max(affinity | reserved, default=-1) + 1) or None)
        used = {c for c in affinity | reserved if any(low <= c <= high for low, high in runs or [])}
        if runs is None:
            problems.append(f"CCL_WORKER_AFFINITY={shown(workers)} is not a list of this node's cores "
                            f"(0-{(facts['cpus'] or 1) - 1}): list one free core per local rank, or unset it")
        elif used:
            problems.append(f"CCL_WORKER_AFFINITY={shown(workers)} puts oneCCL's workers on core(s) "
                            f"{cpu_list(used)}, which this rank or the system uses "
                            "(ezpz #34): unset CCL_WORKER_AFFINITY, or list one free core per local rank")
        elif sum(high - low + 1 for low, high in runs) < local:
            problems.append(f"CCL_WORKER_AFFINITY={shown(workers)} names {sum(h - l + 1 for l, h in runs)} core(s) "
                            f"for {local} local ranks: list one core per local rank, or unset it")
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and affinity and int(threads) > len(affinity):
        problems.append(f"OMP_NUM_THREADS={threads} threads on {len(affinity)} bound CPU(s): "
                        f"export OMP_NUM_THREADS={len(affinity)}")
    # the facility's variables
    bad = _known_bad_monitor(environ, machine)
    if bad:
        problems.append(bad)
    # Polaris: NCCL_PLUGIN=off (jobs/polaris.sh), or the four unset by hand with the rest of the
    # page's set in place, is ALCF's own remedy for a pipeline job the plugin hangs: one warning
    off = doc.get("plugin_off", ())
    rest = [v for v in doc.get("recommended", []) if v.split("=")[0] not in off]
    plugin_off = bool(off) and nodes > 1 and (environ.get("NCCL_PLUGIN") == "off" or not any(
        v in environ for v in off) and all(environ.get(v.split("=")[0]) == v.split("=", 1)[1] for v in rest))
    if plugin_off:
        problems.append(f"{WARNING}the aws-ofi-nccl plugin is off ({' '.join(off)} unset: NCCL_PLUGIN=off, "
                        "ALCF's remedy when the plugin hangs a pipeline job): collectives across nodes go over "
                        "TCP sockets, several times slower; drop NCCL_PLUGIN=off unless the job hangs with it")
    skipped = set(off) if plugin_off else set()
    for name, (good, why) in (doc.get("multi_node", {}) if nodes > 1 else doc.get("single_node", {})).items():
        if name in skipped or name == "FI_MR_CACHE_MONITOR" and bad:
            continue
        if environ.get(name) not in good:
            value = f"{name}={shown(environ[name])}" if name in environ else f"{name} is unset"
            fix = f"export {name}={good[0]}" if good[0] else f"unset {name}"
            problems.append(f"{value} on {nodes} node(s): {fix} ({why})")
    if nodes > 1 and doc.get("plugin") and not facts["libraries"].get(doc["plugin"]):
        problems.append(f"no network plugin ({doc['plugin']}*.so on LD_LIBRARY_PATH or NCCL_NET_PLUGIN) on "
                        f"{nodes} nodes: collectives across nodes go over TCP sockets: {doc['plugin_fix']}")
    if machine == "frontier" and environ.get("FI_CXI_RDZV_PROTO") == "alt_read" and \
            "SLURM_NETWORK" in environ and "disable_rdzv_get" not in environ["SLURM_NETWORK"]:
        problems.append("FI_CXI_RDZV_PROTO=alt_read without the allocation's --network=disable_rdzv_get: "
                        "add #SBATCH --network=disable_rdzv_get, or unset FI_CXI_RDZV_PROTO (OLCF: both or neither)")
    missing = [v for v in doc.get("recommended", []) if environ.get(v.split("=")[0]) != v.split("=", 1)[1]
               and not (v.startswith("FI_MR_CACHE_MONITOR") and bad) and v.split("=")[0] not in skipped]
    if missing and nodes > 1:
        problems.append(f"not set as {doc['site']} documents for jobs across nodes: export {' '.join(missing)} "
                        f"(jobs/{machine}.sh sets them)")
    return problems


def check_nodes(rows):
    """Problems across the ranks of each node (rows: every rank's facts, gathered): two ranks
    driving one device, ranks bound to the same cores, the launcher's idea of the ranks per
    node against the host names. (oneCCL's workers on a rank's cores: every rank checks the
    whole CCL_WORKER_AFFINITY list against its own binding in check_environment.)"""
    problems = []
    by_host = {}
    for row in rows:
        by_host.setdefault(row["host"], []).append(row)
    for host, ranks in by_host.items():
        names = [r["rank"] for r in ranks]
        if any((r.get("local_world_size") or len(ranks)) != len(ranks) for r in ranks):
            problems.append(f"node {host}: the launcher says {ranks[0].get('local_world_size')} ranks per node, "
                            f"the host names say {len(ranks)} (ranks {ranks_text(names)}): check --ppn / "
                            "--ntasks-per-node")
        devices = {}
        for r in ranks:
            uid = (r.get("device") or {}).get("uid")
            if uid is not None:
                devices.setdefault(uid, []).append(r["rank"])
        for uid, sharing in devices.items():
            if len(sharing) > 1:
                problems.append(f"node {host}: ranks {ranks_text(sharing)} all compute on one device ({uid}): "
                                "give each rank its own GPU (the facility's binding: see jobs/README.md)")
        for i, a in enumerate(ranks):
            for b in ranks[i + 1:]:
                shared = set(a["affinity"] or []) & set(b["affinity"] or [])
                if shared and set(a["affinity"]) != set(range(a["cpus"] or 0)):
                    problems.append(f"node {host}: ranks {a['rank']} and {b['rank']} are bound to the same "
                                    f"CPU(s) {cpu_list(shared)}: give each rank cores of its own")
    return problems


def ranks_text(ranks):
    return cpu_list(ranks)  # the same run-length text: 0-7,12


# ---------------------------------------------------------------------------------------
# The hardware: every rank times a matmul and a host-to-device copy
# ---------------------------------------------------------------------------------------

def matmul(a, b):
    """The compute probe (a function of its own, so a test can slow one rank down)."""
    return a @ b


def best_seconds(env, work, iters):
    """The fastest of `iters` timed runs of work() after one warm-up: the hardware's speed,
    with the noise of a shared node taken out (a straggler is slow every time)."""
    work()
    synchronize(env)
    best = math.inf
    for _ in range(iters):
        t0 = time.perf_counter()
        work()
        synchronize(env)
        best = min(best, time.perf_counter() - t0)
    return best


def time_hardware(env, iters):
    """A square matmul (n = 4096 in bf16 on a GPU, 512 in fp32 on a CPU: 2n^3 FLOPs) and a
    copy from pinned host memory to the device (256 MiB; 16 MiB host to host on a CPU)."""
    accelerator = env.device.type in ("cuda", "xpu")
    n, dtype = (4096, torch.bfloat16) if accelerator else (512, torch.float32)
    a = torch.randn(n, n, device=env.device, dtype=dtype)
    b = torch.randn(n, n, device=env.device, dtype=dtype)
    matmul_s = best_seconds(env, lambda: matmul(a, b), iters)
    nbytes = 256 * 2**20 if accelerator else 16 * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=accelerator)
    target = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
    copy_s = best_seconds(env, lambda: target.copy_(host, non_blocking=True), iters)
    return dict(matmul_n=n, matmul_dtype=str(dtype).removeprefix("torch."), matmul_s=matmul_s,
                matmul_tflops=2 * n**3 / matmul_s / 1e12, copy_bytes=nbytes, copy_s=copy_s,
                copy_GBps=nbytes / copy_s / 1e9)


def stragglers(rows, margin):
    """Ranks, then nodes, slower than the median of the others by more than `margin` (0.2:
    20%), in the matmul or the copy: one line each. rows: dict(rank, host, matmul_s, copy_s)."""
    problems = []
    what = {"matmul_s": "matmul", "copy_s": "host-to-device copy"}
    for key, name in what.items():
        for r in rows:
            others = [o[key] for o in rows if o is not r]
            if others and r[key] > (1 + margin) * statistics.median(others):
                med = statistics.median(others)
                problems.append(f"straggler: rank {r['rank']} ({r['host']}): {name} {r[key] * 1e3:.3g} ms, "
                                f"{r[key] / med:.2f}x the median {med * 1e3:.3g} ms of the other ranks (margin "
                                f"{margin:.0%}): check its binding and its GPU (clocks, errors), or leave the node out")
        hosts = {}
        for r in rows:
            hosts.setdefault(r["host"], []).append(r[key])
        medians = {h: statistics.median(v) for h, v in hosts.items()}
        for host, value in medians.items():
            others = [v for h, v in medians.items() if h != host]
            if others and value > (1 + margin) * statistics.median(others):
                problems.append(f"straggler node {host}: median {name} {value * 1e3:.3g} ms, "
                                f"{value / statistics.median(others):.2f}x the other nodes' (margin {margin:.0%}): "
                                "leave it out (Slurm --exclude, PBS: select other hosts) and tell the facility")
    return problems


# ---------------------------------------------------------------------------------------
# The network: the all_reduce sweep per link type, fitted as alpha and beta
# ---------------------------------------------------------------------------------------

def node_sizes(hosts):
    """{host: its ranks}, in the order of the first rank of each (hosts[r]: rank r's host)."""
    nodes = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return nodes


def uneven_nodes(hosts):
    """The verdict when the nodes hold different numbers of ranks (`mpiexec -n 7 --ppn 4`: 4
    and 3), else None. The sweep's groups need as many ranks on every node; training's
    layouts do too."""
    sizes = {host: len(ranks) for host, ranks in node_sizes(hosts).items()}
    if len(set(sizes.values())) < 2:
        return None
    shown = ", ".join(f"{n} on {host}" for host, n in list(sizes.items())[:8]) + (", ..." if len(sizes) > 8 else "")
    return (f"the nodes hold different numbers of ranks per node ({shown}): launch as many on each "
            "(-n a multiple of --ppn, or --ntasks-per-node); the network sweep is skipped")


def link_groups(env, hosts):
    """Every rank's groups: `intra` (the ranks of its node) and `inter` (the ranks with its
    local index on every node), as (group, size) or None where the group has one rank.
    hosts[r]: rank r's host name; every node holds as many ranks (uneven_nodes). Every rank
    creates every group, in one order: with device_id bound, NCCL and XCCL split each new
    group from the world's communicator, a call every rank must make."""
    members = list(node_sizes(hosts).values())
    per_node = len(members[0])
    groups = {}
    for kind, all_ranks in (("intra", members), ("inter", [[m[i] for m in members] for i in range(per_node)])):
        for ranks in all_ranks:
            if len(ranks) > 1:
                group = dist.new_group(ranks)
                if env.rank in ranks:
                    groups[kind] = (group, len(ranks))
        groups.setdefault(kind, None)
    return groups, len(members), per_node


def sweep_link(env, group, g, sizes, iters, world):
    """all_reduce times per message size on `group` (g ranks), every group of this kind at
    once: the median of `iters` timed calls; the time of a size is the slowest rank's in the
    whole world (the step waits for the slowest group)."""
    rows = []
    for size in sizes:
        numel = max(g, size // 4 // g * g)
        buffer = torch.ones(numel, device=env.device)
        seconds = 0.0
        if group is not None:
            for _ in range(2):  # warm-up: connections, algorithm selection
                dist.all_reduce(buffer, group=group)
            synchronize(env)
            dist.barrier(group=group)
            times = []
            for _ in range(iters):  # each timed alone: the median shrugs off a rank descheduled once
                t0 = time.perf_counter()
                dist.all_reduce(buffer, group=group)  # the link's traffic: 2(g-1)/g · S per rank
                synchronize(env)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
        slowest = torch.tensor([seconds], dtype=torch.float64 if env.device.type == "cpu" else torch.float32,
                               device=env.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=world)  # the slowest group of this kind
        t = slowest.item()
        rows.append(dict(bytes=numel * 4, time_us=t * 1e6, busbw_GBps=bus_factor("all_reduce", g) * numel * 4 / t / 1e9))
    return rows


def fit_link(rows, g):
    """alpha (s per ring step) and beta (bytes/s) of t(S) = 2(g-1)·alpha + 2(g-1)/g · S / beta,
    by least squares on the relative error (so the small messages, which measure alpha, count
    as much as the large ones, which measure beta); with the fit's largest relative error."""
    t = np.array([r["time_us"] * 1e-6 for r in rows])
    S = np.array([float(r["bytes"]) for r in rows])
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, S / t], axis=1), np.ones_like(t), rcond=None)
    if b <= 0:  # no size large enough to see the bandwidth: the largest message's
        b = t[-1] / S[-1]
    a = max(a, 0.0)
    steps = 2 * (g - 1)
    error = float(np.max(np.abs(a + b * S - t) / t))
    return dict(group_size=g, alpha_s=a / steps, beta_GBps=bus_factor("all_reduce", g) / b / 1e9,
                max_rel_error=error, rows=rows)


def check_links(links, machine):
    """A link below LINK_FRACTION of its datasheet bandwidth (plan.MACHINES) is a problem."""
    if machine is None:
        return []
    from plan import MACHINES  # the datasheet figures plan.py prices with
    sheet = MACHINES[machine]
    problems = []
    for kind, fit in links.items():
        expected = sheet[f"{kind}_gbps"]
        if fit["beta_GBps"] < LINK_FRACTION * expected:
            where = "inside a node" if kind == "intra" else "across nodes"
            fix = (DOCUMENTED[machine]["plugin_fix"] or "check the network settings above") if kind == "inter" else \
                "check that each rank has its own GPU and that the backend is " + "/".join(DOCUMENTED[machine]["backends"])
            problems.append(f"{where}: {fit['beta_GBps']:.3g} GB/s per GPU, under {LINK_FRACTION:.0%} of "
                            f"{DOCUMENTED[machine]['site']}'s {expected:g} GB/s: {fix}")
    return problems


def arrive(env, monitor, step, timeout, failed=None):
    """Every rank reaches the end of `step`, or the job ends with one line naming the ranks that
    did not (frozen, or their node down) and the step, instead of a collective's traceback:
    gloo's monitored_barrier, in which rank 0 waits for each rank by name. failed: the error a
    collective of the step raised on this rank (a peer that never came), said if all arrived."""
    try:
        dist.monitored_barrier(group=monitor, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as e:
        late = re.search(r"Ranks? ([\d, ]+) failed to pass", str(e))
        if late:
            ranks = sorted(int(r) for r in re.findall(r"\d+", late.group(1)))
            say(f"error: rank(s) {ranks_text(ranks)} did not finish the doctor's {step} within --timeout {timeout:g} s "
                "(frozen, or its node is down): leave that node out and run the doctor again", sys.stderr)
        stop_everyone()  # the other ranks: rank 0, which names them, is gone or said it
    if failed is not None:
        first = (str(failed).strip().splitlines() or [""])[0][:200]
        say(f"error: rank {env.rank}: the doctor's {step} failed: {first}", sys.stderr)
        stop_everyone()


def stop_everyone():
    """Exit 2 now, and end the job's other ranks (MPI_Abort under mpiexec, else the launcher)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if mpi_comm() is not None:
        time.sleep(1)  # let mpiexec's proxy forward the line first
        mpi_comm().Abort(2)
    os._exit(2)


def in_step(env, monitor, step, timeout, work):
    """work(), every rank's part of `step`; then arrive() (a collective that failed: named)."""
    try:
        result, failed = work(), None
    except RuntimeError as e:  # gloo's timeout when a peer never posts: find the peer by name
        result, failed = None, e
    arrive(env, monitor, step, timeout, failed)
    return result


def doctor(args):
    """--doctor: the environment, the hardware and the network of this allocation; one line per
    problem; exit 0 when healthy, 2 otherwise (on every rank)."""
    launch = detect_launcher(os.environ)
    machine, how = (args.machine, "--machine") if args.machine else recognise_machine(os.environ, socket.gethostname())
    master = launch.rank == 0
    if master:
        say(f"doctor: machine {machine or 'not recognised'} ({how}), {launch.world_size} rank(s) "
            f"launched by {launch.kind}" + ("" if machine else "; the general checks only (--machine names one)"))
    facts = local_facts(os.environ, launch)
    if args.device == "auto" and not any(facts["accelerators"].values()) and xpu_backend() is None:
        args.device = "cpu"  # the environment check names the missing GPU; the rest runs on CPU
    from infra.launch import setup  # common.setup hardened, as training starts: one line when a rank cannot join
    env = setup(args, launch)  # mpi4py's world not the launcher's: Slurm's or MASTER_ADDR's, as training
    if env.launch.kind != launch.kind:
        facts["rendezvous"] = env.launch.kind
    world = dist.group.WORLD  # every collective below names its group
    # rank 0 waits for every rank by name at the end of each step (gloo's monitored_barrier)
    monitor = world if env.backend == "gloo" else dist.new_group(backend="gloo")
    facts["device"] = device_facts(os.environ, env.device)
    if env.device.type == "xpu":  # XPUs that only intel_extension_for_pytorch makes visible
        facts["accelerators"]["xpu"] = torch.xpu.device_count()
    facts["problems"] = check_environment(os.environ, facts, machine)
    arrive(env, monitor, "environment check", args.timeout)
    rows = [None] * env.world_size
    in_step(env, monitor, "environment check", args.timeout,
            lambda: dist.all_gather_object(rows, facts, group=world))  # every rank's facts, for the report
    report = dict(machine=machine, recognised_by=how, world_size=env.world_size, backend=env.backend,
                  ranks=rows, problems=[], warnings=[])
    problems, warnings = {}, {}  # message -> ranks that have it
    for row in rows:
        for line in row["problems"]:
            kind = warnings if line.startswith(WARNING) else problems
            kind.setdefault(line.removeprefix(WARNING), []).append(row["rank"])
    for line in check_nodes(rows):
        problems.setdefault(line, [])
    hosts = [r["host"] for r in rows]
    uneven = uneven_nodes(hosts)
    if uneven:
        problems.setdefault(uneven, [])
    log(env, f"environment: {len(rows)} rank(s) on {len(set(hosts))} node(s), backend {env.backend}")
    for row in rows[:16]:
        d = row["device"]
        log(env, f"  rank {row['rank']:>3} {row['host']}: {row['launcher']} local {row['local_rank']}/"
                 f"{row['local_world_size']}, CPUs {cpu_list(row['affinity'] or [])}, {d['type']}"
                 + (f" {d['index']} = {d['physical']} ({d['name']}), near CPUs {d['near_cpus'] or '?'}"
                    if d["name"] else "") + (f", mpi4py {row['mpi']['library']}" if row["mpi"] and
                                             "library" in row["mpi"] else ""))
    if len(rows) > 16:
        log(env, f"  ... {len(rows) - 16} more ranks (--json)")
    # the hardware
    mine = dict(rank=env.rank, host=facts["host"], **time_hardware(env, args.iters))
    arrive(env, monitor, "hardware timing", args.timeout)
    timed = [None] * env.world_size
    in_step(env, monitor, "hardware timing", args.timeout, lambda: dist.all_gather_object(timed, mine, group=world))
    report["hardware"] = timed
    for line in stragglers(timed, args.straggler_margin):
        problems.setdefault(line, [])
    tflops = [r["matmul_tflops"] for r in timed]
    copies = [r["copy_GBps"] for r in timed]
    log(env, f"hardware: matmul {timed[0]['matmul_n']}^3 {timed[0]['matmul_dtype']}: {min(tflops):.3g} / "
             f"{statistics.median(tflops):.3g} / {max(tflops):.3g} TFLOP/s (min / median / max over ranks); copy "
             f"{timed[0]['copy_bytes'] >> 20} MiB to the device: {min(copies):.3g} / {statistics.median(copies):.3g}"
             f" / {max(copies):.3g} GB/s")
    # the network (every node as many ranks, else its verdict is the report's)
    max_bytes = sweep_max_bytes(args, env.device)
    sizes = [args.min_bytes * 4**k for k in range(64) if args.min_bytes * 4**k <= max_bytes]
    report["links"] = {}
    if uneven:
        log(env, "network: not swept (the nodes hold different numbers of ranks)")
    else:
        groups, n_nodes, per_node = link_groups(env, hosts)
        for kind, where in (("intra", "inside a node"), ("inter", "across nodes")):
            g = per_node if kind == "intra" else n_nodes
            if g < 2:
                log(env, f"network {where}: one rank per {'node' if kind == 'intra' else 'job'}, nothing to sweep")
                continue
            mine_group = groups[kind]
            link_rows = in_step(env, monitor, f"network sweep {where}", args.timeout,
                                lambda: sweep_link(env, mine_group[0] if mine_group else None, g, sizes, args.iters, world))
            fit = fit_link(link_rows, g)
            report["links"][kind] = fit
            log(env, f"network {where}: all_reduce over {g} ranks, {len(sizes)} sizes {sizes[0]} B..{sizes[-1] >> 10} KiB: "
                     f"alpha {fit['alpha_s'] * 1e6:.3g} us per ring step, beta {fit['beta_GBps']:.3g} GB/s "
                     f"(fit within {fit['max_rel_error']:.0%}; busbw at the largest size {link_rows[-1]['busbw_GBps']:.3g} GB/s)")
    for line in check_links(report["links"], machine):
        problems.setdefault(line, [])
    # the verdict: identical on every rank (they all hold the gathered rows); rank 0 prints it
    def with_ranks(line, r):
        return (f"ranks {ranks_text(r)}: " if len(r) > 1 else f"rank {r[0]}: " if r else "") + line
    report["problems"] = [with_ranks(line, r) for line, r in problems.items()]
    report["warnings"] = [with_ranks(line, r) for line, r in warnings.items()]
    for line in report["warnings"]:
        log(env, f"warning: {line}")
    for line in report["problems"]:
        log(env, f"problem: {line}")
    log(env, ("healthy: no problem found" + (f" ({len(warnings)} warning(s) above)" if warnings else ""))
        if not problems else f"{len(problems)} problem(s): fix the lines above, "
        "then run the doctor again (jobs/README.md says what each means)")
    if args.json:  # checked before the doctor ran; a disk that filled since: one line, exit 2 everywhere
        written = [None]
        if env.master:
            try:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1, default=str)
            except OSError as e:
                written[0] = f"--json {args.json} cannot be written: {e.strerror or e}"
                say(f"error: {written[0]}", sys.stderr)
        dist.broadcast_object_list(written, src=0, group=world)
        if written[0]:
            problems.setdefault(written[0], [])
    teardown(env)
    sys.exit(2 if problems else 0)


def main():
    args = add_flags(base_parser(__doc__)).parse_args()
    args.dtype = "float32"
    check(args.iters > 0, f"--iters must be positive, got {args.iters}")
    check(0 < args.min_bytes <= (args.max_bytes or args.min_bytes) <= MAX_BYTES,
          f"need 0 < --min_bytes <= --max_bytes <= {MAX_BYTES} (16 GiB), got {args.min_bytes}, {args.max_bytes}")
    check(math.isfinite(args.timeout) and 0 < args.timeout <= 7 * 24 * 3600,
          f"--timeout must be a positive number of seconds (at most a week), got {args.timeout}")
    folder = os.path.dirname(os.path.abspath(args.metrics)) if args.metrics else None
    check(folder is None or os.path.isdir(folder) and os.access(folder, os.W_OK),
          f"--metrics {args.metrics}: the directory {folder} does not exist or is not writable")
    folder = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    check(folder is None or os.path.isdir(folder) and os.access(folder, os.W_OK),
          f"--json {args.json}: the directory {folder} does not exist or is not writable")
    check(folder is None or not os.path.exists(args.json) or os.path.isfile(args.json) and os.access(args.json, os.W_OK),
          f"--json {args.json} is " + ("a directory" if args.json and os.path.isdir(args.json) else
                                       "not a regular file it may write") + ": name the file to write the report to")
    check(math.isfinite(args.straggler_margin) and args.straggler_margin > 0,
          f"--straggler_margin must be a positive fraction (0.2: 20% slower), got {args.straggler_margin}")
    check(args.doctor or not (args.json or args.machine), "--json and --machine go with --doctor")
    check(not (args.doctor and args.bench), "--doctor runs its own sweep: give --doctor or --bench, not both")
    if args.doctor:
        doctor(args)
    launch = detect_launcher(os.environ)
    from infra.launch import setup  # common.setup hardened: an exception on any rank ends the job
    env = setup(args, launch)
    log(env, f"{env.world_size} rank(s), backend {env.backend}, device {env.device}"
             + ("" if mpi_comm() else " (mpi4py side shown only under mpiexec)"))
    world = dist.group.WORLD  # every collective below names its group: here all the ranks
    if args.bench:
        rows = bench(env, args, world)
        if args.metrics and env.master:
            with open(args.metrics, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        failures = []
    else:
        failures = run_checks(env, world)
        log(env, f"{'all collectives correct' if not failures else 'FAILED: ' + ', '.join(failures)}")
    teardown(env)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
