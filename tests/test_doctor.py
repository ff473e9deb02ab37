"""02_collectives.py --doctor, and plan.py --measured.

1. The environment checks are a pure function of (environment variables, what a rank sees):
   recorded environments of Polaris, Aurora, Frontier and Perlmutter, each as its job script
   sets it up (no problem) and with each known fault (one line naming the fix).
2. A real 2-rank doctor run on gloo, with rank 1 slowed on purpose (a sleep in every matmul):
   rank 1 is named the straggler, the intra-node sweep is fitted as alpha and beta, the
   problems are one line each and the exit status is 2; a healthy run exits 0.
3. A slow link injected into the doctor's file changes plan.py's recommendation towards the
   layout that sends fewer bytes over that link, as the alpha-beta model predicts."""

import contextlib
import importlib.util
import io
import json
import os

import pytest

from harness import ROOT, launch
import plan

spec = importlib.util.spec_from_file_location("collectives", os.path.join(ROOT, "02_collectives.py"))
collectives = importlib.util.module_from_spec(spec)
spec.loader.exec_module(collectives)
check_environment, recognise_machine = collectives.check_environment, collectives.recognise_machine

# --------------------------------------------------------------------------------------
# Recorded environments: local rank 0 of a 2-node job, as each machine's job script runs it
# --------------------------------------------------------------------------------------

POLARIS_ENV = dict(
    PBS_JOBID="1234.polaris-pbs-01", PBS_O_HOST="polaris-login-02.hsn.cm.polaris.alcf.anl.gov",
    PALS_RANKID="0", PALS_LOCAL_RANKID="0", PMI_RANK="0", PMI_SIZE="8", PALS_LOCAL_SIZE="4",
    CUDA_VISIBLE_DEVICES="3", OMP_NUM_THREADS="8", NCCL_NET="AWS Libfabric", NCCL_NET_GDR_LEVEL="PHB",
    NCCL_CROSS_NIC="1", NCCL_COLLNET_ENABLE="1", FI_CXI_DISABLE_HOST_REGISTER="1",
    FI_MR_CACHE_MONITOR="userfaultfd", FI_CXI_DEFAULT_CQ_SIZE="131072")
AURORA_ENV = dict(
    PBS_JOBID="5678.aurora-pbs-0001", PBS_O_HOST="aurora-uan-0010.hostmgmt1000.cm.aurora.alcf.anl.gov",
    PALS_RANKID="0", PALS_LOCAL_RANKID="0", PMI_RANK="0", PMI_SIZE="24", PALS_LOCAL_SIZE="12",
    OMP_NUM_THREADS="4", ZE_FLAT_DEVICE_HIERARCHY="FLAT", CCL_PROCESS_LAUNCHER="pmix", CCL_ATL_TRANSPORT="mpi",
    CCL_KVS_MODE="mpi", CCL_KVS_USE_MPI_RANKS="1", CCL_CONFIGURATION="cpu_gpu_dpcpp",
    FI_MR_CACHE_MONITOR="userfaultfd", FI_CXI_RX_MATCH_MODE="hybrid")  # the oneCCL page's minimal set
FRONTIER_ENV = dict(
    SLURM_JOB_ID="99", SLURM_CLUSTER_NAME="frontier", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="16",
    SLURM_JOB_NUM_NODES="2", ROCR_VISIBLE_DEVICES="4", OMP_NUM_THREADS="7", NCCL_NET="OFI",
    NCCL_NET_PLUGIN="/opt/aws-ofi-rccl/lib/librccl-net.so", NCCL_CROSS_NIC="1", NCCL_NET_GDR_LEVEL="PHB",
    HSA_FORCE_FINE_GRAIN_PCIE="1", FI_MR_CACHE_MONITOR="kdreg2", FI_CXI_DISABLE_HOST_REGISTER="1",
    FI_CXI_DEFAULT_CQ_SIZE="131072", FI_CXI_DEFAULT_TX_SIZE="2048", FI_CXI_RX_MATCH_MODE="hybrid",
    FI_CXI_RDZV_PROTO="alt_read", SLURM_NETWORK="disable_rdzv_get")
PERLMUTTER_ENV = dict(
    SLURM_JOB_ID="77", NERSC_HOST="perlmutter", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="8",
    SLURM_JOB_NUM_NODES="2", CUDA_VISIBLE_DEVICES="3,2,1,0", OMP_NUM_THREADS="16",
    FI_MR_CACHE_MONITOR="userfaultfd")


def facts(**changes):
    """What a rank sees (local_facts + device_facts), as on a good node; `changes` override."""
    seen = dict(host="node0", launcher="mpi", rank=0, world_size=8, local_rank=0, local_world_size=4, cpus=64,
                affinity=list(range(8)), torch="2.8.0", hip=None, mpi=dict(size=8, rank=0, library="MPICH Version: 4.1.2"),
                libraries={"librccl-net": None, "libnccl-net": "/soft/aws-ofi-nccl/lib/libnccl-net.so"},
                accelerators=dict(cuda=1, xpu=0), backends=dict(nccl=True, gloo=True, xccl=False, ccl=False),
                device=dict(type="cuda", index=0, name="NVIDIA A100-SXM4-40GB", physical=3, uid="GPU-3",
                            near_cpus=None), pbs_nodes=2)
    seen.update(changes)
    return seen


MACHINES = {
    "polaris": (POLARIS_ENV, facts()),
    "aurora": (AURORA_ENV, facts(world_size=24, local_world_size=12, cpus=208, affinity=[4, 5, 6, 7],
                                 mpi=dict(size=24, rank=0, library="MPICH Version: 4.2.0"),
                                 accelerators=dict(cuda=0, xpu=12), backends=dict(nccl=False, gloo=True, xccl=True, ccl=True),
                                 device=dict(type="xpu", index=0, name="Intel Max 1550", physical=0, uid="t0",
                                             near_cpus=None))),
    "frontier": (FRONTIER_ENV, facts(launcher="slurm", world_size=16, local_world_size=8, cpus=128,
                                     affinity=list(range(1, 8)), mpi=None, pbs_nodes=None, hip="6.2",
                                     libraries={"librccl-net": "/opt/aws-ofi-rccl/lib/librccl-net.so", "libnccl-net": None},
                                     device=dict(type="cuda", index=0, name="AMD Instinct MI250X", physical=4,
                                                 uid="GCD-4", near_cpus="0-15,64-79"))),
    "perlmutter": (PERLMUTTER_ENV, facts(launcher="slurm", mpi=None, pbs_nodes=None, cpus=128,
                                         affinity=list(range(0, 16)) + list(range(64, 80)),
                                         accelerators=dict(cuda=4, xpu=0))),
}


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_each_machine_is_recognised_and_its_job_environment_is_healthy(machine):
    environ, seen = MACHINES[machine]
    assert recognise_machine(environ)[0] == machine
    assert check_environment(environ, seen, machine) == []


def test_an_unknown_machine_is_said_and_only_the_general_checks_run():
    name, how = recognise_machine({"HOME": "/home/me"}, "laptop")
    assert name is None and "polaris" in how
    assert check_environment({}, facts(launcher="single", mpi=None, pbs_nodes=None, world_size=1,
                                        local_world_size=1, affinity=list(range(64))), None) == []


def diagnose(machine, environ_changes=(), unset=(), **fact_changes):
    environ, seen = MACHINES[machine]
    environ = {k: v for k, v in {**environ, **dict(environ_changes)}.items() if k not in unset}
    return check_environment(environ, {**seen, **fact_changes}, machine)


# (machine, environment changes, variables unset, fact changes, the words of each expected line)
KNOWN_BAD = [
    # Polaris: started without jobs/polaris_gpu_affinity.sh: every rank sees 4 GPUs, rank 0 drives GPU 0
    ("polaris", {}, ["CUDA_VISIBLE_DEVICES"], dict(accelerators=dict(cuda=4, xpu=0),
                                                   device=dict(type="cuda", index=0, name="A100", physical=0,
                                                               uid="GPU-0", near_cpus=None)),
     [["sees 4 device(s)", "polaris_gpu_affinity.sh"], ["not next to its device 0", "CPUs 24-31,56-63"]]),
    ("polaris", {}, [], dict(mpi=dict(size=1, rank=0, library="Open MPI v4.1.5")),
     [["sees rank 0 of 1", "started rank 0 of 8", "--no-binary mpi4py"]]),
    ("polaris", {}, [], dict(libraries={"librccl-net": None, "libnccl-net": None}),
     [["no network plugin (libnccl-net", "/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib", "jobs/polaris.sh"]]),
    ("polaris", {}, [], dict(affinity=list(range(64))), [["not bound to cores", "--cpu-bind depth"]]),
    ("polaris", {}, ["NCCL_NET"], {}, [["NCCL_NET is unset", 'export NCCL_NET=AWS Libfabric']]),
    # Aurora: a binding that includes a reserved core; CCL workers on a rank's cores; the
    # composite hierarchy; the frameworks module not loaded
    ("aurora", {}, [], dict(affinity=[0, 1, 2, 3]), [["reserved core(s) 0", "user-guides #836"]]),
    ("aurora", {"CCL_WORKER_AFFINITY": "5,13,21,29,37,45,57,65,73,81,89,97"}, [], {},
     [["CCL_WORKER_AFFINITY=5,13", "core(s) 5", "ezpz #34"]]),
    ("aurora", {"CCL_WORKER_AFFINITY": "100"}, [], {}, [["names 1 core(s) for 12 local ranks"]]),
    ("aurora", {"ZE_FLAT_DEVICE_HIERARCHY": "COMPOSITE"}, [], dict(accelerators=dict(cuda=0, xpu=6)),
     [["sees 6 device(s)", "ZE_FLAT_DEVICE_HIERARCHY=FLAT"]]),
    ("aurora", {}, [], dict(accelerators=dict(cuda=0, xpu=0), backends=dict(nccl=False, gloo=True, xccl=False, ccl=False),
                            device=dict(type="cpu", index=None, name=None, physical=None, uid=None, near_cpus=None)),
     [["no GPU visible", "module load frameworks"]]),
    ("aurora", {}, ["CCL_ATL_TRANSPORT"], {}, [["CCL_ATL_TRANSPORT is unset", "export CCL_ATL_TRANSPORT=mpi"]]),
    # the tuning list's FI_MR_CACHE_MONITOR=disabled against the minimal set's userfaultfd
    ("aurora", {"FI_MR_CACHE_MONITOR": "disabled"}, [], {},
     [["FI_MR_CACHE_MONITOR=disabled on 2 node(s)", "export FI_MR_CACHE_MONITOR=userfaultfd", "minimal set"]]),
    ("aurora", {"FI_MR_CACHE_MONITOR": "memhooks"}, [], {}, [["memhooks", "export FI_MR_CACHE_MONITOR=userfaultfd"]]),
    # a typo's huge range is counted, never built; a range beyond the node's CPUs is named
    ("aurora", {"CCL_WORKER_AFFINITY": "0-99999999999"}, [], {},
     [["CCL_WORKER_AFFINITY=0-99999999999 is not a list of this node's cores (0-207)"]]),
    ("aurora", {"CCL_WORKER_AFFINITY": "100-101,x"}, [], {}, [["is not a list of this node's cores"]]),
    # Frontier: memhooks (olcf-user-docs #947), or the monitor unset; no aws-ofi-rccl plugin on
    # two nodes; NCCL_NET=OFI on one node; srun without --gpus-per-task=1; alt_read alone
    ("frontier", {"FI_MR_CACHE_MONITOR": "memhooks"}, [], {},
     [["FI_MR_CACHE_MONITOR=memhooks", "#947", "export FI_MR_CACHE_MONITOR=kdreg2"]]),
    ("frontier", {}, ["FI_MR_CACHE_MONITOR"], {}, [["FI_MR_CACHE_MONITOR is unset", "kdreg2"]]),
    ("frontier", {}, ["NCCL_NET_PLUGIN"], dict(libraries={"librccl-net": None, "libnccl-net": None}),
     [["no network plugin (librccl-net", "TCP sockets", "module load rccl-net-plugin"]]),
    ("frontier", {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "8"}, [], dict(world_size=8),
     [["NCCL_NET=OFI on 1 node(s)", "export NCCL_NET=Socket"]]),
    ("frontier", {}, ["ROCR_VISIBLE_DEVICES"], dict(accelerators=dict(cuda=8, xpu=0)),
     [["sees 8 device(s)", "--gpus-per-task=1 --gpu-bind=closest"]]),
    ("frontier", {"SLURM_NETWORK": "ho"}, [], {}, [["alt_read without", "disable_rdzv_get"]]),
    # Perlmutter: without CUDA_VISIBLE_DEVICES=3,2,1,0 local rank 0 drives GPU 0, on the far
    # NUMA domain; memhooks; one process in a 2-node job
    ("perlmutter", {}, ["CUDA_VISIBLE_DEVICES"], dict(device=dict(type="cuda", index=0, name="A100", physical=0,
                                                                  uid="GPU-0", near_cpus=None)),
     [["not next to its device 0", "CPUs 48-63,112-127", "--cpu-bind=cores"]]),
    ("perlmutter", {"FI_MR_CACHE_MONITOR": "memhooks"}, [], {},
     [["FI_MR_CACHE_MONITOR=memhooks", "userfaultfd"]]),
    ("perlmutter", {}, ["SLURM_PROCID", "SLURM_NTASKS"], dict(launcher="single", world_size=1, local_world_size=1),
     [["one process in a 2-node job", "srun"]]),
]


POLARIS_PLUGIN = ("NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "NCCL_COLLNET_ENABLE", "NCCL_NET")


@pytest.mark.parametrize("changes", [{"NCCL_PLUGIN": "off"}, {}])
def test_alcfs_plugin_off_remedy_is_one_warning_not_problems(changes):
    """jobs/polaris.sh's NCCL_PLUGIN=off (or the four variables unset by hand, as ALCF's NCCL page
    says when the plugin hangs a pipeline job) is one warning: the doctor exits 0 on it."""
    lines = diagnose("polaris", changes, POLARIS_PLUGIN)
    assert len(lines) == 1 and lines[0].startswith(collectives.WARNING) and "NCCL_PLUGIN=off" in lines[0], lines
    # a job with none of the page's variables is not that remedy: every missing one is a problem
    bare = diagnose("polaris", {}, POLARIS_PLUGIN + ("FI_CXI_DEFAULT_CQ_SIZE",))
    assert len(bare) == 2 and not any(line.startswith(collectives.WARNING) for line in bare), bare


def test_mpi4py_of_another_mpi_is_a_warning_when_the_ranks_met_another_way():
    """common.setup falls back to Slurm's variables or MASTER_ADDR/PORT, as training does: said."""
    seen = dict(mpi=dict(size=1, rank=0, library="Open MPI v4.1.5"))
    assert not diagnose("polaris", **seen)[0].startswith(collectives.WARNING)
    line, = diagnose("polaris", rendezvous="env", **seen)
    assert line.startswith(collectives.WARNING) and "MASTER_ADDR and MASTER_PORT" in line and "sees rank 0 of 1" in line


@pytest.mark.parametrize("name", ["SLURM_JOB_NUM_NODES", "SLURM_NNODES"])
def test_a_node_count_that_is_no_number_is_one_line_naming_it(name, capsys):
    with pytest.raises(SystemExit) as stop:
        diagnose("frontier", {name: "abc"}, [] if name == "SLURM_JOB_NUM_NODES" else ["SLURM_JOB_NUM_NODES"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {name}=abc "), err


def test_uneven_nodes_are_the_verdict_and_even_ones_are_not():
    assert collectives.uneven_nodes(["a"] * 4 + ["b"] * 4) is None
    line = collectives.uneven_nodes(["a"] * 4 + ["b"] * 3)
    assert "ranks per node (4 on a, 3 on b)" in line and "--ppn" in line and "skipped" in line


@pytest.mark.parametrize("machine, changes, unset, fact_changes, expected", KNOWN_BAD,
                         ids=[f"{bad[0]}-{i}" for i, bad in enumerate(KNOWN_BAD)])
def test_each_known_fault_is_one_line_naming_the_fix(machine, changes, unset, fact_changes, expected):
    problems = diagnose(machine, changes, unset, **fact_changes)
    assert len(problems) == len(expected), problems
    for words, line in zip(expected, problems):
        assert "\n" not in line and all(w in line for w in words), (words, line)


def test_ranks_of_a_node_on_one_device_or_the_same_cores_are_named():
    gpu = dict(type="cuda", index=0, name="A100", physical=0, uid="GPU-0", near_cpus=None)
    rows = [facts(rank=r, local_world_size=2, device=gpu, affinity=list(range(8))) for r in range(2)]
    problems = collectives.check_nodes(rows)
    assert any("ranks 0-1 all compute on one device (GPU-0)" in p for p in problems), problems
    assert any("ranks 0 and 1 are bound to the same CPU(s) 0-7" in p for p in problems), problems
    rows = [facts(rank=r, local_world_size=2, affinity=list(range(8 * r, 8 * r + 8)),
                  device=dict(gpu, uid=f"GPU-{r}")) for r in range(2)]
    assert collectives.check_nodes(rows) == []


def test_alpha_and_beta_are_recovered_from_the_ring_model():
    g, alpha, beta = 4, 7e-6, 40e9
    rows = [dict(bytes=s, time_us=1e6 * (2 * (g - 1) * alpha + 2 * (g - 1) / g * s / beta)) for s in
            (1024 * 4**k for k in range(10))]
    fit = collectives.fit_link(rows, g)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6) and fit["beta_GBps"] == pytest.approx(40, rel=1e-6)


# --------------------------------------------------------------------------------------
# Real runs: a healthy one, and a rank slowed on purpose
# --------------------------------------------------------------------------------------

SLOWED = """import os, sys, time, importlib.util
sys.path.insert(0, {root!r})
import common
spec = importlib.util.spec_from_file_location("collectives", os.path.join({root!r}, "02_collectives.py"))
doctor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(doctor)
matmul = doctor.matmul
def slowed(a, b):  # rank 1 is a straggler: 30 ms more for every matmul
    if common.detect_launcher(os.environ).rank == 1:
        time.sleep(0.03)
    return matmul(a, b)
doctor.matmul = slowed
doctor.main()
"""


def test_one_healthy_rank_exits_0_and_says_the_machine_first(tmp_path):
    run = launch("02_collectives.py", ["--doctor", "--device", "cpu", "--iters", "2", "--machine", "polaris"],
                 metrics=False, out_dir=False, timeout=120, env={"PBS_JOBID": ""})
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("doctor: machine polaris (--machine)") and lines[-1] == "healthy: no problem found"


def test_a_slowed_rank_is_named_the_straggler_and_the_sweep_is_fitted(tmp_path):
    script = tmp_path / "slowed_doctor.py"
    script.write_text(SLOWED.format(root=ROOT))
    report = tmp_path / "doctor.json"
    run = launch(str(script), ["--doctor", "--device", "cpu", "--iters", "3", "--min_bytes", "4096",
                               "--max_bytes", "1048576", "--json", report], nprocs=2, metrics=False,
                 out_dir=False, timeout=180)
    assert run.returncode == 2, run.stdout + run.stderr
    doc = json.loads(report.read_text())
    problems = [line.removeprefix("problem: ") for line in run.stdout.splitlines() if line.startswith("problem: ")]
    assert problems == doc["problems"] and problems
    assert any(p.startswith("straggler: rank 1 ") and "matmul" in p for p in problems), problems
    assert not any(p.startswith("straggler: rank 0 ") and "matmul" in p for p in problems), problems
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["hardware"][1]["matmul_s"] > 0.03
    fit = doc["links"]["intra"]
    assert fit["group_size"] == 2 and len(fit["rows"]) == 5  # 4, 16, 64, 256 KiB, 1 MiB
    assert fit["alpha_s"] > 0 and fit["beta_GBps"] > 0 and "inter" not in doc["links"]
    assert "alpha" in run.stdout and "beta" in run.stdout


# --------------------------------------------------------------------------------------
# plan.py --measured
# --------------------------------------------------------------------------------------

# GPT-2 on 2 nodes of 2 GPUs whose 1.2 GB hold no replica: by the datasheet (100 GB/s in a
# node) the plan puts tensor parallelism inside the nodes; a node link measured at 0.2 GB/s
# must move it to a layout that sends less inside a node
PLAN = ["--model", "gpt2", "--block_size", "256", "--global_batch_size", "8", "--gpus", "4", "--gpus_per_node", "2",
        "--gpu_mem_gb", "1.2", "--peak_tflops", "100", "--link_gbps", "400", "--inter_gbps", "2"]
# (a slow datasheet network between the nodes, so that the datasheet's choice keeps its heavy traffic inside
# a node: CP's all-to-alls there, under the simulated step; the measured file then slows the inside link,
# and the plan moves off it)


def test_a_slow_link_in_the_measured_file_moves_the_recommendation_off_it(tmp_path):
    measured = tmp_path / "doctor.json"
    measured.write_text(json.dumps({"machine": None, "links": {
        "intra": {"alpha_s": 5e-6, "beta_GBps": 0.2, "group_size": 2},
        "inter": {"alpha_s": 10e-6, "beta_GBps": 25.0, "group_size": 2}}}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan.main(PLAN + ["--measured", str(measured), "--json"])
    doc = json.loads(out.getvalue())
    m = doc["measured"]
    assert m["recommendation_changed"] and m["old"] == m["datasheet_recommendation"]["label"]
    assert m["new"] == doc["recommendation"]["label"] != m["old"]
    # the model's prediction: the new layout sends fewer bytes over the slowed link, and takes
    # less time on it, than the old one does now
    assert m["new_links"]["intra"]["bytes"] < m["old_links"]["intra"]["bytes"]
    assert m["new_links"]["intra"]["measured_s"] < m["old_links"]["intra"]["measured_s"]
    assert m["old_links"]["intra"]["measured_s"] > 100 * m["old_links"]["intra"]["datasheet_s"]  # 100 / 0.2 GB/s
    assert plan.dry_run.__name__ == "dry_run"  # the remembered dry runs were for that plan only


@pytest.mark.parametrize("content, reason", [("not json", "cannot read it as the doctor's --json"),
                                             ('{"links": {}}', "no measured links in it"),
                                             ('{"links": {"intra": {"alpha_s": 1e-6, "beta_GBps": 0}}}',
                                              "lacks a non-negative alpha_s and a positive beta_GBps")])
def test_a_bad_measured_file_is_one_line_and_status_2(tmp_path, content, reason, capsys):
    path = tmp_path / "doctor.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        plan.main(PLAN + ["--measured", str(path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and reason in err and err.startswith("error: --measured")


@pytest.mark.parametrize("flags, reason", [
    (["--doctor", "--json", "/nonexistent-gptpar/doctor.json"], "--json /nonexistent-gptpar/doctor.json: the directory"),
    (["--doctor", "--json", "/tmp"], "--json /tmp is a directory"),
    (["--doctor", "--straggler_margin", "nan"], "--straggler_margin must be a positive fraction"),
    (["--machine", "polaris"], "--json and --machine go with --doctor"),
    (["--doctor", "--bench"], "give --doctor or --bench, not both"),
])
def test_bad_doctor_flags_are_one_line_and_status_2(flags, reason):
    run = launch("02_collectives.py", ["--device", "cpu"] + flags, nprocs=2, metrics=False, out_dir=False, timeout=60)
    assert run.returncode == 2 and len(run.error_lines) == 1 and reason in run.error_lines[0], run.stderr


# --------------------------------------------------------------------------------------
# Launches the doctor exists for: uneven nodes, a frozen rank
# --------------------------------------------------------------------------------------

FAKE_NODES = """import os, socket, sys, time, importlib.util
sys.path.insert(0, {root!r})
rank, sizes = int(os.environ["RANK"]), {sizes!r}
node = next(i for i in range(len(sizes)) if rank < sum(sizes[:i + 1]))  # mpiexec --ppn's blocks
os.environ.update(LOCAL_RANK=str(rank - sum(sizes[:node])), LOCAL_WORLD_SIZE=str(sizes[node]))
socket.gethostname = lambda: f"node{{node}}"
spec = importlib.util.spec_from_file_location("collectives", os.path.join({root!r}, "02_collectives.py"))
doctor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(doctor)
matmul = doctor.matmul
def frozen(a, b):
    if rank == {frozen}:
        time.sleep(600)
    return matmul(a, b)
doctor.matmul = frozen
doctor.main()
"""


def test_seven_ranks_on_nodes_of_4_and_3_end_with_the_ranks_per_node_verdict(tmp_path):
    """`mpiexec -n 7 --ppn 4` (host names faked per rank, the local ranks as MPICH gives them):
    the verdict, not a hang in groups made only on their members."""
    script = tmp_path / "uneven_doctor.py"
    script.write_text(FAKE_NODES.format(root=ROOT, sizes=[4, 3], frozen=-1))
    run = launch(str(script), ["--doctor", "--device", "cpu", "--iters", "1", "--timeout", "60", "--straggler_margin",
                               "1e6"], nprocs=7,
                 metrics=False, out_dir=False, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    problems = [line for line in run.stdout.splitlines() if line.startswith("problem: ")]
    assert problems == ["problem: the nodes hold different numbers of ranks per node (4 on node0, 3 on node1): "
                        "launch as many on each (-n a multiple of --ppn, or --ntasks-per-node); the network sweep "
                        "is skipped"], run.stdout
    assert "network: not swept" in run.stdout


def test_a_frozen_rank_is_named_with_the_step_it_was_in(tmp_path):
    """Rank 1 of 3 freezes in the hardware timing: one line names it and the step, within
    --timeout, exit 2 (not gloo's traceback)."""
    script = tmp_path / "frozen_doctor.py"
    script.write_text(FAKE_NODES.format(root=ROOT, sizes=[3], frozen=1))
    run = launch(str(script), ["--doctor", "--device", "cpu", "--iters", "1", "--timeout", "3"], nprocs=3,
                 metrics=False, out_dir=False, timeout=60, grace=1)
    assert run.returncode == 2 and run.seconds < 30, (run.returncode, run.seconds, run.stderr)
    assert run.error_lines == ["error: rank(s) 1 did not finish the doctor's hardware timing within --timeout 3 s "
                               "(frozen, or its node is down): leave that node out and run the doctor again"], run.stderr
    assert "Traceback" not in run.stderr


OTHER_MPI = """import os, sys, types, importlib.util
sys.path.insert(0, {root!r})
# PALS's mpiexec (Polaris, Aurora) with an mpi4py built on another MPI: a world of one on each rank
rank, size = os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
os.environ.update(PALS_RANKID=rank, PMI_RANK=rank, PMI_SIZE=size, PALS_LOCAL_RANKID=rank, PALS_LOCAL_SIZE=size)
class World:
    Get_size = staticmethod(lambda: 1)
    Get_rank = staticmethod(lambda: 0)
sys.modules["mpi4py"] = types.SimpleNamespace(MPI=types.SimpleNamespace(
    COMM_WORLD=World(), Get_library_version=lambda: "Open MPI v4.1.5"))
spec = importlib.util.spec_from_file_location("collectives", os.path.join({root!r}, "02_collectives.py"))
doctor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(doctor)
doctor.main()
"""


def test_mpi4py_of_another_mpi_falls_back_as_training_does_and_warns(tmp_path):
    """The doctor meets through MASTER_ADDR/PORT, as common.setup does for training, and says why."""
    script = tmp_path / "other_mpi_doctor.py"
    script.write_text(OTHER_MPI.format(root=ROOT))
    run = launch(str(script), ["--doctor", "--device", "cpu", "--iters", "1", "--max_bytes", "65536",
                               "--straggler_margin", "1e6"], nprocs=2, metrics=False, out_dir=False, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    warnings = [line for line in run.stdout.splitlines() if line.startswith("warning: ")]
    assert [w.split(": mpi4py is built")[0] for w in warnings] == [
        f"warning: rank {r}: mpi4py's MPI (Open MPI v4.1.5) sees rank 0 of 1 where the launcher started rank {r} of 2"
        for r in (0, 1)], run.stdout
    assert all(w.endswith("(the ranks met through MASTER_ADDR and MASTER_PORT instead, as training does)") for w in warnings)
    assert run.stdout.splitlines()[-1] == "healthy: no problem found (2 warning(s) above)"
