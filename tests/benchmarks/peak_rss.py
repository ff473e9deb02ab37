"""Peak resident memory per rank (ru_maxrss): the per-rank memory figure on CPUs, where torch
has no allocator statistics.

    mpiexec -n 4 python tests/benchmarks/peak_rss.py SCRIPT [FLAGS...]
        run a training script in this process (under mpiexec like the script), then print this
        rank's peak resident memory: "peak_rss rank R: N bytes" (bench_cp.py reads it)

    python tests/benchmarks/peak_rss.py --side_by_side [--ranks 4] [--rounds 1] [FLAGS...]
        04_zero.py --stage 3, 05_fsdp.py and PyTorch's own FSDP2 (torch_baselines.py --impl
        fsdp2: fully_shard on every block and the root, 05's units) launched one after the
        other, `rounds` times interleaved, with the same FLAGS; then a table per case: each
        rank's peak RSS, the step time (the median of steps 1..), and the ratio of the peak to
        what costs() predicts per rank (params + grads + optimizer state + gathered units +
        activations, from the script's own --dry_run; FSDP2 is priced with 05's costs(), the
        same sharding), and whether the peak is within costs() + the fit check's CPU
        allowance. Set MALLOC_MMAP_THRESHOLD_ in the environment to compare glibc's settings
        (docs/memory.md).
"""

import os
import re
import resource
import runpy
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = {"04 --stage 3": ["04_zero.py", "--stage", "3"], "05": ["05_fsdp.py"],
         "torch FSDP2": ["tests/benchmarks/torch_baselines.py", "--impl", "fsdp2"]}
PRICED_AS = {"04 --stage 3": ("04_zero.py", ["--stage", "3"]), "05": ("05_fsdp.py", []),
             "torch FSDP2": ("05_fsdp.py", [])}
MIB = 2**20


def run_one():
    """The script named by argv[1], run here as __main__; then this rank's peak RSS."""
    sys.path.insert(0, ROOT)
    script = os.path.join(ROOT, sys.argv[1])
    sys.argv = [script] + sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
    rank = os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))
    print(f"peak_rss rank {rank}: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024} bytes", flush=True)


def predicted(case, flags, ranks):
    """(text, bytes) of costs() per rank for `case`: state + gathered + activations, and the
    fit check's need on CPU (infra.fit.fit_need: that + its CPU allowance)."""
    sys.path.insert(0, ROOT)
    import plan
    from infra.fit import fit_need
    name, strategy = PRICED_AS[case]
    result = plan.dry_run(name, strategy + flags, ranks, ranks)
    if isinstance(result, str):
        sys.exit(f"error: {name} refuses {' '.join(flags)} at {ranks} ranks: {result}")
    cost = result[2]
    terms = [cost["held"][k][1] for k in ("params", "grads", "optim")]
    terms += [cost["gathered"][1] if "gathered" in cost else 0, cost["activations"][1]]
    text = " + ".join(f"{t / MIB:,.1f}" for t in (sum(terms[:3]),) + tuple(terms[3:]))
    return text, sum(terms), fit_need(cost, "cpu")


def launch(case, flags, ranks):
    """One mpiexec run of `case`: ({rank: peak bytes}, [step seconds])."""
    argv = ["mpiexec", "-n", str(ranks), sys.executable, os.path.abspath(__file__), *CASES[case], *flags]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    if done.returncode:
        sys.exit(f"error: {case} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    peaks = {int(r): int(b) for r, b in re.findall(r"peak_rss rank (\d+): (\d+) bytes", done.stdout)}
    steps = [float(ms.replace(",", "")) / 1e3 for ms in re.findall(r"^step \d+: .*?, ([\d.,]+) ms", done.stdout, re.M)]
    return peaks, steps


def side_by_side(argv):
    ranks, rounds, flags = 4, 1, []
    while argv:
        flag = argv.pop(0)
        if flag in ("--ranks", "--rounds"):
            value = int(argv.pop(0))
            ranks, rounds = (value, rounds) if flag == "--ranks" else (ranks, value)
        else:
            flags.append(flag)
    prices = {case: predicted(case, flags, ranks) for case in CASES}
    results = {case: [] for case in CASES}
    for r in range(rounds):
        for case in CASES:  # interleaved: a slow spell of a shared machine hits every case
            peaks, steps = launch(case, flags, ranks)
            results[case].append((peaks, steps))
            print(f"round {r + 1}, {case}: peak RSS per rank "
                  + ", ".join(f"{b / MIB:,.0f}" for _, b in sorted(peaks.items()))
                  + " MiB; steps " + ", ".join(f"{s:.3g}" for s in steps) + " s", flush=True)
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    print(f"\n{ranks} ranks, {' '.join(flags)}; glibc "
          + (f"MALLOC_MMAP_THRESHOLD_={threshold}" if threshold else "default") + f"; {rounds} round(s)")
    print("| run | costs() per rank: state + gathered + activations | peak RSS per rank | peak / costs() "
          "| fit check's need (costs() + 50% + 768 MiB) | within it | step time (median of steps 1..) |")
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        text, total, need = prices[case]
        peaks = [b for peaks, _ in results[case] for b in peaks.values()]
        steps = [s for _, steps in results[case] for s in steps[1:]]
        lo, hi = min(peaks), max(peaks)
        print(f"| {case} | {text} = {total / MIB:,.1f} MiB | {lo / MIB:,.0f}-{hi / MIB:,.0f} MiB "
              f"| {lo / total:.2f}-{hi / total:.2f} | {need / MIB:,.0f} MiB | {'yes' if hi <= need else 'NO'} "
              f"| {statistics.median(steps):.3g} s |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--side_by_side"]:
        side_by_side(sys.argv[2:])
    else:
        run_one()
