"""Hostile launches (the Reliability IV round): launcher variables mistyped or contradictory,
a rendezvous port that is another job's, output paths that would block or clobber each
other, a FIFO where a token file belongs, a lock whose pid was reused. Each is one line
naming the cause and exit 2 on every rank, within seconds, or the run goes on correctly.
Launches are one process through the fork server (the checks run on every rank alike)."""

import datetime
import json
import os
import socket

import pytest
import torch.distributed as dist

import common
import infra.start
from harness import TINY, dry, launch
from test_failures import refused

ONE = TINY + ["--max_iters", "2"]


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"},
     "MASTER_PORT=abc is not a port number (1-65535)"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE=abc in the environment is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "a world of no ranks (WORLD_SIZE=0 RANK=0)"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc"}, "SLURM_NTASKS=abc in the environment is not a whole number"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank 2 (local rank 0) is outside its world of 2 ranks (2 on this node): "
                                       "WORLD_SIZE=2 RANK=2; unset what a launcher did not set"),
])
def test_mistyped_launcher_variables_are_one_line(environ, message):
    """Before: tracebacks (ValueError, ZeroDivisionError), or --timeout spent waiting for a
    rank 0 that was never started (RANK=2 WORLD_SIZE=2)."""
    refused(launch("03_ddp.py", ONE, env=environ), message)


def test_a_bad_master_port_under_mpi_stops_every_rank_before_the_broadcast(monkeypatch, capsys):
    """Under mpiexec, rank 0 used to die parsing MASTER_PORT while rank 1 waited in the
    broadcast of rank 0's address for ever: every rank now checks it first (and rank 1 here
    has no MPI communicator to reach the broadcast with)."""
    monkeypatch.setenv("MASTER_PORT", "abc")
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(SystemExit) as exit:
        common._rendezvous(common.Launch("mpi", 1, 1, 2, 2))
    assert exit.value.code == 2 and capsys.readouterr().err == ""  # rank 0 says it
    monkeypatch.setenv("PMI_RANK", "0")
    with pytest.raises(SystemExit):
        common._rendezvous(common.Launch("mpi", 0, 0, 2, 2))
    assert capsys.readouterr().err == "error: MASTER_PORT=abc is not a port number (1-65535)\n"


@pytest.fixture
def other_jobs_store():
    """Another Slurm job's rendezvous store, on the port this job derives too."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    store.set("gptpar/job", "SLURM_JOB_ID=4242 SLURM_STEP_ID=0")
    yield store.port
    del store


def test_a_rank_that_finds_another_jobs_store_says_so_at_once(other_jobs_store):
    """Two srun jobs on one node with the same derived MASTER_PORT: rank 1 of the second used to
    join the first one's store and wait (102 s seen) for ranks that never came."""
    slurm = {"SLURM_JOB_ID": "24242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
             "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(other_jobs_store)}
    run = launch("03_ddp.py", ONE + ["--timeout", "30"], env=slurm)
    assert run.returncode == 2 and run.seconds < 15, run.stderr[-3000:]
    assert run.error_lines == [
        f"error: rank 1 could not join the process group at 127.0.0.1:{other_jobs_store}: that port is another "
        "job's (SLURM_JOB_ID=4242 SLURM_STEP_ID=0; this is SLURM_JOB_ID=24242 SLURM_STEP_ID=0): export "
        "MASTER_PORT=<a free port>"]


def test_metrics_on_a_fifo_nobody_reads_is_one_line_not_a_hang(tmp_path):
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    refused(launch("01_single_gpu.py", ONE + ["--metrics", fifo]),
            f"--metrics {fifo} is a FIFO that nothing reads: start its reader first, or name a file")


def test_metrics_and_export_naming_one_file_is_refused(tmp_path):
    same = tmp_path / "run.jsonl"
    refused(launch("01_single_gpu.py", ONE + ["--ckpt_interval", "2", "--metrics", same,
                                                  "--export", f"{tmp_path}/./run.jsonl"]),
            f"--metrics and --export name the same file, {tmp_path}/./run.jsonl: the export would overwrite the metrics")


def test_a_token_file_that_is_a_fifo_is_not_called_missing(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "train.bin")
    (data / "val.bin").write_bytes(bytes(2000))
    done = dry("01_single_gpu.py", *TINY, "--data", data, "--world_size", 1)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: --data {data}: {data}/train.bin is not a regular file (a FIFO, socket or device): token files "
        "must be files"], done.stderr


def test_a_fresh_lock_whose_pid_was_reused_is_stale(tmp_path):
    """A job killed a moment ago left its lock; its pid now belongs to another live process
    (here: this one, started long before the lock's holder was). The start time recorded
    with the pid tells them apart: no 60 s wait, no refusal."""
    me = infra.start._lock_holder()
    assert me["started"] == infra.start._started(os.getpid()) is not None
    lock = tmp_path / "LOCK"
    lock.write_text(json.dumps({**me, "started": me["started"] + 1}))  # fresh: written just now
    assert infra.start._lock_is_stale(str(lock), json.loads(lock.read_text()))
    assert infra.start.lock_out_dir(str(tmp_path), wait_s=0) is None  # taken over at once
    assert json.loads(lock.read_text()) == me
    infra.start.release_out_dir()
    lock.write_text(json.dumps(me))  # the holder itself, alive: in use
    assert not infra.start._lock_is_stale(str(lock), me)
    assert "is in use by another job" in infra.start.lock_out_dir(str(tmp_path), wait_s=0)
    assert socket.gethostname() in lock.read_text()
