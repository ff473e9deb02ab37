"""03_ddp.py: the same losses as 01 at 2, 3 and 4 ranks, with and without gradient
accumulation and clipping, overlapped or not; the ledger; resume; bad input."""

import pytest

from harness import TINY, assert_losses_match, launch

BASE = TINY + ["--global_batch_size", "24", "--max_iters", "5"]
CLIP = ["--grad_clip", "0.05"]  # small enough that clipping is active at every step
NO_CLIP = ["--grad_clip", "0"]


@pytest.fixture(scope="module")
def reference():
    return {clip: launch("01_single_gpu.py", BASE + flags + ["--sample_tokens", "0"]).ok()
            for clip, flags in (("clip", CLIP), ("no_clip", NO_CLIP))}


CASES = [  # (ranks, micro_batch_size or None, overlap, clipping, bucket MiB)
    (1, 6, True, "clip", 0.05),
    (2, None, False, "no_clip", 25),
    (3, None, True, "no_clip", 0.05),
    (3, 2, False, "clip", 25),
    (4, None, True, "no_clip", 25),
]


@pytest.mark.parametrize("ranks, micro, overlap, clip, bucket_mb", CASES)
def test_losses_equal_single_gpu(reference, ranks, micro, overlap, clip, bucket_mb):
    flags = BASE + (CLIP if clip == "clip" else NO_CLIP) + ["--bucket_mb", bucket_mb]
    flags += (["--micro_batch_size", micro] if micro else []) + ([] if overlap else ["--no_overlap"])
    run = launch("03_ddp.py", flags, nprocs=ranks).ok()
    assert_losses_match(reference[clip], run, what=f"ddp x{ranks} micro={micro} overlap={overlap} {clip}")
    # the ledger: one all-reduce of every gradient (4Ψ bytes) and of the loss, a full replica;
    # a replica alone posts nothing
    n_params = reference[clip].steps[0]["state_bytes"]["params"] // 4
    for step in run.steps:
        assert step["comm_bytes"] == ({"all_reduce": 4 * n_params + 4} if ranks > 1 else {})
        assert step["state_bytes"] == reference[clip].steps[0]["state_bytes"]
    assert "ledger (rank 0)" in run.stdout and ("4Ψ + 4·loss" in run.stdout) == (ranks > 1)


def test_eval_losses_are_the_global_mean(reference):
    flags = BASE + CLIP + ["--eval_interval", "5", "--eval_iters", "2"]
    single = launch("01_single_gpu.py", flags + ["--sample_tokens", "0"]).ok()
    ddp = launch("03_ddp.py", flags, nprocs=3).ok()
    for a, b in zip(single.evals, ddp.evals):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


def test_resume_is_bit_exact(tmp_path):
    flags = BASE + CLIP + ["--max_iters", "4", "--lr_decay_iters", "4", "--dropout", "0.1"]
    whole = launch("03_ddp.py", flags + ["--out_dir", tmp_path / "whole"], nprocs=2).ok()
    first = launch("03_ddp.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2",
                                         "--ckpt_interval", "2"], nprocs=2).ok()
    second = launch("03_ddp.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=2).ok()
    assert first.losses + second.losses == whole.losses  # bit for bit, dropout streams included
    # (at another world size or by another script: test_checkpoints.py's chains, losses checked)


@pytest.mark.parametrize("flags, message", [
    (["--global_batch_size", "10"], "--global_batch_size 10 is not divisible by the data-parallel size 4"),
    (["--micro_batch_size", "4"], "not divisible by micro_batch_size 4 x data-parallel size 4"),
    (["--bucket_mb", "0"], "--bucket_mb must be positive"),
])
def test_bad_input_gives_one_line(flags, message):
    run = launch("03_ddp.py", BASE + flags, nprocs=4, timeout=60)
    assert run.returncode != 0 and run.seconds < 30
    assert len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr


def test_buckets_are_launched_during_backward_and_not_on_accumulation_steps():
    """In-process, one-rank gloo group: when backward reaches the token embedding (the last
    gradient produced) the later layers' buckets must already be launched (counted at the
    launch: a replica alone posts no all-reduce), in index order."""
    import importlib
    import torch
    import torch.distributed as dist
    from common import GPTConfig, PRESETS, build_model, _free_port
    ddp = importlib.import_module("03_ddp")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = build_model(GPTConfig(vocab_size=65, **PRESETS["tiny"]), 0, "cpu")
        buckets = ddp.GradientBuckets(model.parameters(), 50_000, dist.group.WORLD, overlap=True)
        in_flight_at_embedding, launched, launch = [], [], buckets._launch
        buckets._launch = lambda index: (launched.append(index), launch(index))
        model.transformer.wte.weight.register_hook(lambda g: in_flight_at_embedding.append(len(launched)))
        x = torch.randint(0, 65, (2, 16))
        for sync in (False, True):
            buckets.sync = sync
            model(x, x)[1].backward()
        assert in_flight_at_embedding[0] == 0  # accumulation step: nothing sent
        assert 0 < in_flight_at_embedding[1] < len(buckets.buffers)  # overlapped with backward
        buckets.finish()
        assert launched == list(range(len(buckets.buffers)))  # every bucket once, in index order
        assert len(buckets.handles) == 0 and buckets.next_to_launch == 0  # reset for the next step
    finally:
        dist.destroy_process_group()
