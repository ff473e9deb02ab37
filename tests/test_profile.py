"""--profile STEPS: one Chrome trace per rank under OUT_DIR/profile/, holding the named steps and
the script's collectives under the ledger's names (infra.ledger's traced); off, a collective
passes straight through; a bad window is one line. One 2-rank launch of 03."""

import json

import pytest
import torch

from harness import TINY, launch
from infra.cli import profile_window
from infra.ledger import CommLedger


def test_every_rank_writes_a_trace_naming_the_ledgers_collectives(tmp_path):
    out = tmp_path / "out"
    run = launch("03_ddp.py", TINY + ["--max_iters", "4", "--profile", "1-2", "--out_dir", out], nprocs=2).ok()
    assert sorted(p.name for p in (out / "profile").iterdir()) == ["rank0.json", "rank1.json"]
    for rank in (0, 1):
        names = {event.get("name") for event in json.load(open(out / "profile" / f"rank{rank}.json"))["traceEvents"]}
        assert {"step 1", "step 2"} <= names and not {"step 0", "step 3"} & names
        ledger = {name for name in names if name and name.startswith("all_reduce[world] #")}
        assert len(ledger) >= 2, sorted(n for n in names if n and "all_reduce" in n)  # the gradient buckets, the loss
    assert "--profile: steps 1-2 traced" in run.stdout


def test_off_a_collective_is_not_wrapped(monkeypatch):
    ledger = CommLedger()
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: pytest.fail("profiled while off"))
    assert ledger.traced(lambda x: x + 1, 1) == 2
    ledger.profiling, ledger.label = True, "all_reduce[dp] #1"
    with pytest.raises(pytest.fail.Exception):
        ledger.traced(lambda x: x + 1, 1)


@pytest.mark.parametrize("spec, said", [("x", "name a step (5) or a range"), ("3-1", "name a step"),
                                        ("2-9", "the run's steps are 0..5")])
def test_a_bad_window_is_one_line(spec, said, capsys):
    with pytest.raises(SystemExit) as exit:
        profile_window(spec, 6)
    assert exit.value.code == 2 and said in capsys.readouterr().err
