"""Benchmark of 10_expert_parallel.py: median step time and peak memory per rank of expert
parallelism at --ep 2 and 4 against 01_single_gpu.py on the same mixture-of-experts model,
and against 01 on the dense model of the same active parameters (top-1 routing: a token runs
through one expert MLP, the dense model's MLP, plus the router's h·E). Rerun with

    python tests/benchmarks/bench_moe.py                           # CPU: 4 experts, top-1
    python tests/benchmarks/bench_moe.py --ep 2 4 8 --device cuda --model gpt2 --n_expert 8 ...

Step time is the median over the steps after --skip, the best of --repeats interleaved runs; the
last column, the busiest EP rank's share of the routed tokens (the rank the others wait for).
Memory is each rank's peak resident set (ru_maxrss, so it includes the ~0.3 GB of the torch
runtime) on CPU, torch's max_memory_allocated on GPUs."""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_cp import interleaved  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the median")
    p.add_argument("--repeats", type=int, default=2, help="runs of each, interleaved; best median kept")
    a, model_flags = p.parse_known_args()
    model_flags = model_flags or ["--model", "tiny", "--n_layer", "4", "--n_embd", "256", "--n_head", "4",
                                  "--block_size", "256", "--global_batch_size", "16"]
    moe = [] if "--n_expert" in model_flags else ["--n_expert", "4", "--top_k", "1"]
    routing = ("--n_expert", "--top_k", "--balance", "--bias_update_rate", "--capacity_factor", "--shared_experts",
               "--aux_loss_coef")  # the mixture's own flags: the dense model takes none of them
    dense_flags = [f for i, f in enumerate(model_flags) if f not in routing
                   and (i == 0 or model_flags[i - 1] not in routing)]
    flags = ["--device", a.device, "--max_iters", a.iters, "--log_interval", "1", "--eval_interval", "0",
             "--warmup_iters", "2"] + (["--dtype", "float32"] if a.device == "cpu" else [])
    global_batch = int(model_flags[max(i for i, f in enumerate(model_flags) if f == "--global_batch_size") + 1])
    # one micro-batch per step everywhere (10's ranks are data-parallel too), unless given
    def micro(dp):
        return [] if "--micro_batch_size" in model_flags else ["--micro_batch_size", global_batch // dp]
    configs = [("01 moe", 1, ["01_single_gpu.py", "--sample_tokens", "0"] + model_flags + moe + micro(1)),
               ("01 dense, same active", 1, ["01_single_gpu.py", "--sample_tokens", "0"] + dense_flags + micro(1))]
    configs += [(f"10 ep {n}", n, ["10_expert_parallel.py", "--ep", n] + model_flags + moe + micro(n))
                for n in a.ep]
    runs, ms, mem = interleaved(configs, flags, a.repeats, a.skip)
    single = runs["01 moe"][0]
    ms0, mem0 = ms["01 moe"], mem["01 moe"]
    print(f"expert parallel vs 01_single_gpu.py, best of {a.repeats}: {' '.join(map(str, model_flags + moe))}")
    print(f"{'run':>22} {'ms/step':>9} {'ratio':>6} {'peak MiB/rank':>14} {'ratio':>6} {'same losses':>12} "
          f"{'busiest EP rank':>16}")
    for name, ranks, _ in configs:
        same = max(abs(x - y) / y for x, y in zip(runs[name][0].losses, single.losses)) < 1e-4
        print(f"{name:>22} {ms[name]:>9.0f} {ms[name] / ms0:>6.2f} {mem[name] / 2**20:>14.0f} "
              f"{mem[name] / mem0:>6.2f} {str(same) if name.startswith('10') else '':>12} "
              f"{busiest_share(runs[name][0], ranks, a.skip) if name.startswith('10') else '':>16}", flush=True)
    print("busiest EP rank: the median over the timed steps of the largest share of the routed tokens that one "
          "rank's experts receive (ideal 1/ep; it waits for no one, the others wait for it at every all-to-all)")


def busiest_share(run, ep, skip):
    """The median over the steps after `skip` of max over EP ranks of its experts' share of the step's
    routed tokens (expert_tokens, summed over the layers; rank r holds experts [r·E/ep, (r+1)·E/ep))."""
    shares = []
    for row in run.steps[skip:]:
        tokens = row["expert_tokens"]
        per = len(tokens) // ep
        shares.append(max(sum(tokens[r * per:(r + 1) * per]) for r in range(ep)) / sum(tokens))
    return f"{statistics.median(shares):.3f}"



if __name__ == "__main__":
    main()
