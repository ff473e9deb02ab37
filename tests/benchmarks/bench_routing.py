"""Benchmark of the routing options: 10_expert_parallel.py at --ep 4 on the embedded corpus with
each --balance (aux, bias, none), the same --capacity_factor, for --max_iters steps; per run the
final val loss, the expert imbalance (max/mean of the tokens per expert chosen, worst layer,
before any drop) and the dropped fraction over the run, and the median step time; a picture of
both over the steps. Rerun with

    flock /work/test.lock python tests/benchmarks/bench_routing.py          # the table of docs/measured.md
    python tests/benchmarks/bench_routing.py --max_iters 1000 --capacity_factor 1.25 -o routing.png

The runs start from the same seed and see the same batches; only the balancing differs."""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--max_iters", type=int, default=300)
    p.add_argument("--capacity_factor", default="1.0")
    p.add_argument("--balance", nargs="+", default=["aux", "bias", "none"])
    p.add_argument("-o", "--output", default=os.path.join(ROOT, "docs", "img", "routing_balance.png"))
    a, model_flags = p.parse_known_args()
    model_flags = model_flags or ["--model", "tiny", "--n_expert", "8", "--top_k", "2", "--global_batch_size", "16",
                                  "--micro_batch_size", "4"]
    flags = model_flags + ["--ep", a.ep, "--device", "cpu", "--dtype", "float32", "--max_iters", a.max_iters,
                           "--eval_interval", a.max_iters, "--eval_iters", "10", "--log_interval", "5",
                           "--capacity_factor", a.capacity_factor, "--timeout", "300"]
    results = {}
    for balance in a.balance:
        t0 = time.perf_counter()
        run = launch("10_expert_parallel.py", flags + ["--balance", balance], nprocs=a.ep, timeout=1800).ok()
        rows = [r for r in run.steps if "expert_imbalance" in r]
        tail = rows[len(rows) // 2:]  # the second half of the run: the balance it settles to
        results[balance] = {
            "val_loss": run.evals[-1]["val_loss"], "wall_s": time.perf_counter() - t0,
            "imbalance_tail": statistics.mean(r["expert_imbalance"] for r in tail),
            "dropped_tail": statistics.mean(r["dropped_fraction"] for r in tail),
            "step_ms": statistics.median(r["dt_ms"] for r in rows[2:]),
            "steps": [r["step"] for r in rows], "imbalance": [r["expert_imbalance"] for r in rows],
            "dropped": [r["dropped_fraction"] for r in rows]}
        print(f"{balance}: val {results[balance]['val_loss']:.4f}, imbalance (second half) "
              f"{results[balance]['imbalance_tail']:.2f}, dropped {results[balance]['dropped_tail']:.3f}, "
              f"{results[balance]['step_ms']:.0f} ms/step, {results[balance]['wall_s']:.0f} s", flush=True)
    print(f"\n{' '.join(map(str, flags))}\n")
    print("| --balance | val loss | expert_imbalance (steps > half) | dropped_fraction | ms/step |")
    print("|---|---|---|---|---|")
    for balance, r in results.items():
        print(f"| {balance} | {r['val_loss']:.3f} | {r['imbalance_tail']:.2f} | {r['dropped_tail']:.3f} | "
              f"{r['step_ms']:.0f} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for balance, r in results.items():
        left.plot(r["steps"], r["imbalance"], label=f"--balance {balance}")
        right.plot(r["steps"], r["dropped"], label=f"--balance {balance}")
    left.set(xlabel="step", ylabel="expert_imbalance (max/mean, worst layer)", yscale="log")
    right.set(xlabel="step", ylabel=f"dropped_fraction (--capacity_factor {a.capacity_factor})")
    left.legend()
    fig.suptitle(f"10_expert_parallel.py --ep {a.ep}: {' '.join(map(str, model_flags))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.output, dpi=110)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
