"""Run a training script as `python SCRIPT ARGS...` would, and record for bench.py what its
metrics do not say: the wall-clock and CPU time of every loop iteration, on every rank.
Used the same way for our scripts and for torch_baselines.py, so both sides are measured
alike; nothing in the scripts knows about it.

    python tests/benchmarks/probe.py SCRIPT ARGS...     (bench.py launches it, one per rank)

    GPTPAR_PROBE=DIR   write DIR/rank<R>.json: one row per optimizer step (a global
                       optimizer post-step hook; the first optimizer object that steps is
                       the one followed), taken as the step's optimizer.step() returns:
                       [wall s, process CPU s (user+sys, every thread), main thread CPU s,
                        voluntary context switches, involuntary ones, kernel CPU s (sys),
                        minor page faults]
    GPTPAR_PIN=1       pin this rank, and every thread it starts afterwards (gloo's, torch's
                       pool), to one core of its own: LOCAL_RANK's in the allowed set, modulo
    GPTPAR_ABLATE=guard,meter   take a piece of infra's Run out, to see what it costs: guard,
                       Guard.check returns "go on" with no flags all-reduced and nothing read;
                       meter, the activation meter's saved-tensor hooks are not installed
                       (a benchmark's knife: the ledger's activations then read 0)
    GPTPAR_SAME_MALLOC=1  glibc's mmap and trim thresholds fixed, before the script starts
                       (same_malloc: the same heap behaviour on every side)
    GPTPAR_PROFILE=1   the main thread's CPU and the wall time inside each of infra's per-step
                       methods (Run.check, Run.end_step, the meter's hooks, Metrics.step, the
                       ledger's wrapper of every collective), summed over the run after warm-up

Between two rows is one whole iteration of the loop: its batch, forwards and backwards, the
collectives, the optimizer, and whatever the loop does after the step (logging, metrics). Read
row to row: wall - main thread CPU is what the main thread spent not running (waiting on a
collective, or its core taken by someone else: the involuntary switches say which); process
CPU - main thread CPU is the other threads' work (gloo's communication threads)."""

import faulthandler
import json
import os
import resource
import runpy
import sys
import time

WARM = 5  # the threads' CPU is read after this many steps, and after the last

def pin():
    """This thread (the main one, before any other starts) to one core; threads made later inherit it."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def same_malloc():
    """glibc's mmap and trim thresholds fixed (and their adjustment off), the same in every
    side's process: a freed block of up to 32 MiB stays in the heap, and up to 256 MiB of free
    heap top stays mapped, whatever the process freed before (bench.py's SAME_MALLOC says why).
    mallopt, not MALLOC_*_ environment variables: glibc reads those when the process starts,
    and the fork server's ranks start long before (forked from it)."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    assert libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1


def threads():
    """{thread id: [name, CPU s (user+sys), involuntary context switches]} of this process, from /proc."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read()
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
        switches = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[tid] = [stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick, switches]
    return out


def profile(spent, warm):
    """Wrap infra's per-step methods: spent[name] = [main thread CPU s, wall s, calls], counted
    once `warm()` (a nested call, one wrapped method inside another, counts in both)."""
    import functools
    import infra.activations
    import infra.ledger
    import infra.metrics
    import infra.run
    import infra.stop

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not warm():
                return fn(*args, **kwargs)
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = spent.setdefault(name, [0.0, 0.0, 0])
                total[0] += time.thread_time() - cpu
                total[1] += time.perf_counter() - wall
                total[2] += 1
        return wrapper
    for cls, names in ((infra.run.Run, ("check", "end_step")), (infra.metrics.Metrics, ("step",)),
                       (infra.activations.ActivationMeter, ("start", "stop", "_pack", "_release")),
                       (infra.stop.Guard, ("check",))):
        for name in names:
            setattr(cls, name, timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    wrap = infra.ledger.CommLedger._wrap
    infra.ledger.CommLedger._wrap = lambda self, op, fn, argument: timed(f"ledger {op}", wrap(
        self, op, timed(f"ledger {op}: the collective itself", fn), argument))


def main():
    script, args = sys.argv[1], sys.argv[2:]
    out = os.environ.get("GPTPAR_PROBE")
    if os.environ.get("GPTPAR_PIN") == "1":
        pin()
    if os.environ.get("GPTPAR_SAME_MALLOC") == "1":
        same_malloc()
    ablate = {name for name in os.environ.get("GPTPAR_ABLATE", "").split(",") if name}
    if ablate:
        import infra.activations
        import infra.ledger
        import infra.metrics
        import infra.run
        import infra.stop
        assert ablate <= {"guard", "meter"}, f"GPTPAR_ABLATE: unknown {ablate - {'guard', 'meter'}}"
        if "guard" in ablate:
            infra.stop.Guard.check = lambda self, step, loss, grads, norm=None: False
        if "meter" in ablate:
            infra.activations.ActivationMeter.__enter__ = lambda self: self
            infra.activations.ActivationMeter.__exit__ = lambda self, *exc: None
    spent = {}
    if os.environ.get("GPTPAR_PROFILE") == "1":
        profile(spent, lambda: len(rows) >= WARM)
    import torch
    torch.set_num_threads(1)  # both sides alike (OMP_NUM_THREADS=1 says so already under bench.py)
    from torch.optim.optimizer import register_optimizer_step_post_hook
    rows, followed, per_thread = [], [], {}
    steps = int(args[len(args) - 1 - args[::-1].index("--max_iters") + 1])  # the last one given counts

    def save():
        if out:
            with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
                json.dump({"rows": rows, "affinity": sorted(os.sched_getaffinity(0)), "threads": per_thread,
                           "spent": spent, "warm": WARM}, f)

    def stamp(optimizer, *_):
        if not followed:
            followed.append(id(optimizer))
        if id(optimizer) != followed[0]:  # an optimizer inside another (ZeroRedundancyOptimizer's AdamW)
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        rows.append([time.perf_counter(), usage.ru_utime + usage.ru_stime, time.thread_time(),
                     usage.ru_nvcsw, usage.ru_nivcsw, usage.ru_stime, usage.ru_minflt])
        if len(rows) in (WARM, steps):  # each thread's CPU over the steps after warm-up (coarse: clock ticks)
            per_thread[len(rows)] = threads()
        if len(rows) == steps:  # now, after the last row: a teardown that hangs (DDP's has) loses nothing
            save()
            faulthandler.dump_traceback_later(30)  # and if it does hang, where (every thread's stack, on stderr)

    register_optimizer_step_post_hook(stamp)
    sys.argv = [script] + args  # as `python SCRIPT ARGS` (common.say names the script from argv[0])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        save()


if __name__ == "__main__":
    main()
