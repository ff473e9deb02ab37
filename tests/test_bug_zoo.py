"""Every bug of the zoo (tests/bug_zoo.py, docs/bugs.md) applied to a copy of its script, and
the check it names run at the smallest layout that shows it: the test passes only when the
check FAILS the way the zoo says (a check is trusted once it has been seen to fail). A bug no
check catches yet is a strict xfail whose reason says which check must grow.

    tmp/  common.py  infra/  the script (one bug applied)    ->  harness.launch (fork server)
                                                              ->  the check: oracle, ledger, NCCL
                                                                  replay, hang report, checksum,
                                                                  refusal, crash

Each run is two or three steps of the tiny model at one or two ranks (the fork server starts a
rank in milliseconds), against 01_single_gpu.py's losses for the same flags."""

import dataclasses
import glob
import json
import os
import shutil

import pytest
import torch

import nccl_replay
from bug_zoo import BUGS, CHECKSUM, CRASH, HANG, LEDGER, NCCL, ORACLE, REFUSAL, RESUME, STREAMS
from harness import ROOT, TINY, assert_losses_match, launch

BASE = TINY + ["--max_iters", "3", "--lr_decay_iters", "3", "--micro_batch_size", "2", "--grad_clip", "0.05"]

# the flags of a bug's layout that change 01's losses too (the reference is run with them)
MODEL_FLAGS = {"--grad_clip", "--n_expert", "--top_k", "--n_layer", "--dropout"}


def apply(bug, directory):
    """A copy of the bug's script with its edits, beside common.py and infra/; each edit's
    `old` must occur exactly once in today's script."""
    source = open(os.path.join(ROOT, bug.script)).read()
    for old, new in bug.edits:
        assert source.count(old) == 1, \
            f"{bug.name}: {bug.script} holds {source.count(old)} copies of {old!r}: the zoo has drifted"
        source = source.replace(old, new)
    shutil.copy(os.path.join(ROOT, "common.py"), directory)
    shutil.copytree(os.path.join(ROOT, "infra"), os.path.join(directory, "infra"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(directory, bug.script)
    with open(path, "w") as f:
        f.write(source)
    return path


# What makes the ranks differ where a CPU run keeps them alike: the code each wrapper runs
# before the script (every rank imports it; the script then runs as __main__, as under
# `python script`).
PERTURBATIONS = {
    # Rank 1's gradients become ready in the reverse of the order its backward produced them:
    # every post-accumulate-grad hook is deferred to the end of backward (autograd's
    # queue_callback) and run there last-first, as when ranks' backward passes finish their
    # gradients in different orders (Li et al. 2020, §3.2.3). Code that launches in an order
    # of its own (03's buckets in index order) posts the same collectives; code that launches
    # as gradients arrive does not.
    "grad_ready_order_reversed_on_rank_1": '''
import os
import torch
from torch.autograd.variable import Variable

if os.environ.get("RANK") == "1":
    _register, _pending = torch.Tensor.register_post_accumulate_grad_hook, []

    def _flush():
        calls = _pending[::-1]
        _pending.clear()
        for hook, param in calls:
            hook(param)

    def _register_deferred(self, hook):
        def deferred(param):
            if not _pending:
                Variable._execution_engine.queue_callback(_flush)
            _pending.append((hook, param))
        return _register(self, deferred)
    torch.Tensor.register_post_accumulate_grad_hook = _register_deferred
''',
}

# The dropout-stream probe (the "streams" check): every rank records, for every dropout it
# draws in training, the state of the generator it draws from (a digest), so that the test can
# compare the ranks. In 06 without sequence parallelism, attention dropout acts inside this
# rank's heads (a sharded region: the TP ranks' streams must differ, or every rank drops the
# same positions of different heads) and every other dropout on the replicated residual stream
# (the streams must agree, or the replicas diverge).
STREAMS_PROBE = '''
import hashlib
import json
import os
import torch
import torch.nn.functional as F

_file = open(os.path.join(os.environ["ZOO_STREAMS"], "rank" + os.environ.get("RANK", "0") + ".jsonl"), "a")


def _record(kind):
    state = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
    _file.write(json.dumps({"kind": kind, "state": state}) + "\\n")
    _file.flush()


_attention, _dropout = F.scaled_dot_product_attention, F.dropout


def _scaled_dot_product_attention(*args, **kwargs):
    if kwargs.get("dropout_p", 0.0) > 0:
        _record("attention")
    return _attention(*args, **kwargs)


def _dropout_recorded(input, p=0.5, training=True, inplace=False):
    if training and p > 0:
        _record("dropout")
    return _dropout(input, p, training, inplace)
F.scaled_dot_product_attention, F.dropout = _scaled_dot_product_attention, _dropout_recorded
'''


def streams_verdict(directory, ranks):
    """The first dropout whose stream is wrong: an attention dropout (sharded heads) drawn from
    the same state on two ranks, or a residual-stream dropout (replicated) from different
    states; None when every one is right."""
    draws = []
    for rank in range(ranks):
        with open(os.path.join(directory, f"rank{rank}.jsonl")) as f:
            draws.append([json.loads(line) for line in f if line.strip()])
    assert draws[0] and all(len(d) == len(draws[0]) for d in draws), [len(d) for d in draws]
    count = {}
    for same_call in zip(*draws):
        kind = same_call[0]["kind"]
        count[kind] = count.get(kind, 0) + 1
        states = {d["state"] for d in same_call}
        if kind == "attention" and len(states) < ranks:
            return (f"rank 0 and rank 1 drew attention dropout #{count[kind]} from the same stream "
                    "(inside the sharded heads the streams must differ)")
        if kind == "dropout" and len(states) > 1:
            return (f"the ranks drew residual dropout #{count[kind]} from different streams "
                    "(on the replicated residual stream they must agree)")
    return None


WRAPPER = '''"""Runs sys.argv[1] as __main__ (its arguments after it) under a perturbation of the bug zoo."""
import os
import runpy
import sys
{code}
target = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(target))
runpy.run_path(target, run_name="__main__")
'''


def perturbed(bug, directory, command, code=None):
    """`command` ([script, args...]) as run under the bug's perturbation (or `code`):
    [wrapper, script, args...]."""
    code = code or (PERTURBATIONS[bug.perturb] if bug.perturb else None)
    if code is None:
        return command
    wrapper = os.path.join(directory, "perturbed.py")
    with open(wrapper, "w") as f:
        f.write(WRAPPER.format(code=code))
    return [wrapper] + command


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
        if bug.perturb:  # the control: the script as it is, under the same perturbation, replays
            control = tmp_path / "control"
            control.mkdir()
            plain = apply(dataclasses.replace(bug, edits=()), str(control))
            command = perturbed(bug, str(control), [recorder, control / "record", plain] + flags + ["--max_iters", "1"])
            launch(command[0], command[1:], nprocs=bug.ranks).ok()
            verdict = nccl_replay.replay(nccl_replay.read_records(control / "record"))
            assert verdict.ok, f"{what}: the script without the bug fails under the perturbation:\n{verdict.report()}"
        command = perturbed(bug, str(tmp_path), [recorder, record, script] + flags + ["--max_iters", "1"])
        run = launch(command[0], command[1:], nprocs=bug.ranks, timeout=120)
        if not bug.perturb:  # gloo buffers sends: the run itself passes
            run.ok()
        result = nccl_replay.replay(nccl_replay.read_records(record))
        assert not result.ok, f"{what}: its posting order replays under NCCL's rules"
        return result.report().splitlines()[0]

    if bug.check == STREAMS:  # the dropout streams each rank draws from, without and with the bug
        verdicts = []
        for name, path in (("control", None), ("bug", script)):
            directory = tmp_path / name
            (directory / "streams").mkdir(parents=True)
            if path is None:
                path = apply(dataclasses.replace(bug, edits=()), str(directory))
            command = perturbed(bug, str(directory), [path] + flags, code=STREAMS_PROBE)
            launch(command[0], command[1:], nprocs=bug.ranks, env={"ZOO_STREAMS": str(directory / "streams")}).ok()
            verdicts.append(streams_verdict(directory / "streams", bug.ranks))
        assert verdicts[0] is None, f"{what}: the script without the bug fails the streams check: {verdicts[0]}"
        assert verdicts[1], f"{what}: every dropout drew from the right stream"
        return verdicts[1]

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
        # Every rank names where it was; the stuck one names the bug's collective, the others may
        # have moved on to the next (which one prints first is a race between the ranks' timeouts).
        return ([line for line in lines if bug.first_line in line] or lines)[0]
    assert bug.check == CRASH, bug.check
    assert run.returncode not in (0, "timeout"), f"{what}: the job ended with {run.returncode}"
    lines = [line for line in run.stderr.splitlines() if bug.first_line in line]
    assert lines, f"{what}: the job failed without {bug.first_line!r}\n{run.stderr[-3000:]}"
    return lines[0]


@pytest.mark.parametrize("bug", [pytest.param(b, id=b.name, marks=[pytest.mark.xfail(strict=True, reason=b.slips)]
                                              if b.slips else []) for b in BUGS])
def test_the_check_catches_the_bug(bug, tmp_path):
    first_line = caught(bug, tmp_path)
    print(f"{bug.name}: {first_line} (gradient oracle: {bug.gradient})")  # (pytest -s shows what each check printed)
    assert bug.first_line in first_line, \
        f"{bug.name}: {bug.check} fired, but its first line is {first_line!r}, not {bug.first_line!r}"


def test_the_zoo_is_whole():
    """At least 24 bugs, every name once, every check named, every script a numbered one."""
    assert len(BUGS) >= 24
    assert len({b.name for b in BUGS}) == len(BUGS)
    for b in BUGS:
        assert b.check in (ORACLE, RESUME, LEDGER, NCCL, HANG, CHECKSUM, REFUSAL, CRASH, STREAMS), b
        assert b.script[:2].isdigit() and os.path.exists(os.path.join(ROOT, b.script)), b
        assert b.edits or b.damage, f"{b.name}: neither an edit nor damage"
        assert b.origin and b.symptom and b.first_line, b
