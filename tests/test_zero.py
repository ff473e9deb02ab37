"""04_zero.py: for each stage, the same losses as 01 at 2, 3 and 4 ranks (Ψ is not divisible
by 3, so padding is exercised), model-state bytes and communication equal to the formulas,
resume, export into 01, and the refusals."""

import functools
import json
import math
import os

import pytest
import torch

from common import GPT, GPTConfig, PRESETS
from harness import TINY, assert_losses_match, launch

BASE = TINY + ["--global_batch_size", "24", "--max_iters", "5"]
CLIP, NO_CLIP = ["--grad_clip", "0.05"], ["--grad_clip", "0"]


@pytest.fixture(scope="module")
def reference():
    return {clip: launch("01_single_gpu.py", BASE + flags + ["--sample_tokens", "0"]).ok()
            for clip, flags in (("clip", CLIP), ("no_clip", NO_CLIP))}


def padded_units(n):
    """Ψ per unit padded to a multiple of N, computed here from the model, independently."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=65, **PRESETS["tiny"]))
    root = sum(p.numel() for k, p in model.named_parameters() if not k.startswith("transformer.h."))
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.transformer.h]
    pad = lambda numel: math.ceil(numel / n) * n
    return pad(root), sum(pad(b) for b in blocks)


CASES = [  # (stage, ranks, micro_batch_size or None, clipping)
    (1, 3, 4, "no_clip"), (2, 2, 2, "no_clip"),
    (3, 2, 4, "clip"), (3, 3, 2, "no_clip"), (3, 4, None, "clip"),
    # with clipping, stage 1 at 2 ranks and stage 2 at 3: test_real_conditions.py
]


@functools.lru_cache(maxsize=None)
def zero_run(stage, ranks, micro, clip):
    """04's run of one case, launched once in this file: test_state_shrinks_with_the_stage reads
    the stage 3 x 4 case's rows too (the same command, so the same rows)."""
    flags = BASE + (CLIP if clip == "clip" else NO_CLIP) + ["--stage", stage]
    flags += ["--micro_batch_size", micro] if micro else []
    return launch("04_zero.py", flags, nprocs=ranks).ok()


@pytest.mark.parametrize("stage, ranks, micro, clip", CASES)
def test_losses_and_ledger(reference, stage, ranks, micro, clip):
    run = zero_run(stage, ranks, micro, clip)
    assert_losses_match(reference[clip], run, what=f"zero-{stage} x{ranks} micro={micro} {clip}")

    root, blocks = padded_units(ranks)
    psi, n = root + blocks, ranks
    accum = 24 // ((micro or 24 // ranks) * ranks)
    held = {1: {"params": 4 * psi, "grads": 4 * psi + 4 * psi // n, "optim": 8 * psi // n},
            2: {"params": 4 * psi, "grads": 4 * psi // n, "optim": 8 * psi // n},
            3: {"params": 4 * psi // n, "grads": 4 * psi // n, "optim": 8 * psi // n}}[stage]
    sent = {1: {"reduce_scatter_tensor": 4 * psi, "all_gather_into_tensor": 4 * psi},
            2: {"reduce_scatter_tensor": accum * 4 * psi, "all_gather_into_tensor": 4 * psi},
            3: {"reduce_scatter_tensor": accum * 4 * psi,
                "all_gather_into_tensor": 4 * root + accum * 2 * 4 * blocks}}[stage]
    sent["all_reduce"] = 4 + (4 if clip == "clip" else 0)
    for step in run.steps:
        assert step["state_bytes"] == held
        assert step["comm_bytes"] == sent
    if ranks == 3:
        assert f"Ψ = 208,320 padded to {psi:,}" in run.stdout and psi != 208_320


def test_state_shrinks_with_the_stage(reference):
    """Stage 3 at 4 ranks holds a quarter of 01's 16Ψ (plus padding)."""
    single = sum(reference["clip"].steps[0]["state_bytes"].values())
    run = zero_run(3, 4, None, "clip")  # CASES' stage 3 x 4 with clipping: BASE + CLIP + --stage 3
    held = sum(run.steps[0]["state_bytes"].values())
    assert single / 4 <= held < single / 4 * 1.001


def test_stage_3_starts_and_trains_where_the_whole_model_does_not_fit(reference, tmp_path):
    """Issue 48: ZeRO-3 exists to train a model one rank cannot hold. Under tests/live_bytes.py
    (every live tensor byte counted at every op), a rank may allocate at start-up less than
    the whole model's fp32 parameters, 4Ψ bytes (its full fp32 state with AdamW is 16Ψ): the
    op that would go past that raises MemoryError, as a device out of memory does. 04 --stage
    3 at 4 ranks starts under it (each rank builds only its shards, 8Ψ/N: 2Ψ here, plus one
    unit or one parameter at a time) and trains with 01's losses. The old build (the whole
    model on every rank, then sharded) peaked at 1,499,840 bytes here, 1.8 x the limit."""
    with torch.device("meta"):
        psi = sum(p.numel() for p in GPT(GPTConfig(vocab_size=65, **PRESETS["tiny"])).parameters())
    limit = 4 * psi
    run = launch("tests/live_bytes.py", ["04_zero.py"] + BASE + CLIP + ["--stage", "3"], nprocs=4,
                 env={"LIVE_BYTES_OUT": str(tmp_path), "LIVE_BYTES_STARTUP_LIMIT": str(limit)}).ok()
    assert_losses_match(reference["clip"], run, what="zero-3 x4 under a start-up limit of 4Ψ bytes")
    for rank in range(4):
        live = json.load(open(tmp_path / f"rank{rank}.json"))
        assert live["startup_end"] is not None  # start-up was measured up to the first forward ...
        assert live["startup_end"] <= live["startup_peak"] <= limit  # ... and stayed under the limit
        assert live["startup_end"] >= 8 * psi // 4  # the count sees the shards (masters + gradients)


@pytest.mark.parametrize("stage", [2])  # stages 3 and 1 resume in tests/test_checkpoints.py (chain B)
def test_resume_is_bit_exact_and_export_loads_in_01(tmp_path, stage):
    flags = BASE + CLIP + ["--stage", stage, "--max_iters", "4", "--lr_decay_iters", "4", "--dropout", "0.1",
                           "--eval_interval", "4", "--eval_iters", "2"]
    whole = launch("04_zero.py", flags + ["--out_dir", tmp_path / "w", "--export", tmp_path / "full.pt",
                                          "--ckpt_interval", "4"], nprocs=2).ok()
    first = launch("04_zero.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2", "--ckpt_interval", "1"],
                   nprocs=2).ok()
    second = launch("04_zero.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=2).ok()
    assert first.losses + second.losses == whole.losses  # bit for bit, dropout included
    assert os.listdir(tmp_path / "a" / "ckpt") == ["step_2"]  # step 1's set removed once step 2's was committed
    assert sorted(os.listdir(tmp_path / "a" / "ckpt" / "step_2")) == ["metadata.json"] + [f"rank{r}.pt" for r in range(2)]
    # the consolidated export evaluates in 01 exactly as in the run that wrote it
    ev = launch("01_single_gpu.py", TINY + ["--global_batch_size", "24", "--eval_only", "--eval_iters", "2",
                                            "--eval_interval", "8", "--sample_tokens", "0",
                                            "--init_from", tmp_path / "full.pt"]).ok()
    assert ev.evals[0]["val_loss"] == pytest.approx(whole.evals[-1]["val_loss"], rel=1e-5)
    # (resuming at another layout, resharded, with the losses checked: test_checkpoints.py)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_resumes_bit_exact(tmp_path, stage):
    """--offload --resume at stages 1-2: after the load, the full parameters are gathered from
    the host's master shards, moved to the device first as every step's gather moves them
    (on CPU host and device are one, so what this sees is the values; on GPUs the ledger's
    device check refuses a host tensor handed to a collective)."""
    flags = BASE + CLIP + ["--stage", stage, "--offload", "--max_iters", "4", "--lr_decay_iters", "4"]
    whole = launch("04_zero.py", flags + ["--out_dir", tmp_path / "w"], nprocs=2).ok()
    first = launch("04_zero.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2", "--ckpt_interval", "2"],
                   nprocs=2).ok()
    second = launch("04_zero.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=2).ok()
    assert first.losses + second.losses == whole.losses


BF16 = BASE + NO_CLIP + ["--dtype", "bfloat16", "--max_iters", "5", "--micro_batch_size", "4"]  # 3 micro-batches


@pytest.fixture(scope="module")
def fsdp_bf16():
    return launch("05_fsdp.py", BF16, nprocs=2).ok()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_keeps_fp32_masters_and_reduces_in_fp32_as_05_does(fsdp_bf16, stage):
    """bf16 working parameters and micro-batch gradients; fp32 masters made from the fp32
    initialisation, gradients summed and reduce-scattered in fp32: 05's arithmetic, so the
    same losses bit for bit (a bf16 sum or reduction, or masters rounded to bf16, differ;
    stage 1 sums micro-batches before it reduces, fp32 additions of bf16 terms that are exact
    here)."""
    run = launch("04_zero.py", BF16 + ["--stage", stage], nprocs=2).ok()
    assert run.losses == fsdp_bf16.losses
    assert run.losses[-1] < run.losses[0] - 0.3
    root, blocks = padded_units(2)
    psi, accum = root + blocks, 3
    # bf16 working params (2Ψ, stage 3: gathered only), fp32 gradient shard (4Ψ/N) and in stage 1
    # the fp32 full gradients (4Ψ), fp32 master + moments (12Ψ/N)
    assert run.steps[0]["state_bytes"] == {"params": 2 * psi if stage < 3 else 0,
                                           "grads": 4 * psi // 2 + (4 * psi if stage == 1 else 0),
                                           "optim": 12 * psi // 2}
    comm = run.steps[0]["comm_bytes"]
    assert comm["reduce_scatter_tensor"] == (1 if stage == 1 else accum) * 4 * psi  # fp32 gradients
    assert comm["all_gather_into_tensor"] == (2 * psi if stage < 3 else 2 * (root + accum * 2 * blocks))


@pytest.mark.parametrize("flags, message", [
    (["--stage", "4"], "invalid choice: 4"),
    (["--global_batch_size", "10"], "not divisible by the data-parallel size 4"),
])
def test_bad_input_gives_one_line(flags, message):
    run = launch("04_zero.py", BASE + flags, nprocs=4, timeout=60)
    assert run.returncode != 0 and len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr
