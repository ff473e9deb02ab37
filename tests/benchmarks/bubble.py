"""Benchmark: 07_pipeline.py's measured bubble against the drawn one, for every schedule.
Rerun with

    python tests/benchmarks/bubble.py                          # p 2 and 4, every schedule, m = 2p
    python tests/benchmarks/bubble.py --ranks 2 --schedules zb zbv --micro_batches 8
    python tests/benchmarks/bubble.py --ranks 4 --n_embd 128   # other flags: to 07 (a flag given twice: the last)

Each run is `07_pipeline.py --measure_bubble` on the tiny model with 8 layers (so that 4
ranks hold 2 chunks each in a V), float32 on the CPU, one thread a rank; stage 0's metrics
give busy_fraction (the share of its schedule's time spent in F, B and W, timed around each
pass; 1 - that is its measured bubble). Printed as a Markdown table, one row per schedule
and p:

    drawn     07's unit-cost timeline, the bubble over all stages (what its log prints;
              DualPipeV's pairs overlapped, max(F, B))
    stage 0   the same timeline's idle share of stage 0's own span, from its first pass to
              its last, which is what --measure_bubble measures; for DualPipeV with its pairs
              in order, F + B, as a CPU runs them
    measured  1 - busy_fraction, the median over the steps after --skip (min-max in brackets)
    step      the median step time

On a machine with fewer cores than ranks the ranks time-share the cores: a rank that waits
lets another run, and one that should run may wait for a core, so the measured bubble there
mixes the schedule's idle time with the scheduler's."""

import argparse
import importlib
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the harness
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the scripts
from harness import launch  # noqa: E402

pp = importlib.import_module("07_pipeline")


def stage0_idle(every, p, v, vee, split, overlapped):
    """Stage 0's idle share of its own span in 07's unit-cost timeline."""
    _, _, starts, overlap = pp.timeline(every, p, v, vee, split, overlapped)
    hidden = overlap[0] if overlap else {}
    passes = [start for start, op in starts[0] if op not in hidden]  # an overlapped forward takes no time of its own
    span = max(passes) + 1 / v - min(passes)
    return 1 - len(passes) / v / span


def drawn(kind, p, m, v):
    """(bubble over all stages, stage 0's idle share): the overlapped pairs max(F, B), and
    stage 0 also with them in order (F + B), as the CPU runs them."""
    flags = argparse.Namespace(schedule=kind, schedule_csv=None, virtual_stages=v)
    every, v, vee, split = pp.run_schedule(flags, p, m)
    bubble = pp.timeline(every, p, v, vee, split)[1]
    return bubble, stage0_idle(every, p, v, vee, split, True), stage0_idle(every, p, v, vee, split, False)


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    a.add_argument("--schedules", nargs="+", default=pp.SCHEDULES, choices=pp.SCHEDULES)
    a.add_argument("--micro_batches", type=int, default=None, help="m (default 2p)")
    a.add_argument("--iters", type=int, default=15)
    a.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    a, extra = a.parse_known_args()
    print("| schedule | p | m | drawn | stage 0 drawn | stage 0 measured | step |")
    print("|---|---|---|---|---|---|---|")
    for p in a.ranks:
        m = a.micro_batches or 2 * p
        for kind in a.schedules:
            v = 2  # the interleaved schedule's chunks per rank; the V's two
            flags = ["--model", "tiny", "--n_layer", "8", "--device", "cpu", "--dtype", "float32",
                     "--global_batch_size", 2 * m, "--micro_batch_size", 2, "--schedule", kind,
                     "--virtual_stages", v, "--max_iters", a.iters, "--warmup_iters", 2, "--log_interval", 1,
                     "--eval_interval", 0, "--measure_bubble", *extra]
            run = launch("07_pipeline.py", flags, nprocs=p, timeout=900).ok()
            rows = run.steps[a.skip:]
            idle = sorted(1 - row["busy_fraction"] for row in rows)
            step_ms = statistics.median(row["dt_ms"] for row in rows)
            bubble, stage0, in_order = drawn(kind, p, m, v)
            shown = f"{stage0:.3f}" if stage0 == in_order else f"{stage0:.3f} (in order {in_order:.3f})"
            print(f"| {kind} | {p} | {m} | {bubble:.3f} | {shown} | {statistics.median(idle):.3f} "
                  f"({idle[0]:.2f}-{idle[-1]:.2f}) | {step_ms:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
