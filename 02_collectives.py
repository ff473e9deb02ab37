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

Run:

    mpiexec -n 4 python 02_collectives.py                 # show and check every collective
    torchrun --standalone --nproc_per_node 8 02_collectives.py --bench --metrics bench.jsonl

Any world size >= 1 (send/recv needs 2 ranks and says so). gloo on CPU, nccl/xccl on GPUs.
Where a backend lacks reduce_scatter (gloo before torch 2.6), it falls back to all_reduce
followed by taking this rank's chunk: the same result at twice the traffic.
"""

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from common import base_parser, check, detect_launcher, log, mpi_comm, setup, synchronize, teardown


MAX_BYTES = 16 * 2**30  # the largest message a sweep may ask for: more than one GPU holds


def add_flags(parser):
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "xpu", "mps", "cpu"])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    parser.add_argument("--bench", action="store_true", help="time a sweep of message sizes")
    parser.add_argument("--min_bytes", type=int, default=1024)
    parser.add_argument("--max_bytes", type=int, default=None,
                        help="largest message (default: 16 MiB on CPU, 1 GiB on GPUs)")
    parser.add_argument("--iters", type=int, default=20, help="timed repetitions per size")
    parser.add_argument("--metrics", default=None, help="JSONL: one row per (operation, size)")
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
    max_bytes = args.max_bytes or (2**30 if dev.type in ("cuda", "xpu") else 16 * 2**20)
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
            row = dict(op=name, bytes=nbytes, world_size=n, time_us=seconds * 1e6, algbw_GBps=algbw,
                       busbw_GBps=algbw * bus_factor(name, n), backend=env.backend)
            rows.append(row)
            log(env, f"{name:<16} {nbytes:>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} {row['busbw_GBps']:>11.3f}")
    return rows


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
    launch = detect_launcher(os.environ)
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
