"""Benchmark of 09_context_parallel.py at long context: median step time and peak memory per
rank of ring and Ulysses context parallelism against 01_single_gpu.py on the same model and
global batch. Rerun with

    python tests/benchmarks/bench_cp.py                        # CPU: 2 ranks, context 2048
    python tests/benchmarks/bench_cp.py --ranks 2 4 --block_size 4096 ...   # other flags: to all

torch's own torch.distributed.tensor.experimental.context_parallel is not a baseline here:
on CPU (torch 2.13) it fails with "Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered" (it shards only the CUDA SDPA kernels).

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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the median")
    a, model_flags = p.parse_known_args()
    model_flags = model_flags or ["--model", "tiny", "--n_layer", "4", "--n_embd", "128", "--n_head", "4",
                                  "--block_size", "2048", "--global_batch_size", "8"]
    flags = model_flags + ["--device", a.device, "--max_iters", a.iters, "--log_interval", "1",
                           "--eval_interval", "0", "--warmup_iters", "2", "--dtype", "float32"]
    wrapper, threads = "tests/benchmarks/peak_rss.py", {"OMP_NUM_THREADS": "1"}
    single = launch(wrapper, ["01_single_gpu.py"] + flags + ["--sample_tokens", "0"], env=threads,
                    timeout=3600).ok()
    ms0, mem0 = statistics.median(r["dt_ms"] for r in single.steps[a.skip:]), peak_bytes(single)
    print(f"context parallel vs 01_single_gpu.py: {' '.join(map(str, model_flags))}")
    print(f"{'run':>16} {'ms/step':>9} {'ratio':>6} {'peak MiB/rank':>14} {'ratio':>6} {'same losses':>12}")
    print(f"{'01 (1 rank)':>16} {ms0:>9.0f} {1:>6.2f} {mem0 / 2**20:>14.0f} {1:>6.2f} {'':>12}", flush=True)
    for ranks in a.ranks:
        for impl in ("ring", "ulysses"):
            run = launch(wrapper, ["09_context_parallel.py"] + flags + ["--cp", ranks, "--cp_impl", impl],
                         nprocs=ranks, env=threads, timeout=3600).ok()
            ms, mem = statistics.median(r["dt_ms"] for r in run.steps[a.skip:]), peak_bytes(run)
            same = max(abs(x - y) / y for x, y in zip(run.losses, single.losses)) < 1e-4
            print(f"{f'{impl} cp {ranks}':>16} {ms:>9.0f} {ms / ms0:>6.2f} {mem / 2**20:>14.0f} "
                  f"{mem / mem0:>6.2f} {str(same):>12}", flush=True)


if __name__ == "__main__":
    main()
