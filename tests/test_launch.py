"""Launcher detection for every launcher in docs/design.md (fabricated environments), then real
multi-rank jobs through mpiexec and torchrun: rendezvous, the communication ledger, and a
failing rank that ends the whole job instead of hanging it."""

import json
import shutil

import pytest
import torch

from common import Launch, detect_launcher, first_slurm_host
from harness import launch


@pytest.mark.parametrize("environ, expected", [
    ({}, Launch("single")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
     Launch("torchrun", 3, 1, 8, 2)),
    # MPICH Hydra (and Intel MPI): PMI_* plus MPI_LOCAL*
    ({"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     Launch("mpi", 5, 1, 6, 2)),
    # Cray PALS on Polaris/Aurora
    ({"PALS_RANKID": "13", "PALS_LOCAL_RANKID": "1", "PMI_SIZE": "24", "PMI_RANK": "13"},
     Launch("mpi", 13, 1, 24, None)),
    # Open MPI
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, Launch("mpi", 2, 0, 4, 2)),
    # plain srun (no MPI environment)
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NNODES": "2"},
     Launch("slurm", 9, 1, 16, 8)),
    # torchrun inside a Slurm allocation: torchrun's variables win
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
     Launch("torchrun", 0, 0, 2, 2)),
])
def test_detect_launcher(environ, expected):
    assert detect_launcher(environ) == expected


def test_first_slurm_host():
    assert first_slurm_host("nid[001-004,010]") == "nid001"
    assert first_slurm_host("frontier00123") == "frontier00123"
    assert first_slurm_host("a[7,9],b") == "a7"
    assert first_slurm_host("node1,node2") == "node1"


def probe_reports(run):
    # ranks' lines may interleave in mpiexec's stdout, so decode after each marker
    decoder, reports = json.JSONDecoder(), []
    for chunk in run.stdout.split("PROBE ")[1:]:
        reports.append(decoder.raw_decode(chunk)[0])
    return sorted(reports, key=lambda r: r["rank"])


LAUNCHERS = [l for l in ("mpiexec", "torchrun") if l != "mpiexec" or shutil.which("mpiexec")]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_real_launch_rendezvous_and_ledger(launcher):
    run = launch("tests/dist_probe.py", ["--device", "cpu"], nprocs=3, launcher=launcher,
                 metrics=False, timeout=120).ok()
    reports = probe_reports(run)
    assert [r["rank"] for r in reports] == [0, 1, 2]
    for r in reports:
        assert r["world_size"] == 3 and r["local_world_size"] == 3 and r["local_rank"] == r["rank"]
        assert r["kind"] == {"mpiexec": "mpi", "torchrun": "torchrun"}[launcher]
        assert r["sum"] == 0 + 1 + 2
        assert r["comm"] == {"all_reduce": 4}  # one float32 counted by the ledger
        assert r["threads"] == 1


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_exception_on_one_rank_ends_the_job(launcher):
    # rank 1 raises while ranks 0 and 2 wait for it in a barrier with a 60 s timeout
    run = launch("tests/dist_probe.py", ["--device", "cpu", "--raise_on_rank", "1", "--timeout", "60"],
                 nprocs=3, launcher=launcher, metrics=False, timeout=120)
    assert run.returncode not in (0, "timeout")
    assert run.seconds < 40, f"took {run.seconds:.0f} s: the others waited for the timeout"
    assert "deliberate failure on rank 1" in run.stderr
    assert "[rank 1] uncaught RuntimeError: deliberate failure on rank 1; ending the job" in run.stderr


def test_a_timed_out_collective_is_named_by_every_rank_that_can_speak():
    """Rank 2 stalls past --timeout: ranks 0 and 1 each say which collective they were in
    (operation, group, its number on that group, step, phase) and the job ends."""
    run = launch("tests/dist_probe.py", ["--device", "cpu", "--stall_on_rank", "2", "--timeout", "3"],
                 nprocs=3, metrics=False, timeout=120)
    assert run.returncode not in (0, "timeout") and run.seconds < 40, run.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} was in all_reduce #2 on group world, step 7, forward when it failed" in run.stderr, \
            run.stderr[-3000:]


@pytest.mark.parametrize("variable", ["PBS_JOBID", "SLURM_JOB_ID"])
def test_device_auto_in_a_batch_job_without_a_gpu_is_one_line(monkeypatch, capsys, variable):
    """A batch job whose GPU stack is not visible must not train on CPU in silence."""
    import common
    monkeypatch.setenv(variable, "4242")
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    if common.pick_device("cpu", 0)[0].type != "cpu" or torch.cuda.is_available():
        pytest.skip("this machine has an accelerator")
    with pytest.raises(SystemExit) as exit:
        common.pick_device("auto", 0)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "no GPU visible in batch job 4242" in err and "--device cpu" in err
    assert common.pick_device("cpu", 0) == (torch.device("cpu"), "gloo")  # asked for: allowed


def test_collectives_refuse_a_tensor_off_the_run_device():
    """NCCL and XCCL take only tensors on the rank's device; gloo takes host tensors too, so
    the ledger's wrapper checks every collective and send/recv on every backend."""
    import infra
    ledger = infra.CommLedger()
    calls = []
    all_reduce = ledger._wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: calls.append(1),
                              "tensor")
    all_gather = ledger._wrap("all_gather", lambda tensor_list, tensor, group=None, async_op=False: calls.append(1),
                              "tensor_list")
    ledger.device = torch.device("cpu")
    all_reduce(torch.ones(3))
    all_gather([torch.ones(2), torch.ones(2)], torch.ones(2))
    assert calls == [1, 1] and ledger.take() == {"all_reduce": 12, "all_gather": 16}
    ledger.device = torch.device("meta")  # stands for "cuda:0" on a machine without one
    with pytest.raises(RuntimeError, match="all_reduce was handed a tensor on cpu, but this run's device is meta"):
        all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError, match="all_gather was handed a tensor on cpu"):
        all_gather([torch.ones(2, device="meta")], torch.ones(2))
    with ledger.paused(), pytest.raises(RuntimeError):  # control messages are checked too
        all_reduce(torch.ones(3))
    assert calls == [1, 1]


def test_metrics_over_ranks_and_the_straggler():
    import infra
    rows = [(100.0, 2**30, "x1000c0s0"), (105.0, 3 * 2**30, "x1000c0s0"), (320.0, 2**30, "x1000c0s1"), (98.0, 2**30, "x1000c0s1")]
    stats = infra.rank_stats(rows)
    assert stats["dt_ms_max"] == 320.0 and stats["dt_ms_max_rank"] == 2 and stats["dt_ms_max_host"] == "x1000c0s1"
    assert stats["dt_ms_min"] == 98.0 and stats["dt_ms_mean"] == pytest.approx(155.75)
    assert stats["mem_peak_bytes_max"] == 3 * 2**30 and stats["mem_peak_bytes_max_rank"] == 1
    assert stats["straggler"] == "; straggler: rank 2 on x1000c0s1, 3.2x the median step time"
    even = infra.rank_stats([(100.0, None, "a"), (110.0, None, "b")])
    assert "straggler" not in even and "mem_peak_bytes_max" not in even  # CPU: no device memory


def test_real_run_logs_node_map_micro_batch_and_stats_over_ranks():
    import socket
    from harness import TINY
    run = launch("03_ddp.py", TINY + ["--max_iters", "2", "--micro_batch_size", "2"], nprocs=2).ok()
    assert f"nodes: 1; {socket.gethostname()}: ranks 0-1" in run.stdout
    for row in run.steps:
        assert row["micro_batch_size"] == 2 and row["dt_ms_min"] <= row["dt_ms_mean"] <= row["dt_ms_max"]
        assert row["dt_ms_max_rank"] in (0, 1) and row["dt_ms_max_host"] == socket.gethostname()
