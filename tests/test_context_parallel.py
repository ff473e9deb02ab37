"""09_context_parallel.py: ring and Ulysses attention equal SDPA (outputs and the three
gradients, real ranks); the same losses as 01 for ring and Ulysses at cp 2 and 4 and for
cp x dp = 2 x 2 (both), with gradient accumulation and active clipping, and at a context of
256 (cp 2 and 4, both);
evaluation and resume; the ledger and the activations measured equal the formulas; the zigzag layout balances the causal work; bad input."""

import importlib

import pytest

from harness import TINY, assert_losses_match, launch
from test_jobs import scheduler  # noqa: F401 (the fixture: job scripts under recording stubs)

cp_module = importlib.import_module("09_context_parallel")

BASE = TINY + ["--global_batch_size", "8", "--max_iters", "4", "--grad_clip", "0.05",
               "--eval_interval", "4", "--eval_iters", "1"]  # evaluations at steps 0 and 4
LONG = ["--block_size", "256", "--n_embd", "32", "--n_layer", "2"]  # context 256, narrow: fast


@pytest.fixture(scope="module")
def reference():
    return {"short": launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"]).ok(),
            "long": launch("01_single_gpu.py", BASE + LONG + ["--sample_tokens", "0"]).ok()}


@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_and_ulysses_attention_equal_sdpa(ranks):
    run = launch("tests/cp_units.py", nprocs=ranks, metrics=False, out_dir=False, timeout=120).ok()
    assert f"match SDPA at C = {ranks}" in run.stdout and "fused and explicit blocks, whole and in chunks" in run.stdout


def expected_sent(impl, cp, ranks, micro, block_size, n_embd, n_layer, n_params, e=4):
    """docs/strategies.md's 09 formulas, restated: bytes one rank sends per step, by operation."""
    m = 8 // (micro * (ranks // cp))
    A = micro * (block_size // cp) * n_embd * e
    sent = {"all_reduce": 4 * n_params + 4}
    if impl == "ring":
        # forward: K and V, C-1 hops; backward: K and V again, and fp32 dK, dV, C hops each
        ring = m * n_layer * (2 * (cp - 1) * A + 2 * (cp - 1) * A + 2 * cp * (A // e) * 4)
        sent.update(send=ring, recv=ring)
    else:  # q, k, v and the output, forward and backward
        sent["all_to_all_single[cp]"] = m * n_layer * 8 * A
    return sent


CASES = [  # (impl, cp, ranks, micro_batch_size, long context)
    ("ring", 2, 4, 2, False),  # cp 2 x dp 2
    ("ulysses", 2, 4, 4, False),  # cp 2 x dp 2
    ("ring", 2, 2, 4, True),  # context 256
    ("ring", 4, 4, 4, True),
    ("ulysses", 4, 4, 4, True),  # 2 micro-batches
]


def test_clipping_is_active_in_the_reference(reference):
    """BASE's --grad_clip 0.05 binds (the losses differ without it), so the cases below,
    which equal the reference, clip by the global norm as 01 does."""
    free = launch("01_single_gpu.py", BASE + ["--sample_tokens", "0", "--grad_clip", "0"]).ok()
    assert free.losses[0] == reference["short"].losses[0] and free.losses[-1] != pytest.approx(
        reference["short"].losses[-1], rel=1e-4)


@pytest.mark.parametrize("impl, cp, ranks, micro, long", CASES)
def test_losses_equal_single_gpu(reference, impl, cp, ranks, micro, long):
    flags = BASE + (LONG if long else []) + ["--cp", cp, "--cp_impl", impl, "--micro_batch_size", micro]
    run = launch("09_context_parallel.py", flags, nprocs=ranks).ok()
    ref = reference["long" if long else "short"]
    assert_losses_match(ref, run, what=f"{impl} cp {cp} on {ranks} ranks, micro {micro}")
    assert len(run.evals) == len(ref.evals) == 2
    for mine, theirs in zip(run.evals, ref.evals):  # evaluation: the same global means
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5)
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5)
    n_params = ref.steps[0]["state_bytes"]["params"] // 4
    shape = (256, 32, 2) if long else (64, 64, 4)
    for step in run.steps:
        assert step["comm_bytes"] == expected_sent(impl, cp, ranks, micro, *shape, n_params)
        assert step["state_bytes"] == ref.steps[0]["state_bytes"]  # a full replica
        assert step["activation_bytes"] == step["activation_bytes_theory"] > 0  # the meter = costs()
    assert "ledger (rank 0)" in run.stdout


def test_the_explicit_ring_block_in_chunks_trains_as_01(reference):
    """G3: with every ring block explicit (as on XPU) and taken 5 queries at a time (a rank's
    128 tokens over 4 heads, micro-batch 4: 4·4·128·5 scores), 09 at cp 2 has 01's losses."""
    flags = BASE + LONG + ["--cp", 2, "--cp_impl", "ring", "--micro_batch_size", 4]
    run = launch("tests/explicit_ring.py", [4 * 4 * 128 * 5] + flags, nprocs=2).ok()
    assert_losses_match(reference["long"], run, what="ring cp 2, explicit blocks in chunks")


def test_bfloat16_ledger_and_cost_function():
    """In bf16 K, V, q and the output travel in 2 bytes, dK/dV in fp32: the ledger equals
    costs() for both implementations."""
    import argparse
    from common import GPTConfig, PRESETS
    import torch
    for impl in ("ring", "ulysses"):
        flags = BASE + ["--dtype", "bfloat16", "--max_iters", "1", "--cp", 2, "--cp_impl", impl]
        run = launch("09_context_parallel.py", flags, nprocs=2).ok()
        assert run.steps[0]["state_bytes"] == run.steps[0]["state_bytes_theory"]
        n_params = run.steps[0]["state_bytes"]["params"] // 4
        assert run.steps[0]["comm_bytes"] == expected_sent(impl, 2, 2, 8, 64, 64, 4, n_params, e=2)
        args = argparse.Namespace(cp=2, cp_impl=impl, global_batch_size=8, micro_batch_size=None,
                                  recompute=False, device="cpu", dry_run=False, optimizer="adamw")
        cost = cp_module.costs(args, GPTConfig(vocab_size=65, **PRESETS["tiny"]), 2, torch.bfloat16)
        assert {op: b for op, (_, b) in cost["sent"].items()} == run.steps[0]["comm_bytes"]


def test_zigzag_balances_causal_work_and_covers_every_pair():
    """Over the C ring steps every rank computes the same number of score entries (a step's
    kernel calls: a causal one counts half), and every (query chunk, key chunk) pair at or
    below the diagonal is computed exactly once (a causal call's pairs above it are masked);
    a causal call is one chunk's own triangle, so no call computes a masked square."""
    for C in (1, 2, 3, 4, 8):
        work, seen = [], []
        for r in range(C):
            entries = 0
            for step in range(C):
                j = (r - step) % C
                q_halves, kv_halves, causal = cp_module.ring_block(r, j, C)
                assert causal == (j == r)
                for qhs, khs, causal in cp_module.kernel_blocks(q_halves, kv_halves, causal):
                    assert not causal or (j == r and qhs == khs and len(qhs) == 1)
                    entries += len(qhs) * len(khs) * (0.5 if causal else 1.0)
                    for qh in qhs:
                        for kh in khs:
                            q_chunk = cp_module.zigzag_chunks(r, C)[qh]
                            kv_chunk = cp_module.zigzag_chunks(j, C)[kh]
                            assert causal or kv_chunk < q_chunk  # a call without the mask: all visible
                            if kv_chunk <= q_chunk:
                                seen.append((q_chunk, kv_chunk))
            work.append(entries)
        assert work == [2 * C] * C, (C, work)  # 2 (s/2C)² blocks per step
        assert sorted(seen) == sorted((q, k) for q in range(2 * C) for k in range(q + 1))


def test_merge_is_exact():
    """Attention over keys split in two parts, merged by the log-sum-exp rule, equals the
    softmax over all keys: with the fused CPU kernel's blocks and with the explicit ones."""
    import torch
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 8)
    expected = torch.softmax(q @ k.transpose(-2, -1) / 8 ** 0.5, dim=-1) @ v
    for block in (cp_module.block_forward, cp_module.explicit_block_forward):
        out, lse = block(q, k[:, :, :7], v[:, :, :7], causal=False)[:2]  # (block_forward: + its kernel's state)
        out, lse = out.clone(), lse.clone()
        o2, l2 = block(q, k[:, :, 7:], v[:, :, 7:], causal=False)[:2]
        cp_module.merge(out, lse, o2, l2)
        assert torch.allclose(out, expected, atol=1e-6), block.__name__


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_block_equals_the_explicit_reference(dtype):
    """One block, causal and not, q and k of different lengths: the fused CPU kernel's O_b,
    L_b and its backward (given a final O and L from elsewhere) equal the explicit fp32 block's."""
    import torch
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for tq, tk, causal in ((6, 6, True), (3, 6, False), (6, 3, False)):
        q, k, v, dout = (torch.randn(2, 3, t, 8).to(dt) for t in (tq, tk, tk, tq))
        o, lse, state = cp_module.block_forward(q, k, v, causal)
        o_ref, lse_ref = cp_module.explicit_block_forward(q, k, v, causal)
        assert o.dtype == dt and lse.dtype == torch.float32 and lse.shape == (2, 3, tq)
        assert torch.allclose(o.float(), o_ref, **tol) and torch.allclose(lse, lse_ref, **tol)
        final_out, final_lse = torch.randn(2, 3, tq, 8).to(dt), lse + torch.rand(2, 3, tq)
        fused = cp_module.block_backward(dout, q, k, v, final_out, final_lse, causal, state)
        explicit = cp_module.explicit_block_backward(dout, q, k, v, final_out, final_lse, causal)
        for name, a, b in zip(("dq", "dk", "dv"), fused, explicit):
            assert torch.allclose(a.float(), b, **tol), (name, tq, tk, causal, (a.float() - b).abs().max())


@pytest.mark.parametrize("ranks, flags, message", [
    (4, ["--cp", "3"], "--cp 3 does not divide the world size 4"),
    (2, ["--cp", "0"], "--cp must be positive, got 0"),
    (2, ["--cp", "2", "--cp_impl", "ulysses", "--n_head", "3", "--n_embd", "48"],
     "--cp_impl ulysses needs --cp 2 to divide n_head 3"),
    (2, ["--cp", "2", "--block_size", "66"], "block_size 66 is not divisible by 2 x cp = 4"),
])
def test_bad_input_gives_one_line(ranks, flags, message):
    run = launch("09_context_parallel.py", BASE + flags, nprocs=ranks, timeout=60)
    assert run.returncode == 2 and run.seconds < 30
    assert len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr


def test_job_script_launches_a_valid_layout(scheduler):
    """jobs/polaris_cp.sh under a fabricated PBS allocation of 2 nodes: the launch line, and its
    own flags validated by 09's parser and layout check for the 8 ranks it starts."""
    p, lines = scheduler("polaris_cp.sh")
    assert p.returncode == 0, p.stderr
    line = [line for line in lines if line.startswith("mpiexec ")]
    assert len(line) == 1 and line[0].startswith("mpiexec -n 8 --ppn 4 "), lines
    argv = line[0].split(" | ")[0].split("python 09_context_parallel.py ")[1].split()
    from common import check_batch, make_parser, model_config
    from infra.cli import parse_args
    args = parse_args(cp_module.add_flags(make_parser(cp_module.__doc__)), argv)
    config = model_config(args, 256)
    assert cp_module.check_layout(args, config, 8) == (4, 2) and config.block_size == 16384
    assert check_batch(args, dp_size=2) == 4  # 4 micro-batches of 1 sequence per replica


def test_resume_continues_the_same_losses(reference, tmp_path):
    """Checkpoint at step 2 on cp 2 x dp 1, resume on cp 2 x dp 2 (the state is replicated):
    the remaining steps equal 01's."""
    flags = BASE + ["--cp", "2", "--lr_decay_iters", "4", "--out_dir", tmp_path / "out"]
    first = launch("09_context_parallel.py", flags + ["--max_iters", "2", "--ckpt_interval", "2"], nprocs=2).ok()
    second = launch("09_context_parallel.py", flags + ["--resume"], nprocs=4).ok()
    assert "dropout streams start afresh" in second.stdout
    ref = reference["short"].losses
    assert first.losses == pytest.approx(ref[:2], rel=2e-5)
    assert second.losses == pytest.approx(ref[2:], rel=2e-5)
