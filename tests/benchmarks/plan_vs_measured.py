"""Benchmark: plan.py's step time against the measured one, every script's default layout at 2
and 4 ranks, each as the ratio to 01's step (ratios survive a noisy, shared machine where
absolute times do not). Rerun with

    python tests/benchmarks/plan_vs_measured.py                 # 2 and 4 ranks, 10 layouts each
    python tests/benchmarks/plan_vs_measured.py --ranks 2 --iters 6
    python tests/benchmarks/plan_vs_measured.py --smoke         # 2 layouts at 2 ranks, a few seconds

It calibrates once on this machine: the rate of 01's step (the FLOPs plan.py counts for it,
over its measured median step: one matmul rate, overheads included) and alpha and beta from
`02_collectives.py --doctor --json` on 2 ranks (gloo over this host's shared memory). Then
for each layout it measures 01 and the layout one after the other (interleaved: a load that
comes and goes on the machine falls on both), and prices both with plan.score at the
calibrated rate and links: predicted = plan(layout) / plan(01), measured = step(layout) /
step(01), the step being the slowest rank's (dt_ms_max), the median after --skip steps. On
a host with fewer cores than ranks the ranks share the cores, so each rank is priced at
cores/ranks of the rate (the "cores" term). It prints a Markdown table and a last line
`max |error| X% over N layouts`; a layout off by more than --target says which term plan.py
leaves out, as far as the numbers tell."""

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the harness
sys.path.insert(0, ROOT)  # the scripts, plan.py
from harness import launch  # noqa: E402

import plan  # noqa: E402

MODEL = ["--model", "tiny", "--n_layer", "8", "--n_embd", "128", "--block_size", "64", "--dropout", "0",
         "--global_batch_size", "16", "--micro_batch_size", "2"]
SMOKE_MODEL = ["--model", "tiny", "--dropout", "0", "--global_batch_size", "8", "--micro_batch_size", "2"]
MOE = ["--n_expert", "4", "--top_k", "2"]


def layouts(n):
    """(label, script, strategy flags, model flags added to 01's too) at n ranks: the defaults."""
    return [("03 DDP", "03_ddp.py", [], []),
            ("04 ZeRO-1", "04_zero.py", ["--stage", "1"], []),
            ("04 ZeRO-3", "04_zero.py", ["--stage", "3"], []),
            ("05 FSDP", "05_fsdp.py", [], []),
            ("06 TP", "06_tensor_parallel.py", [], []),
            ("07 1F1B", "07_pipeline.py", ["--schedule", "1f1b"], []),
            ("07 ZB", "07_pipeline.py", ["--schedule", "zb"], []),
            (f"08 {'pp 2' if n == 2 else 'tp 2 pp 2'}", "08_3d.py",
             ["--pp", "2"] if n == 2 else ["--tp", "2", "--pp", "2"], []),
            ("09 ring", "09_context_parallel.py", ["--cp_impl", "ring"], []),
            ("10 EP", "10_expert_parallel.py", [], MOE)]


def measure(script, flags, n, iters, skip):
    """The median over the steps after `skip` of the slowest rank's step, in seconds."""
    run = launch(script, [*flags, "--device", "cpu", "--dtype", "float32", "--max_iters", str(iters),
                          "--warmup_iters", "1", "--log_interval", "1", "--eval_interval", "0"],
                 nprocs=n, timeout=900).ok()
    rows = run.steps[skip:] or run.steps[-1:]
    return statistics.median((row.get("dt_ms_max") or row["dt_ms"]) for row in rows) / 1e3


def links():
    """(alpha s, beta GB/s) of this host's gloo, fitted by 02's doctor on 2 ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "doctor.json")
        run = launch("02_collectives.py", ["--doctor", "--json", path], nprocs=2, metrics=False, out_dir=False,
                     timeout=600)  # (on a shared host it may name a straggler: the fit is still its)
        if not os.path.isfile(path):
            raise SystemExit(f"02 --doctor wrote no {path}:\n{run.stderr[-2000:]}")
        fit = json.load(open(path))["links"]["intra"]
    return fit["alpha_s"], fit["beta_GBps"]


def priced(script, flags, n, rate, alpha, beta, cores):
    """plan.py's candidate for `script` at n ranks on this host: each rank at min(1, cores/n)
    of the calibrated rate, the doctor's links."""
    share = min(1.0, cores / n)
    args, machine = plan.parse([*flags_of(flags), "--gpus", str(n), "--gpus_per_node", str(n), "--device", "cpu",
                                "--dtype", "float32", "--peak_tflops", str(rate * share / 1e12),
                                "--link_gbps", str(beta), "--efficiency", "1"])
    machine.update(alpha_intra=alpha, alpha_inter=alpha)
    strategy = [f for i, f in enumerate(flags) if f not in MODEL_FLAGS and (i == 0 or flags[i - 1] not in MODEL_FLAGS)]
    c, reason = plan.score(script, strategy, script, args, machine)
    if c is None:
        raise SystemExit(f"plan.py refuses {script} {' '.join(flags)} at {n} ranks: {reason}")
    return c


MODEL_FLAGS = {"--model", "--n_layer", "--n_embd", "--block_size", "--dropout", "--global_batch_size",
               "--micro_batch_size", "--n_expert", "--top_k"}


def flags_of(flags):
    """The model and batch flags among `flags` (plan.py takes these; the rest are the strategy's)."""
    out = []
    for i, f in enumerate(flags):
        if f in MODEL_FLAGS:
            out += [f, flags[i + 1]]
    return out


def missing_term(pred, meas, c):
    """What plan.py leaves out, as far as a layout's numbers tell."""
    if meas > pred:
        if c["comm_s"] < 0.1 * c["step_time_s"]:
            return "slower than its FLOPs: the fixed cost per micro-batch and per call (Python, kernel and gloo launches)"
        return "slower than priced: gloo's achieved bandwidth under load below the doctor's fit"
    if c["bubble"] > 0.05:
        return "faster than priced: ranks waiting in the bubble give their core to another rank"
    return "faster than priced: communication overlapped with compute (priced unhidden)"


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    a.add_argument("--iters", type=int, default=8)
    a.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    a.add_argument("--target", type=float, default=25.0, help="per cent: a larger error names its missing term")
    a.add_argument("--smoke", action="store_true", help="2 layouts at 2 ranks, the tiny model, 3 steps")
    a.add_argument("--only", nargs="+", default=None, help="the layouts whose label starts so (\"08\", \"04 ZeRO-1\"), "
                   "as RANKS:LABEL (\"4:03\") or LABEL at every --ranks")
    a = a.parse_args()
    model = SMOKE_MODEL if a.smoke else MODEL
    if a.smoke:
        a.ranks, a.iters, a.skip = [2], 3, 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    alpha, beta = links()
    base = measure("01_single_gpu.py", model, 1, a.iters, a.skip)
    flops = priced("01_single_gpu.py", model, 1, 1.0, alpha, beta, cores)["step_time_s"]  # at 1 FLOP/s
    rate = flops / base
    print(f"calibration: 01's step {base * 1e3:.0f} ms = {rate / 1e9:.2f} GFLOP/s (one rank); gloo alpha "
          f"{alpha * 1e6:.0f} us, beta {beta:.2f} GB/s (02 --doctor, 2 ranks); {cores} core(s)\n")
    print("| layout | ranks | predicted / 01 | measured / 01 | error | plan: compute + comm (bubble) | missing term |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for n in a.ranks:
        for label, script, strategy, extra in layouts(n)[:2 if a.smoke else None]:
            if a.only and not any(label.startswith(o.split(":")[-1]) and (":" not in o or o.split(":")[0] == str(n))
                                  for o in a.only):
                continue
            if a.smoke and script == "03_ddp.py":
                script, strategy, label = "07_pipeline.py", ["--schedule", "1f1b"], "07 1F1B"
            one = measure("01_single_gpu.py", model + extra, 1, a.iters, a.skip)  # interleaved: 01, then the layout
            step = measure(script, model + extra + strategy, n, a.iters, a.skip)
            c1 = priced("01_single_gpu.py", model + extra, 1, rate, alpha, beta, cores)
            c = priced(script, model + extra + strategy, n, rate, alpha, beta, cores)
            pred, meas = c["step_time_s"] / c1["step_time_s"], step / one
            error = 100 * (pred / meas - 1)
            errors.append(abs(error))
            term = missing_term(pred, meas, c) if abs(error) > a.target else ""
            print(f"| {label} | {n} | {pred:.2f} | {meas:.2f} ({step * 1e3:.0f} / {one * 1e3:.0f} ms) | {error:+.0f}% | "
                  f"{c['compute_s'] * 1e3:.0f} + {c['comm_s'] * 1e3:.0f} ms ({100 * c['bubble']:.0f}%) | {term} |",
                  flush=True)
    print(f"\nmax |error| {max(errors):.0f}% over {len(errors)} layouts")


if __name__ == "__main__":
    main()
