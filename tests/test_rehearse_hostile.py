"""--rehearse held to the training scripts' standard (issue 59): bad settings are one line
naming the cause, exit 2, before anything runs; Ctrl-C ends it and its workers at once; the
symmetry and the replay take memory linear in the world's size.

  * GPTPAR_REHEARSAL_WORKERS=2.5 through a launch: one line naming it, exit 2, nothing
    rehearsed; abc and 0, and --metrics / GPTPAR_REHEARSAL_POSTS into a missing directory, a
    directory or an unwritable file, checked in this process (infra.rehearsal's
    rehearsal_settings, which the rehearsal calls first);
  * with GPTPAR_REHEARSAL_POSTS set, a refused symmetry writes the rehearsed ranks' orders
    and says why, where it crashed ('NoneType' ... items);
  * Ctrl-C (SIGINT to the process group, as a terminal sends it) during a rehearsal with forked
    workers: exit 130, one line, no worker left;
  * the symmetry of a data-parallel mesh of 65,536 ranks in a few MiB (each moved order keeps
    the ranks it names, not a permutation of the world: 65,536 x 65,536 integers was the
    MemoryError), and the replay's memory per rank a constant; a symmetry the host cannot hold
    (each order naming 65,536 ranks) refused in one line naming the size;
  * plan.py --rehearse when nothing fits says so (exit 1); with --measured it rehearses the
    measured plan's recommendation."""

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from types import SimpleNamespace

import pytest

from harness import ROOT, TINY, launch
from test_rehearse import rehearse


def test_a_bad_worker_count_is_one_line_naming_it_before_anything_runs():
    run = launch("03_ddp.py", [*TINY, "--rehearse", "all", "--world_size", "4"], metrics=False,
                 env={"GPTPAR_REHEARSAL_WORKERS": "2.5"})
    assert run.returncode == 2 and run.error_lines == [
        "error: GPTPAR_REHEARSAL_WORKERS='2.5': expected a whole number of worker processes, 1 or more "
        "(unset: one per CPU)"], run.stderr[-2000:]
    assert "rehearsal:" not in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("case", ["workers abc", "workers 0", "metrics missing directory", "metrics a directory",
                                  "posts missing directory", "posts a directory", "posts unwritable", "same file"])
def test_the_rehearsals_settings_and_outputs_are_checked_first(tmp_path, monkeypatch, capsys, case):
    from infra.rehearsal import rehearsal_settings
    monkeypatch.delenv("GPTPAR_REHEARSAL_WORKERS", raising=False)
    monkeypatch.delenv("GPTPAR_REHEARSAL_POSTS", raising=False)
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):  # (fail() prints on rank 0)
        monkeypatch.delenv(name, raising=False)
    missing, folder, locked = tmp_path / "no" / "such.jsonl", tmp_path / "dir", tmp_path / "locked.json"
    folder.mkdir()
    locked.write_text("")
    locked.chmod(0o444)
    metrics, posts, workers, said = None, None, None, None
    if case.startswith("workers"):
        workers = case.split()[1]
        said = f"GPTPAR_REHEARSAL_WORKERS='{workers}': expected a whole number of worker processes"
    elif case.startswith("metrics"):
        metrics = str(missing if "missing" in case else folder)
        said = f"--metrics {metrics}: the directory" if "missing" in case else f"--metrics {metrics} is a directory"
    elif case == "same file":
        metrics = posts = str(tmp_path / "both")
        said = "--metrics and GPTPAR_REHEARSAL_POSTS name the same file"
    else:
        posts = str(missing if "missing" in case else folder if "directory" in case else locked)
        said = {"posts missing directory": f"GPTPAR_REHEARSAL_POSTS {posts}: the directory",
                "posts a directory": f"GPTPAR_REHEARSAL_POSTS {posts} is a directory",
                "posts unwritable": f"GPTPAR_REHEARSAL_POSTS {posts} cannot be written"}[case]
    if case == "posts unwritable" and os.access(locked, os.W_OK):
        pytest.skip("root writes a read-only file: permission bits do not stop it here")
    for name, value in (("GPTPAR_REHEARSAL_WORKERS", workers), ("GPTPAR_REHEARSAL_POSTS", posts)):
        if value is not None:
            monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as ended:
        rehearsal_settings(SimpleNamespace(metrics=metrics))
    err = capsys.readouterr().err.splitlines()
    assert ended.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: {said}"), err
    monkeypatch.setenv("GPTPAR_REHEARSAL_WORKERS", " 3 ")
    monkeypatch.setenv("GPTPAR_REHEARSAL_POSTS", str(tmp_path / "posts.json"))
    assert rehearsal_settings(SimpleNamespace(metrics=str(tmp_path / "m.jsonl"))) == (3, str(tmp_path / "posts.json"))


def test_a_refused_symmetry_writes_the_rehearsed_orders(tmp_path):
    """04's Muon owners post all-to-alls whose sizes differ per rank: the symmetry is refused,
    saying why (the one run of this refusal in the suite); with GPTPAR_REHEARSAL_POSTS set, the
    rehearsed ranks' orders are written and the run ends as without it."""
    posts = tmp_path / "posts.json"
    run, _ = rehearse(tmp_path, "04_zero.py", ["--optimizer", "muon", "--global_batch_size", "8", "--max_iters", "2"],
                      ranks="roles", world_size=4, env={"GPTPAR_REHEARSAL_POSTS": str(posts)})
    assert "replay: not done: rank 0's rehearsed posting order is not rank 3's moved through the mesh" in run.stdout, \
        run.stdout[-2000:]
    written = json.loads(posts.read_text())
    assert written["rehearsed"] == [0, 3] and sorted(written["posts"]) == ["0", "3"], sorted(written)
    assert all(written["posts"][r] for r in ("0", "3"))


def children_of(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def test_ctrl_c_ends_a_rehearsal_and_its_workers_at_once():
    """A rehearsal of 12 ranks, 2 forked workers; SIGINT to the whole process group (a terminal's
    Ctrl-C) once both workers run: exit 130 within seconds, one line, both workers gone. The
    guard's handler (a stop request, acted on after a step: a rehearsal's steps read 'nobody
    asked to stop') made it run to its end, exit 0."""
    env = {**os.environ, "GPTPAR_REHEARSAL_WORKERS": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    argv = [sys.executable, os.path.join(ROOT, "03_ddp.py"), *TINY, "--global_batch_size", "12", "--rehearse", "all",
            "--world_size", "12"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        deadline, workers = time.time() + 120, []
        while time.time() < deadline and p.poll() is None and len(workers) < 2:
            time.sleep(0.05)
            workers = children_of(p.pid)
        assert len(workers) == 2, (p.poll(), p.stderr.read() if p.poll() is not None else "")
        t0 = time.time()
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 130 and lines == ["error: interrupted by SIGINT: the rehearsal and its workers stopped"], \
        (p.returncode, err[-3000:])
    assert "rehearsal:" not in out and took < 10, (took, out[-2000:])
    for pid in workers:  # ended by their own handler or their parent's SIGKILL, and reaped
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] in "ZX", pid


def ddp_order(world, steps=2, per_step=25):
    """A data-parallel rank's posting order: its buckets' all-reduces on the world, the guard's."""
    order = []
    for _ in range(steps):
        order += [{"kind": "all_reduce", "group": "0", "ranks": world, "bytes": 4096, "desc": "world",
                   "where": "step"}] * per_step
        order.append({"kind": "all_reduce", "group": "1", "ranks": world, "bytes": 12, "desc": "guard",
                      "where": "step"})
    return order


def under_a_cap(fn, extra):
    """fn() in a forked child whose address space may grow by `extra` bytes at most (its
    MemoryError: False)."""
    import resource
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with open("/proc/self/statm") as f:
                size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (size + extra, resource.getrlimit(resource.RLIMIT_AS)[1]))
            code = 0 if fn() else 1
        except MemoryError:
            code = 3
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_the_symmetry_and_the_replay_take_memory_linear_in_the_world():
    """65,536 ranks of 03 by symmetry from ranks 0 and 65,535 (what `--rehearse roles` gives),
    in a child allowed 256 MiB more (a permutation per moved order was 65,536² integers: 32 GiB,
    the MemoryError); and the replay's peak per rank (traced) the same at 2,048 and 8,192 ranks,
    under 4 KiB (1.5 KiB when written)."""
    from infra.replay import replay, symmetric_posts

    def world_by_symmetry(n=65536):
        world = tuple(range(n))
        made = [("0", world, "world"), ("1", world, "guard")]
        full, how = symmetric_posts({0: ddp_order(world), n - 1: ddp_order(world)}, {0: made, n - 1: made}, n, [0])
        return len(full) == n and "65,534 by symmetry" in how and list(full[12345]) == ddp_order(world)
    assert under_a_cap(world_by_symmetry, 256 << 20) == 0
    per_rank = {}
    tracemalloc.start()
    try:
        for n in (2048, 8192):
            world = tuple(range(n))
            made = [("0", world, "world"), ("1", world, "guard")]
            full, _ = symmetric_posts({0: ddp_order(world, 1, 1), n - 1: ddp_order(world, 1, 1)},
                                      {0: made, n - 1: made}, n, [0])
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            assert replay(full).ok
            per_rank[n] = (tracemalloc.get_traced_memory()[1] - base) / n
    finally:
        tracemalloc.stop()
    assert per_rank[8192] < 1.25 * per_rank[2048] and per_rank[8192] < 4096, per_rank


# plan.py --rehearse: the tiny model on 2 GPUs (tests/test_plan.py's cluster)
PLAN = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--global_batch_size", "8", "--gpus", "2",
        "--gpus_per_node", "2", "--peak_tflops", "0.05", "--link_gbps", "1", "--rehearse"]


def test_plan_rehearse_says_when_nothing_fits_and_rehearses_the_measured_plan(tmp_path, capsys):
    """Nothing fits (1 MB GPUs): one line saying the rehearsal was not done, exit 1, where it
    did nothing, exit 0. With --measured: the measured plan's recommendation rehearsed, where
    --rehearse was ignored."""
    import plan
    with pytest.raises(SystemExit) as stop:
        plan.main([*PLAN, "--gpu_mem_gb", "0.001"])
    out = capsys.readouterr().out.splitlines()
    assert stop.value.code == 1 and out[-1] == "plan: --rehearse: not done: nothing fits, so there is no layout to " \
                                               "rehearse", out[-3:]
    measured = tmp_path / "doctor.json"
    measured.write_text(json.dumps({"machine": None, "links": {"intra": {"alpha_s": 5e-6, "beta_GBps": 0.5,
                                                                         "group_size": 2}}}))
    plan.main([*PLAN, "--gpu_mem_gb", "1", "--measured", str(measured), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["measured"]["file"] == str(measured) and doc["recommendation"]["script"] == "03_ddp.py"
    rehearsal = doc["rehearsal"]
    assert rehearsal["rehearsed"] and rehearsal["replayed"] and rehearsal["status"] == 0, rehearsal
    assert any(line.startswith("rehearsal: 03_ddp.py as rank(s) 0-1 of 2") for line in rehearsal["lines"]), rehearsal


def test_a_symmetry_too_big_for_the_host_is_refused_naming_the_size(monkeypatch):
    """An order naming every rank (an all-to-all over the world) at 65,536 ranks: each moved
    order would map 65,536 ranks (about 400 GiB): refused in one line with the size, at once."""
    import infra.replay
    n = 65536
    world = tuple(range(n))
    order = [{"kind": "all_to_all_single", "group": "0", "ranks": world, "bytes": 4 * n, "sent": [4] * n,
              "received": [4] * n, "desc": "world", "where": "step"}]
    made = [("0", world, "world")]
    monkeypatch.setattr(infra.replay, "available_bytes", lambda: 64 << 30)
    full, why = infra.replay.symmetric_posts({0: order, n - 1: order}, {0: made, n - 1: made}, n, [0])
    assert full is None and why.startswith("the symmetry would need about 400.1 GiB (65,534 ranks' orders, each "
                                           "naming 65,536 ranks), more than half the 64.0 GiB available"), why
