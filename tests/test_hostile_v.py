"""Hostile cases of the Reliability V round (issue 59) on 07's tables, plan.py --measured and
--json, an lr that overflows float32 and an update that overflows the weights (its checkpoint
refused), Ctrl-C while waiting for another host's lock and during the start-up imports (a
frozen peer in 10's all-to-all: tests/test_frozen.py): each ends in one `error:` line naming
the cause (exit 2 on every rank, 3 for the overflowed weights, 130 on Ctrl-C), or in the right
result."""

import json
import math
import os
import signal
import subprocess
import sys
import time
import types

import pytest

import plan
from harness import LAUNCHER_ENV, ROOT, TINY, command, default_launcher, dry, launch
from infra.cli import file_problem, shown
from infra.start import output_problems
from test_failures import refused
from test_reliability import rank_pids

TABLE = TINY + ["--n_layer", "8", "--global_batch_size", "24", "--max_iters", "3", "--micro_batch_size", "4",
                "--world_size", "2"]


def test_a_file_that_is_not_regular_or_too_large_is_refused_before_it_is_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes it: opening it to read would block for ever
    big = tmp_path / "big.csv"
    big.write_text("x" * 101)
    assert "is a FIFO" in file_problem(str(fifo), "--schedule_csv", 100)
    assert "is a device" in file_problem("/dev/zero", "--schedule_csv", 100)
    assert "is a directory" in file_problem(str(tmp_path), "--schedule_csv", 100)
    assert "no such file" in file_problem(str(tmp_path / "none"), "--schedule_csv", 100)
    assert "101 bytes, more than the 100" in file_problem(str(big), "--schedule_csv", 100)
    assert file_problem(str(big), "--schedule_csv", 101) is None


def test_hostile_text_is_shown_cut_and_escaped():
    assert shown("\ufeff0F0\n\x1b[2J") == "\\ufeff0F0\\n\\x1b[2J"  # nothing reaches the terminal raw
    line = shown("F" * 100_000)
    assert len(line) < 240 and line.endswith("... (100,000 characters)")
    assert len(shown("\x00" * 1000, limit=50)) < 80  # escaping never lengthens it past the cut


def test_schedule_tables_from_a_spreadsheet_or_a_hostile_path(tmp_path):
    """07's --schedule_csv: Excel's "CSV UTF-8" (a byte-order mark, CRLF, a trailing line of
    empty cells) runs; a blank line inside is named; a FIFO nobody writes, /dev/zero and an
    oversized file are refused before a byte is read; a 100,000-character cell is shown cut."""
    path = tmp_path / "zbv.csv"
    assert dry("07_pipeline.py", *TABLE, "--schedule", "zbv", "--write_schedule", path).returncode == 0
    rows = path.read_text().splitlines()
    excel = tmp_path / "excel.csv"
    excel.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows + [",,,", ""]).encode())
    assert dry("07_pipeline.py", *TABLE, "--schedule_csv", excel).returncode == 0
    (tmp_path / "gap.csv").write_text(f"{rows[0]}\n\n{rows[1]}\n")
    (tmp_path / "cell.csv").write_text(f"{rows[0]},{'F' * 100_000}\n{rows[1]}\n")
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge.csv", "wb") as f:
        f.truncate(65 * 2**20)  # sparse: nothing is written, and nothing must be read
    for name, reason in (("gap.csv", "the table has 3 rows, one per rank, for 2 ranks (line 2 is empty)"),
                         ("cell.csv", "rank 0: not an action: 'FFFF"), ("fifo", "is a FIFO, not a regular file"),
                         ("huge.csv", "68,157,440 bytes, more than the 67,108,864")):
        p = dry("07_pipeline.py", *TABLE, "--schedule_csv", tmp_path / name)
        assert p.returncode == 2 and reason in p.stderr and len(p.stderr) < 400, p.stderr[-500:]
    p = dry("07_pipeline.py", *TABLE, "--schedule_csv", "/dev/zero")
    assert p.returncode == 2 and "/dev/zero is a device" in p.stderr


def test_write_schedule_is_checked_before_start_up_and_a_full_disk_is_one_agreed_line(tmp_path):
    """--write_schedule into a missing directory is found with the run's other outputs,
    before anything starts (a dry run too); a disk that fills at the write (/dev/full) ends
    every rank of a launch with the one line, exit 2."""
    flags = types.SimpleNamespace(metrics=None, export=None, write_schedule=str(tmp_path / "no" / "t.csv"),
                                  out_dir=str(tmp_path / "out"), resume=False)
    assert output_problems(flags) == f"--write_schedule {flags.write_schedule}: the directory {tmp_path / 'no'} " \
                                     "does not exist"
    p = dry("07_pipeline.py", *TABLE, "--write_schedule", flags.write_schedule)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "No such file or directory" in p.stderr
    run = launch("07_pipeline.py", TINY + ["--n_layer", "2", "--global_batch_size", "4", "--max_iters", "1",
                                           "--write_schedule", "/dev/full"], nprocs=2, timeout=120)
    refused(run, "--write_schedule /dev/full: ")  # root: no space left at the write; others: refused at start-up


@pytest.mark.parametrize("fit", [{"alpha_s": 1e308, "beta_GBps": 25.0}, {"alpha_s": 5e-6, "beta_GBps": 1e-308}])
def test_plan_refuses_a_measured_link_no_network_has_and_writes_strict_json(tmp_path, fit, capsys):
    """plan.py --measured: a latency of 1e308 s or a bandwidth of 1e-308 GB/s (finite, but no
    network's) is one line, exit 2, before any planning; --json never holds Infinity or NaN."""
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps({"machine": None, "links": {"intra": dict(fit, group_size=2)}}))
    with pytest.raises(SystemExit) as stop:
        plan.main(["--model", "gpt2", "--gpus", "4", "--machine", "polaris", "--measured", str(path), "--json"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "are not a network's" in err
    assert plan.strict_json({"step_time_s": math.inf, "mfu": [math.nan, 0.5]}) == '{"step_time_s": null, "mfu": [null, 0.5]}'


def test_an_lr_beyond_float32_is_one_line_before_anything_starts():
    """--lr 1e39 (AdamW or Muon: the same parse) was a RuntimeError traceback at the first step
    (the optimizers take the lr as a float32 scalar); 1e36 stops as non-finite (test_failures)."""
    p = dry("03_ddp.py", *TABLE[:-2], "--world_size", "2", "--optimizer", "muon", "--lr", "1e39")
    assert p.returncode == 2 and p.stderr == "error: --lr 1e+39 is beyond float32's range (at most 3.4e38): " \
                                             "no step can be taken with it\n"


def test_weights_left_non_finite_by_the_last_step_are_one_line_not_a_sampling_traceback():
    """01 --lr 1e36 at one step: the step's loss and norm are finite, its update is not, and
    01's sample at the end used to die in torch.multinomial (probability tensor contains inf)."""
    run = launch("01_single_gpu.py", [*TINY, "--max_iters", "1", "--lr", "1e36", "--sample_tokens", "3"])
    assert run.returncode == 3 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.error_lines == ["error: the model's logits are not finite after its last step (too large an --lr?): "
                               "no sample"], run.stderr[-2000:]


def test_a_checkpoint_of_weights_the_last_update_overflowed_is_refused_and_the_good_one_kept(tmp_path):
    """--lr 1e36 at one step: the step's loss and gradient are finite, so the guard lets the
    update through, and it leaves the weights near 1e34 or more (finite, but no logit is). The final
    checkpoint of such weights was committed over the last good one; now every rank refuses it
    before writing a byte (infra.checkpoint's shared save path): one line, exit 3, the good
    set untouched. 01 alone, and 03 at 2 ranks (another run's set: --overwrite)."""
    out = tmp_path / "out"
    launch("01_single_gpu.py", [*TINY, "--max_iters", "1", "--ckpt_interval", "1", "--out_dir", out]).ok()
    good = out / "ckpt" / "step_1"
    before = {f: (good / f).read_bytes() for f in sorted(os.listdir(good))}
    for script, nprocs in (("01_single_gpu.py", 1), ("03_ddp.py", 2)):
        run = launch(script, [*TINY, "--max_iters", "1", "--lr", "1e36", "--ckpt_interval", "1", "--overwrite",
                              "--out_dir", out], nprocs=nprocs)
        refused(run, "not writing the checkpoint of step 1: model/transformer.", status=3)
        assert "(too large an --lr?); the last good checkpoint, " in run.error_lines[0], run.error_lines
        assert f"{good}, is kept" in run.error_lines[0] and "(beyond 1.8e+19: their products overflow)" in \
            run.error_lines[0], run.error_lines
        assert sorted(os.listdir(out / "ckpt")) == ["step_1"], os.listdir(out / "ckpt")
        assert {f: (good / f).read_bytes() for f in sorted(os.listdir(good))} == before


INTERRUPT_AT_IMPORT = """
import os, runpy, signal, sys
module, script = sys.argv[1], sys.argv[2]
class CtrlC:  # a Ctrl-C just as `module` starts to be imported
    def find_spec(self, name, path=None, target=None):
        if name == module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal starts it (a background shell ignores it)
sys.meta_path.insert(0, CtrlC())
sys.argv, sys.path[0] = sys.argv[2:], os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
"""


def test_ctrl_c_during_the_start_up_imports_is_one_line_and_130():
    """Ctrl-C in the seconds a rehearsal (or any run of a numbered script) spends importing
    torch, before its own handlers are up, was KeyboardInterrupt's traceback: the script now
    imports infra first, whose handler makes it one line and 130. The signal is sent as
    torch's import begins (a meta-path hook), so the run never gets further."""
    p = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, "torch", os.path.join(ROOT, "03_ddp.py"),
                        *TINY, "--rehearse", "roles", "--world_size", "8"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": ROOT}, stdin=subprocess.DEVNULL)
    assert p.returncode == 130 and p.stderr == "error: interrupted (SIGINT) during start-up: nothing was started\n", \
        (p.returncode, p.stderr[-2000:])
    assert p.stdout == ""


def test_ctrl_c_while_waiting_for_another_hosts_lock_is_one_line_and_130(tmp_path):
    """X52: rank 0 waits for the lock of a job on another host (a killed job's heartbeat may
    still be fresh) while the others wait for its verdict. Ctrl-C (SIGINT to every rank, and
    once more as mpiexec forwards it) ends every rank with 130, one line, no traceback, and
    the other job's lock left as it was."""
    out = tmp_path / "out"
    out.mkdir()
    holder = json.dumps({"host": "elsewhere", "pid": 1, "job": "41"})
    (out / "LOCK").write_text(holder)
    marker = f"--out_dir={out}"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    with open(tmp_path / "err", "w") as err:
        job = subprocess.Popen(command("03_ddp.py", 2, default_launcher()) + TINY + ["--max_iters", "2", marker],
                               env=env, stdout=subprocess.PIPE, stderr=err, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "waiting up to" not in (tmp_path / "err").read_text():
            time.sleep(0.2)
        pids = rank_pids(marker)
        assert sorted(pids) == [0, 1], (tmp_path / "err").read_text()[-2000:]
        t0 = time.time()
        for _ in range(2):
            for pid in pids.values():
                os.kill(pid, signal.SIGINT)
            time.sleep(0.05)
        job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    stderr = (tmp_path / "err").read_text()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert job.returncode == 130 and len(errors) == 1 and "interrupted (SIGINT) while waiting" in errors[0], stderr
    assert "Traceback" not in stderr and time.time() - t0 < 20
    assert (out / "LOCK").read_text() == holder and sorted(os.listdir(out)) == ["LOCK"]
