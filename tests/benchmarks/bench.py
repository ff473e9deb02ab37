"""Benchmark: step time of a numbered script against PyTorch's own implementation of the same
strategy, on the same model, batch and ranks. Rerun with

    python tests/benchmarks/bench.py ddp                 # 03_ddp.py vs DistributedDataParallel
    python tests/benchmarks/bench.py zero1               # 04_zero.py --stage 1 vs DDP + ZeroRedundancyOptimizer
    python tests/benchmarks/bench.py fsdp2               # 04_zero.py --stage 3 vs fully_shard (FSDP2)
    python tests/benchmarks/bench.py fsdp                # 05_fsdp.py vs fully_shard (FSDP2)
    python tests/benchmarks/bench.py tp                  # 06 vs torch.distributed.tensor.parallel
    python tests/benchmarks/bench.py 1f1b ... --micro_batch_size 4    # 07 vs torch.distributed.pipelining
    python tests/benchmarks/bench.py ddp --device cuda --ranks 2 4 8 --model gpt2 ...   # other flags: to both

Prints a table of median step times (the first steps, warm-up, are dropped) and the ratio
ours / torch (below 1 is faster), and whether both report the same losses. The two sides run
in turn, --repeats times, who goes first alternating, so that a change in the machine's load
falls on both: each repeat's ratio is of two runs made back to back, and the table gives the
median of those ratios and their range (with the median step times over the repeats).
--lock FILE holds that lock (flock) for each repeat's pair of runs and lets go between
repeats, so that a shared machine's other jobs run between pairs, never beside one. Without
--micro_batch_size both sides get one micro-batch per step (the global batch divided by the
data-parallel ranks; the whole batch for tp and the pipelines), whatever the scripts' default."""

import argparse
import contextlib
import fcntl
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import launch  # noqa: E402


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


def median_ms(run, skip):
    return statistics.median(row["dt_ms"] for row in run.steps[skip:])


TIMEOUT_S = 300  # a run takes well under a minute here; a hang holds the lock no longer than this


def finished(run, iters):
    """The run, if it trained: exited 0, or (torch's baselines only) logged all `iters` steps and
    then hung in its teardown, as DDP's has, rarely, in destroy_process_group (said, not hidden)."""
    if run.returncode != 0 and "torch_baselines" in " ".join(run.cmd) and len(run.steps) == iters:
        print(f"  (torch's baseline logged all {iters} steps, then did not exit: {run.returncode}; its steps kept)")
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pair", choices=sorted(PAIRS))
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs, who goes first alternating")
    p.add_argument("--lock", help="a lock file (flock) held for each pair of runs, e.g. /tmp/gptpar-tests.lock")
    a, model_flags = p.parse_known_args()  # anything else is passed to both scripts
    data_parallel = a.pair in ("ddp", "zero1", "fsdp2", "fsdp")
    # the defaults, then anything given (a flag given twice: the last one counts)
    model_flags = ["--model", "shakespeare", "--n_layer", "4", "--n_embd", "256", "--n_head", "4",
                   "--block_size", "128", "--dropout", "0", "--global_batch_size", "16"] + model_flags
    flags = model_flags + ["--device", a.device, "--max_iters", a.iters, "--log_interval", "1",
                             "--eval_interval", "0", "--warmup_iters", "2"]
    threads = {"OMP_NUM_THREADS": "1"}
    global_batch = int(model_flags[max(i for i, f in enumerate(model_flags) if f == "--global_batch_size") + 1])
    (script, *ours_flags), impl = PAIRS[a.pair]
    print(f"{a.pair}: {' '.join([script] + ours_flags)} vs torch --impl {impl}")
    print(f"{'ranks':>5} {'ours ms':>10} {'torch ms':>10} {'ratio':>6} {'range':>11} {'same losses':>12}")
    for ranks in a.ranks:
        ours, theirs = [], []
        micro = [] if "--micro_batch_size" in model_flags else ["--micro_batch_size", global_batch // (
            ranks if data_parallel else 1)]  # one micro-batch per step, on both sides
        for repeat in range(a.repeats):
            pair = [(ours, script, ours_flags), (theirs, "tests/benchmarks/torch_baselines.py", ["--impl", impl])]
            with locked(a.lock):
                for runs, path, extra in pair if repeat % 2 == 0 else pair[::-1]:  # alternate who goes first
                    runs.append(finished(launch(path, flags + micro + extra, nprocs=ranks, env=threads,
                                                timeout=TIMEOUT_S), a.iters))
            print(f"  repeat {repeat}: {median_ms(ours[-1], a.skip):.1f} / {median_ms(theirs[-1], a.skip):.1f} ms",
                  flush=True)
        ms_ours = statistics.median(median_ms(r, a.skip) for r in ours)
        ms_theirs = statistics.median(median_ms(r, a.skip) for r in theirs)
        ratios = [median_ms(o, a.skip) / median_ms(t, a.skip) for o, t in zip(ours, theirs)]
        same = max(abs(x - y) / y for x, y in zip(ours[0].losses, theirs[0].losses)) < 1e-4
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(f"{ranks:>5} {ms_ours:>10.1f} {ms_theirs:>10.1f} {statistics.median(ratios):>6.2f} {spread:>11} "
              f"{str(same):>12}", flush=True)


if __name__ == "__main__":
    main()
