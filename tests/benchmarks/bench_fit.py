"""The fit check's allowance, measured: each training script's peak resident memory per rank
(CPU: ru_maxrss, printed by peak_rss.py) against what its costs() says the rank holds, at a
few sizes. Rerun with

    flock /tmp/gptpar-tests.lock python tests/benchmarks/bench_fit.py            # every case
    python tests/benchmarks/bench_fit.py --lock /tmp/gptpar-tests.lock           # one lock per case
    python tests/benchmarks/bench_fit.py --only 03 07 --results /tmp/fit.jsonl   # some scripts
    python tests/benchmarks/bench_fit.py --table /tmp/fit.jsonl                  # the table again
    python tests/benchmarks/bench_fit.py --list                                  # the cases

Every case is a real launch (`mpiexec -n N python peak_rss.py SCRIPT ...`; plain `python` for
01, with --sample_tokens 0), with the baby model (the default preset; baby-moe for 10), --device cpu --dtype float32
--dropout 0 --max_iters 2 --eval_iters 1 --global_batch_size 16, an explicit
--micro_batch_size and --no_fit_check (what is measured must not depend on the check or on
the default micro-batch), and no OMP_NUM_THREADS (each rank takes its share of the cores, as
a bare command does).

For every rank the launch records, in the same process:

  runtime     its resident set (VmRSS) when Run.start returns: torch, common and the script
              imported, the process group up, before the model is built. This is the moment
              of the fit check, whose room (MemAvailable) already excludes it.
  costs()     the script's own costs() for this rank, as the fit check computes them
              (infra.fit.fit_problem: this rank's position for 07/08, all of held incl. the
              (host) parts on CPU): model state (held) + activations.
  peak        ru_maxrss at the end of the run (peak_rss.py).
  rest        peak - runtime - costs(): what the allowance must cover (outputs before the
              next op consumes them, gradients in flight, AdamW's temporaries, buffers of the
              collectives, the allocator's and the libraries' first-use growth).
  allowance   infra.fit.FIT_SHARE x costs() + infra.fit.FIT_MIB MiB; the check's need is
              costs() + allowance, so it keeps its promise here when rest <= allowance.

The table shows, per case, the rank with the least margin (allowance - rest); `all ranks`
says whether every rank's rest is within its allowance. The constants that would hold for
every rank measured are printed below the table: the least FIT_MIB at the current FIT_SHARE,
and the least FIT_SHARE at the current FIT_MIB."""

import argparse
import fcntl
import json
import os
import re
import resource
import runpy
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MiB = 2**20

# name, ranks, script and its flags; the micro-batch sizes each is measured at
CASES = [
    ("01", 1, ["01_single_gpu.py", "--sample_tokens", "0"], (2, 8, 16)),
    ("01 --recompute", 1, ["01_single_gpu.py", "--sample_tokens", "0", "--recompute"], (2, 8, 16)),
    ("03 dp 2", 2, ["03_ddp.py"], (2, 8)),
    ("03 dp 2 --recompute", 2, ["03_ddp.py", "--recompute"], (8,)),
    ("04 stage 1, dp 2", 2, ["04_zero.py", "--stage", "1"], (2, 8)),
    ("04 stage 2, dp 2", 2, ["04_zero.py", "--stage", "2"], (2, 8)),
    ("04 stage 3, dp 2", 2, ["04_zero.py", "--stage", "3"], (2, 8)),
    ("04 stage 3 --offload, dp 2", 2, ["04_zero.py", "--stage", "3", "--offload"], (8,)),
    ("05 dp 2", 2, ["05_fsdp.py"], (2, 8)),
    ("06 tp 2", 2, ["06_tensor_parallel.py"], (2, 8)),
    ("06 tp 2 --sequence_parallel", 2, ["06_tensor_parallel.py", "--sequence_parallel"], (8,)),
    ("06 tp 2 --recompute", 2, ["06_tensor_parallel.py", "--recompute"], (8,)),
    ("07 pp 2 1f1b", 2, ["07_pipeline.py", "--schedule", "1f1b"], (2, 8)),
    ("07 pp 2 gpipe", 2, ["07_pipeline.py", "--schedule", "gpipe"], (2,)),
    ("07 pp 2 1f1b --recompute", 2, ["07_pipeline.py", "--schedule", "1f1b", "--recompute"], (8,)),
    ("08 tp 2 pp 2", 4, ["08_3d.py", "--tp", "2", "--pp", "2"], (2, 8)),
    ("09 cp 2 ring", 2, ["09_context_parallel.py", "--cp", "2", "--cp_impl", "ring"], (2, 8)),
    ("09 cp 2 ulysses", 2, ["09_context_parallel.py", "--cp", "2", "--cp_impl", "ulysses"], (8,)),
    ("10 ep 2 (baby-moe)", 2, ["10_expert_parallel.py", "--ep", "2"], (2, 8)),
]

FLAGS = ["--device", "cpu", "--dtype", "float32", "--dropout", "0", "--max_iters", "2", "--eval_iters", "1",
         "--global_batch_size", "16", "--log_interval", "1", "--no_fit_check", "--timeout", "300"]

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "SLURM_PROCID",
                "SLURM_NTASKS", "OMP_NUM_THREADS")


# ----------------------------------------------------------------------------------------
# In each rank: the runtime and costs() at Run.start's return, then the run under peak_rss.py
# ----------------------------------------------------------------------------------------

def vm_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def worker(argv):
    """`bench_fit.py --worker SCRIPT FLAGS...`, one per rank: wrap infra.run.Run.start so that,
    once the process group and device are up (where the fit check runs), this rank prints
    its resident set and its costs(); then run the script under peak_rss.py, which prints
    its ru_maxrss at the end."""
    sys.path.insert(0, ROOT)
    import argparse as _argparse
    import inspect

    import common
    import infra.fit
    import infra.run

    start = infra.run.Run.start

    def measured_start(self, *args, **kwargs):
        env, accum_steps = start(self, *args, **kwargs)
        runtime, runtime_peak = vm_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        costs = kwargs.get("costs", args[0] if args else None)
        a = _argparse.Namespace(**vars(self.args))
        config = common.model_config(a, common.Data.vocab_size_of(a.data))
        at_rank = {"rank": env.rank} if "rank" in inspect.signature(costs).parameters else {}
        cost = costs(a, config, env.world_size, env.dtype, **at_rank)
        held = sum(v for _, (_, v) in cost["held"].items())  # on CPU the (host) parts too, as fit_need
        acts = cost["activations"][1] if "activations" in cost else 0
        print("bench_fit " + json.dumps(dict(rank=env.rank, runtime=runtime, runtime_peak=runtime_peak, held=held,
                                             activations=acts, fit_share=infra.fit.FIT_SHARE, fit_mib=infra.fit.FIT_MIB,
                                             threads=common.torch.get_num_threads())), flush=True)
        return env, accum_steps

    infra.run.Run.start = measured_start
    sys.argv = [os.path.join(HERE, "peak_rss.py")] + argv
    runpy.run_path(sys.argv[0], run_name="__main__")


# ----------------------------------------------------------------------------------------
# The driver: one launch per case, one lock per launch, the table
# ----------------------------------------------------------------------------------------

def measure(name, ranks, script_flags, micro, lock, timeout, extra_env=()):
    tmp = tempfile.mkdtemp(prefix="gptpar-fit-")
    flags = script_flags + FLAGS + ["--micro_batch_size", str(micro), "--out_dir", os.path.join(tmp, "out")]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + flags
    if ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks)] + cmd
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(PYTHONUNBUFFERED="1", **dict(kv.split("=", 1) for kv in extra_env))
    with open(lock or os.devnull) as held:
        if lock:  # flock(1)'s lock, taken here so that the timeout counts the run, not the wait
            fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            print(f"error: {name} at micro-batch {micro} ran past {timeout:g} s:\n{e.stdout}\n{e.stderr}",
                  file=sys.stderr)
            return []
    seconds = time.time() - t0
    # (the ranks' lines may run together in mpiexec's merged output)
    at_setup = {r["rank"]: r for r in map(json.loads, re.findall(r"bench_fit (\{[^{}]*\})", p.stdout))}
    peaks = {int(r): int(b) for r, b in re.findall(r"peak_rss rank (\d+): (\d+) bytes", p.stdout)}
    if p.returncode or set(peaks) != set(range(ranks)) or set(at_setup) != set(range(ranks)):
        print(f"error: {name} at micro-batch {micro} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n"
              f"{p.stderr[-3000:]}", file=sys.stderr, flush=True)
        return []
    rows = []
    for rank in range(ranks):
        r = at_setup[rank]
        base = r["held"] + r["activations"]
        rest = peaks[rank] - r["runtime"] - base
        allowance = int(r["fit_share"] * base) + r["fit_mib"] * MiB
        rows.append(dict(case=name, ranks=ranks, micro=micro, flags=" ".join(flags), peak=peaks[rank],
                         rest=rest, allowance=allowance, holds=rest <= allowance, seconds=round(seconds, 1),
                         env=" ".join(extra_env), **r))
    return rows


def mib(x):
    return f"{x / MiB:.0f}"


def table(rows):
    """The markdown table: per case, the rank with the least margin; then the constants that
    would hold for every rank measured."""
    out = ["| case | micro-batch | rank | peak RSS | runtime at the check | costs(): state + activations "
           "| the rest (transients) | allowance: 25% + 128 MiB | rest within? (all ranks) |",
           "|---|---|---|---|---|---|---|---|---|"]
    share, fit_mib = rows[0]["fit_share"], rows[0]["fit_mib"]
    out[0] = out[0].replace("25% + 128 MiB", f"{share:.0%} + {fit_mib} MiB")
    cases, order = {}, {name: i for i, (name, *_) in enumerate(CASES)}
    for r in sorted(rows, key=lambda r: (order.get(r["case"], len(order)), r["micro"], r["rank"])):
        cases.setdefault((r["case"], r["micro"]), []).append(r)
    for (case, micro), rs in cases.items():
        r = min(rs, key=lambda r: r["allowance"] - r["rest"])
        out.append(f"| {case} | {micro} | {r['rank']} of {r['ranks']} | {mib(r['peak'])} MiB | {mib(r['runtime'])} MiB "
                   f"| {mib(r['held'])} + {mib(r['activations'])} MiB | {mib(r['rest'])} MiB | {mib(r['allowance'])} MiB "
                   f"| {'yes' if r['holds'] else '**no**'} ({'yes' if all(x['holds'] for x in rs) else 'no'}) |")
    runtimes = [r["runtime"] for r in rows]
    worst_mib = max(r["rest"] - share * (r["held"] + r["activations"]) for r in rows)
    worst_share = max((r["rest"] - fit_mib * MiB) / (r["held"] + r["activations"]) for r in rows)
    out += ["", f"runtime at the check (VmRSS when Run.start returns): {mib(min(runtimes))} to {mib(max(runtimes))} MiB "
                f"per rank; the rest {mib(min(r['rest'] for r in rows))} to {mib(max(r['rest'] for r in rows))} MiB; "
                f"every rank within the allowance: {all(r['holds'] for r in rows)}",
            f"the least FIT_MIB that holds at FIT_SHARE = {share}: {worst_mib / MiB:.0f} MiB; the least FIT_SHARE "
            f"that holds at FIT_MIB = {fit_mib}: {max(0.0, worst_share):.2f}"]
    return "\n".join(out)


def main():
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", help="the cases whose name starts with one of these (e.g. 03 07)")
    p.add_argument("--case", nargs="+", help="the cases of exactly these names (see --list)")
    p.add_argument("--micro", type=int, nargs="+", help="only these micro-batch sizes")
    p.add_argument("--lock", help="run each launch under `flock LOCK` (released between cases)")
    p.add_argument("--results", help="append each case's per-rank rows to this JSONL file as it finishes")
    p.add_argument("--table", metavar="JSONL", help="print the table of a --results file and exit")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--env", nargs="+", default=[], metavar="KEY=VALUE",
                   help="set in the ranks' environment, e.g. MALLOC_MMAP_THRESHOLD_=65536 (glibc)")
    a = p.parse_args()
    if a.table:
        with open(a.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    todo = [(name, ranks, flags, micro) for name, ranks, flags, micros in CASES for micro in micros
            if (not a.only or any(name.startswith(o) for o in a.only)) and (not a.case or name in a.case)
            and (not a.micro or micro in a.micro)]
    if a.list:
        for name, ranks, flags, micro in todo:
            print(f"{name}, micro-batch {micro}: {ranks} rank(s): {' '.join(flags)}")
        return
    rows, failed = [], []
    for name, ranks, flags, micro in todo:
        case = measure(name, ranks, flags, micro, a.lock, a.timeout, a.env)
        if not case:
            failed.append(f"{name} at micro-batch {micro}")
            continue
        rows += case
        worst = min(case, key=lambda r: r["allowance"] - r["rest"])
        print(f"{name}, micro-batch {micro}: peak {mib(worst['peak'])} MiB, runtime {mib(worst['runtime'])}, "
              f"costs {mib(worst['held'])} + {mib(worst['activations'])}, rest {mib(worst['rest'])} MiB, allowance "
              f"{mib(worst['allowance'])} MiB (rank {worst['rank']}, {worst['seconds']:.0f} s)", file=sys.stderr,
              flush=True)
        if a.results:
            with open(a.results, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in case)
    if rows:
        print(table(rows))
    if failed:
        sys.exit(f"error: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
