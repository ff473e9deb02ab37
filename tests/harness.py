"""Launch any script with N ranks on CPU and read back what it wrote.

mpiexec when it is on the PATH (as on the clusters), torchrun otherwise; one thread per rank;
the metrics JSONL parsed into a list of dicts. Start-up (importing torch in every rank)
dominates on two cores, so tests share reference runs through module-scoped fixtures."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the shared flags of a tiny, fast, deterministic CPU run
TINY = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--eval_interval", "0",
        "--log_interval", "1", "--global_batch_size", "8", "--max_iters", "6", "--lr", "3e-3",
        "--warmup_iters", "2", "--timeout", "60"]

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "SLURM_PROCID",
                "SLURM_NTASKS")


def default_launcher():
    return "mpiexec" if shutil.which("mpiexec") else "torchrun"


@dataclass
class Run:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    metrics: list = field(default_factory=list)

    @property
    def losses(self):
        return [row["loss"] for row in self.metrics if "loss" in row]

    @property
    def steps(self):
        return [row for row in self.metrics if "loss" in row]

    @property
    def evals(self):
        return [row for row in self.metrics if "val_loss" in row]

    @property
    def error_lines(self):
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def ok(self):
        assert self.returncode == 0, f"{' '.join(self.cmd)} failed ({self.returncode}):\n{self.stdout[-3000:]}\n{self.stderr[-5000:]}"
        return self


def command(script, nprocs, launcher):
    path = script if os.path.isabs(script) else os.path.join(ROOT, script)
    if nprocs == 1 and launcher is None:
        return [sys.executable, path]
    launcher = launcher or default_launcher()
    if launcher == "mpiexec":
        return ["mpiexec", "-n", str(nprocs), sys.executable, path]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nprocs}", path]
    raise ValueError(launcher)


def launch(script, args=(), nprocs=1, launcher=None, timeout=300, metrics=True, env=None, cwd=None,
           out_dir=True):
    """Run `script` with `nprocs` ranks and return a Run (metrics read from --metrics); a
    temporary --metrics file and --out_dir are added unless given (or turned off)."""
    tmp = tempfile.mkdtemp(prefix="gptpar-")
    args = list(map(str, args))
    metrics_path = os.path.join(tmp, "metrics.jsonl")
    if metrics and "--metrics" not in args:
        args += ["--metrics", metrics_path]
    if out_dir and "--out_dir" not in args:
        args += ["--out_dir", os.path.join(tmp, "out")]
    cmd = command(script, nprocs, launcher) + args
    run_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    run_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    run_env.update(env or {})
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env,
                           cwd=cwd or tmp, stdin=subprocess.DEVNULL)
        code, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = "timeout", (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    run = Run(cmd, code, out, err, time.time() - t0)
    path = args[args.index("--metrics") + 1] if "--metrics" in args else None
    if path and os.path.exists(path):
        run.metrics = [json.loads(line) for line in open(path) if line.strip()]
    return run


def assert_losses_match(reference, candidate, rtol=2e-5, atol=2e-6, what=""):
    """DESIGN.md's oracle: the same per-step losses as 01_single_gpu.py, within a tolerance
    that allows for a different summation order only."""
    ref, got = np.asarray(reference.losses), np.asarray(candidate.losses)
    assert len(ref) > 0 and ref.shape == got.shape, f"{what}: {len(ref)} reference steps, {len(got)} here"
    worst = np.max(np.abs(ref - got) / np.abs(ref))
    assert np.allclose(got, ref, rtol=rtol, atol=atol), \
        f"{what}: losses differ from 01 (max rel {worst:.2e}):\n01:   {ref}\nhere: {got}"
