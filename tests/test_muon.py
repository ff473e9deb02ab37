"""--optimizer muon: common.Muon equals torch.optim.Muon (Moonlight's lr scaling) plus AdamW on the
same parameter split, step for step; the scripts that hold whole matrices (03, 07, 09, 10)
reproduce 01's Muon losses, their ledgers count Muon's one moment; checkpoints carry the
momentum and resume across scripts."""

import argparse

import pytest
import torch

from common import GPT, GPTConfig, Muon, is_hidden_matrix, make_adamw, orthogonalize
from harness import TINY, assert_losses_match, dry, launch

BASE = TINY + ["--max_iters", "5", "--optimizer", "muon", "--lr", "1e-2"]
MOE = ["--n_expert", "4", "--top_k", "2"]


def test_muon_equals_torch_muon_with_adamw_for_the_rest():
    config = GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
    args = argparse.Namespace(lr=1e-2, weight_decay=0.1)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(config))

    def split(model):
        named = list(model.named_parameters())
        return ([p for n, p in named if is_hidden_matrix(n, p.shape)],
                [p for n, p in named if not is_hidden_matrix(n, p.shape)])
    matrices, rest = split(models[0])
    assert len(matrices) == 4 * config.n_layer  # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    ours = [Muon(matrices, make_adamw(rest, args, "cpu"), args, torch.bfloat16)]  # bf16, as torch's
    matrices, rest = split(models[1])
    torchs = [torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, momentum=0.95, nesterov=True,
                               adjust_lr_fn="match_rms_adamw"), make_adamw(rest, args, "cpu")]
    x, y = torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    for step in range(4):
        for model, optimizers in zip(models, (ours, torchs)):
            model(x, y)[1].backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        for p, q in zip(*(m.parameters() for m in models)):
            assert torch.equal(p, q), f"step {step}: common.Muon and torch.optim.Muon differ"


def test_newton_schulz_flattens_the_singular_values():
    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(0)) * 3
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.5 and s.max() < 1.5  # Jordan's quintic: roughly U·Vᵀ, S' in (0.5, 1.5)
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 2 * s.max() / s.min()


@pytest.fixture(scope="module")
def reference():
    return {"dense": launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"]).ok(),
            "moe": launch("01_single_gpu.py", BASE + MOE + ["--sample_tokens", "0"]).ok(),
            "dense12": launch("01_single_gpu.py", BASE + ["--global_batch_size", "12", "--sample_tokens", "0"]).ok()}


def test_01_muon_is_not_adamw_and_its_ledger_holds(reference):
    adamw = launch("01_single_gpu.py", TINY + ["--max_iters", "5", "--lr", "1e-2", "--sample_tokens", "0"]).ok()
    muon = reference["dense"]
    assert adamw.losses[0] == muon.losses[0] and adamw.losses[-1] != muon.losses[-1]
    for run in (muon, reference["moe"]):
        row = run.steps[0]
        assert row["state_bytes"] == row["state_bytes_theory"]
    # Muon keeps one fp32 moment for the matrices, AdamW two for the rest
    assert muon.steps[0]["state_bytes"]["optim"] < adamw.steps[0]["state_bytes"]["optim"]
    assert "held optim" in muon.stdout and "| 4Ψ_m + 8(Ψ - Ψ_m) = " in muon.stdout


CASES = [  # (script, ranks, flags, reference)
    ("03_ddp.py", 2, [], "dense"),
    ("07_pipeline.py", 2, ["--schedule", "interleaved", "--virtual_stages", "2", "--micro_batch_size", "2"], "dense"),
    ("09_context_parallel.py", 2, [], "dense"),
    ("04_zero.py", 2, ["--stage", "1"], "dense"),
    ("04_zero.py", 3, ["--stage", "2", "--offload", "--global_batch_size", "12"], "dense12"),
    ("05_fsdp.py", 4, ["--replicate", "2", "--offload", "--global_batch_size", "12"], "dense12"),
    ("08_3d.py", 4, ["--tp", "2", "--pp", "2"], "dense"),
    # --zero1: ZeRO-1 shards AdamW's state (here over the CP ranks), Muon's matrices all-reduced;
    # tp2 x dp2 --zero1 is test_momentum_is_checkpointed_and_resharded_by_another_script's writer
    ("08_3d.py", 4, ["--tp", "2", "--cp", "2", "--sequence_parallel", "--zero1"], "dense"),
    ("08_3d.py", 4, ["--pp", "2", "--zero1"], "dense"),
    ("06_tensor_parallel.py", 2, ["--sequence_parallel"], "dense"),
    ("10_expert_parallel.py", 4, ["--ep", "2"] + MOE, "moe"),
]


@pytest.mark.parametrize("script, ranks, flags, which", CASES)
def test_strategies_equal_01_with_muon(reference, script, ranks, flags, which):
    run = launch(script, BASE + flags, nprocs=ranks).ok()
    assert_losses_match(reference[which], run, what=f"{script} x{ranks} {flags} muon")
    for row in run.steps:
        assert row["state_bytes"] == row["state_bytes_theory"], f"{script} {flags}"
        assert row["comm_bytes"] == row["comm_bytes_theory"], f"{script} {flags}"
        assert row["comm_calls"] == row["comm_calls_theory"], f"{script} {flags}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("script, extra", [("06_tensor_parallel.py", []), ("04_zero.py", ["--stage", "3"])])
def test_sharded_muon_moves_whole_matrices_as_its_formula_says(script, extra, dtype):
    """At 3 ranks (06: c_attn's Q, K and V blocks each split in three; 04: matrices that
    straddle flat shard boundaries): one all-to-all of every rank's update pieces to the
    matrices' owners and one back, in the Newton-Schulz dtype, as costs() says on every rank
    (a mismatch on any rank fails the run's ledger line). Two steps: the second is a steady one."""
    flags = BASE + ["--dtype", dtype, "--n_head", "6", "--n_embd", "96", "--global_batch_size", "12", "--max_iters", "2"]
    run = launch(script, flags + extra, nprocs=3).ok()
    row = run.steps[-1]
    assert row["comm_bytes"]["all_to_all_single"] == row["comm_bytes_theory"]["all_to_all_single"] > 0
    assert row["state_bytes"] == row["state_bytes_theory"] and "ledger mismatch" not in run.stdout + run.stderr
    if dtype == "float32":
        single = launch("01_single_gpu.py", flags + ["--sample_tokens", "0"]).ok()
        assert_losses_match(single, run, what=f"{script} x3 muon")


@pytest.mark.parametrize("ranks", [1, 3])
def test_replicas_broadcast_each_matrix_from_its_owner(ranks):
    """03's ReplicatedMuon in bf16: each matrix orthogonalised by one replica (3 ranks: unequal
    owners) and broadcast from it in the Newton-Schulz dtype, received into the gradient's
    memory read as bf16: e·Ψ_m bytes on every rank, as costs() says; one rank posts nothing."""
    run = launch("03_ddp.py", BASE + ["--dtype", "bfloat16", "--global_batch_size", "12", "--max_iters", "3"],
                 nprocs=ranks).ok()
    row = run.steps[-1]
    assert row["comm_bytes"] == row["comm_bytes_theory"] and "ledger mismatch" not in run.stdout + run.stderr
    assert (row["comm_bytes"].get("broadcast", 0) > 0) == (ranks > 1)
    assert any(row["comm_bytes"].values()) == (ranks > 1)  # a replica alone posts nothing at all


def test_momentum_is_checkpointed_and_resharded_by_another_script(reference, tmp_path):
    first = launch("08_3d.py", BASE + ["--tp", "2", "--zero1", "--max_iters", "3", "--ckpt_interval", "3",
                                       "--lr_decay_iters", "5", "--out_dir", tmp_path], nprocs=4).ok()
    # written: the matrices' TP shards with their momentum (DP rank 0), AdamW's flat ZeRO-1 shards (each DP rank)
    row = first.steps[-1]
    assert row["state_bytes"] == row["state_bytes_theory"] and row["comm_bytes"] == row["comm_bytes_theory"]
    assert "ledger mismatch" not in first.stdout + first.stderr
    rest = launch("06_tensor_parallel.py", BASE + ["--resume", "--out_dir", tmp_path, "--lr_decay_iters", "5"],
                  nprocs=2).ok()  # the momentum resharded into TP_PLAN's rows and columns
    assert first.losses + rest.losses == pytest.approx(reference["dense"].losses, rel=2e-5)


def test_an_adamw_checkpoint_is_not_resumed_with_muon(tmp_path):
    flags = TINY + ["--max_iters", "4", "--lr_decay_iters", "4", "--out_dir", tmp_path, "--sample_tokens", "0"]
    launch("01_single_gpu.py", flags + ["--max_iters", "2", "--ckpt_interval", "2"]).ok()
    run = launch("01_single_gpu.py", flags + ["--resume", "--optimizer", "muon"])
    assert run.returncode == 2 and len(run.error_lines) == 1
    assert "written with optimizer=adamw, this run has optimizer=muon" in run.error_lines[0]


@pytest.mark.parametrize("script, ranks", [("04_zero.py", 8), ("05_fsdp.py", 8), ("06_tensor_parallel.py", 4)])
def test_the_dry_run_says_how_the_owners_share_the_work(script, ranks):
    done = dry(script, "--world_size", ranks, "--model", "gpt2", "--optimizer", "muon")
    assert done.returncode == 0, done.stderr
    assert "Muon: 48 matrices, each orthogonalised whole by its owner" in done.stdout  # 4 per block, 12 blocks
    assert "all_to_all_single" in done.stdout and "Newton-Schulz " in done.stdout
