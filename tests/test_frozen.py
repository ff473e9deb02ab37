"""A frozen peer (SIGSTOP: alive, its sockets open, silent) ends the job within about
--timeout, in the scripts whose collectives run on sub-groups: 05's all-gather on the shard
group, 09's ring of send/recv on the cp group, 10's all-to-all on the expert group. (torch
gives a group made by dist.new_group its own default timeout, 30 minutes on gloo, unless
common.setup hands it --timeout.) The other rank names the collective it was in and exits,
whether a tensor's or an object's (10 frozen inside the metrics' gather of a logged step);
the frozen one is killed by the test, as mpiexec or srun would kill it once a rank failed."""

import os
import signal
import threading
import time

import pytest

from harness import ROOT, TINY, launch

TIMEOUT = 2  # --timeout, seconds (tests/bug_zoo.py hangs 03 with 1)


def alive(pid):
    """Running or stopped, not yet exited (the fork server reaps its ranks only at the end)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def frozen_run(script, flags, tmp_path, step=1):
    """Run `script` on 2 ranks with rank 1 frozen after step `step` (tests/frozen_rank.py);
    returns (the run, seconds from the freeze until rank 0 had exited)."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    args = [1, step, piddir, os.path.join(ROOT, script)] + TINY + flags + ["--max_iters", 50, "--timeout", TIMEOUT]
    done = {}
    job = threading.Thread(target=lambda: done.update(run=launch("tests/frozen_rank.py", args, nprocs=2, timeout=120)))
    job.start()
    frozen, deadline = piddir / "frozen", time.time() + 100
    while not frozen.exists() and job.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert frozen.exists(), done.get("run") and done["run"].stderr[-3000:]
    froze = time.time()
    other = int((piddir / "rank0").read_text())
    while alive(other) and time.time() < froze + 60:
        time.sleep(0.05)
    waited = time.time() - froze
    os.kill(int(frozen.read_text()), signal.SIGKILL)  # as the launcher would, once a rank has failed
    job.join()
    return done["run"], waited


MOE = ["--n_expert", "2", "--top_k", "1", "--ep", "2"]


@pytest.mark.parametrize("script, flags, step, where", [
    ("05_fsdp.py", [], 1, "all_gather_into_tensor #"),
    ("09_context_parallel.py", ["--cp", "2", "--cp_impl", "ring"], 1, "batch_isend_irecv of 4 #"),
    ("10_expert_parallel.py", MOE, 1, "all_to_all_single #"),
    # X55: frozen between two steps' all-to-alls, inside the metrics' gather of a logged step
    # (an all_gather_object, which the ledger did not wrap): the job ended, but without the line
    ("10_expert_parallel.py", MOE, "1:gather", "all_gather_object on group world, step 1, optimizer"),
])
def test_a_frozen_peer_ends_the_job_within_the_timeout(tmp_path, script, flags, step, where):
    run, waited = frozen_run(script, flags, tmp_path, step)
    assert run.returncode not in (0, "timeout"), run.stderr[-3000:]
    assert waited < TIMEOUT + 15, f"rank 0 waited {waited:.0f} s for its frozen peer (--timeout {TIMEOUT})"
    said = [line for line in run.stderr.splitlines() if line.startswith("rank 0 was in ")]
    assert len(said) == 1 and where in said[0], run.stderr[-3000:]
    assert step != 1 or ", step 2, " in said[0], said
