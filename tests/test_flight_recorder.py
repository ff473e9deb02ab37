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
from common import make_parser, setup
from infra.cli import parse_args
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
