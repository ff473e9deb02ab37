"""Copy one script and it runs (issue "Copy one script"): every training script, copied with
common.py alone into an empty directory and its one tie to the run infrastructure replaced
(`from infra import Run` -> `from common import Run`), launches at its usual small layout
where infra/ cannot be imported, and trains with 01's per-step losses. 03's copy goes through
a real launcher in fresh interpreters, as a user starts it; the others are forked from the
fork server with the repository's modules dropped and its directories off sys.path
(harness.launch's isolated=True), which imports only what lies beside the copy, as a fresh
interpreter in that directory would, without each rank importing torch again (the plain Run logs each step's loss: `step N: loss X, ...`). The copy is
a complete program (issue "The lesson first", item 5): without data/ its default flags say so in
one line; it writes a checkpoint per rank at --ckpt_interval and resumes from it with the
uninterrupted run's losses; a flag of the run infrastructure is refused in one line."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from common import INFRA_FLAGS
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


def copy(tmp_path, script):
    """`script` with its tie switched, and common.py, alone in tmp_path."""
    source = open(os.path.join(ROOT, script)).read()
    assert source.count(TIE) == 1, f"{script}: its one tie to infra is not the line {TIE.strip()!r}"
    top_level = [node for node in ast.parse(source).body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n) for n in top_level if "infra" in ast.unparse(n)] == ["from infra import Run"], \
        f"{script} imports infra at module level besides the Run line (costs() imports it inside)"
    (tmp_path / script).write_text(source.replace(TIE, "from common import Run\n"))
    shutil.copy(os.path.join(ROOT, "common.py"), tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted([script, "common.py"])


def run_copy(tmp_path, script, ranks, args, ok=True, real=False):
    """The copy in tmp_path, where infra cannot be imported: forked as `python script` (one rank)
    or with torchrun's variables, isolated from the repository; real=True: launched as a user
    would, with python, mpiexec or torchrun, in fresh interpreters."""
    if not real:
        done = launch(str(tmp_path / script), args, nprocs=ranks, cwd=str(tmp_path), metrics=False, out_dir=False,
                      isolated=True)
        assert not ok or done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if ranks == 1:
        cmd = [sys.executable, script]
    elif default_launcher() == "mpiexec":
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script]
    done = subprocess.run(cmd + list(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert not ok or done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


# every copy forked (a second or two each) but 03's, through a real launcher as a user starts it
REAL_LAUNCHER = "03_ddp.py"


@pytest.mark.parametrize("script,ranks,flags", CASES, ids=[c[0] for c in CASES])
def test_a_copied_script_trains_with_common_alone(tmp_path, references, script, ranks, flags):
    copy(tmp_path, script)
    done = run_copy(tmp_path, script, ranks, FLAGS + flags, real=script == REAL_LAUNCHER)
    assert not (tmp_path / "out").exists(), "the plain copy wrote a checkpoint directory"
    losses = plain_losses(done.stdout)
    expected = references["moe" if "--n_expert" in flags else "dense"]
    assert len(losses) == len(expected) == 4, done.stdout
    # the plain line prints 4 decimals: equal to 01's losses to that precision
    assert losses == pytest.approx(expected, abs=2e-4), (losses, expected)


def test_a_copy_without_data_says_so_in_one_line(tmp_path):
    """The copy as issue 56 found it: 06 and common.py, no data/, default flags, on 2 ranks: each
    rank (its own exit status seen) exits 2; rank 0 says in one line what is missing and how to go
    on; no traceback. With infra beside it: the same line."""
    script = "06_tensor_parallel.py"
    copy(tmp_path, script)
    run = run_copy(tmp_path, script, 2, ["--device", "cpu"], ok=False)
    assert run.statuses == [2, 2], (run.statuses, run.stderr[-3000:])
    errors = run.stderr
    assert "Traceback" not in errors, errors
    lines = [line for line in errors.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --data shakespeare_char reads "), errors
    assert str(tmp_path / "data" / "tinyshakespeare.txt") in lines[0] and "copy data/" in lines[0], lines[0]
    # with the run infrastructure copied too (and the tie kept), the README's dry run says the same
    with_infra = tmp_path / "with_infra"
    with_infra.mkdir()
    shutil.copy(os.path.join(ROOT, script), with_infra)
    shutil.copy(os.path.join(ROOT, "common.py"), with_infra)
    shutil.copytree(os.path.join(ROOT, "infra"), with_infra / "infra", ignore=shutil.ignore_patterns("__pycache__"))
    dry = run_copy(with_infra, script, 1, ["--dry_run", "--world_size", "8"], ok=False)
    assert dry.returncode == 2 and dry.stderr.strip().splitlines() == [lines[0].replace(str(tmp_path),
                                                                                        str(with_infra))], dry.stderr


@pytest.mark.parametrize("script,ranks,flags", [("07_pipeline.py", 2, [])], ids=["07_pipeline.py"])
def test_a_copy_checkpoints_and_resumes_with_the_same_losses(tmp_path, script, ranks, flags):
    """nanoGPT's --out_dir, --ckpt_interval and --resume in the copy: one file per rank, read back
    with weights_only; 3 steps, then --resume to 6, log the uninterrupted run's 6 losses (to the
    plain line's 4 decimals); another layout is refused in one line that names infra."""
    copy(tmp_path, script)
    six = FLAGS[:FLAGS.index("--max_iters")] + ["--max_iters", "6", "--lr_decay_iters", "6"] \
        + FLAGS[FLAGS.index("--max_iters") + 2:] + flags
    whole = plain_losses(run_copy(tmp_path, script, ranks, six + ["--out_dir", "whole"]).stdout)
    first = run_copy(tmp_path, script, ranks, six + ["--out_dir", "cut", "--ckpt_interval", "3", "--max_iters", "3"])
    assert sorted(os.listdir(tmp_path / "cut")) == [f"plain_ckpt_rank{r}.pt" for r in range(ranks)], first.stdout
    for r in range(ranks):
        held = torch.load(tmp_path / "cut" / f"plain_ckpt_rank{r}.pt", weights_only=True)  # no pickled objects
        assert held["step"] == 3 and held["layout"]["world_size"] == ranks, held.keys()
    again = run_copy(tmp_path, script, ranks, six + ["--out_dir", "cut", "--ckpt_interval", "3", "--resume"])
    assert "resumed step 3" in again.stdout, again.stdout
    assert len(whole) == 6 and plain_losses(first.stdout) + plain_losses(again.stdout) == whole, (first.stdout, again.stdout)
    fresh = run_copy(tmp_path, script, ranks, six + ["--out_dir", "cut", "--ckpt_interval", "3"], ok=False)
    assert fresh.returncode == 2 and "--overwrite" in fresh.stderr, fresh.stderr
    other = run_copy(tmp_path, script, 1, six + ["--out_dir", "cut", "--resume"], ok=False)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr
    errors = [line for line in other.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another layout" in errors[0] and "infra" in errors[0], other.stderr


def test_where_the_copies_run_infra_cannot_be_imported(tmp_path):
    """What makes the forked copies' proof: beside common.py alone, the script with its tie kept
    (`from infra import Run`) fails at that import, and common is the copy's own file."""
    script = "03_ddp.py"
    shutil.copy(os.path.join(ROOT, script), tmp_path)
    shutil.copy(os.path.join(ROOT, "common.py"), tmp_path)
    kept = run_copy(tmp_path, script, 1, ["--help"], ok=False)
    assert kept.returncode == 1 and "ModuleNotFoundError: No module named 'infra'" in kept.stderr, kept.stderr[-2000:]
    (tmp_path / "which.py").write_text("import common\nprint(common.__file__)\n")
    assert run_copy(tmp_path, "which.py", 1, []).stdout == f"{tmp_path / 'common.py'}\n"


def usage_flags(text):
    """The flags argparse's usage line lists (--help), in order."""
    return re.findall(r"\[(--\w+)", text.split("\n\n")[0])


def test_an_infra_flag_in_a_copy_is_refused_in_one_line(tmp_path):
    """The README's dry run in a copy: refused in one line naming infra, not argparse's
    "unrecognized arguments"; and the flags a copy refuses are exactly those the repository's
    scripts have and a copy has not (common.INFRA_FLAGS, as the README lists them)."""
    script = "03_ddp.py"
    copy(tmp_path, script)
    done = run_copy(tmp_path, script, 1, ["--dry_run", "--world_size", "8", "--metrics=m.jsonl"], ok=False)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == ["error: --dry_run --world_size --metrics need infra, the run "
                                                "infrastructure: copy the infra package (infra/) beside this script "
                                                "and import Run from it"], done.stderr
    typo = run_copy(tmp_path, script, 1, ["--maxiters", "3"], ok=False)  # not infra's: argparse's own line
    assert typo.returncode == 2 and "unrecognized arguments: --maxiters 3" in typo.stderr, typo.stderr
    repo = launch(script, ["--help"], metrics=False, out_dir=False, cwd=str(tmp_path)).ok().stdout
    plain = run_copy(tmp_path, script, 1, ["--help"]).stdout
    dropped = [flag for flag in usage_flags(repo) if flag not in usage_flags(plain)]
    assert sorted(dropped) == sorted(f"--{name}" for name in INFRA_FLAGS), (dropped, INFRA_FLAGS)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert all(flag in readme for flag in dropped), [flag for flag in dropped if flag not in readme]
