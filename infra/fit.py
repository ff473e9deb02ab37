"""Fitting: this rank's costs() against the memory it can have, before anything is built. The
need (costs()'s peak plus an allowance for transients), the room (free device memory, or on a
CPU the host's available memory within the job's cgroup and address-space limit, shared by the
node's ranks), the cheapest change that fits when it does not, the process groups warmed up
before the room is read, and after step 0 what the step really took."""

import argparse
import inspect
import os
from contextlib import contextmanager
from functools import wraps

import torch
import torch.distributed as dist

from common import Data, model_config
from infra.cli import GPU_MEMORY_GB
from infra.formulas import format_bytes
from infra.ledger import LEDGER


# What a rank needs beyond its costs() (model state + activations saved for backward): the
# transients autograd does not save (an op's output before the next consumes it, gradients
# in flight in backward, AdamW's temporaries) and what the allocator keeps. Measured on CPU
# for every script (peak RSS less the runtime less costs(): tests/benchmarks/bench_fit.py,
# docs/memory.md): up to 670 MiB at dropout 0, and 1.1-1.5 GiB for the default model's bare
# commands (dropout 0.2, 24-48 sequences); most of it is glibc's heap keeping freed memory.
# FIT_SHARE of costs() + FIT_MIB covers every case measured. On GPUs, where the caching
# allocator reuses freed blocks, the allowance is an estimate: the one GPU lent so far checked
# it once, on 01's default model at one rank (21% high; docs/measured.md, "One GPU").
FIT_SHARE, FIT_MIB = 0.5, 768  # CPU


FIT_SHARE_GPU, FIT_MIB_GPU = 0.25, 128  # CUDA, ROCm, XPU (an estimate: one run on one GPU)


def fit_allowance(device_type):
    """(share of costs(), MiB) that a rank needs beyond its costs() on this device type."""
    return (FIT_SHARE, FIT_MIB) if device_type == "cpu" else (FIT_SHARE_GPU, FIT_MIB_GPU)


def allowance_text(device_type):
    share, mib = fit_allowance(device_type)
    return f"costs()'s peak + {share:.0%} + {mib} MiB"


# What a GPU of known size leaves for a rank's tensors when only its size is known (a dry run
# or plan.py for a named machine): the CUDA / ROCm / Level Zero context, the communicators'
# buffers and the caching allocator's fragmentation take the rest. A launch reads the free
# memory itself instead.
GPU_USABLE = 0.9


def peak_numbers(cost):
    """{phase: bytes} of costs()'s step peak ("peak": forward, backward, optimizer) and its
    start-up peak ("startup"), or None where the cost states no peak."""
    if "peak" not in cost:
        return None
    return {**{phase: v for phase, (_, v) in cost["peak"].items()},
            **({"startup": cost["startup"][1]} if "startup" in cost else {})}


def fit_base(cost, device_type):
    """costs()'s own bytes on this rank's device at their most: the largest of its step's
    peaks by phase ("peak": forward, backward, optimizer; the state held, the gathered units,
    the saved activations and the transients of each phase) and its start-up peak
    ("startup": building, initialising, sharding the model); on GPUs less the state that
    --offload keeps in host memory. A cost without a peak: its state, gathered units and
    activations."""
    host = sum(v for kind, (_, v) in cost["held"].items() if "host" in kind) if device_type != "cpu" else 0
    if "peak" in cost:
        return max(peak_numbers(cost).values()) - host
    held = sum(v for _, v in cost["held"].values()) - host
    return held + sum(cost[k][1] for k in ("gathered", "activations") if k in cost)


def fit_need(cost, device_type):
    """Bytes this rank needs on its device: fit_base(), plus the transients' allowance."""
    base = fit_base(cost, device_type)
    share, mib = fit_allowance(device_type)
    return base + int(share * base) + mib * 2**20


# The memory a job may use on this host is bounded three ways, and the fit check takes the least:
# the host's MemAvailable; the job's memory cgroup (Slurm's --mem, PBS's mem=, a shared node),
# whose limit the kernel enforces with the OOM killer long before the host runs out; and the
# process's own address-space limit (ulimit -v, RLIMIT_AS), which makes an allocation fail.
CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup file systems are mounted (tests point it elsewhere)


PROC_SELF_CGROUP = "/proc/self/cgroup"


def _read_int(path):
    """The integer in a one-value file (a cgroup's limit or usage), or None ("max", missing)."""
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def cgroup_room():
    """The bytes this process's memory cgroup still allows (its limit less its usage), or None
    without a limit: cgroup v2 (memory.max, memory.current) or v1 (memory.limit_in_bytes,
    memory.usage_in_bytes; v1's "no limit" is a huge number, larger than any host)."""
    try:
        with open(PROC_SELF_CGROUP) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    rooms = []
    for _, controllers, path in lines:
        if controllers == "":  # v2: one unified hierarchy
            folder, files = os.path.join(CGROUP_ROOT, path.lstrip("/")), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            folder = os.path.join(CGROUP_ROOT, "memory", path.lstrip("/"))
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        limit, usage = _read_int(os.path.join(folder, files[0])), _read_int(os.path.join(folder, files[1]))
        if limit is not None and limit < 2**60:
            rooms.append(max(0, limit - (usage or 0)))
    return min(rooms) if rooms else None


def address_space_room():
    """The bytes this process may still map under its RLIMIT_AS (ulimit -v) less what it has
    mapped (VmSize), or None without a limit."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        size = 0
    return max(0, soft - size)


def host_available():
    """The bytes the ranks of this job on this host may still take, together: the least of
    MemAvailable and the memory cgroup's room (None where neither is known)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = None
    known = [room for room in (available, cgroup_room()) if room is not None]
    return min(known) if known else None


def host_room(local_ranks):
    """One rank's room on this host: its share of host_available(), within its own
    address-space limit."""
    available = host_available()
    share = available and available // max(1, local_ranks)
    known = [room for room in (share, address_space_room()) if room is not None]
    return min(known) if known else None


def memory_room(env):
    """Bytes this rank can have: the device's free memory, or on CPU host_room(): the host's
    available memory within the job's cgroup, shared by the ranks on this node (each one's
    runtime is already resident), within the rank's address-space limit."""
    if env.device.type == "cuda":
        return torch.cuda.mem_get_info(env.device)[0]
    if env.device.type == "xpu" and hasattr(torch.xpu, "mem_get_info"):
        return torch.xpu.mem_get_info(env.device)[0]
    return host_room(env.launch.local_world_size or 1) if env.device.type == "cpu" else None  # mps: unknown


def planned_room(args):
    """The room a dry run (and plan.py) plans for, per rank: GPU_USABLE of --gpu_mem_gb or of
    --machine's GPU; with neither and --device cpu, host_room() for --ranks_per_node ranks
    on this host; else None (no verdict: the GPU is not named)."""
    gb = args.gpu_mem_gb or GPU_MEMORY_GB.get(args.machine)
    if gb:
        return int(gb * 1e9 * GPU_USABLE)
    return host_room(args.ranks_per_node) if args.device == "cpu" else None


def rank_need(args, costs, world_size, dtype, device_type, ranks=(0,), **changes):
    """The largest fit_need() of the script's costs() over `ranks` (where the ranks differ: a
    pipeline's stages), with the flags in `changes` changed."""
    changed = argparse.Namespace(**{**vars(args), **changes})
    key = (costs, repr(sorted(vars(changed).items())), world_size, dtype, device_type, tuple(ranks))
    if key not in _RANK_NEEDS:  # remembered: the fit's search asks again for the layouts it tried
        config = model_config(args, Data.vocab_size_of(args.data))
        by_rank = "rank" in inspect.signature(costs).parameters
        _RANK_NEEDS[key] = max(fit_need(costs(changed, config, world_size, dtype,
                                              **({"rank": r} if by_rank else {})), device_type) for r in ranks)
    return _RANK_NEEDS[key]


_RANK_NEEDS = {}


def fit_problem(args, env, costs, room=None):
    """None if this rank's costs() fit its memory_room() (or `room`); else one line with the
    need, the room and the cheapest change that fits: the largest smaller micro-batch,
    --recompute, or, when the model state alone does not fit, sharding it."""
    room = memory_room(env) if room is None else room
    if room is None:
        return None

    def need(**changes):
        return rank_need(args, costs, env.world_size, env.dtype, env.device.type, (env.rank,), **changes)
    needed = need()
    if needed <= room:
        return None
    local = env.launch.local_world_size or 1
    where = (f" x {local} rank(s) on this node = {format_bytes(needed * local)}, {format_bytes(room * local)} "
             "available" if env.device.type == "cpu" else f", {format_bytes(room)} free on {env.device}")
    return (f"rank {env.rank} needs {format_bytes(needed)} ({allowance_text(env.device.type)} for "
            f"transients){where}: {fit_fixes(args, need, room, env.device.type)} (--no_fit_check skips this check)")


@contextmanager
def recording_groups(made):
    """Inside, every process group dist.new_group makes that has this rank is appended to
    `made` (in the order made: the same on every rank)."""
    new_group = dist.new_group

    @wraps(new_group)
    def recorded(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if isinstance(group, dist.ProcessGroup):  # not GroupMember.NON_GROUP_MEMBER
            made.append(group)
        return group
    dist.new_group = recorded
    try:
        yield made
    finally:
        dist.new_group = new_group


def warm_groups(env, made):
    """One 4-byte all-reduce on the world and on every group in `made`, in the order they
    were made (the same on every rank, so no rank waits in one group for a rank waiting in
    another): on NCCL, RCCL and XCCL a communicator allocates its buffers at its first
    collective, and the fit check must see them gone from the room. Returns how many groups
    this rank is in (the world included)."""
    if env.world_size == 1:
        return 1
    with LEDGER.paused():  # control traffic, not a step's
        for group in [dist.group.WORLD, *made]:
            dist.all_reduce(torch.zeros(1, device=env.device), group=group)
    return 1 + len(made)


def _proc_status(key):
    """A /proc/self/status value in bytes (VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def memory_mark(env):
    """Where the room stands when the fit check has read it, for memory_taken() after step 0:
    on CUDA / XPU the free device memory and the allocator's reservation; on CPU the resident
    memory, with the peak (VmHWM) reset to it (/proc/self/clear_refs, Linux)."""
    module = torch.get_device_module(env.device) if env.device.type in ("cuda", "xpu") else None
    if module is not None and hasattr(module, "mem_get_info"):
        return {"free": module.mem_get_info(env.device)[0], "reserved": module.memory_reserved(env.device)}
    if env.device.type == "cpu":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
            reset = True
        except OSError:
            reset = False
        return {"rss": _proc_status("VmRSS"), "reset": reset}
    return {}


def memory_taken(env, mark):
    """(bytes, parts) that the run took from the room since memory_mark(), at its peak: on
    CUDA / XPU parts are (the allocator's peak reservation less its reservation at the mark,
    its peak allocation (mem_peak_bytes), the memory taken outside it); on CPU (whether VmHWM
    was reset at the mark, 0, 0). None where the device says nothing."""
    module = torch.get_device_module(env.device) if "free" in mark else None
    if module is not None:
        grown = module.max_memory_reserved(env.device) - mark["reserved"]
        outside = max(0, (mark["free"] - module.mem_get_info(env.device)[0])
                      - (module.memory_reserved(env.device) - mark["reserved"]))
        return grown + outside, (grown, module.max_memory_allocated(env.device), outside)
    hwm = _proc_status("VmHWM")
    if mark.get("rss") is None or hwm is None:
        return None, (0, 0, 0)
    return max(0, hwm - mark["rss"]), (int(mark["reset"]), 0, 0)


def after_step_problem(args, need, took, estimate, room):
    """None when step 0 took no more than the room the fit check read (or either is unknown);
    else one warning: what the step took past the room, and the largest smaller micro-batch
    whose estimate (costs() at that micro-batch, `need`) fits the room once scaled by how far
    the estimate was from step 0 (took / estimate). The next steps hold what step 0 held, so
    a run past its room now runs out of memory later, at a worse moment."""
    if room is None or took is None or took <= room:
        return None
    rate, micro = took / max(estimate, 1), args.micro_batch_size
    smaller = next((m for m in range(micro - 1, 0, -1) if micro % m == 0 and need(micro_batch_size=m) * rate <= room),
                   None)
    fix = (f"restart with --micro_batch_size {smaller} ({micro // smaller}x the accumulation steps), which fits "
           "at that rate" if smaller else "no smaller micro-batch fits at that rate: restart with --recompute, or "
           "shard the state (04_zero.py --stage 3, 05_fsdp.py)")
    return (f"step 0 took {format_bytes(took)}, more than the {format_bytes(room)} the fit check read as this "
            f"rank's room ({rate:.2f}x costs()' estimate of {format_bytes(estimate)}): {fix}")


def fit_fixes(args, need, room, device_type="cpu"):
    """The cheapest changes that fit, each checked by evaluating costs() at the changed flags
    (`need`): the largest smaller micro-batch, --recompute, or both. When none fits, what is
    too big, so that the advice is one that could help:

        room < the allowance (768 MiB on CPU)         -> no model fits: more memory, fewer ranks
        the state (need at b = 1, recompute, less one
          sequence's activations) is over the room    -> shard the state or split the model
        else one sequence's activations are           -> a shorter context, or split the
                                                         sequence (09) or the layers (06-08)"""
    fixes, micro = [], args.micro_batch_size
    smaller = next((m for m in range(micro - 1, 0, -1) if micro % m == 0 and need(micro_batch_size=m) <= room), None)
    if smaller:
        fixes.append(f"--micro_batch_size {smaller} fits ({micro // smaller}x the accumulation steps)")
    if not args.recompute and need(recompute=True) <= room:
        fixes.append("--recompute fits")
    if not fixes and not args.recompute:
        both = next((m for m in range(micro - 1, 0, -1)
                     if micro % m == 0 and need(micro_batch_size=m, recompute=True) <= room), None)
        if both:
            fixes.append(f"--micro_batch_size {both} --recompute fits ({micro // both}x the accumulation steps)")
    if fixes:
        return ", or ".join(fixes)
    _, mib = fit_allowance(device_type)
    if room <= mib * 2**20:
        more = ("ask the scheduler for more memory (Slurm --mem, PBS mem=) or run fewer ranks per node"
                if device_type == "cpu" else "free the device: other processes hold its memory")
        return (f"the room, {format_bytes(room)}, is less than the {mib} MiB every rank needs for transients "
                f"whatever the model: {more}")
    least, two = need(micro_batch_size=1, recompute=True), need(micro_batch_size=2, recompute=True)
    state = least - (two - least) - mib * 2**20  # (activations grow with the micro-batch, the state does not)
    if state > room - mib * 2**20:
        return ("the model state alone does not fit: shard it (04_zero.py --stage 3, 05_fsdp.py), split the "
                "model (06-08), or use more nodes (the ranks of one host share its memory)")
    return (f"one sequence's activations do not fit (--micro_batch_size 1 --recompute needs {format_bytes(least)}): "
            "a shorter --block_size, or split the sequence (09_context_parallel.py) or the layers (06-08)")
