"""Every bug of the zoo (tests/bug_zoo.py, docs/bugs.md) applied to a copy of its script, and
the check it names run at the smallest layout that shows it: the test passes only when the
check FAILS the way the zoo says (a check is trusted once it has been seen to fail). A bug no
check catches yet is a strict xfail whose reason says which check must grow.

    tmp/  common.py  infra.py  the script (one bug applied)    ->  harness.launch (fork server)
                                                              ->  the check: oracle, ledger, NCCL
                                                                  replay, hang report, checksum,
                                                                  refusal, crash

Each run is two or three steps of the tiny model at one or two ranks (the fork server starts a
rank in milliseconds), against 01_single_gpu.py's losses for the same flags."""

import glob
import os
import shutil

import pytest
import torch

import nccl_replay
from bug_zoo import BUGS, CHECKSUM, CRASH, HANG, LEDGER, NCCL, ORACLE, REFUSAL, RESUME
from harness import ROOT, TINY, assert_losses_match, launch

BASE = TINY + ["--max_iters", "3", "--lr_decay_iters", "3", "--micro_batch_size", "2", "--grad_clip", "0.05"]

# the flags of a bug's layout that change 01's losses too (the reference is run with them)
MODEL_FLAGS = {"--grad_clip", "--n_expert", "--top_k", "--n_layer", "--dropout"}


def apply(bug, directory):
    """A copy of the bug's script with its edits, beside common.py and infra.py; each edit's
    `old` must occur exactly once in today's script."""
    source = open(os.path.join(ROOT, bug.script)).read()
    for old, new in bug.edits:
        assert source.count(old) == 1, \
            f"{bug.name}: {bug.script} holds {source.count(old)} copies of {old!r}: the zoo has drifted"
        source = source.replace(old, new)
    for name in ("common.py", "infra.py"):
        shutil.copy(os.path.join(ROOT, name), directory)
    path = os.path.join(directory, bug.script)
    with open(path, "w") as f:
        f.write(source)
    return path


_references = {}


def reference(flags):
    """01's run for the flags among `flags` that change the losses (cached per session)."""
    wanted = []
    for i, flag in enumerate(flags):
        if flag in MODEL_FLAGS:
            wanted.append(flag)
            if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
                wanted.append(flags[i + 1])
    key = tuple(wanted)
    if key not in _references:
        _references[key] = launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"] + wanted).ok()
    return _references[key]


def oracle_message(ref, run, what):
    """The oracle's first line when the losses differ; None when it passes."""
    try:
        assert_losses_match(ref, run, what=what)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None


def flip_a_bit(out_dir):
    """One bit of one float of transformer.h.0.mlp.c_fc.weight in the newest set's rank0.pt."""
    sets = sorted(glob.glob(os.path.join(out_dir, "ckpt", "step_*", "metadata.json")))  # committed sets
    rank0 = os.path.join(os.path.dirname(sets[-1]), "rank0.pt")
    weight = torch.load(rank0, weights_only=True)["model/transformer.h.0.mlp.c_fc.weight#0"]
    data = bytearray(open(rank0, "rb").read())
    at = data.find(weight.reshape(-1)[:16].numpy().tobytes())  # the tensor's bytes in the zip
    assert at > 0
    data[at + 8 * 4 + 2] ^= 0x10  # one bit of the 9th element
    open(rank0, "wb").write(bytes(data))
    return rank0


def caught(bug, tmp_path):
    """Run the bug's check on its mutated copy; returns what the check printed first (it must
    have fired), or raises AssertionError saying how the bug slipped through."""
    script = apply(bug, str(tmp_path))
    flags = BASE + list(bug.flags)
    out = str(tmp_path / "out")
    what = f"{bug.name} ({bug.script} {' '.join(bug.flags)})"

    if bug.check == CHECKSUM:  # the script as it is writes a checkpoint; the file is damaged after
        launch(script, flags + ["--sample_tokens", "0", "--max_iters", "2", "--ckpt_interval", "2",
                                "--out_dir", out], nprocs=bug.ranks).ok()
        rank0 = flip_a_bit(out)
        run = launch(script, flags + ["--sample_tokens", "0", "--resume", "--out_dir", out], nprocs=bug.ranks)
        assert run.returncode == 2, f"{what}: the damaged checkpoint resumed ({run.returncode})\n{run.stderr[-2000:]}"
        line = run.error_lines[0]
        assert rank0 in line
        return line

    if bug.check == NCCL:  # gloo runs it; the recorded posting order is replayed under NCCL's rules
        record = tmp_path / "record"
        recorder = os.path.join(ROOT, "tests", "nccl_replay.py")
        launch(recorder, [record, script] + flags + ["--max_iters", "1"], nprocs=bug.ranks).ok()
        result = nccl_replay.replay(nccl_replay.read_records(record))
        assert not result.ok, f"{what}: its posting order replays under NCCL's rules"
        return result.report().splitlines()[0]

    if bug.check == RESUME:  # the bug writes the checkpoint; 01 at one rank resumes it
        first = launch(script, flags + ["--out_dir", out], nprocs=bug.ranks).ok()
        second = launch("01_single_gpu.py", BASE + ["--sample_tokens", "0", "--resume", "--out_dir", out]).ok()
        assert len(first.losses) == 2 and len(second.losses) == 1
        first.metrics += second.metrics
        message = oracle_message(reference(list(bug.flags)), first, what + " resumed by 01")
        assert message, f"{what}: 01 resumed its checkpoint with 01's losses"
        return message

    run = launch(script, flags, nprocs=bug.ranks, timeout=120)
    if bug.check in (ORACLE, LEDGER):
        run.ok()
        message = oracle_message(reference(list(bug.flags)), run, what)
        if bug.check == ORACLE:
            assert message, f"{what}: the losses are 01's"
            return message
        # the ledger: right losses, wrong bytes, said on stderr by every rank that differs
        assert message is None, f"{what}: the ledger's bug changed the losses: {message}"
        lines = [line for line in run.stderr.splitlines() if line.startswith("ledger mismatch")]
        assert lines, f"{what}: the ledger found the bytes equal to the formulas"
        return ([line for line in lines if line.startswith("ledger mismatch on rank 0:")] or lines)[0]
    if bug.check == REFUSAL:
        assert run.returncode == 2 and run.error_lines, f"{what}: no refusal ({run.returncode})\n{run.stderr[-2000:]}"
        return run.error_lines[0]
    if bug.check == HANG:
        assert run.returncode not in (0, "timeout"), f"{what}: the job ended with {run.returncode}"
        lines = [line for line in run.stderr.splitlines() if " was in " in line and "when it failed" in line]
        assert lines, f"{what}: no rank named the collective it was in\n{run.stderr[-3000:]}"
        return lines[0]
    assert bug.check == CRASH, bug.check
    assert run.returncode not in (0, "timeout"), f"{what}: the job ended with {run.returncode}"
    lines = [line for line in run.stderr.splitlines() if bug.first_line in line]
    assert lines, f"{what}: the job failed without {bug.first_line!r}\n{run.stderr[-3000:]}"
    return lines[0]


@pytest.mark.parametrize("bug", [pytest.param(b, id=b.name, marks=[pytest.mark.xfail(strict=True, reason=b.slips)]
                                              if b.slips else []) for b in BUGS])
def test_the_check_catches_the_bug(bug, tmp_path):
    first_line = caught(bug, tmp_path)
    print(f"{bug.name}: {first_line}")  # (pytest -s shows what each check printed)
    assert bug.first_line in first_line, \
        f"{bug.name}: {bug.check} fired, but its first line is {first_line!r}, not {bug.first_line!r}"


def test_the_zoo_is_whole():
    """At least 24 bugs, every name once, every check named, every script a numbered one."""
    assert len(BUGS) >= 24
    assert len({b.name for b in BUGS}) == len(BUGS)
    for b in BUGS:
        assert b.check in (ORACLE, RESUME, LEDGER, NCCL, HANG, CHECKSUM, REFUSAL, CRASH), b
        assert b.script[:2].isdigit() and os.path.exists(os.path.join(ROOT, b.script)), b
        assert b.edits or b.damage, f"{b.name}: neither an edit nor damage"
        assert b.origin and b.symptom and b.first_line, b
