"""Failures: a rank killed with SIGKILL ends the whole job promptly under mpiexec and
torchrun, and the run resumes from its last checkpoint with exactly the uninterrupted
losses; checkpoint writes are atomic; bad data is refused with one line."""

import glob
import os
import pickle
import signal
import subprocess
import time
import uuid

import numpy as np
import pytest
import torch

import infra.checkpoint_format
from harness import LAUNCHER_ENV, ROOT, TINY, command, default_launcher, launch

LAUNCHERS = [l for l in ("mpiexec", "torchrun") if l != "mpiexec" or default_launcher() == "mpiexec"]


def background_job(script, nprocs, launcher, args, cwd):
    """Start `script` on `nprocs` ranks without waiting (for a test to signal or kill a rank).
    Always through a real launcher (launcher None: default_launcher()), never the fork
    server: the tests find each rank's pid by its command line and environment in /proc."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    return subprocess.Popen(command(script, nprocs, launcher or default_launcher()) + list(map(str, args)), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(cwd))


def wait_for_rows(metrics, rows, seconds=120):
    """Until the metrics file holds `rows` lines (the job is training) or `seconds` pass."""
    deadline = time.time() + seconds
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        time.sleep(0.2)


def rank_pids(marker):
    """{rank: pid} of the processes whose command line holds `marker` (from /proc)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environ = dict(v.split(b"=", 1) for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if marker.encode() in cmdline and (b"RANK" in environ or b"PMI_RANK" in environ):
            found[int(environ.get(b"RANK", environ.get(b"PMI_RANK")))] = int(pid)
    return found


STEPS = 100000  # the killed job's length and the schedule's: the kill lands long before the end
AFTER = 6  # steps run after the resume, compared with an uninterrupted run over the same steps
CASES = [("03_ddp.py", [], LAUNCHERS[0]), ("04_zero.py", ["--stage", "3"], LAUNCHERS[-1])]  # each launcher once


def last_checkpoint(out_dir):
    """The step of the newest checkpoint that its metadata.json commits (common.py's format)."""
    steps = [int(os.path.basename(os.path.dirname(p)).split("_")[1])
             for p in glob.glob(os.path.join(out_dir, "ckpt", "step_*", "metadata.json"))]
    return max(steps, default=None)


@pytest.mark.parametrize("script, extra, launcher", CASES)
def test_sigkill_ends_the_job_and_resume_reproduces_the_run(tmp_path, launcher, script, extra):
    flags = TINY + extra + ["--global_batch_size", "8", "--lr_decay_iters", STEPS, "--ckpt_interval", "4",
                            "--timeout", "30"]
    marker = f"--out_dir={tmp_path / ('killed-' + uuid.uuid4().hex[:8])}"
    out_dir = marker.split("=", 1)[1]
    metrics = tmp_path / "killed.jsonl"
    job = background_job(script, 2, launcher, flags + ["--max_iters", "100000", "--metrics", metrics, marker],
                         tmp_path)
    wait_for_rows(metrics, 10)
    pids = rank_pids(marker)
    assert 1 in pids, f"rank 1 not found among {pids}"
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.time()
    try:
        out, err = job.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job did not end within 90 s of a rank being killed")
    assert job.returncode != 0
    assert time.time() - killed_at < 60
    said = out + err  # mpiexec reports on stdout, torchrun on stderr: the signal is named
    assert any(word in said for word in ("Killed (signal 9)", "Signal 9 (SIGKILL)", "SIGKILL")), said[-3000:]
    gone_by = time.time() + 15  # the launcher has exited; its ranks may take a moment to be reaped
    while rank_pids(marker) and time.time() < gone_by:
        time.sleep(0.2)
    assert not rank_pids(marker), f"ranks outlived the job: {rank_pids(marker)}"
    # resume from the last complete checkpoint: exactly the losses of a run never interrupted
    # (forked ranks: what the resume reads is the killed job's files, whoever launches it)
    first = last_checkpoint(out_dir)
    assert first is not None and first >= 8  # checkpoints every 4 steps; the kill came after step 9
    end = ["--max_iters", first + AFTER]
    resumed = launch(script, flags + end + ["--out_dir", out_dir, "--resume"], nprocs=2).ok()
    reference = launch(script, flags + end, nprocs=2).ok()
    assert resumed.steps[0]["step"] == first
    assert resumed.losses == reference.losses[first:]  # exactly the uninterrupted losses


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    infra.checkpoint_format.atomic_save({"step": 1, "w": torch.ones(3)}, path)
    real_save = torch.save

    def crash(obj, f):
        real_save(obj, f)
        f.write(b"partial")
        raise KeyboardInterrupt("killed mid-write")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        infra.checkpoint_format.atomic_save({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path, weights_only=True)["step"] == 1  # the previous checkpoint, intact
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # and no half-written file beside it


@pytest.mark.parametrize("setup_data, message", [
    (lambda d: None, "no such directory"),
    (lambda d: (d.mkdir(), np.zeros(10, np.uint16).tofile(d / "train.bin"), np.zeros(10, np.uint16).tofile(d / "val.bin")),
     "fewer than block_size+2"),
    (lambda d: (d.mkdir(), np.zeros(500, np.uint16).tofile(d / "train.bin")), "val.bin is missing"),
    (lambda d: (d.mkdir(), np.zeros(500, np.uint16).tofile(d / "train.bin"), np.zeros(500, np.uint16).tofile(d / "val.bin"),
                (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 100_000}))), "must be in 1..65536"),
])
def test_data_errors_give_one_line(tmp_path, setup_data, message):
    d = tmp_path / "data"
    setup_data(d)
    run = launch("03_ddp.py", TINY + ["--data", d], nprocs=2, timeout=60)
    assert run.returncode != 0 and run.seconds < 30
    assert len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr
