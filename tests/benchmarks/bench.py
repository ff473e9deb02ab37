"""Benchmark: step time of a numbered script against PyTorch's own implementation of the same
strategy, on the same model, batch and ranks. Rerun with

    python tests/benchmarks/bench.py ddp                 # 03_ddp.py vs DistributedDataParallel
    python tests/benchmarks/bench.py zero1               # 04_zero.py --stage 1 vs DDP + ZeroRedundancyOptimizer
    python tests/benchmarks/bench.py fsdp2               # 04_zero.py --stage 3 vs fully_shard (FSDP2)
    python tests/benchmarks/bench.py fsdp                # 05_fsdp.py vs fully_shard (FSDP2)
    python tests/benchmarks/bench.py tp                  # 06 vs torch.distributed.tensor.parallel
    python tests/benchmarks/bench.py 1f1b ... --micro_batch_size 4    # 07 vs torch.distributed.pipelining
    python tests/benchmarks/bench.py ddp --device cuda --ranks 2 4 8 --model gpt2 ...   # other flags: to both

    python tests/benchmarks/bench.py ddp --ranks 2 --repeats 5 --pin --plain --ablate guard --profile \
        --lock /tmp/gptpar-tests.lock    # which part is the strategy's, which the run protocol's

Every side runs through probe.py (the same way for ours and torch's), which records each
iteration's wall time and CPU time (user+sys of the whole process, and of its main thread)
and each thread's CPU. Prints per side the medians (the first steps, warm-up, dropped) of the
script's own step time (dt), the loop's period (optimizer step to optimizer step), the CPU,
the main thread's CPU and the involuntary context switches per step; the ratios to torch's
(below 1 is faster); whether ours and torch's report the same losses; each thread's CPU.
CPU time is the steadier figure on a shared machine: another job landing on our core
stretches the wall time but adds little CPU. The sides run in turn, --repeats times, who goes
first rotating, so that a change in the machine's load falls on all: each repeat's ratio is
of runs made back to back, and the table gives the median of those ratios and their range.
--lock FILE holds that lock (flock) for each repeat's round of runs and lets go between
repeats, so that a shared machine's other jobs run between rounds, never beside one. Without
--micro_batch_size both sides get one micro-batch per step (the global batch divided by the
data-parallel ranks; the whole batch for tp and the pipelines), whatever the scripts' default.

    --pin             each rank, and the threads it starts, on a core of its own, both sides
    --plain           a third side: our script with `from common import Run` (the copy a
                      reader takes: no ledger, meter, guard, metrics)
    --ablate PIECE    another side: ours with infra's guard or activation meter taken out
    --profile         the main thread's CPU and wall time inside infra's per-step methods
    --glibc_default   glibc's malloc as it comes (by default every side gets the same fixed
                      mmap and trim thresholds: SAME_MALLOC says why)
    --log_interval N  log every N steps (default 1: every step's loss compared with torch's);
                      infra's activation meter runs on the logged steps only, so at the
                      scripts' default of 10 the period and cpu columns are what a user's run
                      pays (dt, from the logged steps' rows, is then the measured steps')"""

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import ROOT, launch  # noqa: E402


PAIRS = {  # name: (our script and flags, --impl of torch_baselines.py); the last five have no data parallelism
    "ddp": (["03_ddp.py"], "ddp"),
    "zero1": (["04_zero.py", "--stage", "1"], "zero1"),
    "fsdp2": (["04_zero.py", "--stage", "3"], "fsdp2"),
    "fsdp": (["05_fsdp.py"], "fsdp2"),
    "tp": (["06_tensor_parallel.py"], "tp"),
    "gpipe": (["07_pipeline.py", "--schedule", "gpipe"], "gpipe"),
    "1f1b": (["07_pipeline.py", "--schedule", "1f1b"], "1f1b"),
    "interleaved": (["07_pipeline.py", "--schedule", "interleaved"], "interleaved"),
}


PROFILE, LOG_INTERVAL = False, 1  # bench.py's --profile and --log_interval
# glibc's malloc, the same on every side. By default glibc returns a freed block of at least
# its mmap threshold to the kernel, and the kernel maps it afresh, page by page, when the next
# step allocates it again: ~1,800 minor page faults a step (~6 ms of kernel time, 2% of the
# step) for our scripts at this model. Its threshold rises once such a block is freed, so a
# process that happened to free a large one at start-up (DDP's does) pays none of it: the
# comparison measured glibc's history, not the strategies. probe.py fixes the same thresholds
# in every side's process before the script starts (mallopt; --glibc_default leaves glibc alone).
SAME_MALLOC = {"GPTPAR_SAME_MALLOC": "1"}
TIMEOUT_S = 60  # a run takes well under a minute here; a hang holds the lock no longer than this


def finished(run, iters, plain=False):
    """The run, if it trained: exited 0, or (torch's baselines only) logged all `iters` steps and
    then hung in its teardown, as DDP's has, rarely, in destroy_process_group (said, not hidden)."""
    if run.returncode != 0 and "torch_baselines" in " ".join(run.cmd) and len(run.steps) == iters and not plain:
        print(f"  (torch's baseline logged all {iters} steps, then did not exit: {run.returncode}; its steps kept)")
        print("\n".join("    " + line for line in run.stderr.splitlines()[-40:]))  # probe.py: where it hung
        return run
    return run.ok()


@contextlib.contextmanager
def locked(path):
    """Hold the lock file `path` (flock, as `flock FILE command` does) for the block; no path, no lock."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")
TIE = "from infra import Run  # the run infrastructure; `from common import Run` is the plain loop\n"


def plain_copy(script, into):
    """`script` with its one tie to infra replaced by `from common import Run`, as a copier takes
    it (tests/test_copy.py): the plain loop, no ledger, meter, guard or metrics."""
    source = open(os.path.join(ROOT, script)).read()
    assert source.count(TIE) == 1, f"{script}: no line {TIE.strip()!r}"
    path = os.path.join(into, script)
    with open(path, "w") as f:
        f.write(source.replace(TIE, "from common import Run\n"))
    return path


def side_run(path, flags, ranks, pin, plain, iters, ablate=""):
    """One launch through probe.py: its step times (ms, the script's own clock) and the probe's
    rows of every rank."""
    probe = tempfile.mkdtemp(prefix="gptpar-probe-")
    env = {"OMP_NUM_THREADS": "1", "GPTPAR_PROBE": probe, "GPTPAR_PIN": "1" if pin else "0", "GPTPAR_ABLATE": ablate,
           "GPTPAR_PROFILE": "1" if PROFILE else "0", **SAME_MALLOC}
    run = launch(PROBE, [path] + flags, nprocs=ranks, env=env, timeout=TIMEOUT_S,
                 metrics=not plain, out_dir=not plain)  # the plain Run has neither flag
    run = finished(run, iters, plain)
    if plain:  # its line: `step N: loss X, lr Y, T ms, ...`
        dt = [float(ms) for ms in re.findall(r"^step \d+: loss [0-9.]+, lr \S+, (\d+) ms", run.stdout, re.M)]
        losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+),", run.stdout, re.M)]
    else:
        dt, losses = [row["dt_ms"] for row in run.steps], run.losses
    # every rank that wrote its rows (torch's baseline hung in teardown: the killed rank wrote none)
    files = [os.path.join(probe, f"rank{r}.json") for r in range(ranks)]
    probes = [json.load(open(f)) for f in files if os.path.exists(f)]
    assert probes, f"no rank wrote its probe rows: {run.stderr[-2000:]}"
    shutil.rmtree(probe, ignore_errors=True)
    return {"dt": dt, "losses": losses, "rows": [p["rows"] for p in probes], "threads": [p["threads"] for p in probes],
            "spent": [p["spent"] for p in probes]}


def thread_costs(side):
    """{thread name: [CPU ms per step, involuntary switches per step]} summed over the threads of
    that name, mean over the ranks, between probe.py's two readings (after warm-up, after the last
    step; CPU in clock ticks, so coarse)."""
    out = {}
    for per_rank in side["threads"]:
        if len(per_rank) < 2:  # --iters at most probe.py's WARM: one reading, no interval
            continue
        (a, early), (b, late) = sorted(per_rank.items(), key=lambda kv: int(kv[0]))
        steps = int(b) - int(a)
        for tid, (name, cpu, switches) in late.items():
            was = early.get(tid, [name, 0.0, 0])
            total = out.setdefault(name, [0.0, 0.0])
            total[0] += (cpu - was[1]) * 1e3 / steps / len(side["threads"])
            total[1] += (switches - was[2]) / steps / len(side["threads"])
    return out


def per_step(side, skip):
    """Medians over the steps after `skip`, averaged over the ranks: the script's own step time,
    and from the probe the loop's period, the process's CPU (all threads), the main thread's CPU
    (ms), the involuntary context switches per step (the core taken by someone else), the
    kernel's share of the CPU (ms) and the minor page faults (memory the kernel maps afresh)."""
    logged_skip = -(-skip // LOG_INTERVAL)  # dt is in the logged steps' rows: every LOG_INTERVAL-th step
    out = {"dt": statistics.median(side["dt"][logged_skip:])}
    for key, column in (("period", 0), ("cpu", 1), ("main", 2), ("preempted", 4), ("sys", 5), ("faults", 6)):
        out[key] = statistics.mean(statistics.median((b[column] - a[column]) * (1 if column in (4, 6) else 1e3)
                                                     for a, b in zip(rows[skip:], rows[skip + 1:]))
                                   for rows in side["rows"])
    return out


def profile_costs(side, iters):
    """{method: [main thread CPU ms, wall ms] per step} from probe.py's GPTPAR_PROFILE, mean over ranks."""
    out = {}
    for spent in side["spent"]:
        for name, (cpu, wall, _) in spent.items():
            total = out.setdefault(name, [0.0, 0.0])
            steps = max(1, iters - 5 + 1)  # counted from probe.py's WARM = 5
            total[0] += cpu * 1e3 / steps / len(side["spent"])
            total[1] += wall * 1e3 / steps / len(side["spent"])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pair", choices=sorted(PAIRS))
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    p.add_argument("--repeats", type=int, default=2, help="rounds of runs, who goes first rotating")
    p.add_argument("--lock", help="a lock file (flock) held for each round of runs, e.g. /tmp/gptpar-tests.lock")
    p.add_argument("--pin", action="store_true", help="each rank (and its threads) on a core of its own, both sides")
    p.add_argument("--plain", action="store_true",
                   help="a third side: our script with `from common import Run` (no ledger, guard, meter, metrics)")
    p.add_argument("--glibc_default", action="store_true",
                   help="leave glibc's malloc thresholds alone (each side's depend on what it freed at start-up)")
    p.add_argument("--profile", action="store_true",
                   help="the main thread's CPU and wall time in each of infra's per-step methods (probe.py)")
    p.add_argument("--log_interval", type=int, default=1,
                   help="both sides log (and ours measures its activations) every N steps; the scripts' default is 10")
    p.add_argument("--ablate", action="append", default=[], choices=["guard", "meter", "guard,meter"],
                   help="another side: ours with that piece of infra's Run taken out (probe.py)")
    a, model_flags = p.parse_known_args()  # anything else is passed to both scripts
    global PROFILE, LOG_INTERVAL, SAME_MALLOC
    PROFILE, LOG_INTERVAL = a.profile, a.log_interval
    if a.glibc_default:
        SAME_MALLOC = {}
    data_parallel = a.pair in ("ddp", "zero1", "fsdp2", "fsdp")
    # the defaults, then anything given (a flag given twice: the last one counts)
    model_flags = ["--model", "shakespeare", "--n_layer", "4", "--n_embd", "256", "--n_head", "4",
                   "--block_size", "128", "--dropout", "0", "--global_batch_size", "16"] + model_flags
    flags = model_flags + ["--device", a.device, "--max_iters", a.iters, "--log_interval", a.log_interval,
                             "--eval_interval", "0", "--warmup_iters", "2"]
    global_batch = int(model_flags[max(i for i, f in enumerate(model_flags) if f == "--global_batch_size") + 1])
    (script, *ours_flags), impl = PAIRS[a.pair]
    copies = tempfile.mkdtemp(prefix="gptpar-plain-")
    sides = {"ours": (os.path.join(ROOT, script), ours_flags, False, ""),
             "torch": (os.path.join(ROOT, "tests/benchmarks/torch_baselines.py"), ["--impl", impl], False, "")}
    if a.plain:
        sides["plain"] = (plain_copy(script, copies), ours_flags, True, "")
    for piece in a.ablate:
        sides[f"-{piece}"] = (os.path.join(ROOT, script), ours_flags, False, piece)
    print(f"{a.pair}: {' '.join([script] + ours_flags)} vs torch --impl {impl}"
          + (", and its plain copy" if a.plain else "") + (", each rank pinned to a core" if a.pin else ""))
    print("ms per step (medians over steps, mean over ranks): dt = the script's clock; period = optimizer step to "
          "optimizer step (wall); cpu = the process's user+sys, all threads; main = the main thread's CPU; "
          "pre = involuntary context switches; sys = the kernel's CPU; faults = minor page faults")
    names = list(sides)
    for ranks in a.ranks:
        results = {name: [] for name in names}
        micro = [] if "--micro_batch_size" in model_flags else ["--micro_batch_size", global_batch // (
            ranks if data_parallel else 1)]  # one micro-batch per step, on both sides
        for repeat in range(a.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]  # rotate who goes first
            with locked(a.lock):
                for name in order:
                    path, extra, plain, ablate = sides[name]
                    results[name].append(side_run(path, flags + micro + extra, ranks, a.pin, plain, a.iters, ablate))
            print(f"  repeat {repeat}: " + "; ".join(
                f"{name} " + " ".join(f"{k} {v:.1f}" for k, v in per_step(results[name][-1], a.skip).items())
                for name in names), flush=True)
        same = max(abs(x - y) / y for x, y in zip(results["ours"][0]["losses"], results["torch"][0]["losses"])) < 1e-4
        print(f"{ranks} ranks, same losses as torch: {same}")
        print(f"  {'side':6s} " + " ".join(f"{k:>8s}" for k in ("dt", "period", "cpu", "main", "pre", "sys", "faults"))
              + "   ratios to torch (median, range over repeats): dt, period, cpu")
        for name in names:
            stats = [per_step(r, a.skip) for r in results[name]]
            line = " ".join(f"{statistics.median(s[k] for s in stats):8.1f}" for k in stats[0])
            if name != "torch":
                theirs = [per_step(r, a.skip) for r in results["torch"]]
                for k in ("dt", "period", "cpu"):
                    ratios = [s[k] / t[k] for s, t in zip(stats, theirs)]
                    line += f"   {k} {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
            print(f"  {name:6s} {line}", flush=True)
        print("  threads, CPU ms and involuntary switches per step (summed by name; mean over ranks, median over repeats):")
        for name in names:
            costs = [thread_costs(r) for r in results[name]]
            keys = sorted({k for c in costs for k in c})
            print(f"  {name:6s} " + ", ".join(
                f"{k} {statistics.median(c.get(k, [0, 0])[0] for c in costs):.1f} ms "
                f"{statistics.median(c.get(k, [0, 0])[1] for c in costs):.0f} sw" for k in keys))
        if a.profile:
            print("  inside infra's methods, ms per step (main thread CPU / wall; mean over ranks, median over repeats):")
            for name in names:
                spent = [profile_costs(r, a.iters) for r in results[name]]
                keys = sorted({k for s in spent for k in s})
                for k in keys:
                    print(f"  {name:6s} {k:48s} " + " / ".join(
                        f"{statistics.median(s.get(k, [0, 0])[i] for s in spent):7.2f}" for i in (0, 1)))
    shutil.rmtree(copies, ignore_errors=True)


if __name__ == "__main__":
    main()
