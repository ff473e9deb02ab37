"""Failures, tried as a hostile user would, through real multi-rank launches: each ends every
rank within seconds with one `error:` line naming the cause and status 2 (bad input) or 3
(non-finite loss), or, for a stop signal and --time_limit, with a checkpoint and status 0.
docs/failures.md lists the same cases."""

import glob
import json
import os
import pickle
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

import infra.metrics
import infra.start
import infra.stop
from harness import TINY, launch, start
from test_real_conditions import dry
from test_reliability import wait_for_rows

QUICK = 60  # seconds: every refusal below ends the job well within this


def refused(run, message, status=2):
    """One `error:` line, naming the cause, printed once for the whole job; every rank ended
    with `status` (mpiexec and torchrun return the ranks' status when they all agree)."""
    assert run.returncode == status, f"{run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    assert len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and run.seconds < QUICK


def dataset(path, n_train=4000, n_val=400, vocab=65, meta=True):
    path.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        rng.integers(0, vocab, n, dtype=np.uint16).tofile(path / f"{split}.bin")
    if meta:
        (path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab, "itos": {}, "stoi": {}}))
    return path


# ---- data -------------------------------------------------------------------------------

@pytest.mark.parametrize("script, nprocs, extra", [("06_tensor_parallel.py", 2, []), ("01_single_gpu.py", 1, []),
                                                    ("08_3d.py", 2, ["--tp", "2"]), ("07_pipeline.py", 2, [])])
def test_token_ids_outside_the_vocabulary(tmp_path, script, nprocs, extra):
    d = dataset(tmp_path / "data")  # meta.pkl says 65; the last train token is 199: rank 1's slice
    tokens = np.fromfile(d / "train.bin", dtype=np.uint16)
    tokens[-1] = 199
    tokens.tofile(d / "train.bin")
    run = launch(script, TINY + extra + ["--data", d], nprocs=nprocs)
    refused(run, f"train.bin holds token id 199 at position {len(tokens) - 1}, outside the vocabulary")
    assert not run.steps


@pytest.mark.parametrize("damage, message", [
    ("odd", "not a whole number of uint16 tokens"),
    ("exact", "holds 65 tokens, fewer than block_size+2 = 66"),
    ("vocab0", "says vocab_size 0"),
    ("junk", "cannot read vocab_size from"),
])
def test_damaged_data_directory(tmp_path, damage, message):
    """Refused by the launch, and by a dry run of the same command (one line, status 2)."""
    d = dataset(tmp_path / "data", n_val=65 if damage == "exact" else 400)  # tiny: block_size 64
    if damage == "odd":
        with open(d / "val.bin", "ab") as f:
            f.write(b"\x01")
    if damage == "vocab0":
        (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 0}))
    if damage == "junk":
        (d / "meta.pkl").write_bytes(b"not a pickle at all")
    refused(launch("03_ddp.py", TINY + ["--data", d], nprocs=2), message)
    dry_refused(["--data", d], message)


def dry_refused(flags, message):
    """`03_ddp.py --dry_run --world_size 2` with these flags: one error line naming the cause."""
    p = dry("03_ddp.py", "--world_size", 2, *TINY, *flags)
    errors = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(errors) == 1 and message in errors[0], p.stderr


@pytest.mark.parametrize("script, nprocs, data, block", [("03_ddp.py", 2, "synthetic", 1 << 17),
                                                         ("01_single_gpu.py", 1, "shakespeare_char", 200_000)])
def test_block_size_longer_than_the_embedded_corpus(script, nprocs, data, block):
    run = launch(script, TINY + ["--data", data, "--block_size", block], nprocs=nprocs)
    refused(run, f"--data {data}: its val split holds")


# ---- flags ------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value, message", [
    ("--seed", "-1", "--seed must be in [0, 2^32)"),
    ("--seed", "1e23", "invalid int value: '1e23'"),
    ("--timeout", "inf", "--timeout must be a finite number"),
    ("--lr_decay_iters", "-5", "--lr_decay_iters must not be negative, got -5"),
    ("--lr", "nan", "--lr must be a finite number"),
    ("--time_limit", "0", "--time_limit must be positive"),
])
def test_numeric_flags_out_of_range(flag, value, message):
    refused(launch("03_ddp.py", TINY + [flag, value], nprocs=2), message)


# ---- the out_dir and the metrics file ----------------------------------------------------

def read_only_dir(tmp_path):
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d / "out"
    return "/sys/gptpar-out"  # root ignores permission bits; sysfs refuses new directories


@pytest.mark.parametrize("where, message", [
    ("file", "exists and is not a directory"),
    ("read-only", "cannot be created"),
    ("metrics", "--metrics"),
    ("export", "--export"),
])
def test_unusable_out_dir_metrics_or_export_refused_before_training(tmp_path, where, message):
    """Found before the first step (not at the first write), and by a dry run, which writes nothing."""
    flags = ["--max_iters", "2"]
    if where == "file":
        (tmp_path / "afile").write_text("not a directory")
        flags += ["--out_dir", tmp_path / "afile"]
    elif where == "read-only":
        flags += ["--out_dir", read_only_dir(tmp_path)]
    elif where == "metrics":
        flags += ["--metrics", tmp_path / "missing" / "m.jsonl"]
    else:
        flags += ["--ckpt_interval", "2", "--export", tmp_path / "missing" / "model.pt"]
    dry_refused(flags, message)
    assert not (tmp_path / "missing").exists() and not os.path.isdir(tmp_path / "afile")
    run = launch("03_ddp.py", TINY + flags, nprocs=2)
    refused(run, message)
    assert "step 0" not in run.stdout


# ---- non-finite loss ---------------------------------------------------------------------

def test_non_finite_loss_stops_before_the_update(tmp_path):
    """--lr 1e6: step 0's update blows the weights up, step 1's loss is not finite. Every rank
    stops before step 1's update with status 3; the checkpoint written after step 0 is the
    last one (resuming from it meets the same step); the metrics stay strict JSON."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    flags = TINY + ["--lr", "1e6", "--ckpt_interval", "1", "--out_dir", out, "--metrics", metrics]
    run = launch("04_zero.py", flags + ["--stage", "3"], nprocs=2)
    refused(run, "non-finite loss or gradient at step 1", status=infra.stop.NONFINITE_EXIT)
    text = metrics.read_text()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the metrics")) for line in text.splitlines()]
    assert [row["step"] for row in rows] == [0]  # no row for the step that was stopped
    assert "LOCK" not in os.listdir(out)
    again = launch("04_zero.py", flags + ["--stage", "3", "--resume"], nprocs=2)
    refused(again, "non-finite loss or gradient at step 1", status=infra.stop.NONFINITE_EXIT)


@pytest.mark.parametrize("script, extra", [("09_context_parallel.py", ["--cp", "2", "--cp_impl", "ring"]),
                                           ("03_ddp.py", ["--grad_clip", "0"])])
def test_non_finite_loss_stops_every_strategy(tmp_path, script, extra):
    """The same stop in a script whose loop was written apart from 04's (09's ring), and
    without clipping (no global norm: the guard agrees on its flags before the update)."""
    run = launch(script, TINY + extra + ["--lr", "1e6", "--out_dir", tmp_path / "out"], nprocs=2)
    refused(run, "non-finite loss or gradient at step 1", status=infra.stop.NONFINITE_EXIT)
    assert "stopped before the optimizer step" in run.error_lines[0]


GUARD_ON_TWO_RANKS = """
import os, sys, types
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import infra.stop
dist.init_process_group("gloo")
rank = dist.get_rank()
env = types.SimpleNamespace(device=torch.device("cpu"), backend="gloo", world_size=2, rank=rank, master=rank == 0)
guard = infra.stop.Guard(types.SimpleNamespace(time_limit=0, max_iters=10, out_dir="unused"), env)
for step in range(4):
    if (rank, step) == (1, 0):
        guard.signal = "SIGTERM"  # as the handler sets it
    nan = (rank, step) == (1, 2) and {nan}
    loss = torch.full((), float("nan") if nan else 1.0)
    stop = guard.check(step, loss, [], norm=torch.ones(()))
    os.write(1, f"rank {{rank}} step {{step}}: stop {{stop}}\\n".encode())  # one write: the ranks share stdout
"""


@pytest.mark.parametrize("nan", [False, True])
def test_the_guard_agrees_on_a_stop_one_step_later_on_every_rank(tmp_path, nan):
    """infra.stop.Guard on two real gloo ranks, with a finite global norm (clipping's): a stop
    signal on rank 1 at step 0 travels in the flags posted at step 0 and read at step 1, so
    both ranks say stop at step 1 and not before; a loss non-finite on rank 1 alone at step 2
    (the norm finite: it reached no gradient) stops both ranks before step 3's update, one
    line naming the step and the rank."""
    from harness import ROOT
    path = tmp_path / "guard.py"
    path.write_text(GUARD_ON_TWO_RANKS.format(root=ROOT, nan=nan))
    run = launch(str(path), nprocs=2, launcher="fork", metrics=False, out_dir=False, timeout=60)
    said = {line for line in run.stdout.splitlines() if line.startswith("rank ")}
    for rank in (0, 1):
        assert {f"rank {rank} step 0: stop False", f"rank {rank} step 1: stop True"} <= said, run.stdout
    if not nan:
        assert run.returncode == 0 and len(said) == 8, run.stdout + run.stderr
        return
    assert {f"rank {rank} step 2: stop True" for rank in (0, 1)} <= said and len(said) == 6, run.stdout
    refused(run, "non-finite loss or gradient at step 2 (first seen on rank 1): stopped before step 3's update",
            status=infra.stop.NONFINITE_EXIT)


def test_metrics_rows_are_strict_json():
    row = infra.metrics.finite_or_null({"loss": float("nan"), "val": [float("inf"), 1.0], "x": {"y": -float("inf")}})
    assert json.dumps(row, allow_nan=False) == '{"loss": null, "val": [null, 1.0], "x": {"y": null}}'


# ---- one job per out_dir; stop signals; --time_limit -------------------------------------

def test_second_job_refused_then_sigterm_checkpoints_and_resume_takes_a_stale_lock(tmp_path):
    out, metrics = tmp_path / "out", tmp_path / "a.jsonl"
    out_flag = f"--out_dir={out}"
    flags = TINY + ["--max_iters", "100000", "--lr_decay_iters", "100000"]
    job = start("03_ddp.py", flags + ["--metrics", metrics, out_flag], nprocs=2, cwd=tmp_path)
    try:
        wait_for_rows(metrics, 3)
        # a second job on the same out_dir: refused in one line, the first one untouched
        second = launch("03_ddp.py", TINY + ["--out_dir", out], nprocs=2)
        refused(second, f"--out_dir {out} is in use by another job (host {socket.gethostname()}")
        # SIGTERM to rank 1 only (as a scheduler's signal to one node): every rank finishes the
        # step, a checkpoint is written, every rank exits 0
        pids = job.pids
        os.kill(pids[1], signal.SIGTERM)
        signalled = time.time()
        time.sleep(0.05)  # the scheduler's and the launcher's copy of the same signal: one request
        os.kill(pids[1], signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert time.time() - signalled < 30
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped after step")]
    assert len(stopped) == 1 and "a SIGTERM, SIGUSR1 or SIGINT on another rank" in stopped[0] and "--resume" in stopped[0]
    step = int(stopped[0].split()[3])
    assert step >= 3 and committed(out) and "LOCK" not in os.listdir(out)
    # a lock left behind by a killed job on this host (its pid is gone) is recognised as stale
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "job": None}))
    resumed = launch("03_ddp.py", flags[:-4] + ["--max_iters", step + 2, "--lr_decay_iters", "100000",
                                                "--out_dir", out, "--resume"], nprocs=2).ok()
    assert "removing the stale lock" in resumed.stderr
    assert [row["step"] for row in resumed.steps] == [step, step + 1]


def signalled_job(script, tmp_path, deliver):
    """Start `script` on 2 ranks of a long run, wait until it trains, then `deliver(pids)`
    (pids: {rank: pid}) the signals; returns (stdout, stderr, out_dir) once it has ended,
    after asserting that every rank exited 0 with a committed checkpoint and no lock left."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    out_flag = f"--out_dir={out}"
    flags = TINY + ["--max_iters", "100000", "--lr_decay_iters", "100000", "--metrics", metrics, out_flag]
    job = start(script, flags, nprocs=2, cwd=tmp_path)
    try:
        wait_for_rows(metrics, 2)
        deliver(job.pids)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert committed(out) and "LOCK" not in os.listdir(out)
    return stdout, stderr, out


def test_sigusr1_to_rank_0_of_a_pipeline_checkpoints_and_exits_0(tmp_path):
    """Slurm's `--signal=USR1@180`, here to rank 0 of 07 (a loop written apart from 03's):
    every rank finishes the step, a checkpoint is committed, every rank exits 0."""
    stdout, _, _ = signalled_job("07_pipeline.py", tmp_path, lambda pids: os.kill(pids[0], signal.SIGUSR1))
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped after step")]
    assert len(stopped) == 1 and "(SIGUSR1)" in stopped[0] and "--resume" in stopped[0], stdout[-2000:]


def test_ctrl_c_twice_to_every_rank_ends_quietly_with_a_checkpoint(tmp_path):
    """Ctrl-C at a terminal reaches every rank, and mpiexec forwards it once more: two SIGINTs
    per rank, 50 ms apart, are one stop request: the step ends, a checkpoint is committed,
    every rank exits 0, and no KeyboardInterrupt traceback is printed."""
    def ctrl_c(pids):
        for _ in range(2):
            for pid in pids.values():
                os.kill(pid, signal.SIGINT)
            time.sleep(0.05)
    stdout, stderr, _ = signalled_job("03_ddp.py", tmp_path, ctrl_c)
    stopped = [line for line in stdout.splitlines() if line.startswith("stopped after step")]
    assert len(stopped) == 1 and "(SIGINT)" in stopped[0], stdout[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]


def test_lock_of_another_host_is_stale_once_its_heartbeat_stops(tmp_path):
    lock = tmp_path / "LOCK"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "42"}))
    assert not infra.start._lock_is_stale(str(lock), {"host": "elsewhere", "pid": 1})
    old = time.time() - infra.start.LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    assert infra.start._lock_is_stale(str(lock), {"host": "elsewhere", "pid": 1})


def test_lock_of_another_host_is_waited_for_then_taken_or_refused(tmp_path, monkeypatch):
    """A chained job may start seconds after the last one was killed on another host: its
    lock still looks alive. The new job waits for the heartbeat to stop (LOCK_STALE_S, here
    shortened), then takes the lock; a lock whose heartbeat goes on is refused after the wait."""
    import threading
    monkeypatch.setattr(infra.start, "LOCK_STALE_S", 2)
    out = tmp_path / "out"
    out.mkdir()
    lock = out / "LOCK"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "41"}))  # killed: no heartbeat
    t0 = time.time()
    assert infra.start.lock_out_dir(str(out), wait_s=10) is None
    assert 1.5 < time.time() - t0 < 6 and json.loads(lock.read_text())["pid"] == os.getpid()
    infra.start.release_out_dir()
    assert not lock.exists()
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "42"}))  # alive: it beats on
    alive = threading.Event()

    def heartbeat():
        while not alive.wait(0.3):
            os.utime(lock)
    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        t0 = time.time()
        problem = infra.start.lock_out_dir(str(out), wait_s=1.5)  # the whole wait, the heartbeat going on
        assert problem and "is in use by another job" in problem and "job 42" in problem
        assert 1.4 < time.time() - t0 < 6.5
    finally:
        alive.set()


def committed(out):
    """The checkpoint sets of out_dir that a metadata.json commits (common.py's format)."""
    return glob.glob(os.path.join(out, "ckpt", "step_*", "metadata.json"))


def test_time_limit_stops_with_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    run = launch("07_pipeline.py", TINY + ["--max_iters", "100000", "--lr_decay_iters", "100000",
                                           "--time_limit", "0.05", "--out_dir", out], nprocs=2).ok()
    stopped = [line for line in run.stdout.splitlines() if line.startswith("stopped after step")]
    assert len(stopped) == 1 and "--time_limit 0.05 min is near" in stopped[0], run.stdout[-2000:]
    assert run.steps and int(stopped[0].split()[3]) == run.steps[-1]["step"] + 1
    assert committed(out) and "LOCK" not in os.listdir(out)
    assert run.seconds < 3 + 30  # stopped before the limit (plus the launch before the clock starts)
