"""Hostile cases of the Reliability IV round (issue 47), each kept fixed through the entry
point a user runs: damaged or foreign checkpoint metadata, data that moved, a rolled-back
set, an absurd model, advice that fits the problem, a malicious --init_from, and plan.py's
and plot.py's inputs. Each ends in one `error:` line naming the cause (exit 2 on every
rank), or in the right result."""

import copy
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import common
import infra.checkpoint
import infra.checkpoint_format
import infra.cli
import infra.fit
from harness import ROOT, TINY, dry, launch
from test_failures import dataset, refused

FLAGS = TINY + ["--lr_decay_iters", "8"]
SOLO = ["--sample_tokens", "0"]  # 01 only: no sample at the end


def module(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A committed set of 03 at 2 ranks (two rank files), step 2; copied fresh per test."""
    out = tmp_path_factory.mktemp("two") / "out"
    launch("03_ddp.py", FLAGS + ["--out_dir", out, "--max_iters", "2", "--ckpt_interval", "2"], nprocs=2).ok()
    return out


def damaged(two_ranks, tmp_path, change):
    """A copy of the set with its metadata.json changed by `change(meta)` (or replaced by the
    text it returns); returns (out_dir, the metadata's path)."""
    out = tmp_path / "out"
    shutil.copytree(two_ranks, out)
    path = out / "ckpt" / "step_2" / "metadata.json"
    meta = json.loads(path.read_text())
    text = change(meta)
    path.write_text(text if isinstance(text, str) else json.dumps(meta))
    return out, path


RESUME = FLAGS + ["--max_iters", "3", "--resume"]

DAMAGE = {  # what a user or a disk did to metadata.json -> what the one line says
    "checksums keyed by rank": (lambda m: m.update(checksums={str(r): c for r, c in enumerate(m["checksums"])}),
                                'checksums is a dict, not a list of one {key: CRC-32} table per rank file'),
    "time null": (lambda m: m.update(time=None), 'time is null, not the commit\'s time'),
    "nested thousands deep": (lambda m: "[" * 100000 + "]" * 100000, "its JSON is nested thousands of levels deep"),
    "checksums of fewer ranks": (lambda m: m.update(checksums=m["checksums"][:1]),
                                 'checksums is a list of 1, not a list of one {key: CRC-32} table per rank file '
                                 "(the layout has 2)"),
    "checksums null": (lambda m: m.update(checksums=None),
                       "records no checksums of its rank files, so what they hold cannot be verified"),
    "a piece on a rank file that is not there": (
        lambda m: m["tensors"]["model/transformer.wte.weight"]["pieces"][0].update(rank=5),
        'tensors/model/transformer.wte.weight: a piece on rank 5, not one of the 2 rank files'),
    "a box outside the shape": (
        lambda m: m["tensors"]["model/transformer.wte.weight"]["pieces"][0].update(box=[[0, 66], [0, 64]]),
        "the box [[0, 66], [0, 64]] of model/transformer.wte.weight#0 is not inside the shape [65, 64]"),
    "a dtype that is not one": (lambda m: m["tensors"]["model/transformer.wte.weight"].update(dtype="os.system"),
                                'its dtype "os.system" is not a tensor type'),
    "a step that is not a number": (lambda m: m.update(step="2"), 'step is missing or not a non-negative int'),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_metadata_is_one_line_naming_the_file_and_the_field(two_ranks, tmp_path, case):
    """The dry run opens the set as a launch does (the same code): one line, exit 2."""
    change, message = DAMAGE[case]
    out, path = damaged(two_ranks, tmp_path, change)
    p = dry("03_ddp.py", "--world_size", 2, *RESUME, "--out_dir", out)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith(f"error: checkpoint metadata {path} ") and message in p.stderr, p.stderr


def test_metadata_that_links_to_a_device_is_refused_not_read_or_removed(two_ranks, tmp_path):
    out, path = damaged(two_ranks, tmp_path, lambda m: None)
    path.unlink()
    path.symlink_to("/dev/zero")  # json.load would read it for ever; a set "without metadata" would be removed
    p = dry("03_ddp.py", "--world_size", 2, *RESUME, "--out_dir", out)
    assert p.returncode == 2 and p.stderr == f"error: checkpoint metadata {path} is not a regular file (a link to a " \
        "device, or to nothing?): not a checkpoint's metadata\n", p.stderr
    refused(launch("03_ddp.py", RESUME + ["--out_dir", out], nprocs=2), f"checkpoint metadata {path} is not a regular")
    assert os.path.islink(path) and (path.parent / "rank0.pt").exists()


def test_checksums_keyed_by_rank_end_every_rank_with_2(two_ranks, tmp_path):
    """The round's KeyError: 0 on every rank, now one line and exit 2 on both ranks."""
    change, message = DAMAGE["checksums keyed by rank"]
    out, path = damaged(two_ranks, tmp_path, change)
    refused(launch("03_ddp.py", RESUME + ["--out_dir", out], nprocs=2), message)


def test_a_tensor_without_its_checksum_is_refused_and_unverified_is_said(two_ranks, tmp_path):
    out, path = damaged(two_ranks, tmp_path, lambda m: m["checksums"][0].clear())
    run = launch("01_single_gpu.py", RESUME + SOLO + ["--out_dir", out])
    refused(run, f"checkpoint metadata {path} lists no checksum for ")
    assert f"in {path.parent / 'rank0.pt'}, so it cannot be verified" in run.error_lines[0]
    p = dry("01_single_gpu.py", "--world_size", 1, *FLAGS, "--unverified")
    assert p.returncode == 2 and p.stderr == "error: --unverified belongs to --resume (a set without checksums)\n"
    out, path = damaged(two_ranks, tmp_path / "b", lambda m: m.update(checksums=None))
    run = launch("01_single_gpu.py", RESUME + SOLO + ["--out_dir", out, "--unverified"]).ok()
    assert f"warning: --unverified: {path.parent} records no checksums; its files are read unchecked" in run.stdout
    assert [row["step"] for row in run.steps] == [2]


def test_any_damage_to_the_metadata_is_a_checkpoint_error(two_ranks, tmp_path):
    """Random damage to one field of metadata.json (a value of another kind or range, or a
    key removed): opening the set and reading the tensor concerned raises CheckpointError or
    succeeds, never another exception."""
    out, path = damaged(two_ranks, tmp_path, lambda m: None)
    good = json.loads(path.read_text())
    run = good["run"]

    def places(value, at=()):
        yield at
        for key, inner in (value.items() if isinstance(value, dict) else enumerate(value)
                           if isinstance(value, list) else ()):
            yield from places(inner, at + (key,))
    where = [at for at in places(good) if at and at[0] != "run" and len(at) < 7]
    values = [None, -1, 0, 1, 2**40, 1.5, float("nan"), "x", [], {}, [0], [[0, 1]], {"0": {}}, True, [-1, 5]]
    rng = random.Random(47)
    for _ in range(200):
        meta, at = copy.deepcopy(good), rng.choice(where)
        inner = meta
        for key in at[:-1]:
            inner = inner[key]
        if isinstance(inner, dict) and rng.random() < 0.2:
            del inner[at[-1]]
        else:
            inner[at[-1]] = rng.choice(values)
        path.write_text(json.dumps(meta))
        try:
            ckpt = infra.checkpoint.open_checkpoint(str(out), run)
            names = [at[1]] if at[0] == "tensors" else list(good["tensors"])[:2]
            for name in names:
                shape = good["tensors"][name]["shape"]
                ckpt.read(name, shape, [[0, s] for s in shape])
        except infra.checkpoint_format.CheckpointError:
            pass


def test_moved_data_resumes_changed_data_is_refused_and_a_rolled_back_set_is_kept(tmp_path):
    """The same token files moved ($HOME to $SCRATCH) are the same run; a commit replaces only
    the set it follows, so an older set copied back beside it stays, named at the resume;
    files changed at the same path, or other files at a new one, are refused."""
    dataset(tmp_path / "home")
    out = tmp_path / "out"
    first = FLAGS + SOLO + ["--out_dir", out, "--ckpt_interval", "2"]
    launch("01_single_gpu.py", first + ["--data", tmp_path / "home", "--max_iters", "2"]).ok()
    root = out / "ckpt"
    shutil.copytree(root / "step_2", root / "step_1")  # a set rolled back beside the newest
    meta = json.loads((root / "step_1" / "metadata.json").read_text())
    (root / "step_1" / "metadata.json").write_text(json.dumps({**meta, "time": meta["time"] - 100}))
    os.rename(tmp_path / "home", tmp_path / "scratch")
    run = launch("01_single_gpu.py", first + ["--data", tmp_path / "scratch", "--max_iters", "4", "--resume"]).ok()
    assert (f"note: the data moved: {root / 'step_2'} was written with --data {tmp_path / 'home'}; "
            f"{tmp_path / 'scratch'} holds the same files") in run.stdout
    assert f"note: kept: {root / 'step_1'}, committed set(s) besides {root / 'step_2'}" in run.stdout
    assert [row["step"] for row in run.steps] == [2, 3] and sorted(os.listdir(root)) == ["step_1", "step_4"]
    tokens = np.fromfile(tmp_path / "scratch" / "train.bin", dtype=np.uint16)
    tokens[7] = (tokens[7] + 1) % 65
    tokens.tofile(tmp_path / "scratch" / "train.bin")  # one token changed at the same path
    again = ["--world_size", 1, *first, "--max_iters", "6", "--resume"]
    p = dry("01_single_gpu.py", *again, "--data", tmp_path / "scratch")
    assert p.returncode == 2 and f"data={tmp_path / 'scratch'}, whose files have changed since" in p.stderr, p.stderr
    os.rename(tmp_path / "scratch", tmp_path / "elsewhere")
    p = dry("01_single_gpu.py", *again, "--data", tmp_path / "elsewhere")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"holds another run: it was written with data={tmp_path / 'scratch'}" in p.stderr
    assert f"the files in {tmp_path / 'elsewhere'} are not those it was written with" in p.stderr


def test_an_absurd_model_is_refused_at_once():
    """--n_expert 1000000 built a million expert modules on the meta device for minutes, then
    a MemoryError; now the flags alone refuse it, on every rank."""
    run = launch("10_expert_parallel.py", TINY + ["--n_expert", 1000000], nprocs=2)
    refused(run, "--n_layer 4 x --n_expert 1000000 = 4,000,000 MLPs, more than the 65,536 these scripts build")
    for flags, message in ((["--n_layer", 100000], "--n_layer 100000 = 100,000 MLPs"),
                           (["--n_embd", 10**10, "--n_head", 1], f"--n_embd {10**10} is more than 1,048,576")):
        p = dry("01_single_gpu.py", "--world_size", 1, "--model", "tiny", *flags)
        assert p.returncode == 2 and p.stderr == f"error: {p.stderr[7:]}" and message in p.stderr, p.stderr


def test_the_advice_fits_the_problem(monkeypatch):
    """Each verdict's fix is one that costs() says fits, and where none can, the cause: the
    room below the allowance (no model fits), the model state, or one sequence's activations."""
    flags = ["--world_size", 1, "--device", "cpu", "--model", "shakespeare", "--global_batch_size", 64,
             "--micro_batch_size", 64, "--block_size", 1024]
    single = module("single_iv", "01_single_gpu.py")
    args = infra.cli.parse_args(common.make_parser(""),
                                [str(f) for f in flags[2:]] + ["--dry_run", "--world_size", "1"])

    def need(**changes):
        return infra.fit.rank_need(args, single.costs, 1, torch.float32, "cpu", **changes)

    def verdict(room):
        monkeypatch.setattr(infra.fit, "host_room", lambda ranks: room)
        p = dry("01_single_gpu.py", *flags)
        assert p.returncode == 0, p.stderr
        return next(line for line in p.stdout.splitlines() if line.startswith("fit: "))
    # a room in which neither a smaller micro-batch (down to 1) nor --recompute alone fits, both do
    micro = next(m for m in (32, 16, 8, 4, 2) if need(micro_batch_size=m, recompute=True) < need(micro_batch_size=1))
    room = need(micro_batch_size=micro, recompute=True)
    assert need(recompute=True) > room
    assert f"fit: does not fit: --micro_batch_size {micro} --recompute fits ({64 // micro}x" in verdict(room)
    assert "is less than the 768 MiB every rank needs for transients whatever the model" in verdict(500 * 10**6)
    assert "the model state alone does not fit" in verdict(800 * 2**20)
    least = need(micro_batch_size=1, recompute=True)
    assert "one sequence's activations do not fit (--micro_batch_size 1 --recompute needs " in verdict(least - 1)


def test_a_launch_whose_room_is_below_the_allowance_is_told_so(tmp_path):
    """The round's case, run for real: a 3 MiB model where a few hundred MB are left (an
    address-space limit set after torch is loaded): no sharding advice, one line, exit 2."""
    code = ("import resource, runpy, sys, torch; "
            "size = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:')); "
            "resource.setrlimit(resource.RLIMIT_AS, (size + 500 * 2**20, resource.RLIM_INFINITY)); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "01_single_gpu.py"), "--model", "tiny",
                        "--device", "cpu", "--max_iters", "1", "--out_dir", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT},
                       cwd=tmp_path)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "every rank needs for transients whatever the model: ask the scheduler for more memory" in errors[0]
    assert "shard" not in errors[0]


class Payload:
    def __reduce__(self):  # what a malicious pickle runs when it is unpickled
        return (os.system, ("touch /tmp/gptpar-pwned-by-init-from",))


def test_a_malicious_init_from_is_one_line_and_runs_nothing(tmp_path):
    import pickle
    evil = tmp_path / "evil.pt"
    with open(evil, "wb") as f:
        pickle.dump({"model": Payload(), "model_args": {}}, f, protocol=4)  # torch warns of the protocol too
    run = launch("01_single_gpu.py", FLAGS + SOLO + ["--init_from", evil])
    refused(run, f"--init_from {evil} holds more than tensors (")
    assert run.stderr.count("\n") == 1 and "Warning" not in run.stderr, run.stderr
    assert not os.path.exists("/tmp/gptpar-pwned-by-init-from")
    refused(launch("01_single_gpu.py", FLAGS + SOLO + ["--init_from", tmp_path]),
            f"--init_from {tmp_path} is a directory, not a one-file model")
    torch.save({"model": Payload(), "model_args": {}}, evil)
    obj, problem = infra.checkpoint_format.load_tensors(str(evil))
    assert obj is None and problem.startswith("holds more than tensors (unsupported GLOBAL posix.system)")


def test_plan_bench_that_is_a_device_or_nested_too_deep_is_one_line(tmp_path, capsys):
    plan = module("plan_iv", "plan.py")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000 + "]" * 100000 + "\n")
    for bench, message in (("/dev/zero", "--bench /dev/zero: not a regular file"),
                           (str(deep), "a line nests JSON thousands of levels deep")):
        with pytest.raises(SystemExit) as stop:
            plan.parse(["--model", "gpt2", "--gpus", "8", "--machine", "polaris", "--bench", bench])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_plot_draws_a_step_0_run_and_zero_bubble_and_refuses_deep_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = module("plot_iv", "plot.py")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000 + "]" * 100000 + "\n")
    assert plot.main([str(deep)]) == 2
    assert capsys.readouterr().err == f"error: {deep}: line 1 nests JSON thousands of levels deep: not a metrics JSONL file\n"
    early = tmp_path / "early.jsonl"  # a run stopped after its step-0 evaluation
    early.write_text(json.dumps({"step": 0, "val_loss": 4.17, "train_loss": 4.18}) + "\n")
    assert plot.main([str(early)]) == 0 and (tmp_path / "early.png").stat().st_size > 0
    assert "no training step logged" in plot.summary("early", plot.clean(plot.load_rows(str(early))))
    out = tmp_path / "zb.png"
    assert plot.main(["--schedule", "zb", "--pp", "4", "--micro_batches", "8", "-o", str(out)]) == 0
    assert out.stat().st_size > 0


@pytest.mark.parametrize("argv, reason", [
    (["plan.py", "--model", "gpt2", "--gpus", "8", "--machine", "polaris", "--measured", "/dev/zero"],
     "error: --measured /dev/zero: not a regular file"),  # read forever (and out of memory) before
    (["plot.py", "--hangs", "/dev/null"], "error: --hangs /dev/null: not a directory"),
    (["03_ddp.py", "--model", "tiny", "--device", "cpu", "--rehearse", "", "--world_size", "2"],
     "error: --rehearse is empty (an unset variable?)"),
])
def test_the_new_entry_points_refuse_hostile_input_in_one_line(argv, reason):
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stderr.strip().startswith(reason), done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
