"""jobs/: every submit script parses, launches the right line under a fabricated scheduler
environment (module, conda and scontrol replaced by stubs that record their arguments;
mpiexec and srun by a stand-in that records its line and then really runs the job's python
command as `--dry_run --world_size N --ranks_per_node R`, so the job's own configuration is
validated by the script itself), refuses layouts that do not fit, and jobs/local.sh really
trains."""

import glob
import os
import re
import subprocess
import sys

import pytest

from harness import ROOT

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "jobs", "*.sh")))
STUB = """#!/bin/bash
echo "$(basename "$0") $* | MASTER_ADDR=${MASTER_ADDR:-} MASTER_PORT=${MASTER_PORT:-}" >> "$RECORD"
[ "$(basename "$0")" != scontrol ] || for i in $(seq 1 "$NODES"); do printf 'nid%03d\\n' "$i"; done
"""
# mpiexec / srun: record the line, then dry-run the python command it launches at its size
LAUNCHER = """#!{python}
import os, subprocess, sys
name, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["RECORD"], "a") as f:
    f.write(f"{{name}} {{' '.join(argv)}} | MASTER_ADDR={{os.environ.get('MASTER_ADDR', '')}} "
            f"MASTER_PORT={{os.environ.get('MASTER_PORT', '')}}\\n")
command = argv[argv.index("python") + 1:]
launcher = argv[:argv.index("python")]
def value(*flags):
    for i, a in enumerate(launcher):
        if a in flags:
            return int(launcher[i + 1])
world = value("-n", "--ntasks")
per_node = value("--ppn", "--ntasks-per-node") or world // (value("-N", "--nodes") or 1)
sys.exit(subprocess.call([sys.executable, *command, "--dry_run", "--world_size", str(world),
                          "--ranks_per_node", str(per_node)]))
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
        (stubs / name).write_text(LAUNCHER.format(python=sys.executable) if name in ("mpiexec", "srun") else STUB)
        (stubs / name).chmod(0o755)
    nodefile = tmp_path / "nodefile"
    record = tmp_path / "record"

    def run(script, *args, kind="pbs"):
        nodes = nodes_asked(script)  # the scheduler grants what the job's header asks for
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PBS_", "SLURM_"))}
        env.update(PATH=f"{stubs}:{env['PATH']}", RECORD=str(record), USER="tester", NODES=str(nodes))
        if kind == "pbs":
            nodefile.write_text("".join(f"x3001c0s13b{i}n0\n" for i in range(nodes)))
            env.update(PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=ROOT, PBS_JOBID="1234.polaris-pbs")
        else:
            env.update(SLURM_SUBMIT_DIR=ROOT, SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST=f"nid[001-{nodes:03d}]",
                       SLURM_JOB_ID="4242")
        p = subprocess.run(["bash", os.path.join(ROOT, "jobs", script), *args], env=env, cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=60)
        lines = record.read_text().splitlines() if record.exists() else []
        record.unlink(missing_ok=True)
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


def test_polaris(scheduler):
    p, lines = scheduler("polaris.sh", "03_ddp.py", "--model", "tiny")
    assert p.returncode == 0, p.stderr
    assert "module use /soft/modulefiles" in lines[0] and "module load conda" in lines[1]
    line = launch_line(lines, "mpiexec")
    assert line.startswith("mpiexec -n 8 --ppn 4 --depth 8 --cpu-bind depth python 03_ddp.py --model tiny |")
    assert "layout: 8 ranks = 8 data-parallel x 1 pipeline x 1 tensor-parallel" in p.stdout


def test_aurora(scheduler):
    p, lines = scheduler("aurora.sh", "03_ddp.py", "--model", "gpt2")
    assert p.returncode == 0, p.stderr
    assert any("module load frameworks" in line for line in lines)
    line = launch_line(lines, "mpiexec")
    assert line.startswith("mpiexec -n 24 --ppn 12 --cpu-bind list:1-8:9-16:17-24:25-32:33-40:41-48:"
                           "53-60:61-68:69-76:77-84:85-92:93-100 python 03_ddp.py --model gpt2 |")


def test_frontier(scheduler):
    p, lines = scheduler("frontier.sh", "03_ddp.py", "--model", "gpt2", kind="slurm")
    assert p.returncode == 0, p.stderr
    line = launch_line(lines, "srun")
    assert line.startswith("srun -N 2 -n 16 -c7 --gpus-per-task=1 --gpu-bind=closest --kill-on-bad-exit=1 "
                           "python 03_ddp.py --model gpt2 |")
    assert line.endswith("MASTER_ADDR=nid001 MASTER_PORT=29742")


def test_perlmutter(scheduler):
    p, lines = scheduler("perlmutter.sh", "03_ddp.py", kind="slurm")
    assert p.returncode == 0, p.stderr
    line = launch_line(lines, "srun")
    assert line.startswith("srun -N 2 -n 8 --ntasks-per-node 4 -c 32 --cpu-bind=cores --gpus-per-node 4 "
                           "--kill-on-bad-exit=1 python 03_ddp.py |")


def test_named_scripts(scheduler):
    p, lines = scheduler("polaris_ddp.sh", "--max_iters", "7")
    assert p.returncode == 0, p.stderr
    assert "python 03_ddp.py --model gpt2 --data synthetic --global_batch_size 96 --micro_batch_size 12 " \
           "--max_iters 500 --max_iters 7 |" in launch_line(lines, "mpiexec")
    # perlmutter_fsdp.sh and frontier_3d.sh: their launch lines in the test below


JOBS = [  # every named job, and every machine script with its default ARGS
    ("polaris.sh", "pbs", 8), ("aurora.sh", "pbs", 24), ("frontier.sh", "slurm", 16),
    ("perlmutter.sh", "slurm", 8), ("polaris_ddp.sh", "pbs", 8), ("perlmutter_fsdp.sh", "slurm", 16),
    ("frontier_3d.sh", "slurm", 16), ("polaris_cp.sh", "pbs", 8),
]


def test_every_job_is_listed():
    assert sorted(j[0] for j in JOBS) == sorted(os.path.basename(s) for s in SCRIPTS if not s.endswith(("lib.sh", "local.sh")))


@pytest.mark.parametrize("script, kind, world", JOBS, ids=[j[0] for j in JOBS])
def test_every_job_configuration_dry_runs_clean(scheduler, script, kind, world):
    """The job's own python line, validated by the training script for the job's world size:
    model, layout, batch and data all fit (this is how frontier_3d.sh's GPT-2 XL with 25 heads
    at tp 4 was found)."""
    p, lines = scheduler(script, kind=kind)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"dry run: " in p.stdout and f"on {world} rank(s)" in p.stdout, p.stdout
    assert "per rank:" in p.stdout and "holds model state in all" in p.stdout
    for expected in LAUNCHED.get(script, ()):
        assert expected in launch_line(lines, "srun" if kind == "slurm" else "mpiexec") + p.stdout, expected


LAUNCHED = {  # what some jobs' launch lines and dry runs must say
    "perlmutter_fsdp.sh": ["srun -N 4 -n 16 ", "python 05_fsdp.py --model gpt2-xl --replicate 4"],  # 4 nodes
    "frontier_3d.sh": ["-n 16 ", "python 08_3d.py --tp 4 --pp 2 --model gpt3-xl",
                       "16 ranks = 2 data-parallel x 2 pipeline x 4 tensor-parallel"],
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


def test_local_really_trains(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    p = subprocess.run(["bash", os.path.join(ROOT, "jobs", "local.sh"), "2", "03_ddp.py", "--model", "tiny",
                        "--device", "cpu", "--max_iters", "3", "--eval_interval", "0", "--log_interval", "1",
                        "--global_batch_size", "4", "--out_dir", str(tmp_path / "out")],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step 2: loss" in p.stdout and "2 replicas" in p.stdout


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
