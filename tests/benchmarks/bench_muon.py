"""Benchmark: step time with --optimizer muon against adamw, side by side, for each sharded
strategy, at bench.py's model and batch (4 layers x 256, 128 tokens, 16 sequences, one
micro-batch per data-parallel rank). Rerun with

    python tests/benchmarks/bench_muon.py                       # every layout below
    python tests/benchmarks/bench_muon.py --only 04-s3 06 --iters 20 --repeats 3

The two optimizers run alternately (who goes first alternates too), each run's median step
time over its steps after --skip, the best median of --repeats kept (as bench.py); the last
column is the median over the --repeats pairs of muon/adamw, each pair run back to back. Each layout
holds /tmp/gptpar-tests.lock while it runs, so the shared machine's tests and benchmarks do not
overlap it. Also printed: the Newton-Schulz GFLOP of the busiest rank (costs()'s muon_flops),
the iteration the step time's difference pays for."""

import argparse
import fcntl
import importlib.util
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import ROOT, launch  # noqa: E402

LAYOUTS = {  # name: (script, ranks, flags)
    "03": ("03_ddp.py", 2, []),
    "03-x4": ("03_ddp.py", 4, []),
    "04-s1": ("04_zero.py", 2, ["--stage", "1"]),
    "04-s3": ("04_zero.py", 2, ["--stage", "3"]),
    "05": ("05_fsdp.py", 2, []),
    "06": ("06_tensor_parallel.py", 2, []),
    "08-tp2xpp2": ("08_3d.py", 4, ["--tp", "2", "--pp", "2", "--micro_batch_size", "4"]),
}
MODEL = ["--model", "shakespeare", "--n_layer", "4", "--n_embd", "256", "--n_head", "4", "--block_size", "128",
         "--dropout", "0", "--global_batch_size", "16", "--device", "cpu", "--dtype", "float32"]


def busiest_ns_gflop(script, ranks, flags):
    """costs()'s muon_flops at every rank of the layout, the largest, in GFLOP."""
    spec = importlib.util.spec_from_file_location(script[:-3], os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from common import Data, make_parser, model_config, parse_args
    import torch
    args = parse_args(module.add_flags(make_parser(module.__doc__)), [*MODEL, *flags, "--optimizer", "muon"])
    config = model_config(args, Data.vocab_size_of(args.data))
    per_rank = [module.costs(args, config, ranks, torch.float32, *([rank] if "rank" in
                             module.costs.__code__.co_varnames else []))["muon_flops"][1] for rank in range(ranks)]
    return max(per_rank) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    print(f"{'layout':<12} {'ranks':>5} {'adamw ms':>9} {'muon ms':>9} {'muon - adamw':>13} {'NS GFLOP':>9} "
          f"{'muon/adamw':>10}", flush=True)
    for name in a.only:
        script, ranks, flags = LAYOUTS[name]
        dp = ranks if name.startswith(("03", "04", "05")) else 1  # every rank a data-parallel one
        micro = [] if "--micro_batch_size" in flags else ["--micro_batch_size", str(16 // dp)]
        base = [*MODEL, *flags, *micro, "--max_iters", str(a.iters), "--log_interval", "1", "--eval_interval", "0",
                "--warmup_iters", "2"]
        ms = {"adamw": [], "muon": []}
        with open("/tmp/gptpar-tests.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            for repeat in range(a.repeats):
                order = ["adamw", "muon"] if repeat % 2 == 0 else ["muon", "adamw"]
                for opt in order:
                    run = launch(script, base + ["--optimizer", opt], nprocs=ranks, env={"OMP_NUM_THREADS": "1"},
                                 timeout=1800).ok()
                    ms[opt].append(statistics.median(row["dt_ms"] for row in run.steps[a.skip:]))
        adamw, muon = min(ms["adamw"]), min(ms["muon"])
        ratio = statistics.median(m / a for m, a in zip(ms["muon"], ms["adamw"]))  # pair by pair
        print(f"{name:<12} {ranks:>5} {adamw:>9.0f} {muon:>9.0f} {muon - adamw:>+13.0f} "
              f"{busiest_ns_gflop(script, ranks, flags + micro):>9.2f} {ratio:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
