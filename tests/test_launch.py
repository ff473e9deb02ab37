"""Launcher detection for every launcher in docs/design.md (fabricated environments), then real
multi-rank jobs through mpiexec and torchrun: rendezvous, the communication ledger, and a
failing rank that ends the whole job instead of hanging it."""

import json
import shutil

import pytest
import torch

from common import Launch, detect_launcher, first_slurm_host
from harness import LAUNCHER_ENV, launch


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
def test_real_launch_rendezvous_ledger_and_a_failing_rank(launcher):
    """One real job per launcher (each fresh interpreter costs seconds of CPU, so one job makes
    both checks): the three ranks meet, each reports what it detected and what the ledger
    counted of one all-reduce; then rank 1 raises while ranks 0 and 2 wait for it in a barrier
    with a 60 s timeout, and the job ends at once, with the message, instead of hanging."""
    run = launch("tests/dist_probe.py", ["--device", "cpu", "--raise_on_rank", "1", "--timeout", "60"],
                 nprocs=3, launcher=launcher, metrics=False, timeout=120)
    reports = probe_reports(run)
    assert [r["rank"] for r in reports] == [0, 1, 2], run.stdout[-3000:] + run.stderr[-3000:]
    for r in reports:
        assert r["world_size"] == 3 and r["local_world_size"] == 3 and r["local_rank"] == r["rank"]
        assert r["kind"] == {"mpiexec": "mpi", "torchrun": "torchrun"}[launcher]
        assert r["sum"] == 0 + 1 + 2
        assert r["comm"] == {"all_reduce": 4}  # one float32 counted by the ledger
        assert r["threads"] == 1
    assert run.returncode not in (0, "timeout")
    assert run.seconds < 40, f"took {run.seconds:.0f} s: the others waited for the timeout"
    assert "deliberate failure on rank 1" in run.stderr
    assert "[rank 1] uncaught RuntimeError: deliberate failure on rank 1; ending the job" in run.stderr


def test_a_timed_out_collective_is_named_by_every_rank_that_can_speak():
    """Rank 2 stalls past --timeout: ranks 0 and 1 each say which collective they were in
    (operation, group, its number on that group, step, phase) and the job ends."""
    # grace 1.5 s: the stalled rank, asleep past the others' end, is ended then (a real
    # launcher ends it at once) instead of after the fork server's usual 10 s or its own 6 s
    run = launch("tests/dist_probe.py", ["--device", "cpu", "--stall_on_rank", "2", "--timeout", "3"],
                 nprocs=3, metrics=False, timeout=120, grace=1.5)
    assert run.returncode not in (0, "timeout") and run.seconds < 40, run.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} was in all_reduce #2 on group world, step 7, forward when it failed" in run.stderr, \
            run.stderr[-3000:]


@pytest.mark.parametrize("variable", ["PBS_JOBID", "SLURM_JOB_ID", "FLUX_JOB_ID"])
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
    import infra.ledger
    ledger = infra.ledger.CommLedger()
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
    import infra.metrics
    rows = [(100.0, 2**30, "x1000c0s0"), (105.0, 3 * 2**30, "x1000c0s0"), (320.0, 2**30, "x1000c0s1"), (98.0, 2**30, "x1000c0s1")]
    stats = infra.metrics.rank_stats(rows)
    assert stats["dt_ms_max"] == 320.0 and stats["dt_ms_max_rank"] == 2 and stats["dt_ms_max_host"] == "x1000c0s1"
    assert stats["dt_ms_min"] == 98.0 and stats["dt_ms_mean"] == pytest.approx(155.75)
    assert stats["mem_peak_bytes_max"] == 3 * 2**30 and stats["mem_peak_bytes_max_rank"] == 1
    assert stats["straggler"] == "; straggler: rank 2 on x1000c0s1, 3.2x the median step time"
    even = infra.metrics.rank_stats([(100.0, None, "a"), (110.0, None, "b")])
    assert "straggler" not in even and "mem_peak_bytes_max" not in even  # CPU: no device memory


def test_real_run_logs_node_map_micro_batch_and_stats_over_ranks():
    import socket
    from harness import TINY
    run = launch("03_ddp.py", TINY + ["--max_iters", "2", "--micro_batch_size", "2"], nprocs=2).ok()
    assert f"nodes: 1; {socket.gethostname()}: ranks 0-1" in run.stdout
    for row in run.steps:
        assert row["micro_batch_size"] == 2 and row["dt_ms_min"] <= row["dt_ms_mean"] <= row["dt_ms_max"]
        assert row["dt_ms_max_rank"] in (0, 1) and row["dt_ms_max_host"] == socket.gethostname()


# ---- srun with Slurm's cray_shasta MPI plugin, and an mpi4py built on another MPI ----------

def cray_shasta(rank, ntasks=2, since_23_02=True):
    """A task's environment under `srun --mpi=cray_shasta` on one node: Slurm's own variables
    and what the plugin sets (src/plugins/mpi/cray_shasta/mpi_cray_shasta.c, mpi_p_slurmstepd_task);
    before Slurm 23.02 it set neither PALS_LOCAL_RANKID nor any PMI_* but PMI_CONTROL_PORT."""
    spool = "/var/spool/slurmd/mpi_cray_shasta/4242.0"
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
           "SLURM_NTASKS": str(ntasks), "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost",
           "PALS_APID": "4242.0", "PALS_APINFO": f"{spool}/apinfo", "PALS_RANKID": str(rank), "PALS_NODEID": "0",
           "PALS_SPOOL_DIR": spool, "PMI_CONTROL_PORT": "11000"}
    if since_23_02:
        env.update(PALS_LOCAL_RANKID=str(rank), PMI_JOBID="4242", PMI_LOCAL_RANK=str(rank), PMI_LOCAL_SIZE=str(ntasks),
                   PMI_RANK=str(rank), PMI_SIZE=str(ntasks), PMI_UNIVERSE_SIZE=str(ntasks), PMI_SHARED_SECRET="8675309")
    return env


@pytest.fixture
def singleton_mpi4py(monkeypatch):
    """mpi4py as it is when built on another MPI than the launcher's: a world of one."""
    import sys
    import types

    class World:
        def Get_size(self):
            return 1

        def Get_rank(self):
            return 0
    monkeypatch.setitem(sys.modules, "mpi4py", types.SimpleNamespace(MPI=types.SimpleNamespace(COMM_WORLD=World())))


def launcher_environ(monkeypatch, environ):
    import os
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PMI_", "PALS_", "OMPI_", "FLUX_")) or name in LAUNCHER_ENV:
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("since_23_02", [True, False])
def test_srun_cray_shasta_with_a_singleton_mpi4py_falls_back_to_slurm(monkeypatch, singleton_mpi4py, since_23_02):
    """Every rank of srun's job, not only rank 0, finds its place: MPI's world of one does not
    match the launcher's 2 ranks, so Slurm's variables are used (and a world size is known even
    where the plugin exports no PMI_SIZE)."""
    import common
    for rank in (0, 1):
        launcher_environ(monkeypatch, cray_shasta(rank, since_23_02=since_23_02))
        detected = detect_launcher(cray_shasta(rank, since_23_02=since_23_02))
        assert detected == Launch("mpi", rank, rank, 2, 2 if since_23_02 else None)
        assert common._mpi_world(detected) == Launch("slurm", rank, rank, 2, 2)
        assert common.mpi_comm() is None  # the singleton is not used for the rendezvous


def test_an_mpi_launch_without_its_mpi4py_needs_master_addr_and_port(monkeypatch, singleton_mpi4py, capsys):
    """PALS's mpiexec (Polaris, Aurora) with a pip-installed mpi4py: MASTER_ADDR/PORT, if the job
    exported them, are the rendezvous; else one line says what is wrong on every rank."""
    import common
    pals = {"PALS_RANKID": "1", "PALS_LOCAL_RANKID": "1", "PMI_RANK": "1", "PMI_SIZE": "4"}
    launcher_environ(monkeypatch, pals)
    with pytest.raises(SystemExit) as exit:
        common._mpi_world(detect_launcher(pals))
    assert exit.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: the launcher's variables make this rank 1 of 4, but mpi4py's MPI sees rank 0 of 1: build "
                   "mpi4py on the launcher's MPI (MPICC=mpicc pip install --no-binary mpi4py mpi4py), or export "
                   "MASTER_ADDR and MASTER_PORT (a rendezvous without MPI)"]
    launcher_environ(monkeypatch, {**pals, "MASTER_ADDR": "x3005c0s7b0n0", "MASTER_PORT": "29400"})
    assert common._mpi_world(detect_launcher(pals)) == Launch("env", 1, 1, 4, 2)
    assert common._rendezvous(Launch("env", 1, 1, 4, 2)) == "tcp://x3005c0s7b0n0:29400"


def test_srun_cray_shasta_with_the_real_singleton_mpi4py_trains_on_every_rank(tmp_path):
    """The real thing on CPU: two tasks with the plugin's exact environment (no PMI server, so
    the installed mpi4py's MPI_Init makes a singleton on each) and the job script's
    MASTER_ADDR/PORT: both ranks join, and the all-reduce sums over both."""
    import os
    import socket
    import subprocess
    import sys
    from harness import ROOT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith(("SLURM_", "PMI_", "PALS_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tasks = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "dist_probe.py"), "--device", "cpu",
                               "--timeout", "30"], env={**base, **cray_shasta(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for rank in (0, 1)]
    outs = [task.communicate(timeout=90) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], [err[-2000:] for _, err in outs]
    reports = [json.loads(out.split("PROBE ", 1)[1].splitlines()[0]) for out, _ in outs]
    assert [(r["kind"], r["rank"], r["world_size"], r["sum"]) for r in reports] == [("slurm", 0, 2, 1.0), ("slurm", 1, 2, 1.0)]


# ---- devices: oversubscription refused, device_id given to NCCL/XCCL ----------------------

def test_more_local_ranks_than_gpus_is_refused_in_one_line(monkeypatch, capsys):
    """local_rank % device_count would put ranks 4-7 of a node on GPUs 0-3 beside ranks 0-3."""
    import common
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for name in common.DEVICE_MASKS:
        monkeypatch.delenv(name, raising=False)
    assert common.pick_device("auto", 3, 4) == (torch.device("cuda", 3), "nccl")
    for local_rank in range(8):
        with pytest.raises(SystemExit) as exit:
            common.pick_device("auto", local_rank, 8)
        assert exit.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: 8 ranks on ") and "but 4 cuda devices: local ranks 4 and up" in err[0]
    # one device seen by each rank, bound by the launcher (srun --gpus-per-task=1, affinity scripts): allowed
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert common.pick_device("auto", 5, 8) == (torch.device("cuda", 0), "nccl")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(SystemExit):  # one GPU and nothing binding it: 8 ranks would share it
        common.pick_device("auto", 1, 8)


@pytest.mark.parametrize("device, backend, device_id", [("cuda:1", "nccl", "cuda:1"), ("cpu", "gloo", None)])
def test_device_id_goes_to_init_process_group_on_accelerators(monkeypatch, device, backend, device_id):
    """With device_id, NCCL makes the world's communicator at once and splits every sub-group's
    from it (ncclCommSplit), instead of bootstrapping each group on its own; the groups made
    later by dist.new_group get --timeout, not torch's 30-minute default."""
    import argparse
    import datetime
    import common
    import torch.distributed as dist
    launcher_environ(monkeypatch, {})
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # setup leaves this process's threads alone
    calls = {}
    monkeypatch.setattr(common, "pick_device", lambda *a: (torch.device(device), backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(kw, backend=backend))
    monkeypatch.setattr(dist.distributed_c10d, "default_pg_timeout", dist.distributed_c10d.default_pg_timeout)
    monkeypatch.setattr(dist.distributed_c10d, "default_pg_nccl_timeout", dist.distributed_c10d.default_pg_nccl_timeout)
    common.setup(argparse.Namespace(device="auto", dtype="float32", timeout=7.0))
    assert calls["backend"] == backend and calls["device_id"] == (torch.device(device_id) if device_id else None)
    assert dist.distributed_c10d.default_pg_timeout == datetime.timedelta(seconds=7)


def test_a_plain_setup_under_srun_joins_at_the_address_slurm_gives(monkeypatch):
    """common.setup alone, a copied script's launch (infra.launch's marked store is not there):
    srun's variables and the job script's MASTER_ADDR/PORT are the rendezvous, joined as
    init_method, and every later group gets --timeout."""
    import argparse
    import datetime
    import common
    import torch.distributed as dist
    launcher_environ(monkeypatch, {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_NNODES": "1",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(common._free_port())})
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # setup leaves this process's threads alone
    monkeypatch.setattr(dist.distributed_c10d, "default_pg_timeout", dist.distributed_c10d.default_pg_timeout)
    monkeypatch.setattr(dist.distributed_c10d, "default_pg_nccl_timeout", dist.distributed_c10d.default_pg_nccl_timeout)
    env = common.setup(argparse.Namespace(device="cpu", dtype="float32", timeout=9.0))
    try:
        assert env.launch == Launch("slurm", 0, 0, 1, 1) and dist.get_world_size(dist.group.WORLD) == 1
        assert dist.distributed_c10d.default_pg_timeout == datetime.timedelta(seconds=9)
    finally:
        dist.destroy_process_group()
