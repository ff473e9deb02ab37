"""Benchmark of 09_context_parallel.py at long context: median step time and peak memory per
rank of ring and Ulysses context parallelism against 01_single_gpu.py on the same model and
global batch. Rerun with

    python tests/benchmarks/bench_cp.py                        # CPU: 2 ranks, context 2048
    python tests/benchmarks/bench_cp.py --ranks 2 4 --block_size 4096 ...   # other flags: to all
    git show REV:09_context_parallel.py > /tmp/09_before.py
    python tests/benchmarks/bench_cp.py --before /tmp/09_before.py  # that version too, interleaved

torch's own torch.distributed.tensor.experimental.context_parallel is not a baseline here:
on CPU (torch 2.13) it fails with "Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered" (it shards only the CUDA SDPA kernels).

Step time is the median over the steps after --skip, the best of --repeats interleaved runs.
Memory is each rank's peak resident set (ru_maxrss, so it includes the ~0.3 GB of the torch
runtime) on CPU, torch's max_memory_allocated on GPUs."""

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import launch  # noqa: E402


def peak_bytes(run):
    """The largest per-rank peak: ru_maxrss printed by peak_rss.py, else the metrics'."""
    rss = [int(b) for b in re.findall(r"peak_rss rank \d+: (\d+) bytes", run.stdout)]
    gpu = [row["mem_peak_bytes"] for row in run.steps if row.get("mem_peak_bytes")]
    return max(gpu) if gpu else max(rss)


def interleaved(configs, flags, repeats, skip):
    """Run every (name, ranks, [script, *flags]) `repeats` times, interleaved so that a busy
    spell of the machine hits all alike, one thread per rank, each rank's peak RSS recorded.
    Returns the runs by name, the best of the repeats' median step times (skipping `skip`
    warm-up steps) and the largest peak memory per rank."""
    runs = {name: [] for name, _, _ in configs}
    for _ in range(repeats):
        for name, ranks, (script, *extra) in configs:
            runs[name].append(launch("tests/benchmarks/peak_rss.py", [script] + flags + extra, nprocs=ranks,
                                     env={"OMP_NUM_THREADS": "1"}, timeout=3600).ok())
    ms = {name: min(statistics.median(r["dt_ms"] for r in rs.steps[skip:]) for rs in runs[name]) for name in runs}
    mem = {name: max(peak_bytes(r) for r in runs[name]) for name in runs}
    return runs, ms, mem


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the median")
    p.add_argument("--repeats", type=int, default=2, help="runs of each, interleaved; best median kept")
    p.add_argument("--before", help="another 09_context_parallel.py (a file), run too, interleaved")
    p.add_argument("--before_impl", nargs="+", default=["ring", "ulysses"], choices=["ring", "ulysses"],
                   help="which of --before's attentions to run (the other's code unchanged: fewer runs)")
    a, model_flags = p.parse_known_args()
    model_flags = model_flags or ["--model", "tiny", "--n_layer", "4", "--n_embd", "128", "--n_head", "4",
                                  "--block_size", "2048", "--global_batch_size", "8",
                                  "--micro_batch_size", "8"]  # every run one micro-batch (no data parallelism)
    flags = model_flags + ["--device", a.device, "--max_iters", a.iters, "--log_interval", "1",
                           "--eval_interval", "0", "--warmup_iters", "2", "--dtype", "float32"]
    configs = [("01 (1 rank)", 1, ["01_single_gpu.py", "--sample_tokens", "0"])]
    configs += [(f"{impl} cp {n}", n, ["09_context_parallel.py", "--cp", n, "--cp_impl", impl])
                for n in a.ranks for impl in ("ring", "ulysses")]
    if a.before:
        configs += [(f"{impl} cp {n} before", n, [os.path.abspath(a.before), "--cp", n, "--cp_impl", impl])
                    for n in a.ranks for impl in a.before_impl]
    runs, ms, mem = interleaved(configs, flags, a.repeats, a.skip)
    single = runs["01 (1 rank)"][0]
    ms0, mem0 = ms["01 (1 rank)"], mem["01 (1 rank)"]
    print(f"context parallel vs 01_single_gpu.py, best of {a.repeats}: {' '.join(map(str, model_flags))}")
    print(f"{'run':>20} {'ms/step':>9} {'ratio':>6} {'peak MiB/rank':>14} {'ratio':>6} {'same losses':>12}")
    print(f"{'01 (1 rank)':>20} {ms0:>9.0f} {1:>6.2f} {mem0 / 2**20:>14.0f} {1:>6.2f} {'':>12}", flush=True)
    for name, _, _ in configs[1:]:
        same = max(abs(x - y) / y for x, y in zip(runs[name][0].losses, single.losses)) < 1e-4
        print(f"{name:>20} {ms[name]:>9.0f} {ms[name] / ms0:>6.2f} {mem[name] / 2**20:>14.0f} "
              f"{mem[name] / mem0:>6.2f} {str(same):>12}", flush=True)


if __name__ == "__main__":
    main()
