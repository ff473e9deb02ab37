"""The fork server the harness starts ranks with (tests/forkserver.py): a forked rank looks
like a fresh `python script` started by torchrun (or by nothing, for one process), and a job
ends and reports its status as under a real launcher. Every run here takes well under a
second: no rank imports torch."""

import json
import os
import signal
import textwrap
import time

import pytest

import harness
from harness import launch
from test_launch import probe_reports

REPORT = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    import infra.stop
    rank = int(os.environ.get("RANK", 0))
    handlers = {name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGPIPE", "SIGCHLD")}
    print("REPORT " + json.dumps(dict(
        argv=sys.argv, path0=sys.path[0], cwd=os.getcwd(), name=__name__, file=__file__, pid=os.getpid(),
        env={k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                            "MASTER_PORT", "OMP_NUM_THREADS", "GPTPAR_FORK_PROBE")},
        handlers=handlers, blocked=sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        stdin=os.readlink("/proc/self/fd/0"), since_start=time.monotonic() - infra.stop.STARTED,
        pgid=os.getpgid(0), threads=threading.active_count())), flush=True)
    print(f"rank {rank} to stderr", file=sys.stderr)
    code = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if rank == 1 and len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))  # the others are done: this one ends late
    sys.exit(code)
    """)


def script(tmp_path, text, name="probe.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def reports(run):
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in run.stdout.split("REPORT ")[1:]]


def test_a_rank_looks_like_a_fresh_interpreter_under_torchrun(tmp_path):
    cwd = tmp_path / "here"
    cwd.mkdir()
    path = script(tmp_path, REPORT)
    run = launch(path, ["0"], nprocs=3, launcher="fork", metrics=False, out_dir=False,
                 env={"GPTPAR_FORK_PROBE": "yes"}, cwd=str(cwd), timeout=60).ok()
    found = sorted(reports(run), key=lambda r: r["env"]["RANK"])
    assert [r["env"]["RANK"] for r in found] == ["0", "1", "2"]
    ports = {r["env"]["MASTER_PORT"] for r in found}
    assert len(ports) == 1 and int(ports.pop()) > 0
    assert len({r["pgid"] for r in found}) == 1 and len({r["pid"] for r in found}) == 3
    for r in found:
        assert r["argv"] == [path, "0"] and r["path0"] == str(tmp_path) and r["cwd"] == str(cwd)
        assert r["name"] == "__main__" and r["file"] == path
        assert r["env"]["WORLD_SIZE"] == r["env"]["LOCAL_WORLD_SIZE"] == "3" and r["env"]["LOCAL_RANK"] == r["env"]["RANK"]
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1" and r["env"]["OMP_NUM_THREADS"] == "1"
        assert r["env"]["GPTPAR_FORK_PROBE"] == "yes"
        assert r["handlers"] == {"SIGINT": str(signal.default_int_handler), "SIGTERM": str(signal.SIG_DFL),
                                 "SIGUSR1": str(signal.SIG_DFL), "SIGPIPE": str(signal.SIG_IGN),
                                 "SIGCHLD": str(signal.SIG_DFL)}
        assert r["blocked"] == [] and r["stdin"] == "/dev/null" and r["threads"] == 1
        assert 0 <= r["since_start"] < 5  # infra.stop.STARTED: this rank's start, not the server's
        assert r["pgid"] != os.getpgid(0)  # the job's own group
    assert sorted(run.stderr.splitlines()) == ["rank 0 to stderr", "rank 1 to stderr", "rank 2 to stderr"]
    assert run.seconds < 10


def test_one_process_is_a_plain_python_script(tmp_path):
    run = launch(script(tmp_path, REPORT), [], nprocs=1, launcher="fork", metrics=False, out_dir=False,
                 timeout=60).ok()
    (r,) = reports(run)
    assert {k: v for k, v in r["env"].items() if v is not None} == {"OMP_NUM_THREADS": "1"}


def test_a_rank_ends_as_the_interpreter_would_without_undoing_the_servers_imports(tmp_path):
    """At its end a rank runs its script's atexit handlers, then the weakref finalizers its script
    registered, as an interpreter does; the finalizers alive in the server before the fork
    (torch.library's, which would deregister torch's every kernel, copying the server's pages
    to do it) are detached first. The server's objects are frozen out of the rank's collections."""
    text = textwrap.dedent("""
        import atexit, gc, weakref
        class Held:
            pass
        held = Held()
        weakref.finalize(held, print, "the script's finalizer ran", flush=True)
        atexit.register(lambda: print("alive at exit:", sum(f.alive for f in weakref.finalize._registry), flush=True))
        print("frozen:", gc.get_freeze_count() > 100_000, "collected:", gc.collect() >= 0, flush=True)
        """)
    run = launch(script(tmp_path, text), nprocs=1, launcher="fork", metrics=False, out_dir=False, timeout=60).ok()
    assert run.stdout.splitlines() == ["frozen: True collected: True", "alive at exit: 1", "the script's finalizer ran"]


def test_a_rank_reads_the_default_corpus_the_server_read(tmp_path):
    """The server makes the default corpus's tokens once (forkserver.warm); a rank's Data and
    model_config find them made (its first ask is a hit of the cache it inherited), the same
    tokens a fresh interpreter makes."""
    text = textwrap.dedent("""
        import common
        chars, tokens = common.shakespeare_tokens()
        info = common.shakespeare_tokens.cache_info()
        print("inherited:", info.hits, info.misses, len(chars), int(tokens[:1000].sum()), flush=True)
        """)
    run = launch(script(tmp_path, text), nprocs=1, launcher="fork", metrics=False, out_dir=False,
                 timeout=60).ok()
    import common
    chars, tokens = common.shakespeare_tokens()
    assert run.stdout.splitlines() == [f"inherited: 1 1 {len(chars)} {int(tokens[:1000].sum())}"], run.stdout


def test_a_rank_reimports_the_repositorys_modules_when_one_was_edited(tmp_path):
    import forkserver
    module = tmp_path / "module.py"
    module.write_text("x = 1\n")
    loaded = {"module": forkserver.file_stamp(str(module))}
    assert not forkserver.edited(loaded)
    module.write_text("x = 22\n")
    assert forkserver.edited(loaded)
    module.unlink()
    assert forkserver.edited(loaded)


def test_rendezvous_ledger_and_one_thread_per_rank():
    run = launch("tests/dist_probe.py", ["--device", "cpu"], nprocs=3, launcher="fork", metrics=False,
                 timeout=120).ok()
    found = probe_reports(run)
    assert [r["rank"] for r in found] == [0, 1, 2]
    for r in found:
        assert r["kind"] == "torchrun" and r["world_size"] == r["local_world_size"] == 3
        assert r["sum"] == 3 and r["comm"] == {"all_reduce": 4} and r["threads"] == 1


def test_exception_ends_the_job_with_the_traceback_of_the_script():
    run = launch("tests/dist_probe.py", ["--device", "cpu", "--raise_on_rank", "1", "--timeout", "60"],
                 nprocs=3, launcher="fork", metrics=False, timeout=120)
    assert run.returncode == 1 and run.seconds < 30
    assert "[rank 1] uncaught RuntimeError" in run.stderr and "deliberate failure on rank 1" in run.stderr
    assert "forkserver" not in run.stderr and "runpy" not in run.stderr  # as `python script` prints it


@pytest.mark.parametrize("codes, expected", [((2, 2, 2), 2), ((0, 3, 0), 3)])
def test_status_is_the_agreed_one_else_the_first_failure(tmp_path, codes, expected):
    text = "import os, sys\nsys.exit([%s][int(os.environ['RANK'])])\n" % ", ".join(map(str, codes))
    run = launch(script(tmp_path, text), nprocs=3, launcher="fork", metrics=False, out_dir=False, timeout=60)
    assert run.returncode == expected


def test_a_late_rank_gets_its_grace_then_the_status_is_the_first_failure(tmp_path):
    """Rank 1 still prints and exits with its own status within the grace period; a rank that
    hangs past it is ended (SIGTERM, then SIGKILL)."""
    path = script(tmp_path, REPORT)
    run = launch(path, ["2", "1.0"], nprocs=2, launcher="fork", metrics=False, out_dir=False, timeout=60)
    assert run.returncode == 2 and len(reports(run)) == 2 and "rank 1 to stderr" in run.stderr
    # a grace of 1 s instead of GRACE_S (10): the same path through the supervisor, 9 s sooner
    hang = "import os, sys, time\nif os.environ['RANK'] == '0': sys.exit(4)\nwhile True: time.sleep(1)\n"
    t0 = time.time()
    run = launch(script(tmp_path, hang, "hang.py"), nprocs=2, launcher="fork", metrics=False, out_dir=False,
                 timeout=120, grace=1.0)
    import forkserver
    assert run.returncode == 4 and 1.0 <= time.time() - t0 < 1.0 + forkserver.KILL_S + 5


def test_timeout_kills_the_whole_process_group(tmp_path):
    text = textwrap.dedent("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("PIDS", os.getpid(), child.pid, flush=True)
        time.sleep(600)
        """)
    t0 = time.time()
    run = launch(script(tmp_path, text), nprocs=2, launcher="fork", metrics=False, out_dir=False, timeout=1.5)
    assert run.returncode == "timeout" and time.time() - t0 < 15
    pids = [int(p) for line in run.stdout.splitlines() if line.startswith("PIDS") for p in line.split()[1:]]
    assert len(pids) == 4
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "processes outlived the job"


def test_the_server_holds_one_thread_and_is_restarted_when_it_dies(tmp_path):
    launch(script(tmp_path, "print('hi')\n"), launcher="fork", metrics=False, out_dir=False, timeout=60).ok()
    server = harness.FORK_SERVER.proc
    assert len(os.listdir(f"/proc/{server.pid}/task")) == 1
    server.kill()
    server.wait()
    run = launch(script(tmp_path, "print('again')\n"), launcher="fork", metrics=False, out_dir=False, timeout=60).ok()
    assert run.stdout == "again\n" and harness.FORK_SERVER.proc.pid != server.pid


def test_the_launcher_variable_names_the_default(monkeypatch):
    monkeypatch.setenv("GPTPAR_TEST_LAUNCHER", "torchrun")
    assert harness.chosen_launcher() == harness.default_launcher() == "torchrun"
    monkeypatch.setenv("GPTPAR_TEST_LAUNCHER", "fork")
    assert harness.chosen_launcher() == "fork" and harness.default_launcher() in ("mpiexec", "torchrun")
    monkeypatch.setenv("GPTPAR_TEST_LAUNCHER", "srun")
    with pytest.raises(ValueError, match="GPTPAR_TEST_LAUNCHER=srun"):
        harness.chosen_launcher()
