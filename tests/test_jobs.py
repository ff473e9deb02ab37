"""jobs/: every submit script parses, launches the right line under a fabricated scheduler
environment (module, conda and scontrol replaced by stubs that record their arguments;
mpiexec and srun by a stand-in that records its line and the environment it launches with,
emulates each local rank's CPU binding and GPU wrapper, and then really runs the job's python
command as `--dry_run --world_size N --ranks_per_node R`, so the job's own configuration is
validated by the script itself: forked as `python script` from the session's fork server,
tests/forkserver.py, or a fresh interpreter where GPTPAR_TEST_LAUNCHER names a real launcher), refuses layouts that do not fit, binds every rank to the
CPU cores next to its GPU, sets the communication variables the facilities document
(jobs/README.md cites each), and jobs/local.sh really trains."""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from harness import FORK_SERVER, LAUNCHER_ENV, ROOT, TINY, chosen_launcher, launch
from test_failures import committed
from test_reliability import wait_for_rows

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "jobs", "*.sh")))
STUB = """#!/bin/bash
echo "$(basename "$0") $* | MASTER_ADDR=${MASTER_ADDR:-} MASTER_PORT=${MASTER_PORT:-}" >> "$RECORD"
[ "$(basename "$0")" != scontrol ] || for i in $(seq 1 "$NODES"); do printf 'nid%03d\\n' "$i"; done
"""
# mpiexec / srun: record the line and the environment; emulate each local rank (its CPU
# binding as the launcher's flags give it, and the GPU wrapper before `python`, if any, run
# with that rank's PALS/PMI/Slurm local rank); then dry-run the python command at its size
LAUNCHER = """#!{python}
import json, os, subprocess, sys
name, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["RECORD"], "a") as f:
    f.write(f"{{name}} {{' '.join(argv)}} | MASTER_ADDR={{os.environ.get('MASTER_ADDR', '')}} "
            f"MASTER_PORT={{os.environ.get('MASTER_PORT', '')}}\\n")
command = argv[argv.index("python") + 1:]
launcher = argv[:argv.index("python")]
def option(*flags):
    for i, a in enumerate(launcher):
        for f in flags:
            if a == f:
                return launcher[i + 1]
            if a.startswith(f + "=") or (not f.startswith("--") and a[len(f):].isdigit() and a.startswith(f)):
                return a[len(f):].lstrip("=")
def value(*flags):
    v = option(*flags)
    return None if v is None else int(v)
world = value("-n", "--ntasks", "--np")
per_node = value("--ppn", "--ntasks-per-node") or world // (value("-N", "--nodes") or 1)
def cores(r):  # physical cores of local rank r: PALS' depth/list binding, Slurm's -c N --cpu-bind=cores (2 threads a core)
    bind = (option("--cpu-bind") or "").replace("verbose,", "")
    if bind == "depth":
        d = value("--depth", "-d")
        return list(range(d * r, d * r + d))
    if bind.startswith("list:"):
        out = []
        for part in bind[len("list:"):].split(":")[r].split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
        return out
    if bind == "cores" and value("-c", "--cpus-per-task"):
        n = value("-c", "--cpus-per-task") // 2
        return list(range(n * r, n * r + n))
    return None
wrapper = [a for a in launcher if a.endswith(".sh")]
ranks = []
for r in range(per_node):
    env = dict(os.environ, PALS_LOCAL_RANKID=str(r), PMI_LOCAL_RANK=str(r), SLURM_LOCALID=str(r))
    if wrapper:
        out = subprocess.run(["bash", *wrapper, "env", "-0"], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        env = dict(kv.split("=", 1) for kv in out.stdout.split("\\0") if "=" in kv)
    ranks.append({{"local_rank": r, "cores": cores(r),
                   "env": {{k: env.get(k) for k in ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "ROCR_VISIBLE_DEVICES")}}}})
with open(os.environ["RECORD"] + ".launch.json", "w") as f:
    json.dump({{"env": dict(os.environ), "ranks": ranks}}, f)
if os.environ.get("LAUNCH_ONLY"):
    sys.exit(0)
dry = ["--dry_run", "--world_size", str(world), "--ranks_per_node", str(per_node)]
if os.environ.get("GPTPAR_FORK_SOCKET"):  # `python script` forked from the session's server: torch imported once
    import socket, tempfile
    sys.path.insert(0, {tests!r})
    from harness import fork_job
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["GPTPAR_FORK_SOCKET"])
    code, out, err = fork_job(conn, os.path.abspath(command[0]), command[1:] + dry, 1, dict(os.environ), os.getcwd(),
                              120, tempfile.mkdtemp(prefix="gptpar-"))
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.exit(code)
sys.exit(subprocess.call([sys.executable, *command, *dry]))
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_parses(script):
    subprocess.run(["bash", "-n", script], check=True)


@pytest.fixture
def scheduler(tmp_path):
    """Run a job script as the scheduler would, with recording stubs on the PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("mpiexec", "srun", "module", "conda", "scontrol"):
        (stubs / name).write_text(LAUNCHER.format(python=sys.executable, tests=os.path.join(ROOT, "tests"))
                                  if name in ("mpiexec", "srun") else STUB)
        (stubs / name).chmod(0o755)
    nodefile = tmp_path / "nodefile"
    record = tmp_path / "record"

    def run(script, *args, kind="pbs", nodes=None, env=None, launch_only=False):
        """Run a job script; returns the process and the recorded stub lines, and leaves the
        launch's environment and emulated ranks in run.launch (None when nothing launched).
        nodes: as granted (default: what the header asks); env: extra variables, as a
        facility module would have set them; launch_only: record the launch, skip the dry run."""
        nodes = nodes or nodes_asked(script)  # the scheduler grants what the job's header asks for
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("PBS_", "SLURM_"))}
        environ.update(PATH=f"{stubs}:{environ['PATH']}", RECORD=str(record), USER="tester", NODES=str(nodes))
        environ.update(env or {})
        if launch_only:
            environ["LAUNCH_ONLY"] = "1"
        elif chosen_launcher() == "fork":  # the stand-in launcher's dry run: forked, not a fresh interpreter
            if not FORK_SERVER.alive():
                FORK_SERVER.start()
            environ["GPTPAR_FORK_SOCKET"] = FORK_SERVER.socket
        if kind == "pbs":
            nodefile.write_text("".join(f"x3001c0s13b{i}n0\n" for i in range(nodes)))
            environ.update(PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=ROOT, PBS_JOBID="1234.polaris-pbs")
        else:
            environ.update(SLURM_SUBMIT_DIR=ROOT, SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=f"nid[001-{nodes:03d}]",
                           SLURM_JOB_ID="4242")
        p = subprocess.run(["bash", os.path.join(ROOT, "jobs", script), *args], env=environ, cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=60)
        lines = record.read_text().splitlines() if record.exists() else []
        record.unlink(missing_ok=True)
        launched = tmp_path / "record.launch.json"
        run.launch = json.loads(launched.read_text()) if launched.exists() else None
        launched.unlink(missing_ok=True)
        return p, lines
    return run


def nodes_asked(script):
    """The node count of a job script's header: `#PBS -l select=N` or `#SBATCH -N N`."""
    header = open(os.path.join(ROOT, "jobs", script)).read()
    found = re.findall(r"^#PBS -l select=(\d+)|^#SBATCH (?:-N|--nodes[= ])\s*(\d+)", header, re.M)
    assert len(found) == 1, f"{script}: expected one node count in its header, found {found}"
    return int(found[0][0] or found[0][1])


def launch_line(lines, launcher):
    found = [line for line in lines if line.startswith(launcher + " ")]
    assert len(found) == 1, lines
    return found[0]


# Which physical cores are local to which device, as the facilities document it (jobs/README.md)
def _cores(lo, hi):
    return set(range(lo, hi + 1))


NEAR = {
    # ALCF Polaris device affinity table: GPU 0 on NUMA 3 (cores 24-31) ... GPU 3 on NUMA 0 (0-7)
    "polaris": {0: _cores(24, 31), 1: _cores(16, 23), 2: _cores(8, 15), 3: _cores(0, 7)},
    # NERSC: Perlmutter's GPUs in reverse of Slurm's default CPU affinity (64 cores, 4 NUMA domains)
    "perlmutter": {g: _cores(16 * (3 - g), 16 * (3 - g) + 15) for g in range(4)},
    # ALCF Aurora: tile t (flat hierarchy, PCI order) is on GPU t // 2; GPUs 0-2 on socket 0
    # (cores 0-51), 3-5 on socket 1 (52-103); cores 0 and 52 are kept for the OS
    "aurora": {t: (_cores(1, 51) if t // 2 < 3 else _cores(53, 103)) for t in range(12)},
}


def device_of(machine, rank):
    """The physical device a rank computes on: common.py takes device (local rank % visible
    count) of those the rank's environment leaves visible."""
    env = rank["env"]
    if machine == "aurora":
        visible = env["ZE_AFFINITY_MASK"].split(",") if env["ZE_AFFINITY_MASK"] else [str(t) for t in range(12)]
    else:
        visible = env["CUDA_VISIBLE_DEVICES"].split(",") if env["CUDA_VISIBLE_DEVICES"] else ["0", "1", "2", "3"]
    return int(visible[rank["local_rank"] % len(visible)])


def assert_ranks_sit_next_to_their_devices(machine, launch):
    ranks = launch["ranks"]
    assert len(ranks) == {"aurora": 12}.get(machine, 4)
    devices = [device_of(machine, r) for r in ranks]
    assert sorted(devices) == sorted(NEAR[machine]), devices  # every device used once per node
    for rank, device in zip(ranks, devices):
        assert rank["cores"] and set(rank["cores"]) <= NEAR[machine][device], (machine, rank, device)
    others = [set(r["cores"]) for r in ranks]
    assert all(not (a & b) for i, a in enumerate(others) for b in others[i + 1:]), others  # no core shared


def test_the_affinity_check_catches_the_polaris_default():
    # without the wrapper every Polaris rank sees all four GPUs and drives cuda:(local rank),
    # the GPU farthest from its cores: the check above must reject that
    launch = {"ranks": [{"local_rank": r, "cores": list(range(8 * r, 8 * r + 8)), "env": {"CUDA_VISIBLE_DEVICES": None}}
                        for r in range(4)]}
    with pytest.raises(AssertionError):
        assert_ranks_sit_next_to_their_devices("polaris", launch)


def test_polaris_gpu_affinity_wrapper():
    """As ALCF's set_affinity_gpu_polaris script: local rank r drives GPU 3 - r (round robin past 4)."""
    wrapper = os.path.join(ROOT, "jobs", "polaris_gpu_affinity.sh")
    base = {k: v for k, v in os.environ.items() if k not in ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "CUDA_VISIBLE_DEVICES")}
    show = ["sh", "-c", "echo $CUDA_VISIBLE_DEVICES \"$@\"", "sh", "and", "its args"]
    for name in ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"):
        for r in range(8):
            p = subprocess.run(["bash", wrapper, *show], env=dict(base, **{name: str(r)}), capture_output=True, text=True)
            assert p.returncode == 0 and p.stdout == f"{3 - r % 4} and its args\n", (name, r, p.stdout, p.stderr)
    p = subprocess.run(["bash", wrapper, "true"], env=base, capture_output=True, text=True)
    assert p.returncode == 2 and "no PALS_LOCAL_RANKID or PMI_LOCAL_RANK" in p.stderr
    assert os.access(wrapper, os.X_OK)  # mpiexec runs it directly


def test_polaris(scheduler, tmp_path):
    plugin = tmp_path / "aws-ofi-nccl" / "lib"
    plugin.mkdir(parents=True)
    (plugin / "libnccl-net.so").write_text("")
    p, lines = scheduler("polaris.sh", "03_ddp.py", "--model", "tiny", env={"LD_LIBRARY_PATH": str(plugin)})
    assert p.returncode == 0, p.stderr
    assert "module use /soft/modulefiles" in lines[0] and "module load conda" in lines[1]
    line = launch_line(lines, "mpiexec")
    assert line.startswith(f"mpiexec -n 8 --ppn 4 --depth 8 --cpu-bind depth {ROOT}/jobs/polaris_gpu_affinity.sh "
                           "python 03_ddp.py --model tiny |")
    assert "layout: 8 ranks = 8 data-parallel x 1 pipeline x 1 tensor-parallel" in p.stdout
    assert_ranks_sit_next_to_their_devices("polaris", scheduler.launch)
    assert [r["env"]["CUDA_VISIBLE_DEVICES"] for r in scheduler.launch["ranks"]] == ["3", "2", "1", "0"]
    env = scheduler.launch["env"]
    assert {k: env.get(k) for k in POLARIS_ENV} == POLARIS_ENV
    assert "warning" not in p.stderr and "note: ALCF warns" not in p.stdout
    # ALCF's NCCL page puts the aws-ofi-nccl plugin and hwloc on LD_LIBRARY_PATH itself
    assert env["LD_LIBRARY_PATH"].split(":")[:3] == ["/soft/libraries/hwloc/lib/", "/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib",
                                                     str(plugin)], env["LD_LIBRARY_PATH"]
    # its warning (Megatron-DeepSpeed hangs with the plugin): a note for the pipeline scripts, and
    # its remedy on request
    p, _ = scheduler("polaris.sh", "07_pipeline.py", "--pp", "4", env={"LD_LIBRARY_PATH": str(plugin)}, launch_only=True)
    assert p.returncode == 0 and "note: ALCF warns that pipeline-parallel jobs" in p.stdout and "NCCL_PLUGIN=off" in p.stdout
    p, _ = scheduler("polaris.sh", "07_pipeline.py", "--pp", "4", launch_only=True,
                     env={"LD_LIBRARY_PATH": str(plugin), "NCCL_PLUGIN": "off"})
    env = scheduler.launch["env"]
    assert p.returncode == 0 and "note: ALCF warns" not in p.stdout
    assert [k for k in ("NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "NCCL_COLLNET_ENABLE", "NCCL_NET") if k in env] == []
    assert env["FI_MR_CACHE_MONITOR"] == "userfaultfd"  # the page unsets only the four NCCL variables
    # the conda module puts the aws-ofi-nccl plugin on LD_LIBRARY_PATH; without it: a warning
    p, _ = scheduler("polaris.sh", "03_ddp.py", env={"LD_LIBRARY_PATH": ""}, launch_only=True)
    assert p.returncode == 0 and "warning: no aws-ofi-nccl plugin (libnccl-net*.so) on LD_LIBRARY_PATH" in p.stderr


POLARIS_ENV = {  # ALCF's NCCL page for Polaris
    "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_CROSS_NIC": "1", "NCCL_COLLNET_ENABLE": "1", "NCCL_NET": "AWS Libfabric",
    "FI_CXI_DISABLE_HOST_REGISTER": "1", "FI_MR_CACHE_MONITOR": "userfaultfd", "FI_CXI_DEFAULT_CQ_SIZE": "131072",
}

AURORA_ENV = {  # ALCF's oneCCL page for Aurora (its minimal set, the set for runs at scale, and the CXI/PALS list)
    "CCL_PROCESS_LAUNCHER": "pmix", "CCL_ATL_TRANSPORT": "mpi", "CCL_KVS_MODE": "mpi", "CCL_KVS_USE_MPI_RANKS": "1",
    "CCL_KVS_CONNECTION_TIMEOUT": "600", "CCL_CONFIGURATION": "cpu_gpu_dpcpp", "CCL_CONFIGURATION_PATH": "",
    "CCL_ALLREDUCE": "topo", "CCL_ALLREDUCE_SCALEOUT": "direct:0-1048576;rabenseifner:1048577-max",
    "CCL_BCAST": "double_tree", "CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD": "1024", "MPI_PROVIDER": "cxi",
    "FI_CXI_DEFAULT_CQ_SIZE": "1048576", "FI_CXI_OFLOW_BUF_SIZE": "8388608", "FI_CXI_CQ_FILL_PERCENT": "30",
    "FI_CXI_RX_MATCH_MODE": "hybrid", "FI_MR_CACHE_MONITOR": "userfaultfd", "FI_MR_ZE_CACHE_MONITOR_ENABLED": "0",
    "PALS_PING_PERIOD": "240", "PALS_RPC_TIMEOUT": "240",
    "ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1",  # tile t = GPU t // 2, in PCI order
}
AURORA_UNSET = ["MPIR_CVAR_CH4_POSIX_COLL_SELECTION_TUNING_JSON_FILE", "MPIR_CVAR_CH4_COLL_SELECTION_TUNING_JSON_FILE",
                "MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE", "CCL_WORKER_AFFINITY", "ZE_AFFINITY_MASK"]


def test_aurora(scheduler):
    # as the frameworks module leaves them: FI_PROVIDER set, MPICH's tuning files and oneCCL's
    # worker affinity that ALCF's page unsets
    module_env = {"FI_PROVIDER": "cxi", "CCL_WORKER_AFFINITY": "1,2,3", **{k: "/x.json" for k in AURORA_UNSET[:3]}}
    p, lines = scheduler("aurora.sh", "03_ddp.py", "--model", "gpt2", env=module_env)
    assert p.returncode == 0, p.stderr
    assert any("module load frameworks" in line for line in lines)
    line = launch_line(lines, "mpiexec")
    assert line.startswith("mpiexec -n 24 --ppn 12 --cpu-bind list:4-7:8-11:12-15:16-19:20-23:24-27:"
                           "56-59:60-63:64-67:68-71:72-75:76-79 python 03_ddp.py --model gpt2 |")
    env = scheduler.launch["env"]
    assert {k: env.get(k) for k in AURORA_ENV} == AURORA_ENV
    assert [k for k in AURORA_UNSET if k in env] == []
    assert_ranks_sit_next_to_their_devices("aurora", scheduler.launch)
    # oneCCL's workers go to the last cores of each socket when CCL_WORKER_AFFINITY is unset:
    # no rank is bound there
    assert max(max(r["cores"]) for r in scheduler.launch["ranks"]) < 80


FRONTIER_ENV = {  # OLCF's PyTorch-on-Frontier guide, "RCCL Environment Variables"
    "NCCL_CROSS_NIC": "1", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_SOCKET_IFNAME": "hsn0,hsn1,hsn2,hsn3",
    "HSA_FORCE_FINE_GRAIN_PCIE": "1", "FI_MR_CACHE_MONITOR": "kdreg2", "FI_CXI_DISABLE_HOST_REGISTER": "1",
    "FI_CXI_DEFAULT_CQ_SIZE": "131072", "FI_CXI_RDZV_PROTO": "alt_read", "FI_CXI_RDZV_EAGER_SIZE": "0",
    "FI_CXI_RDZV_THRESHOLD": "0", "FI_CXI_RDZV_GET_MIN": "0", "FI_CXI_DEFAULT_TX_SIZE": "2048",
    "FI_CXI_RX_MATCH_MODE": "hybrid",
}


def test_frontier(scheduler, tmp_path):
    # the rccl-net-plugin module puts the plugin on LD_LIBRARY_PATH (emulated here)
    plugin = tmp_path / "rccl-net-plugin" / "lib"
    plugin.mkdir(parents=True)
    (plugin / "librccl-net.so").write_text("")
    p, lines = scheduler("frontier.sh", "03_ddp.py", "--model", "gpt2", kind="slurm",
                         env={"LD_LIBRARY_PATH": f"/opt/rocm/lib:{plugin}"})
    assert p.returncode == 0, p.stderr
    modules = [line.split(" |")[0] for line in lines if line.startswith("module load")]
    # OLCF's PyTorch page (2026-07-07): its batch script's modules, in its order
    assert modules == ["module load PrgEnv-gnu/8.7.0", "module load cpe/26.03", "module load miniforge3/23.11.0-0",
                       "module load rocm/7.1.1", "module load rccl-net-plugin", "module load craype-accel-amd-gfx90a"]
    line = launch_line(lines, "srun")
    assert line.startswith("srun -N 2 -n 16 -c7 --gpus-per-task=1 --gpu-bind=closest --kill-on-bad-exit=1 "
                           "python 03_ddp.py --model gpt2 |")
    assert line.endswith("MASTER_ADDR=nid001 MASTER_PORT=29742")
    env = scheduler.launch["env"]
    assert {k: env.get(k) for k in FRONTIER_ENV} == FRONTIER_ENV
    assert env["NCCL_NET_PLUGIN"] == f"{plugin}/librccl-net.so"
    assert str(plugin) in env["LD_LIBRARY_PATH"].split(":")
    assert env["NCCL_NET"] == "OFI" and "warning" not in p.stderr  # 2 nodes: the plugin or a refusal, never TCP
    # "Because using a non-default CPE": the Cray libraries of cpe/26.03 first
    p, _ = scheduler("frontier.sh", "03_ddp.py", kind="slurm", launch_only=True,
                     env={"LD_LIBRARY_PATH": "/opt/rocm/lib", "CRAY_LD_LIBRARY_PATH": "/opt/cray/pe/lib64"})
    assert scheduler.launch["env"]["LD_LIBRARY_PATH"].split(":")[-2:] == ["/opt/cray/pe/lib64", "/opt/rocm/lib"]


def test_frontier_plugin_of_your_own_and_none(scheduler, tmp_path):
    # RCCL_NET_PLUGIN_DIR: your own build's install prefix (OLCF's manual build)
    (tmp_path / "aws-ofi-nccl" / "lib").mkdir(parents=True)
    (tmp_path / "aws-ofi-nccl" / "lib" / "librccl-net.so").write_text("")
    p, _ = scheduler("frontier.sh", "03_ddp.py", kind="slurm", launch_only=True,
                     env={"RCCL_NET_PLUGIN_DIR": str(tmp_path / "aws-ofi-nccl"), "LD_LIBRARY_PATH": ""})
    env = scheduler.launch["env"]
    assert p.returncode == 0 and env["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path / "aws-ofi-nccl" / "lib")
    assert env["NCCL_NET_PLUGIN"] == str(tmp_path / "aws-ofi-nccl" / "lib" / "librccl-net.so")
    assert "" not in env["LD_LIBRARY_PATH"].split(":")  # an empty entry would mean the working directory
    # no plugin anywhere: a warning, and NCCL_NET=OFI makes RCCL stop rather than use TCP sockets
    p, _ = scheduler("frontier.sh", "03_ddp.py", kind="slurm", launch_only=True, env={"LD_LIBRARY_PATH": ""})
    assert p.returncode == 0 and "warning: no aws-ofi-rccl plugin" in p.stderr
    assert scheduler.launch["env"]["NCCL_NET"] == "OFI" and "NCCL_NET_PLUGIN" not in scheduler.launch["env"]
    # one node: nothing leaves it, and OLCF's network does not set the plugin up there
    p, lines = scheduler("frontier.sh", "03_ddp.py", kind="slurm", nodes=1, launch_only=True, env={"LD_LIBRARY_PATH": ""})
    assert p.returncode == 0 and "warning" not in p.stderr and scheduler.launch["env"]["NCCL_NET"] == "Socket"
    assert launch_line(lines, "srun").startswith("srun -N 1 -n 8 ")


def test_frontier_jobs_ask_for_the_rendezvous_network():
    """FI_CXI_RDZV_PROTO=alt_read needs `#SBATCH --network=disable_rdzv_get` in the header
    Slurm reads, which for frontier_3d.sh is its own, not frontier.sh's."""
    for script in ("frontier.sh", "frontier_3d.sh"):
        assert "\n#SBATCH --network=disable_rdzv_get\n" in open(os.path.join(ROOT, "jobs", script)).read(), script


def test_perlmutter(scheduler):
    p, lines = scheduler("perlmutter.sh", "03_ddp.py", kind="slurm")
    assert p.returncode == 0, p.stderr
    assert any("module load pytorch" in line for line in lines)
    line = launch_line(lines, "srun")
    assert line.startswith("srun -N 2 -n 8 --ntasks-per-node 4 -c 32 --cpu-bind=cores --gpus-per-node 4 "
                           "--gpu-bind=none --kill-on-bad-exit=1 python 03_ddp.py |")
    assert line.endswith("MASTER_ADDR=nid001 MASTER_PORT=29742")
    env = scheduler.launch["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0" and env["FI_MR_CACHE_MONITOR"] == "userfaultfd"
    assert_ranks_sit_next_to_their_devices("perlmutter", scheduler.launch)


SOURCED = re.compile(r"^#\s+\[([\w-]+)\]\s+(\S+)")
ENVIRONMENT = re.compile(r"(?:^|[|&;]\s*|\bthen\s+|\belse\s+)\s*(export\s|unset\s|module\s+(?:load|use)\s|conda\s+activate)", re.M)


def uncited_environment_lines(text, sources):
    """The lines of a job script that set its environment (export, unset, module load/use,
    conda activate) without naming a source in brackets, or naming one that `sources` (tag ->
    its definition: a URL and the date it was read, or this project's own reason) lacks."""
    bad = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not ENVIRONMENT.search(line):
            continue
        tags = re.findall(r"\[([\w-]+)\]", line.partition(" # ")[2] or line.partition("  #")[2])
        if not tags or any(t not in sources for t in tags):
            bad.append(line)
    return bad


def sources_of(text):
    """{tag: its definition} from a script's header, each a `#   [tag]  URL` line and the
    comment lines that continue it."""
    found, tag = {}, None
    for line in text.splitlines():
        m = SOURCED.match(line)
        if m:
            tag = m.group(1)
            found[tag] = line
        elif tag and re.match(r"^#\s{4,}\S", line):
            found[tag] += "\n" + line
        else:
            tag = None
    return found


@pytest.mark.parametrize("script", [s for s in SCRIPTS if ENVIRONMENT.search(re.sub(r"(?m)^\s*#.*$", "", open(s).read()))],
                         ids=os.path.basename)
def test_every_environment_line_cites_its_source(script):
    """Each export, unset and module line of a job script names, in brackets, a source defined
    in its header (or in jobs/lib.sh, which it sources): the facility's page with the date and
    commit it was read at, or this project's own reason."""
    text = open(script).read()
    sources = sources_of(text)
    if "jobs/lib.sh" in text:
        sources.update(sources_of(open(os.path.join(ROOT, "jobs", "lib.sh")).read()))
    for tag, definition in sources.items():
        assert re.search(r"\d{4}-\d{2}-\d{2}", definition), f"{script}: [{tag}] says when it was read"
        assert "https://" in definition or (tag == "here" and "jobs/README.md" in definition), (script, definition)
    assert uncited_environment_lines(text, sources) == [], script


def test_the_citation_check_sees_a_missing_or_unknown_source():
    sources = {"alcf-nccl": "#   [alcf-nccl] https://docs.alcf.anl.gov/... 2026-11-25"}
    text = ("export NCCL_NET=x   # [alcf-nccl] fine\nexport FI_X=1   # no source\n"
            "[ -z \"$A\" ] || export B=$A  # [elsewhere] unknown\nmodule load foo\n# export C=1 (a comment)\n")
    assert uncited_environment_lines(text, sources) == [
        "export FI_X=1   # no source", "[ -z \"$A\" ] || export B=$A  # [elsewhere] unknown", "module load foo"]


@pytest.mark.parametrize("script, kind", [("polaris.sh", "pbs"), ("aurora.sh", "pbs"), ("frontier.sh", "slurm"),
                                          ("perlmutter.sh", "slurm")])
def test_gpu_jobs_keep_their_flight_recorder_dumps(scheduler, script, kind):
    """NCCL's watchdog ends a hung job from C++: these variables make it write every rank's
    Flight Recorder buffer first, on the shared file system, for `python plot.py --hangs`."""
    p, _ = scheduler(script, "03_ddp.py", kind=kind, launch_only=True)
    assert p.returncode == 0, p.stderr
    env = scheduler.launch["env"]
    folder = os.path.join(ROOT, "logs", "fr-" + ("1234.polaris-pbs" if kind == "pbs" else "4242"))
    try:
        assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert env["TORCH_FR_DUMP_TEMP_FILE"] == folder + "/rank_" and os.path.isdir(folder)
        # G10: the names torch read before the rename, alike; G4: NCCL and RCCL connect at init
        assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"]
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == folder + "/rank_"
        assert env.get("NCCL_RUNTIME_CONNECT") == (None if script == "aurora.sh" else "0"), script
        assert f"python plot.py --hangs {folder}" in p.stdout
    finally:
        shutil.rmtree(folder, ignore_errors=True)


COMMUNICATION = re.compile(r"^\s*(?:export|unset)\s+(NCCL_|RCCL_|FI_|CCL_|MPIR_|MPI_|PALS_|ZE_|HSA_|MASTER_|CUDA_VISIBLE)")


@pytest.mark.parametrize("script", ["polaris.sh", "aurora.sh", "frontier.sh", "perlmutter.sh", "polaris_gpu_affinity.sh"])
def test_every_communication_variable_has_its_comment(script):
    lines = open(os.path.join(ROOT, "jobs", script)).read().splitlines()
    for i, line in enumerate(lines):
        if COMMUNICATION.match(line) or COMMUNICATION.match(line.split("|| ")[-1]):
            assert " # " in line or lines[i - 1].lstrip().startswith("#"), f"{script}: {line}"


def test_named_scripts(scheduler):
    p, lines = scheduler("polaris_ddp.sh", "--max_iters", "7")
    assert p.returncode == 0, p.stderr
    assert "python 03_ddp.py --model gpt2 --data synthetic --global_batch_size 96 --micro_batch_size 12 " \
           "--max_iters 500 --max_iters 7 |" in launch_line(lines, "mpiexec")
    # perlmutter_fsdp.sh and frontier_3d.sh: their launch lines in the test below


JOBS = [  # every named job, and every machine script with its default ARGS
    ("polaris.sh", "pbs", 8), ("aurora.sh", "pbs", 24), ("frontier.sh", "slurm", 16),
    ("perlmutter.sh", "slurm", 8), ("polaris_ddp.sh", "pbs", 8), ("perlmutter_fsdp.sh", "slurm", 16),
    ("frontier_3d.sh", "slurm", 16), ("polaris_cp.sh", "pbs", 8), ("frontier_moe.sh", "slurm", 16),
]


HELPERS = ("lib.sh", "local.sh", "polaris_gpu_affinity.sh")  # sourced, local, or run by mpiexec per rank


def test_every_job_is_listed():
    assert sorted(j[0] for j in JOBS) == sorted(os.path.basename(s) for s in SCRIPTS if not s.endswith(HELPERS))


@pytest.mark.parametrize("script, kind, world", JOBS, ids=[j[0] for j in JOBS])
def test_every_job_configuration_dry_runs_clean(scheduler, script, kind, world):
    """The job's own python line, validated by the training script for the job's world size:
    model, layout, batch and data all fit (this is how frontier_3d.sh's GPT-2 XL with 25 heads
    at tp 4 was found)."""
    p, lines = scheduler(script, kind=kind)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "dry run: " in p.stdout and f"on {world} rank(s)" in p.stdout, p.stdout
    assert "per rank:" in p.stdout and "holds model state in all" in p.stdout
    for expected in LAUNCHED.get(script, ()):
        assert expected in launch_line(lines, "srun" if kind == "slurm" else "mpiexec") + p.stdout, expected


LAUNCHED = {  # what some jobs' launch lines and dry runs must say
    "perlmutter_fsdp.sh": ["srun -N 4 -n 16 ", "python 05_fsdp.py --model gpt2-xl --replicate 4"],  # 4 nodes
    "frontier_3d.sh": ["-n 16 ", "python 08_3d.py --tp 4 --pp 2 --model gpt3-xl",
                       "16 ranks = 2 data-parallel x 2 pipeline x 4 tensor-parallel"],
    "frontier_moe.sh": ["-n 16 ", "python 10_expert_parallel.py --ep 8 --model gpt2 --n_expert 8",
                        "2 expert-parallel group(s) of 8 ranks, 1 of 8 experts per rank"],
}


def test_a_job_whose_configuration_does_not_fit_fails_in_its_dry_run(scheduler):
    # (the job sends the script's stderr through tee into its log and stdout)
    p, _ = scheduler("polaris.sh", "06_tensor_parallel.py", "--model", "gpt2-xl")
    assert p.returncode == 2 and "error: n_head 25 is not divisible by the tensor-parallel size 8" in p.stdout
    p, _ = scheduler("polaris.sh", "08_3d.py", "--tp", "4", "--model", "gpt2-xl")
    assert p.returncode == 2 and "error: n_head 25 is not divisible by tp 4" in p.stdout


@pytest.mark.parametrize("script, kind, flags, message", [
    ("polaris.sh", "pbs", ["--tp", "8"], "--tp 8 does not divide the 4 ranks per node"),
    ("aurora.sh", "pbs", ["--tp=5"], "--tp 5 does not divide the 12 ranks per node"),
    ("frontier.sh", "slurm", ["--tp", "8", "--pp", "3"], "--tp 8 x --pp 3 = 24 does not divide the world size 16"),
    ("perlmutter.sh", "slurm", ["--tp", "3"], "--tp 3 does not divide the 4 ranks per node"),
])
def test_layouts_that_do_not_fit_are_refused(scheduler, script, kind, flags, message):
    p, lines = scheduler(script, "03_ddp.py", *flags, kind=kind)
    assert p.returncode == 2 and message in p.stderr
    assert not any(line.startswith(("mpiexec", "srun")) for line in lines)


def test_missing_script_is_refused(scheduler):
    p, _ = scheduler("frontier.sh", "09_nothing.py", kind="slurm")
    assert p.returncode == 2 and "no training script 09_nothing.py" in p.stderr


def test_walltime_and_automatic_resume(scheduler, tmp_path):
    """PBS: --time_limit is the walltime (qstat) less a 5-minute margin; Slurm: SIGUSR1 three
    minutes before the walltime (the #SBATCH --signal line). Both add --resume once the run's
    out_dir holds a checkpoint, so resubmitting the same job continues the run."""
    qstat = tmp_path / "bin" / "qstat"
    qstat.write_text("#!/bin/bash\necho 'Job Id: 1234'\necho '    Resource_List.walltime = 01:00:00'\n")
    qstat.chmod(0o755)
    out = tmp_path / "out"
    p, lines = scheduler("polaris.sh", "03_ddp.py", "--out_dir", str(out))
    assert p.returncode == 0, p.stderr
    head, limit = launch_line(lines, "mpiexec").split(" |")[0].rsplit(" ", 1)
    # 60 minutes less the margin of 5 and the time the script has run, rounded down to whole
    # minutes: 55, or 54 once the script has run a second before asking (a slow machine)
    assert head.endswith(f"03_ddp.py --out_dir {out} --time_limit") and limit in ("55", "54"), limit
    out.mkdir()
    (out / "ckpt" / "step_4").mkdir(parents=True)
    (out / "ckpt" / "step_4" / "metadata.json").write_text("{}")  # a committed set (common.py's format)
    p, lines = scheduler("aurora.sh", "04_zero.py", f"--out_dir={out}", "--time_limit", "9")
    assert "resuming" in p.stdout
    assert launch_line(lines, "mpiexec").split(" |")[0].endswith(f"04_zero.py --out_dir={out} --time_limit 9 --resume")
    p, lines = scheduler("frontier.sh", "03_ddp.py", "--out_dir", str(out), "--resume", kind="slurm")
    assert launch_line(lines, "srun").split(" |")[0].endswith(f"03_ddp.py --out_dir {out} --resume")
    for script in SCRIPTS:
        text = open(script).read()
        assert ("#SBATCH" not in text) or "#SBATCH --signal=USR1@180" in text, script


def test_overwrite_through_a_job_script_is_not_given_resume_too(scheduler, tmp_path):
    """--overwrite replaces the run in out_dir: the job script must not add --resume to it
    (the scripts refuse the two together); without either, it adds --resume."""
    out = tmp_path / "out"
    (out / "ckpt" / "step_4").mkdir(parents=True)
    (out / "ckpt" / "step_4" / "metadata.json").write_text("{}")  # a committed set (common.py's format)
    for flag in ("--overwrite", "--resume"):
        p, lines = scheduler("frontier.sh", "03_ddp.py", "--out_dir", str(out), flag, kind="slurm", launch_only=True)
        assert p.returncode == 0 and "resuming" not in p.stdout, p.stdout + p.stderr
        assert launch_line(lines, "srun").split(" |")[0].endswith(f"03_ddp.py --out_dir {out} {flag}")
    p, lines = scheduler("frontier.sh", "03_ddp.py", "--out_dir", str(out), kind="slurm", launch_only=True)
    assert launch_line(lines, "srun").split(" |")[0].endswith(f"03_ddp.py --out_dir {out} --resume")

def local_env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV + ("OMP_NUM_THREADS",)}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"  # the venv's python, mpiexec/torchrun
    return env


def stopped_local_job(tmp_path, sig, close_reader=False):
    """`bash jobs/local.sh 2 03_ddp.py` on a long run, in a session of its own as a scheduler
    starts a job; once it trains, `sig` goes to every process of it at once (os.killpg: the
    job script, the launcher, the ranks, and tee), as PBS and Slurm do at walltime and a
    terminal's Ctrl-C does. close_reader: the reader of the job's output goes away first
    (`| head`). Returns (returncode, the lines read, the log's text, out_dir)."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    flags = TINY + ["--max_iters", "100000", "--lr_decay_iters", "100000", "--metrics", metrics, "--out_dir", out]
    job = subprocess.Popen(["bash", os.path.join(ROOT, "jobs", "local.sh"), "2", "03_ddp.py", *map(str, flags)],
                           env=local_env(), cwd=str(tmp_path), start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in job.stdout:  # until training is under way
            lines.append(line)
            if line.startswith("step 2:") or len(lines) > 200:
                break
        if close_reader:
            job.stdout.close()
        wait_for_rows(metrics, 4)
        os.killpg(job.pid, sig)
        if not close_reader:
            lines += job.stdout.readlines()
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    log = re.search(r", log (\S+)", "".join(lines))
    assert log, "".join(lines)
    return job.returncode, lines, open(log.group(1)).read(), out


def assert_stopped_with_a_checkpoint(returncode, lines, log, out, sig):
    stopped = [line for line in log.splitlines() if line.startswith("stopped after step")]
    assert returncode == 0 and len(stopped) == 1 and f"({sig.name})" in stopped[0], "".join(lines)[-3000:] + log[-3000:]
    assert committed(out) and "LOCK" not in os.listdir(out)
    return int(stopped[0].split()[3])


def test_sigterm_to_every_process_of_a_local_job_checkpoints_and_resumes(tmp_path):
    """At walltime PBS and Slurm send SIGTERM to every process of the job, tee included: the
    job script, tee and the launcher outlive it (jobs/lib.sh's run_logged), the ranks finish
    the step and commit a checkpoint, the job exits 0, and its log ends with the stop line.
    Resumed with --resume, the run continues from that step and ends with status 0: the local
    job really trained, on 2 replicas, and left a checkpoint that resumes. (The resume is
    forked: jobs/local.sh only passes --resume on, and a resume under a real launcher is
    test_reliability's; a second local job would cost two fresh interpreters.)"""
    returncode, lines, log, out = stopped_local_job(tmp_path, signal.SIGTERM)
    step = assert_stopped_with_a_checkpoint(returncode, lines, log, out, signal.SIGTERM)
    assert "".join(lines).endswith(log[-500:])  # the job's output got every line the log got
    assert "2 replicas" in log, log[-3000:]
    p = launch("03_ddp.py", [*TINY, "--max_iters", step + 2, "--lr_decay_iters", "100000", "--out_dir", out,
                             "--resume"], nprocs=2, launcher="fork").ok()
    assert f"resumed step {step} from" in p.stdout and f"step {step + 1}: loss" in p.stdout, p.stdout[-3000:]


def test_ctrl_c_to_a_local_job_whose_reader_went_away_still_checkpoints(tmp_path):
    """`bash jobs/local.sh ... | head`: the reader of the job's output exits mid-run, then Ctrl-C
    (SIGINT to the whole foreground process group): tee goes on writing the log (tee -p), the
    launcher's output never breaks, and the run stops with a checkpoint as at walltime. (One
    job for both cases: each local job starts fresh interpreters, seconds of CPU; the SIGTERM
    test above reads the output to the end.)"""
    assert_stopped_with_a_checkpoint(*stopped_local_job(tmp_path, signal.SIGINT, close_reader=True), signal.SIGINT)


def test_run_args_gives_02_neither_resume_nor_time_limit(tmp_path):
    """The doctor and the bench (02) keep no checkpoint and refuse --resume and --time_limit:
    run_args adds them to training scripts only, also where out/ holds a checkpoint."""
    (tmp_path / "out" / "ckpt" / "step_5").mkdir(parents=True)
    (tmp_path / "out" / "ckpt" / "step_5" / "metadata.json").write_text("{}")
    script = (f'. {os.path.join(ROOT, "jobs", "lib.sh")}; TIME_LIMIT_MINUTES=30; '
              'run_args 02_collectives.py --doctor; echo "${RUN_ARGS[*]}"; '
              'run_args 03_ddp.py --model gpt2; echo "${RUN_ARGS[*]}"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path).stdout.splitlines()
    assert out[0] == "02_collectives.py --doctor"
    assert out[-1].startswith("03_ddp.py --model gpt2") and "--time_limit 30" in out[-1]
