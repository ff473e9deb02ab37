"""Hostile cases of the Reliability V round (issue 59) on 07's tables, plan.py --measured and
--json, an lr that overflows float32, Ctrl-C while waiting for another host's lock, and a
frozen peer in 10's all-to-all: each ends in one `error:` line naming the cause (exit 2 on
every rank, 130 on Ctrl-C), or in the right result."""

import os

from infra.cli import file_problem, shown


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
