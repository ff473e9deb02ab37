"""The routing options of common.py's mixture of experts (--balance aux|bias|none, --capacity_factor,
--shared_experts): the router itself as pure functions (GShard's capacity and drop order,
DeepSeek-V3's bias for selection only and its update), then 10_expert_parallel.py with the options
equal to 01_single_gpu.py with the same options at ep 4 and at ep 2 x dp 2 (other micro-batches:
the capacity's group is one sequence), --balance none at ep 2, the ledger on each step's routing,
the bias carried by the checkpoint (bit for bit at the same layout, and from 10 to 01), and the
refusals."""

import math

import pytest
import torch

from common import combine, GPTConfig, route, Router, update_expert_bias
from harness import TINY, assert_losses_match, launch

L, K, E, B, S = 4, 2, 4, 8, 64  # tiny: layers, top-k, experts, global batch, block size
MOE = ["--n_expert", E, "--top_k", K]
# every option at once, the bias's step large enough to change the choices of a tiny run's
# near-uniform routers within its 6 steps
OPTIONS = ["--balance", "bias", "--bias_update_rate", "0.05", "--capacity_factor", "1.0", "--shared_experts", "1"]
BASE = TINY + MOE + OPTIONS


def gshard_keep(experts, capacity):
    """The reference: per sequence, every token's first choice before any second, then by position;
    an expert takes entries while it has room."""
    Bn, T, k = experts.shape
    keep = torch.zeros(Bn, T, k, dtype=torch.bool)
    for b in range(Bn):
        used = {}
        for j in range(k):
            for t in range(T):
                e = int(experts[b, t, j])
                if used.get(e, 0) < capacity:
                    keep[b, t, j], used[e] = True, used.get(e, 0) + 1
    return keep.reshape(-1)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_in_gshards_order_per_sequence(factor):
    torch.manual_seed(0)
    logits = torch.randn(3, 16, 4)
    weights, order, counts, aux, load = route(logits, 2, capacity_factor=factor)
    experts = torch.topk(torch.softmax(logits, -1), 2, -1).indices
    keep, flat = gshard_keep(experts, math.ceil(factor * 2 * 16 / 4)), experts.reshape(-1)
    kept = int(counts.sum())
    assert 0 < kept < flat.numel()  # this draw overflows some expert at every factor
    assert sorted(order[:kept].tolist()) == torch.nonzero(keep).view(-1).tolist()
    assert (flat[order[:kept]].diff() >= 0).all()  # the kept entries grouped by expert
    assert torch.equal(counts, torch.bincount(flat[keep], minlength=4))
    assert torch.equal(load, torch.bincount(flat, minlength=4))  # the load counts every choice
    # combine: a dropped entry adds nothing; a token with both dropped comes out zero (the residual carries it)
    out = torch.ones(kept, 5)
    y = combine(out, order, weights)
    expect = (weights * keep.view(-1, 2)).sum(dim=1, keepdim=True).expand(-1, 5)
    assert torch.equal(y, expect)
    # a sequence's drops depend on that sequence only: route it alone, and the same entries are kept
    _, order_1, counts_1, _, _ = route(logits[1:2], 2, capacity_factor=factor)
    assert sorted(order_1[:int(counts_1.sum())].add(16 * 2).tolist()) == \
        [i for i in torch.nonzero(keep).view(-1).tolist() if 32 <= i < 64]


def test_dropless_is_a_full_permutation():
    logits = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(1))
    _, order, counts, _, load = route(logits, 2)
    assert torch.equal(counts, load) and sorted(order.tolist()) == list(range(32))


def test_bias_chooses_and_the_probabilities_weigh():
    logits = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(logits, -1)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])  # expert 0 chosen by every token
    weights, order, counts, aux, load = route(logits, 2, bias=bias)
    assert load[0] == 16 and counts.sum() == 32
    experts = torch.topk(probs + bias, 2, -1).indices
    top_p = probs.gather(-1, experts).view(16, 2)
    assert torch.equal(weights, top_p / top_p.sum(dim=-1, keepdim=True))  # unbiased, renormalised


def test_bias_update_is_gamma_sign_of_mean_minus_load():
    config = GPTConfig(n_embd=8, n_expert=4, balance="bias", bias_update_rate=0.01)

    class Model(torch.nn.Module):  # only the routers are read: model.transformer.h[i].mlp.router
        def __init__(self, config):
            super().__init__()
            block = torch.nn.Module()
            block.mlp = torch.nn.Module()
            block.mlp.router = Router(config)
            self.transformer = torch.nn.Module()
            self.transformer.h = torch.nn.ModuleList([block])

    model = Model(config)
    update_expert_bias(model, torch.tensor([[10, 2, 4, 4]]))  # mean 5
    assert torch.equal(model.transformer.h[0].mlp.router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    update_expert_bias(model, torch.tensor([[5, 5, 5, 5]]))  # balanced: sign 0, no move
    assert torch.equal(model.transformer.h[0].mlp.router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert "transformer.h.0.mlp.router.expert_bias" in dict(model.named_buffers())  # hence in the checkpoint
    plain = Model(GPTConfig(n_embd=8, n_expert=4))  # --balance aux: no bias, nothing moves
    update_expert_bias(plain, torch.tensor([[10, 2, 4, 4]]))
    assert plain.transformer.h[0].mlp.router.expert_bias is None and not dict(plain.named_buffers())


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"]).ok()


def test_options_change_the_run(reference):
    """The options act (so the checks below can fail): tokens are dropped at capacity 1.0, and the
    bias, zero at step 0, moves the choices from step 1 on (a rate of 0 leaves them alone)."""
    assert all(0 < row["dropped_fraction"] < 0.5 for row in reference.steps)
    still = launch("01_single_gpu.py", BASE + ["--sample_tokens", "0", "--bias_update_rate", "0", "--max_iters", "3",
                                               "--lr_decay_iters", "6"]).ok()
    assert still.losses[0] == reference.losses[0] and still.losses[1:] != reference.losses[1:3]


@pytest.mark.parametrize("ranks, ep, micro", [(4, 4, None), (4, 2, 1)])
def test_options_equal_single_gpu(reference, ranks, ep, micro):
    """01's losses, tokens per expert and drops at ep 4, and at ep 2 x dp 2 with micro-batches of
    one sequence (01 runs all 8 at once: the capacity's group is a sequence, not a micro-batch);
    the ledger on each step's routing (the all-to-alls carry only the kept rows)."""
    run = launch("10_expert_parallel.py", BASE + ["--ep", ep] + (["--micro_batch_size", micro] if micro else []),
                 nprocs=ranks).ok()
    assert_losses_match(reference, run, what=f"ep {ep} x dp {ranks // ep}, {' '.join(OPTIONS)}")
    assert "ledger mismatch" not in run.stderr, run.stderr
    for mine, single in zip(run.steps, reference.steps):
        assert mine["expert_tokens"] == single["expert_tokens"] and sum(mine["expert_tokens"]) == L * K * B * S
        assert mine["dropped_fraction"] == pytest.approx(single["dropped_fraction"], abs=1e-12)
        assert mine["comm_bytes"] == mine["comm_bytes_theory"], mine["step"]
        assert mine["activation_bytes"] == mine["activation_bytes_theory"], mine["step"]


def test_balance_none_equals_single_gpu():
    """--balance none (no loss, no bias) with a tighter capacity, at ep 2: 01's losses and drops."""
    flags = TINY + MOE + ["--balance", "none", "--capacity_factor", "0.5", "--max_iters", "3"]
    single = launch("01_single_gpu.py", flags + ["--sample_tokens", "0"]).ok()
    ep = launch("10_expert_parallel.py", flags + ["--ep", "2"], nprocs=2).ok()
    assert_losses_match(single, ep, what="--balance none --capacity_factor 0.5 at ep 2")
    assert [r["dropped_fraction"] for r in ep.steps] == pytest.approx([r["dropped_fraction"] for r in single.steps])
    assert all(r["dropped_fraction"] >= 0.3 for r in single.steps)  # half the room: about half dropped


def test_bias_resumes_bit_exact_and_moves_to_01(reference, tmp_path):
    """The biases are in the checkpoint: 01 resumed at its own layout continues bit for bit, and
    01 resuming 10's checkpoint (ep 2) continues 01's run."""
    flags = BASE + ["--sample_tokens", "0", "--max_iters", "6", "--lr_decay_iters", "6"]
    first = launch("01_single_gpu.py", flags + ["--max_iters", "3", "--ckpt_interval", "3",
                                                "--out_dir", tmp_path / "a"]).ok()
    second = launch("01_single_gpu.py", flags + ["--resume", "--out_dir", tmp_path / "a"]).ok()
    assert first.losses + second.losses == reference.losses
    ep = launch("10_expert_parallel.py", BASE + ["--ep", "2", "--max_iters", "3", "--lr_decay_iters", "6",
                                                 "--ckpt_interval", "3", "--out_dir", tmp_path / "b"], nprocs=2).ok()
    single = launch("01_single_gpu.py", flags + ["--resume", "--out_dir", tmp_path / "b"]).ok()

    class Chain:
        losses = ep.losses + single.losses
    assert_losses_match(reference, Chain, what="10 ep 2 with the biases, then 01")


@pytest.mark.parametrize("flags, message", [
    (MOE + ["--capacity_factor", "-1"], "--capacity_factor must not be negative, got -1.0"),
    (MOE + ["--shared_experts", "-1"], "--shared_experts must not be negative, got -1"),
    (MOE + ["--balance", "none", "--aux_loss_coef", "0.01"], "--aux_loss_coef with --balance none"),
    (MOE + ["--bias_update_rate", "0.1"], "--bias_update_rate is the step of --balance bias's bias"),
    (["--balance", "bias"], "--balance: routing options of a mixture of experts: pass --n_expert E"),
])
def test_refusals_are_one_line(flags, message):
    run = launch("01_single_gpu.py", TINY + flags, metrics=False)
    assert run.returncode == 2 and len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr
