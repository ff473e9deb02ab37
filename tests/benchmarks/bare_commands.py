"""Does "fits" hold? Every training script's bare command (the default model, batch and
--micro_batch_size auto; only --max_iters 1 and no evaluation added, so that one step is the
whole run) launched through mpiexec at the rank counts of real nodes, on this machine: each
must train or be refused by the fit check in one line (exit 2), never be killed by the
kernel's OOM killer (signal 9, MPICH's "BAD TERMINATION") or fail otherwise. Rerun with

    python tests/benchmarks/bare_commands.py                       # 1, 2, 4, 8, 12 ranks
    python tests/benchmarks/bare_commands.py --ranks 8 12 --scripts 06_tensor_parallel.py

Prints one markdown row per command: what happened, the micro-batch auto chose, the step
time, the peak resident memory of the fullest rank and of the node (each rank's ru_maxrss
from tests/benchmarks/peak_rss.py), and the error line of a refusal."""

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ["01_single_gpu.py", "03_ddp.py", "04_zero.py", "05_fsdp.py", "06_tensor_parallel.py", "07_pipeline.py",
           "08_3d.py", "09_context_parallel.py", "10_expert_parallel.py"]
FLAGS = ["--device", "cpu", "--max_iters", "1", "--eval_interval", "0", "--log_interval", "1"]


def run(script, ranks, out_dir):
    flags = FLAGS + (["--sample_tokens", "0"] if script == "01_single_gpu.py" else [])
    os.makedirs(out_dir, exist_ok=True)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    argv = ["mpiexec", "-n", str(ranks), sys.executable, os.path.join(ROOT, "tests", "benchmarks", "peak_rss.py"),
            script, *flags, "--out_dir", out_dir, "--metrics", metrics, "--overwrite"]
    if script == "01_single_gpu.py":
        argv = argv[3:]  # one process, no launcher
    start = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - start
    rss = [int(b) for b in re.findall(r"peak_rss rank \d+: (\d+) bytes", p.stdout)]
    chose = re.search(r"--micro_batch_size auto: (\d+)", p.stdout + p.stderr)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    if p.returncode == 0 and rss:
        outcome = "trains"
    elif p.returncode == 2 and errors and "needs" in errors[0]:
        outcome = "refused (fit check)"
    elif "signal 9" in p.stdout + p.stderr or "Killed" in p.stdout + p.stderr or p.returncode in (-9, 137):
        outcome = "KILLED"
    else:
        outcome = f"FAILED (exit {p.returncode})"
    step_ms = None
    if os.path.exists(metrics):
        rows = [line for line in open(metrics) if '"dt_ms"' in line]
        found = re.search(r'"dt_ms": ([0-9.]+)', rows[-1]) if rows else None
        step_ms = float(found.group(1)) if found else None
    return dict(outcome=outcome, micro=chose.group(1) if chose else "-", seconds=seconds, step_ms=step_ms,
                rank_gib=max(rss) / 2**30 if rss else None, node_gib=sum(rss) / 2**30 if rss else None,
                error=errors[0] if errors else (p.stderr.strip().splitlines() or [""])[-1][:160])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 12])
    p.add_argument("--scripts", nargs="+", default=SCRIPTS)
    p.add_argument("--out_dir", default="/tmp/bare_commands")
    args = p.parse_args()
    print("| script | ranks | outcome | micro-batch (auto) | step ms | peak RSS, fullest rank | peak RSS, node | "
          "wall s | error line |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for script in args.scripts:
        for ranks in args.ranks:
            if script == "01_single_gpu.py" and ranks != 1:
                continue
            r = run(script, ranks, os.path.join(args.out_dir, f"{script[:2]}_{ranks}"))
            gib = lambda x: "-" if x is None else f"{x:.2f} GiB"  # noqa: E731
            step = "-" if r["step_ms"] is None else f"{r['step_ms']:.0f}"
            print(f"| {script} | {ranks} | {r['outcome']} | {r['micro']} | {step} | {gib(r['rank_gib'])} | "
                  f"{gib(r['node_gib'])} | {r['seconds']:.0f} | {r['error'] if r['outcome'] != 'trains' else ''} |",
                  flush=True)


if __name__ == "__main__":
    main()
