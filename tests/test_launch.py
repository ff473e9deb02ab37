"""Launcher detection for every launcher in DESIGN.md (fabricated environments), then real
multi-rank jobs through mpiexec and torchrun: rendezvous, the communication ledger, and a
failing rank that ends the whole job instead of hanging it."""

import json
import shutil

import pytest

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
    assert "[rank 1] uncaught RuntimeError; ending the job" in run.stderr
