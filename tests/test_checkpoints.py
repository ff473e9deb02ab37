"""One checkpoint format for every script (common.py): a checkpoint written by any script at
any layout resumes in any script at any valid layout, optimizer state included, and the
resumed losses equal an uninterrupted 01 run's (the oracle). Two chains of short legs, each
leg resuming the previous leg's checkpoint in another script or layout:

    chain A: 08 dp2 x pp2 x tp2 --zero1 -> 05 at 2 -> 07 pp 2 -> 03 at 2 -> 01 (--export)
    chain B: 01 -> 04 stage 3 at 4 -> 04 stage 1 at 3 -> 06 tp 2 -> 01

Then the refusals and the clean-ups: a half-written set is ignored and removed, leftovers of
interrupted writes are removed, another model is refused in one line, a bad file on rank 1
is one line naming it and exit 2 on every rank, foreign files are refused in one line."""

import json
import os
import shutil

import pytest
import torch

import common
import infra.checkpoint
import infra.checkpoint_format
from harness import TINY, assert_losses_match, launch
from test_real_conditions import dry

FLAGS = TINY + ["--global_batch_size", "12", "--lr_decay_iters", "8", "--dropout", "0"]
STEPS = 8


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", FLAGS + ["--max_iters", STEPS, "--sample_tokens", "0"]).ok()


def run_chain(out_dir, legs):
    """Each leg: (script, extra flags, nprocs, the step it stops at); every leg but the
    first resumes; every leg saves its last step."""
    runs = []
    for i, (script, extra, nprocs, stop) in enumerate(legs):
        flags = FLAGS + extra + ["--out_dir", out_dir, "--max_iters", stop, "--ckpt_interval", stop]
        if script == "01_single_gpu.py":
            flags += ["--sample_tokens", "0"]
        runs.append(launch(script, flags + (["--resume"] if i else []), nprocs=nprocs, timeout=400).ok())
    return runs


@pytest.fixture(scope="module")
def chain_a(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain_a")
    legs = [("08_3d.py", ["--tp", "2", "--pp", "2", "--zero1"], 8, 2), ("05_fsdp.py", [], 2, 4),
            ("07_pipeline.py", [], 2, 6), ("03_ddp.py", [], 2, 7),
            ("01_single_gpu.py", ["--export", out / "exported.pt"], 1, 8)]
    return out, run_chain(out, legs)


@pytest.fixture(scope="module")
def chain_b(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain_b")
    legs = [("01_single_gpu.py", [], 1, 2), ("04_zero.py", ["--stage", "3"], 4, 4),
            ("04_zero.py", ["--stage", "1"], 3, 5), ("09_context_parallel.py", ["--cp", "2"], 2, 6),
            ("06_tensor_parallel.py", [], 2, 7)]
    runs = run_chain(out, legs)
    saved = out.parent / (out.name + "_06_set")  # the 06 set, kept for the damage tests below
    shutil.copytree(out, saved)
    last = launch("01_single_gpu.py", FLAGS + ["--out_dir", out, "--max_iters", STEPS, "--sample_tokens", "0",
                                               "--resume"]).ok()
    return out, runs + [last], saved


def check_chain(reference, runs, starts):
    for run, start in zip(runs, starts):
        stop = start + len(run.losses)
        what = f"{' '.join(map(str, run.cmd[:5]))} ... steps {start}-{stop}"
        assert run.steps[0]["step"] == start, what
        ref = type(reference)(reference.cmd, 0, "", "", 0, reference.steps[start:stop])
        assert_losses_match(ref, run, what=what)


def test_any_script_resumes_any_other_at_any_layout_chain_a(reference, chain_a):
    _, runs = chain_a
    check_chain(reference, runs, [0, 2, 4, 6, 7])
    # the layout changed at every leg: the log says the dropout streams start afresh
    for run in runs[1:]:
        assert "cannot carry across layouts" in run.stdout


def test_any_script_resumes_any_other_at_any_layout_chain_b(reference, chain_b):
    _, runs, _ = chain_b
    check_chain(reference, runs, [0, 2, 4, 5, 6, 7])


def test_metadata_names_every_piece_and_each_rank_file_holds_its_share(chain_b):
    out, _, saved = chain_b
    (directory,) = os.listdir(saved / "ckpt")  # only the newest set is kept
    meta = json.load(open(saved / "ckpt" / directory / "metadata.json"))
    assert meta["step"] == 7 and meta["layout"]["world_size"] == 2 and meta["layout"]["strategy"] == "tensor parallel"
    wte = meta["tensors"]["model/transformer.wte.weight"]
    assert wte["shape"] == [65, 64]  # the unpadded vocabulary, though tp 2 pads it to 66
    assert sorted(p["box"][0] for p in wte["pieces"]) == [[0, 33], [33, 65]]
    # a reader opens only the rank files whose pieces overlap what it asks for
    ckpt = infra.checkpoint_format.Checkpoint(str(saved / "ckpt" / directory))
    (first,) = [p["rank"] for p in wte["pieces"] if p["box"][0] == [0, 33]]
    ckpt.read("model/transformer.wte.weight", [65, 64], [[0, 20], [0, 64]])
    assert list(ckpt.files) == [first]
    c_attn = meta["tensors"]["optim/exp_avg/transformer.h.0.attn.c_attn.weight"]
    assert len(c_attn["pieces"]) == 6  # [Q_t; K_t; V_t] on each of 2 ranks
    assert "lm_head.weight" not in str(meta["tensors"])  # the tied head is wte
    # 4 params tensors x 3 (value, exp_avg, exp_avg_sq) of nanoGPT's model, by name
    names = {n.split("/", 1)[1] if n.startswith("model/") else None for n in meta["tensors"]} - {None}
    model = common.GPT(common.GPTConfig(vocab_size=65, **common.PRESETS["tiny"]))
    assert names == {n for n, _ in model.named_parameters()}


def test_a_4d_checkpoint_resumes_in_06_and_01(reference, tmp_path):
    """08 at pp 2 x cp 2 x tp 2 + SP + ZeRO-1 (8 ranks) for steps 0-1: its layout recorded, every
    piece written once (DP x CP rank 0 the parameters, each DP x CP rank its ZeRO-1 moments);
    06 at tp 2 resumes it for steps 2-3 and 01 for step 4, both with 01's losses."""
    legs = [("08_3d.py", ["--tp", "2", "--pp", "2", "--cp", "2", "--sequence_parallel", "--zero1"], 8, 2)]
    runs = run_chain(tmp_path, legs)
    (directory,) = os.listdir(tmp_path / "ckpt")
    layout = json.load(open(tmp_path / "ckpt" / directory / "metadata.json"))["layout"]
    assert {k: layout[k] for k in ("dp", "pp", "cp", "tp", "cp_impl")} == {"dp": 1, "pp": 2, "cp": 2, "tp": 2,
                                                                            "cp_impl": "ring"}
    for script, nprocs, stop in (("06_tensor_parallel.py", 2, 4), ("01_single_gpu.py", 1, 5)):
        flags = FLAGS + ["--out_dir", tmp_path, "--max_iters", stop, "--ckpt_interval", stop, "--resume"]
        runs.append(launch(script, flags + (["--sample_tokens", "0"] if script.startswith("01") else []),
                           nprocs=nprocs, timeout=400).ok())
    check_chain(reference, runs, [0, 2, 4])


def test_export_is_the_checkpoint_consolidated_in_nanogpts_format(chain_a):
    out, runs = chain_a
    exported = torch.load(out / "exported.pt", weights_only=True)
    assert exported["iter_num"] == 8 and exported["model_args"]["n_layer"] == 4
    ckpt = infra.checkpoint_format.Checkpoint(infra.checkpoint_format.latest_checkpoint(str(out)))
    for name, value in exported["model"].items():
        stored = "transformer.wte.weight" if name == "lm_head.weight" else name
        shape = list(value.shape)
        assert torch.equal(value, ckpt.read(f"model/{stored}", shape, [[0, s] for s in shape]).view(shape))
    ev = launch("01_single_gpu.py", FLAGS + ["--eval_only", "--eval_iters", "1", "--eval_interval", "1",
                                             "--sample_tokens", "0", "--init_from", out / "exported.pt"]).ok()
    assert len(ev.evals) == 1


def test_half_written_set_is_ignored_and_leftovers_are_removed(reference, tmp_path):
    out = tmp_path / "out"
    launch("01_single_gpu.py", FLAGS + ["--out_dir", out, "--max_iters", "2", "--ckpt_interval", "2",
                                        "--sample_tokens", "0"]).ok()
    root = out / "ckpt"
    (root / "step_5").mkdir()  # a newer set whose write was killed before the commit
    (root / "step_5" / "rank0.pt").write_bytes(b"half")
    (root / "step_2" / "rank0.pt.tmp.4242").write_bytes(b"")  # SIGTERM mid-write
    resumed = launch("01_single_gpu.py", FLAGS + ["--out_dir", out, "--max_iters", "3", "--sample_tokens", "0",
                                                  "--resume"]).ok()
    assert resumed.steps[0]["step"] == 2
    assert_losses_match(type(reference)(reference.cmd, 0, "", "", 0, reference.steps[2:3]), resumed)
    assert os.listdir(root) == ["step_2"] and sorted(os.listdir(root / "step_2")) == ["metadata.json", "rank0.pt"]
    # a fresh start (--overwrite: the out_dir holds another run's checkpoint) that writes no
    # checkpoint cleans up too, as soon as it holds the out_dir, and leaves the committed set
    (root / "step_5").mkdir()
    (root / "step_2" / "rank0.pt.tmp.4243").write_bytes(b"")
    launch("01_single_gpu.py", FLAGS + ["--out_dir", out, "--max_iters", "1", "--sample_tokens", "0",
                                        "--overwrite"]).ok()
    assert os.listdir(root) == ["step_2"] and sorted(os.listdir(root / "step_2")) == ["metadata.json", "rank0.pt"]


def test_refusals_are_one_line(tmp_path):
    out = tmp_path / "out"
    base = FLAGS + ["--out_dir", out, "--max_iters", "2", "--sample_tokens", "0"]
    launch("01_single_gpu.py", base + ["--ckpt_interval", "2"]).ok()

    def refused(flags, *words):  # a real launch: one line, exit 2, no traceback
        run = launch("01_single_gpu.py", flags)
        assert run.returncode == 2 and len(run.error_lines) == 1, run.stderr
        assert all(w in run.error_lines[0] for w in words), run.error_lines[0]
        assert "Traceback" not in run.stderr

    def says(action, *words):  # the same checks in this process, without the launch cost
        with pytest.raises(infra.checkpoint_format.CheckpointError) as e:
            action()
        assert all(w in str(e.value) for w in words), str(e.value)

    refused(base + ["--resume", "--n_layer", "2"], "another model", "n_layer")
    run = json.load(open(out / "ckpt" / "step_2" / "metadata.json"))["run"]  # what 01 wrote: this run
    infra.checkpoint.open_checkpoint(str(out), run)  # opens
    says(lambda: infra.checkpoint.open_checkpoint(str(out), {**run, "seed": 7}), "another run", "seed")
    says(lambda: infra.checkpoint.open_checkpoint(str(out), {**run, "lr_decay_iters": 20}), "lr_decay_iters=20",
         f"pass --lr_decay_iters {run['lr_decay_iters']}")
    rank0 = out / "ckpt" / "step_2" / "rank0.pt"
    good = rank0.read_bytes()
    torch.save(torch.zeros(3), rank0)  # a plain tensor (another file renamed into place)
    says(lambda: infra.checkpoint_format.Checkpoint(str(rank0.parent)).file(0), str(rank0), "not a rank file", "Tensor")
    rank0.write_bytes(good[:1000])  # truncated
    refused(base + ["--resume"], str(rank0), "unreadable")
    # foreign one-file checkpoints: nanoGPT's ckpt.pt where the set is expected, and as --init_from
    nano = tmp_path / "nano"
    nano.mkdir()
    torch.save({"model": {"w": torch.zeros(2)}, "iter_num": 3, "config": {"x": 1}}, nano / "ckpt.pt")
    refused(FLAGS + ["--out_dir", nano, "--resume", "--sample_tokens", "0"], "ckpt.pt", "not a checkpoint of this format")
    torch.save(torch.zeros(3), nano / "tensor.pt")
    refused(FLAGS + ["--init_from", nano / "tensor.pt", "--sample_tokens", "0"], "not a one-file model", "Tensor")
    # the dry run opens the checkpoint as the launch would: the same refusal, before queueing
    p = dry("01_single_gpu.py", "--world_size", 1, *base, "--resume", "--n_layer", 2)
    assert p.returncode == 2 and "another model" in p.stderr and "n_layer" in p.stderr and len(p.stderr.splitlines()) == 1
    metadata = out / "ckpt" / "step_2" / "metadata.json"
    damaged = json.load(open(metadata))
    del damaged["tensors"]["model/transformer.wte.weight"]["pieces"], damaged["layout"]
    metadata.write_text(json.dumps(damaged))
    says(lambda: infra.checkpoint.open_checkpoint(str(out), run), str(metadata), "damaged", "layout",
         "tensors/model/transformer.wte.weight")
    (out / "ckpt" / "step_2" / "metadata.json").write_text("[1, 2]")
    says(lambda: infra.checkpoint.open_checkpoint(str(out), run), "metadata.json", "not the metadata")
    says(lambda: infra.checkpoint.open_checkpoint(str(tmp_path / "none"), run), "no checkpoint")


def test_a_bad_file_on_rank_1_is_one_line_naming_it_and_exit_2_everywhere(chain_b, tmp_path):
    _, _, saved = chain_b
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    (directory,) = os.listdir(out / "ckpt")
    rank1 = out / "ckpt" / directory / "rank1.pt"
    rank1.write_bytes(rank1.read_bytes()[:2000])  # truncated, as by a full disk
    run = launch("06_tensor_parallel.py", FLAGS + ["--out_dir", out, "--max_iters", STEPS, "--resume"], nprocs=2)
    assert run.returncode == 2 and len(run.error_lines) == 1, run.stderr
    assert str(rank1) in run.error_lines[0] and "unreadable" in run.error_lines[0]
    assert "Traceback" not in run.stderr


def test_flat_ranges_and_boxes_meet_exactly():
    """The geometry the reader relies on: any flat range of any box, split into boxes, holds
    exactly those elements of the global tensor."""
    torch.manual_seed(0)
    for _ in range(500):
        shape = torch.randint(1, 6, (int(torch.randint(1, 4, ())),)).tolist()
        box = [sorted(torch.randint(0, s + 1, (2,)).tolist()) for s in shape]
        box = [[a, b] if a < b else [0, s] for (a, b), s in zip(box, shape)]
        n = int(torch.tensor([b - a for a, b in box]).prod())
        a, b = sorted(torch.randint(0, n + 1, (2,)).tolist())
        if a == b:
            continue
        full = torch.arange(int(torch.tensor(shape).prod())).view(shape)
        expected = full[tuple(slice(s, e) for s, e in box)].reshape(-1)[a:b]
        got = torch.full((b - a,), -1)
        copied = infra.checkpoint_format._copy_overlap(got, infra.checkpoint_format._flat_boxes(box, (a, b)),
                                                       full.reshape(-1), [([[0, s] for s in shape], 0)])
        assert copied == b - a and torch.equal(got, expected)
