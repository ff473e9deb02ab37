"""05_fsdp.py: the same losses as 01 at 2, 3 and 4 ranks with prefetch and reshard on and
off and as HSDP 2 x 2; the ledger, including the bound on gathered parameters; resume;
export into 01; mixed precision; refusals."""

import pytest

from harness import TINY, assert_losses_match, launch

BASE = TINY + ["--global_batch_size", "24", "--max_iters", "5", "--grad_clip", "0.05",
               "--eval_interval", "5", "--eval_iters", "1"]


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"]).ok()


CASES = [  # (ranks, flags, micro-batch)
    (2, ["--no_prefetch", "--no_reshard"], 12),  # plain FSDP at 2: test_checkpoints.py's chain A, with 01's losses (3, ["--no_prefetch"], 2), (3, ["--no_reshard"], 8),
    (4, ["--no_reshard"], 2), (4, ["--replicate", "2", "--no_prefetch"], 6),  # HSDP 2 x 2: test_real_conditions.py too
]


@pytest.mark.parametrize("ranks, flags, micro", CASES, ids=str)
def test_losses_and_ledger(reference, ranks, flags, micro):
    run = launch("05_fsdp.py", BASE + flags + ["--micro_batch_size", micro], nprocs=ranks).ok()
    assert_losses_match(reference, run, what=f"fsdp x{ranks} {flags} micro={micro}")
    assert run.evals[-1]["val_loss"] == pytest.approx(reference.evals[-1]["val_loss"], rel=2e-5)
    R = 2 if "--replicate" in flags else 1
    S = ranks // R
    full = reference.steps[0]["state_bytes"]  # 01: 4Ψ, 4Ψ, 8Ψ
    step = run.steps[0]
    held = step["state_bytes"]
    for kind in ("params", "grads", "optim"):  # 1/S of 01's, plus at most the padding rows
        assert full[kind] / S <= held[kind] <= full[kind] / S * 1.02 + 2048
    assert held["grads"] == held["params"] and held["optim"] == 2 * held["params"]
    psi = held["params"] // 4 * S  # Ψ padded, in elements
    accum = 24 // (micro * ranks)
    assert step["comm_bytes"]["reduce_scatter_tensor[shard]"] == accum * 4 * psi
    if R > 1:
        assert step["comm_bytes"]["all_reduce[replicate]"] == accum * 4 * psi // S
    # the gathered parameters never exceed the root and one block (two with prefetch; all
    # of them with --no_reshard): the full model never exists on a rank
    assert 0 < step["gathered_peak_bytes"] <= step["gathered_bound_bytes"]
    if "--no_reshard" not in flags:
        assert step["gathered_peak_bytes"] < 0.6 * full["params"]
        if "--no_prefetch" not in flags:  # prefetch really has two blocks in flight
            assert step["gathered_peak_bytes"] == step["gathered_bound_bytes"]


def test_mixed_precision_reduces_in_the_chosen_dtype():
    run = launch("05_fsdp.py", BASE + ["--dtype", "bfloat16", "--reduce_dtype", "bfloat16", "--max_iters", "8"],
                 nprocs=2).ok()
    assert run.losses[-1] < run.losses[0] - 0.3
    step = run.steps[0]
    psi = step["state_bytes"]["params"] // 4 * 2  # fp32 master shards
    assert step["comm_bytes"]["reduce_scatter_tensor[shard]"] == 2 * psi  # bf16 gradients
    assert step["comm_bytes"]["all_gather_into_tensor[shard]"] % 2 == 0


def test_resume_is_bit_exact_and_export_loads_in_01(tmp_path):
    flags = BASE + ["--max_iters", "4", "--lr_decay_iters", "4", "--dropout", "0.1", "--eval_interval", "4"]
    whole = launch("05_fsdp.py", flags + ["--out_dir", tmp_path / "w", "--export", tmp_path / "full.pt",
                                          "--ckpt_interval", "4"], nprocs=2).ok()
    first = launch("05_fsdp.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2", "--ckpt_interval", "2"],
                   nprocs=2).ok()
    second = launch("05_fsdp.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=2).ok()
    assert first.losses + second.losses == whole.losses
    ev = launch("01_single_gpu.py", TINY + ["--global_batch_size", "24", "--eval_only", "--eval_iters", "1",
                                            "--eval_interval", "8", "--sample_tokens", "0",
                                            "--init_from", tmp_path / "full.pt"]).ok()
    assert ev.evals[0]["val_loss"] == pytest.approx(whole.evals[-1]["val_loss"], rel=1e-5)
    # (resuming at another layout, resharded, with the losses checked: test_checkpoints.py)


@pytest.mark.parametrize("ranks, flags, message", [
    (4, ["--replicate", "3"], "--replicate 3 does not divide the world size 4"),
    (2, ["--reduce_dtype", "float16"], "invalid choice: 'float16'"),
])
def test_bad_input_gives_one_line(ranks, flags, message):
    run = launch("05_fsdp.py", BASE + flags, nprocs=ranks, timeout=60)
    assert run.returncode != 0 and len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr
