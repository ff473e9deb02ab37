"""Hangs on GPUs: torch's Flight Recorder, read back as one line per rank.

On NCCL a collective returns at once and the Python line of a timed-out collective never
appears: NCCL's watchdog ends the process and, with the job scripts' TORCH_FR_* variables,
dumps every rank's Flight Recorder buffer first. torch 2.13's gloo records the same entries,
so this test makes a real 3-rank gloo job stall (rank 2 stops before a collective, --timeout
3), lets its ranks leave their dumps (the waiting ranks at their timeout, infra's report; the
stopped rank when it sees theirs, as NCCL's monitor thread does when the store signals a
timeout) and the ledger's trail beside them, and checks what `python plot.py --hangs DIR`
says about each rank."""

import os
import pickle
import subprocess
import sys

from harness import ROOT, launch

PROBE = '''
import datetime, glob, os, sys, time
import torch
import torch.distributed as dist
from common import make_parser
from infra.cli import parse_args
from infra.launch import setup
from infra.ledger import LEDGER, dump_flight_recorder, flight_recorder_prefix

args = parse_args(make_parser("a stalled job"))
env = setup(args)
LEDGER.install()
# a sub-group with the job's --timeout (new_group's default is torch's 30 minutes)
pair = dist.new_group([1, 2], timeout=datetime.timedelta(seconds=args.timeout), group_desc="pair")
x = torch.ones(4)
for step in range(3):
    LEDGER.step, LEDGER.phase = step, "step"  # as Run sets them: the forward of step `step`
    if step == 2 and env.rank == 2:  # rank 2 stops here (a stuck data loader, a slow disk, a bug)
        prefix = flight_recorder_prefix()
        deadline = time.time() + 60
        while len(glob.glob(prefix + "[01]")) < 2 and time.time() < deadline:
            time.sleep(0.1)
        dump_flight_recorder()  # as NCCL's monitor thread does when the others time out
        sys.exit(1)
    dist.all_reduce(x, group=dist.group.WORLD)  # ranks 0 and 1 time out here at step 2
    LEDGER.phase = "optimizer"
    if env.rank in (1, 2):
        dist.all_reduce(x, group=pair)
'''


def test_a_stalled_gloo_job_is_one_line_per_rank(tmp_path):
    probe, dumps = tmp_path / "stall_probe.py", tmp_path / "fr"
    probe.write_text(PROBE)
    run = launch(str(probe), ["--device", "cpu", "--timeout", "2"], nprocs=3, metrics=False, out_dir=False,
                 env={"TORCH_FR_DUMP_TEMP_FILE": f"{dumps}/rank_", "TORCH_FR_BUFFER_SIZE": "2000"}, timeout=120)
    assert run.returncode not in (0, "timeout") and run.seconds < 60, run.stderr[-3000:]
    # the Python line of gloo's timeout is still there
    assert "rank 0 was in all_reduce #3 on group world, step 2, forward when it failed" in run.stderr, run.stderr[-3000:]
    assert sorted(os.listdir(dumps)) == ["ledger.0.jsonl", "ledger.1.jsonl", "ledger.2.jsonl",
                                         "rank_0", "rank_1", "rank_2"]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), "--hangs", str(dumps)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "rank 0 waits in operation #3 (all_reduce) on group world, posted at step 2, phase forward",
        "rank 1 waits in operation #3 (all_reduce) on group world, posted at step 2, phase forward",
        "rank 2 waits in no operation: it has not posted #3 on group world, which rank(s) 0, 1 wait in; "
        "its last was #2 (all_reduce) on group pair, posted at step 1, phase optimizer",
        "the hang: rank(s) 2 never posted #3 on group world",
    ], p.stdout

    # G9: rank 2's dump without entries (a recorder that saw none of the run's collectives) is
    # said to be empty, never read as a rank that waits in no operation
    saved = (dumps / "rank_2").read_bytes()
    (dumps / "rank_2").write_bytes(pickle.dumps({**pickle.loads(saved), "entries": []}))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), "--hangs", str(dumps)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.splitlines()[2].startswith(
        "rank 2: its dump holds no entries (its recorder saw none of this run's collectives"), p.stdout
    assert "waits in no operation" not in p.stdout and "never posted" not in p.stdout, p.stdout

    # without rank 2's dump (its process was killed first) and without rank 1's trail: said so
    os.remove(dumps / "rank_2")
    os.remove(dumps / "ledger.1.jsonl")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), "--hangs", str(dumps)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.splitlines() == [
        "rank 0 waits in operation #3 (all_reduce) on group world, posted at step 2, phase forward",
        "rank 1 waits in operation #3 (all_reduce) on group world, posted at an unknown step and phase (no ledger trail)",
        "rank 2: no dump (its process ended before it could write one)",
        "the hang: every rank with a dump posted what the others wait in; rank(s) 2 left none: look at its log first",
    ], p.stdout


class _Executes:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_hangs_refuses_what_is_not_a_dump_in_one_line(tmp_path):
    """A dump is read without running code: a pickle that names any object is refused."""
    def hangs(folder):
        return subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), "--hangs", str(folder)],
                              capture_output=True, text=True, timeout=60)
    (tmp_path / "rank_0").write_bytes(pickle.dumps(_Executes()))
    p = hangs(tmp_path)
    assert p.returncode == 2 and "pwned" not in p.stdout and p.stderr.count("\n") == 1
    assert p.stderr.startswith(f"error: {tmp_path}/rank_0 is not a Flight Recorder dump (refusing posix.system")
    p = hangs(tmp_path / "nothing")
    assert p.returncode == 2 and p.stderr == f"error: --hangs {tmp_path}/nothing: no such directory\n"


# --------------------------------------------------------------------------------------
# Dumps as other torch versions, full disks and second runs leave them (one process, no launch)
# --------------------------------------------------------------------------------------

def entry(seq, group="0", desc="default_pg", op="all_reduce", t_ns=1000, record=None, p2p=False, **more):
    e = dict(record_id=seq if record is None else record, process_group=[group, desc], collective_seq_id=seq,
             p2p_seq_id=0, is_p2p=p2p, profiling_name=f"gloo:{op}", time_created_ns=t_ns, state="scheduled")
    e.update(more)
    return e


def write_dump(folder, rank, entries, pg_config=None):
    folder.mkdir(exist_ok=True)
    (folder / f"rank_{rank}").write_bytes(pickle.dumps({"entries": entries, "pg_config": pg_config or {}}))


def hangs(folder):
    import plot
    return plot.hang_lines(str(folder))


def test_older_and_odd_dumps_are_read_where_they_can_be_and_the_rest_named(tmp_path):
    """torch before collective_seq_id (seq_id), entries without a process group, string
    entries, a string time and a pg_config nested thousands deep: read, never a traceback."""
    old = [{k: v for k, v in entry(s).items() if k != "collective_seq_id"} | {"seq_id": s} for s in (1, 2)]
    nested = {"0": {"ranks": "[" * 5000 + "]" * 5000}, "1": [[[[1]]]]}
    write_dump(tmp_path, 0, old + ["a string entry", {"record_id": 9, "collective_seq_id": 3}], pg_config=nested)
    write_dump(tmp_path, 1, [entry(1, t_ns="1000")])
    lines = hangs(tmp_path)
    assert lines[:2] == ["rank 0 waits in operation #2 (all_reduce) on group world, posted at an unknown step and "
                         "phase (no ledger trail)",
                         "rank 1 waits in no operation: it has not posted #2 on group world, which rank(s) 0 wait in; "
                         "its last was #1 (all_reduce) on group world, posted at an unknown step and phase "
                         "(no ledger trail)"], lines
    assert "note: rank 0: 2 of 4 Flight Recorder entries not read (no process group or sequence number: " \
           "another torch's format)" in lines


def test_hangs_is_linear_in_the_entries(tmp_path):
    """50,000 entries per rank (a larger TORCH_FR_BUFFER_SIZE), p2p among them: seconds, not hours."""
    import time
    for rank in (0, 1):
        write_dump(tmp_path, rank, [entry(i // 2 + 1, p2p=True, op="send", p2p_seq_id=i // 2 + 1, record=i)
                                    if i % 2 else entry(i // 2 + 1, record=i) for i in range(50_000 - rank)])
    t0 = time.perf_counter()
    lines = hangs(tmp_path)
    assert time.perf_counter() - t0 < 10 and lines[-1].startswith("the hang"), lines


def test_an_earlier_runs_dump_is_not_read_as_this_runs_and_a_cut_trail_line_loses_only_itself(tmp_path):
    """Two runs into one folder: rank 0's dump is the first run's (written before this run's
    trail began), so it is named, not read; the trail's last line, cut by a full disk, is skipped."""
    write_dump(tmp_path, 0, [entry(1, t_ns=10)])
    os.utime(tmp_path / "rank_0", ns=(50, 50))
    now = 10**18
    write_dump(tmp_path, 1, [entry(1, t_ns=now + 5), entry(2, t_ns=now + 7)])
    for rank in (0, 1):
        (tmp_path / f"ledger.{rank}.jsonl").write_text(
            f'{{"group": "0", "name": "world", "ranks": [0, 1]}}\n{{"t_ns": {now}, "step": 4, "phase": "forward"}}\n'
            f'{{"t_ns": {now + 6}, "step": 4, "phase": "backward"}}\n{{"t_ns": {now + 8}, "st')
    lines = hangs(tmp_path)
    assert lines[0] == "rank 1 waits in operation #2 (all_reduce) on group world, posted at step 4, phase backward", lines
    assert f"rank 0: no dump of this run (its dump {tmp_path}/rank_0 was written before this run began: an earlier " \
           "run's, not read)" in lines
    assert f"note: {tmp_path}/ledger.1.jsonl: line 4 not a trail line (cut, or not JSON): skipped" in lines


def test_a_fifo_or_device_among_the_dumps_is_named_not_read(tmp_path):
    write_dump(tmp_path, 0, [entry(1)])
    os.mkfifo(tmp_path / "rank_1")  # nobody writes it: reading it would wait for ever
    os.symlink("/dev/zero", tmp_path / "ledger.0.jsonl")
    lines = hangs(tmp_path)
    assert f"note: {tmp_path}/rank_1 is a FIFO, not a Flight Recorder dump: not read" in lines, lines
    assert f"note: {tmp_path}/ledger.0.jsonl is a device, not a ledger trail: not read" in lines, lines


def test_two_runs_outside_a_scheduler_leave_their_dumps_apart(tmp_path):
    """jobs/lib.sh: without a job id ("fr-local", "fr-") each run's folder is named by its start."""
    def folder(base):
        p = subprocess.run(["bash", "-c", f"source {ROOT}/jobs/lib.sh && flight_recorder {base} && "
                            'echo "$TORCH_FR_DUMP_TEMP_FILE"'], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        return p.stdout.splitlines()[-1]
    first, second = folder(tmp_path / "fr-local"), folder(tmp_path / "fr-local")
    assert first != second and first.startswith(f"{tmp_path}/fr-local-") and first.endswith("/rank_")
    assert folder(tmp_path / "fr-").startswith(f"{tmp_path}/fr-2") and folder(tmp_path / "fr-77") == f"{tmp_path}/fr-77/rank_"
