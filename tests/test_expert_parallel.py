"""10_expert_parallel.py: the same losses as 01_single_gpu.py with the same --n_expert/--top_k
at ep 2, ep 4 and ep 2 x dp 2 with accumulation; the all-to-all ledger on each step's routing;
expert load in the metrics; checkpoints between 01 and 10 at another --ep; refusals."""

import pytest

from harness import TINY, assert_losses_match, launch

MOE = ["--n_expert", "4", "--top_k", "2"]
BASE = TINY + MOE + ["--max_iters", "5"]
L, K, B, S = 4, 2, 8, 64  # tiny: layers, top-k, global batch, block size


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"]).ok()


def test_moe_objective_does_not_depend_on_the_split(reference):
    """01 with accumulation: the balancing loss is per sequence, so micro-batches change nothing."""
    micro = launch("01_single_gpu.py", BASE + ["--sample_tokens", "0", "--micro_batch_size", "2"]).ok()
    assert_losses_match(reference, micro, what="01 moe micro 2")
    dense = launch("01_single_gpu.py", TINY + ["--max_iters", "5", "--sample_tokens", "0"]).ok()
    assert dense.losses[0] < reference.losses[0]  # + coef x L x (balancing loss >= 1)


CASES = [  # (ranks, --ep, micro_batch_size or None, extra flags)
    (2, 2, None, []),
    (4, 4, None, []),
    (4, 2, 1, []),  # ep 2 x dp 2, two micro-batches per rank
    (2, 2, 2, ["--recompute"]),
    (2, 1, None, []),  # ep 1 x dp 2: every rank all the experts, their gradients all-reduced
]


@pytest.mark.parametrize("ranks, ep, micro, extra", CASES)
def test_losses_equal_single_gpu(reference, ranks, ep, micro, extra):
    flags = BASE + ["--ep", ep] + (["--micro_batch_size", micro] if micro else []) + extra
    run = launch("10_expert_parallel.py", flags, nprocs=ranks).ok()
    assert_losses_match(reference, run, what=f"ep {ep} x dp {ranks // ep} micro={micro} {extra}")
    assert "ledger mismatch" not in run.stderr
    for step in run.steps:
        # the ledger: the all-to-all bytes are the formula on this step's routing counts; each
        # collective under its group's name: the EP group's, and with a second replica of the
        # experts the expert_dp group's
        assert step["comm_bytes"] == step["comm_bytes_theory"], step["step"]
        assert step["comm_calls"] == step["comm_calls_theory"], step["step"]
        assert {"all_to_all_single[ep]", "all_reduce"} <= set(step["comm_bytes"])
        assert ("all_reduce[expert_dp]" in step["comm_bytes"]) == (ranks > ep), step["comm_bytes"]
        assert step["activation_bytes"] == step["activation_bytes_theory"], step["step"]
        assert sum(step["expert_tokens"]) == L * K * B * S and len(step["expert_tokens"]) == 4
        assert step["expert_imbalance"] >= 1.0


class Chain:
    """The losses of runs that continue one another."""

    def __init__(self, *runs):
        self.losses = [loss for run in runs for loss in run.losses]
        self.steps = [row for run in runs for row in run.steps]  # (their gradient norms, for the oracle)


def test_checkpoints_move_between_01_and_10_at_another_ep(reference, tmp_path):
    flags = BASE + ["--lr_decay_iters", "5"]
    first = launch("10_expert_parallel.py", flags + ["--ep", "2", "--max_iters", "3", "--ckpt_interval", "3",
                                                     "--out_dir", tmp_path / "a"], nprocs=2).ok()
    second = launch("01_single_gpu.py", flags + ["--sample_tokens", "0", "--resume", "--out_dir", tmp_path / "a"]).ok()
    assert_losses_match(reference, Chain(first, second), what="10 ep 2, then 01")
    one = launch("01_single_gpu.py", flags + ["--sample_tokens", "0", "--max_iters", "2", "--ckpt_interval", "2",
                                              "--out_dir", tmp_path / "b"]).ok()
    four = launch("10_expert_parallel.py", flags + ["--ep", "4", "--resume", "--out_dir", tmp_path / "b"],
                  nprocs=4).ok()
    assert_losses_match(reference, Chain(one, four), what="01, then 10 ep 4")


def test_resume_is_bit_exact(tmp_path):
    flags = BASE + ["--ep", "2", "--max_iters", "4", "--lr_decay_iters", "4", "--dropout", "0.1"]
    whole = launch("10_expert_parallel.py", flags + ["--out_dir", tmp_path / "whole"], nprocs=2).ok()
    first = launch("10_expert_parallel.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2",
                                                     "--ckpt_interval", "2"], nprocs=2).ok()
    second = launch("10_expert_parallel.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=2).ok()
    assert first.losses + second.losses == whole.losses


@pytest.mark.parametrize("script, ranks, flags, message", [
    ("10_expert_parallel.py", 2, ["--ep", "3"], "--ep 3 does not divide the world size 2"),
    ("10_expert_parallel.py", 2, ["--ep", "0"], "--ep must be positive, got 0"),
    ("10_expert_parallel.py", 3, ["--ep", "3", "--global_batch_size", "6"], "--n_expert 4 is not divisible by --ep 3"),
    ("10_expert_parallel.py", 1, ["--top_k", "5"], "--top_k must be in [1, n_expert = 4], got 5"),
    ("10_expert_parallel.py", 1, ["--n_expert", "0"], "needs a mixture of experts"),
    ("01_single_gpu.py", 1, ["--n_expert", "-1"], "--n_expert must not be negative"),
    ("03_ddp.py", 2, [], "03_ddp.py has no mixture of experts"),
    ("06_tensor_parallel.py", 1, [], "06_tensor_parallel.py has no mixture of experts"),
])
def test_refusals_are_one_line(script, ranks, flags, message):
    run = launch(script, (TINY if "--n_expert" in flags else BASE) + flags, nprocs=ranks)
    assert run.returncode == 2 and len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr


def test_top_k_without_experts_is_refused():
    run = launch("01_single_gpu.py", TINY + ["--top_k", "2"])
    assert run.returncode == 2 and "--top_k and --aux_loss_coef belong to a mixture of experts" in run.stderr


@pytest.mark.parametrize("ranks", [1, 2, 4, 8, 12])
def test_bare_command_dry_runs(ranks):
    run = launch("10_expert_parallel.py", ["--dry_run", "--world_size", ranks], metrics=False, out_dir=False).ok()
    ep = {1: 1, 2: 2, 4: 4, 8: 8, 12: 4}[ranks]
    assert f"expert-parallel group(s) of {ep} ranks" in run.stdout and "all_to_all_single[ep]" in run.stdout


@pytest.mark.parametrize("script, dtype, extra", [
    ("01_single_gpu.py", "float32", ["--sample_tokens", "0"]),
    ("01_single_gpu.py", "bfloat16", ["--sample_tokens", "0", "--recompute", "--dropout", "0.1"]),
    ("10_expert_parallel.py", "bfloat16", ["--micro_batch_size", "4"]),
])
def test_activations_and_bf16_ledger_equal_their_formulas(script, dtype, extra):
    """The MoE block's activations (infra.formulas.activation_terms counts the router, k rows through
    the experts and the combine) and, in bfloat16, the all-to-alls moving 2-byte rows."""
    run = launch(script, BASE + ["--max_iters", "2", "--dtype", dtype] + extra).ok()
    for step in run.steps:
        assert step["activation_bytes"] == step["activation_bytes_theory"]
        assert step["comm_bytes"] == step["comm_bytes_theory"] and step["comm_calls"] == step["comm_calls_theory"]


def test_eval_losses_are_01s():
    """Evaluation reports the language-model loss (no balancing term), the global mean."""
    flags = BASE + ["--max_iters", "2", "--eval_interval", "2", "--eval_iters", "2"]
    single = launch("01_single_gpu.py", flags + ["--sample_tokens", "0"]).ok()
    ep = launch("10_expert_parallel.py", flags + ["--ep", "2"], nprocs=2).ok()
    assert len(single.evals) == len(ep.evals) == 2
    for a, b in zip(single.evals, ep.evals):
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
