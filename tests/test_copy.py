"""Copy one script and it runs (issue "Copy one script"): every training script, copied with
common.py alone into an empty directory and its one tie to the run infrastructure replaced
(`from infra import Run` -> `from common import Run`), launches at its usual small layout
through a real launcher, in fresh interpreters that cannot import infra/, and trains with
01's per-step losses (the plain Run logs each step's loss: `step N: loss X, ...`)."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

from harness import ROOT, default_launcher, launch

FLAGS = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--data", "synthetic", "--eval_interval", "0",
         "--log_interval", "1", "--global_batch_size", "8", "--max_iters", "4", "--lr", "3e-3",
         "--warmup_iters", "2", "--timeout", "60", "--micro_batch_size", "2"]
MOE = ["--n_expert", "4", "--top_k", "2"]

# script, ranks, its flags: the layouts its own tests use most
CASES = [
    ("01_single_gpu.py", 1, ["--sample_tokens", "0"]),
    ("03_ddp.py", 2, []),
    ("04_zero.py", 2, ["--stage", "3"]),
    ("05_fsdp.py", 2, []),
    ("06_tensor_parallel.py", 2, ["--sequence_parallel"]),
    ("07_pipeline.py", 2, []),
    ("08_3d.py", 4, ["--tp", "2", "--pp", "2"]),
    ("09_context_parallel.py", 2, []),
    ("10_expert_parallel.py", 2, MOE + ["--ep", "2"]),
]

TIE = "from infra import Run  # the run infrastructure; `from common import Run` is the plain loop\n"


def plain_losses(stdout):
    return [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+),", stdout, re.M)]


@pytest.fixture(scope="module")
def references():
    """01's losses, dense and with experts (the full repository: the oracle)."""
    dense = launch("01_single_gpu.py", FLAGS + ["--sample_tokens", "0"]).ok().losses
    moe = launch("01_single_gpu.py", FLAGS + MOE + ["--sample_tokens", "0"]).ok().losses
    return {"dense": dense, "moe": moe}


@pytest.mark.parametrize("script,ranks,flags", CASES, ids=[c[0] for c in CASES])
def test_a_copied_script_trains_with_common_alone(tmp_path, references, script, ranks, flags):
    source = open(os.path.join(ROOT, script)).read()
    assert source.count(TIE) == 1, f"{script}: its one tie to infra is not the line {TIE.strip()!r}"
    top_level = [node for node in ast.parse(source).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in top_level if "infra" in ast.unparse(n)] == ["from infra import Run"], \
        f"{script} imports infra at module level besides the Run line (costs() imports it inside)"
    (tmp_path / script).write_text(source.replace(TIE, "from common import Run\n"))
    shutil.copy(os.path.join(ROOT, "common.py"), tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([script, "common.py"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if ranks == 1:
        cmd = [sys.executable, script]
    elif default_launcher() == "mpiexec":
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script]
    done = subprocess.run(cmd + FLAGS + flags, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert not (tmp_path / "out").exists(), "the plain copy wrote a checkpoint directory"
    losses = plain_losses(done.stdout)
    expected = references["moe" if "--n_expert" in flags else "dense"]
    assert len(losses) == len(expected) == 4, done.stdout
    # the plain line prints 4 decimals: equal to 01's losses to that precision
    assert losses == pytest.approx(expected, abs=2e-4), (losses, expected)
