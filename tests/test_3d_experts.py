"""08_3d.py with experts (--n_expert E --top_k K --ep N): the experts of every block over EP
groups carved out of each DP x CP group, attention keeping its TP (and SP) and the pipeline
its stages, with common.py's routing options (--balance, --capacity_factor, --shared_experts)
and Muon. Each launch checks at once: the losses, the tokens per expert and the drops equal
01_single_gpu.py's with the same experts and options (the oracle), and the ledger equals
costs() on every rank, bytes and calls (each rank checks its own: the all-to-alls on this
step's routing, the experts' expert_dp all-reduce). A checkpoint resumed with the routers'
biases; the options priced by costs() alone; the dry runs of the big presets; the refusals."""

import importlib

import pytest

from harness import TINY, assert_losses_match, dry, launch
from test_rehearse import rehearse

MOE = ["--n_expert", "4", "--top_k", "2"]
BASE = TINY + MOE + ["--global_batch_size", "8", "--max_iters", "3", "--grad_clip", "0.05"]
BIAS = ["--balance", "bias", "--bias_update_rate", "0.05"]  # a step large enough to move a tiny run's choices
CAPACITY, SHARED, MUON = ["--capacity_factor", "1.0"], ["--shared_experts", "1"], ["--optimizer", "muon"]
REFERENCES = {}


def reference(options):
    """01 with the same experts and options (one launch per set of options, kept for the module)."""
    key = tuple(map(str, options))
    if key not in REFERENCES:
        REFERENCES[key] = launch("01_single_gpu.py", BASE + list(options) + ["--sample_tokens", "0"]).ok()
    return REFERENCES[key]


def assert_ledger(run):
    assert "ledger mismatch" not in run.stderr, run.stderr[-3000:]
    for row in run.steps:  # rank 0's, on every logged step's own routing
        assert row["state_bytes"] == row["state_bytes_theory"]
        assert row["comm_bytes"] == row["comm_bytes_theory"], row["step"]
        assert row["comm_calls"] == row["comm_calls_theory"], row["step"]
        assert row["comm_bytes"]["all_to_all_single[ep]"] > 0


def assert_routing_is_01s(single, run):
    """The metrics' routing keys (08 sums every layer's counts over the world) equal 01's."""
    for mine, one in zip(run.steps, single.steps):
        assert mine["expert_tokens"] == one["expert_tokens"] and mine["expert_imbalance"] == one["expert_imbalance"]
        assert mine["dropped_fraction"] == pytest.approx(one["dropped_fraction"], abs=1e-12)


# (ranks, flags, options): tp2 x ep2 (dp 2, the experts and the shared expert replicated over TP) with
# every routing option at once (the check); cp2 x ep2 (dp 2: the EP group is the CP pair, whose
# tokens every rank gathers, so the capacity's sequence is whole; a second one, so the experts'
# gradients over expert_dp and their Muon's broadcasts there) with the capacity alone and Muon; pp2 x
# ep2 (dp 2, four micro-batches: every stage's balancing loss) with --balance aux; and tp2 x pp2 x ep2
# at 8 ranks with sequence parallelism and ZeRO-1, the shared expert alone. --balance bias alone:
# test_resumes_with_the_routers_biases.
CASES = [
    (4, ["--tp", 2, "--ep", 2, "--micro_batch_size", 2], BIAS + CAPACITY + SHARED),
    (4, ["--cp", 2, "--ep", 2, "--micro_batch_size", 2], CAPACITY + MUON),
    (4, ["--pp", 2, "--ep", 2, "--micro_batch_size", 1], []),
    (8, ["--tp", 2, "--pp", 2, "--ep", 2, "--micro_batch_size", 2, "--sequence_parallel", "--zero1"], SHARED),
]


@pytest.mark.parametrize("ranks, flags, options", CASES,
                         ids=lambda x: " ".join(map(str, x)) if isinstance(x, list) else str(x))
def test_losses_equal_01_and_ledger_equals_costs(ranks, flags, options):
    single = reference(options)
    run = launch("08_3d.py", BASE + flags + options, nprocs=ranks, timeout=400).ok()
    assert_losses_match(single, run, what=f"08 {flags} {options}")
    assert_ledger(run)
    assert_routing_is_01s(single, run)
    if "--capacity_factor" in options:  # the capacity acts: some tokens dropped, as 01 drops them
        assert all(row["dropped_fraction"] > 0 for row in run.steps)


def test_resumes_with_the_routers_biases(tmp_path):
    """--balance bias alone, at pp2 x ep2 (every stage moves its own layers' biases on the world's
    counts): two steps, a checkpoint, the third resumed from it equal to 01's three steps; the biases
    must come back from the checkpoint (step 2 routes with them)."""
    single = reference(BIAS)
    flags = BASE + BIAS + ["--pp", 2, "--ep", 2, "--micro_batch_size", 1, "--lr_decay_iters", 3,
                           "--out_dir", tmp_path]
    first = launch("08_3d.py", flags + ["--max_iters", 2, "--ckpt_interval", 2], nprocs=4, timeout=400).ok()
    second = launch("08_3d.py", flags + ["--resume"], nprocs=4, timeout=400).ok()
    assert "resum" in second.stdout + second.stderr

    class Chain:
        losses = first.losses + second.losses
    assert_losses_match(single, Chain, what="08 pp2 x ep2 --balance bias, resumed at step 2")
    assert_ledger(first)


def test_plan_ranks_08_with_experts_next_to_10_on_their_groups():
    """plan.py's candidates with experts: 10 at every ep, and 08 with EP groups carved out of DP
    (ZeRO-1, with and without SP, ep dividing dp and E); 08's ep and expert_dp groups priced where
    they sit: at tp 2 x pp 2 on 16 GPUs (dp 4, ep 2), an EP group is DP ranks 0 and 1 (global
    0 and 4, one node of 8), expert_dp the DP ranks 0 and 2 (global 0 and 8: two nodes)."""
    import argparse

    import plan
    moe = list(plan.candidates(16, 8, 4, n_expert=4))
    three = [c for c in moe if c[0] == "08_3d.py"]
    assert ("08_3d.py", ["--tp", "2", "--pp", "2", "--ep", "2", "--zero1", "--sequence_parallel"],
            "3D+EP dp 4 pp 2 tp 2 ep 2 + SP + ZeRO-1") in three
    assert all(16 // (int(f[1]) * int(f[3])) % int(f[5]) == 0 and 4 % int(f[5]) == 0 for _, f, _ in three)
    args = argparse.Namespace(tp=2, pp=2, cp=1, ep=2)
    assert plan.group_of("08_3d.py", "all_to_all_single[ep]", args, 16, 8) == (2, None)
    assert plan.group_of("08_3d.py", "all_reduce[expert_dp]", args, 16, 8) == (2, 1)


@pytest.mark.parametrize("flags, fit", [
    (["--model", "mixtral-8x7b", "--tp", 4, "--pp", 8, "--ep", 4, "--world_size", 256, "--gpu_mem_gb", 80], "fit: fits"),
    (["--model", "deepseek-v3", "--tp", 8, "--pp", 16, "--ep", 4, "--world_size", 1024, "--gpu_mem_gb", 141], "fit: "),
], ids=["mixtral-8x7b", "deepseek-v3"])
def test_big_mixtures_dry_run_priced_and_fit_checked(flags, fit):
    """The two presets (common.py says what they approximate) dry-run with ZeRO-1 and SP: the
    experts E/N per rank in the layout, the EP all-to-alls and the expert_dp all-reduce priced,
    and the fit verdict (DeepSeek-V3's 4h-wide experts are 14x V3's: its verdict is whatever
    the formulas say)."""
    p = dry("08_3d.py", *flags, "--zero1", "--sequence_parallel", "--global_batch_size", 1024,
            "--micro_batch_size", 1, "--data", "synthetic")
    assert p.returncode == 0, p.stderr
    assert " experts per layer)" in p.stdout and fit in p.stdout
    assert "all_to_all_single[ep]" in p.stdout and "all_reduce[expert_dp]" in p.stdout


def costs_of(*flags, received=None, sent=None):
    """Rank 0's costs() of 08 at tp2 x ep2 on 4 ranks (dp 2), m = 2 micro-batches of 2, without a launch."""
    import torch

    from common import Data, model_config
    m = importlib.import_module("08_3d")
    args = m.add_flags(m.make_parser(m.__doc__, experts=True)).parse_args(
        [str(f) for f in [*TINY, *MOE, "--tp", 2, "--ep", 2, "--micro_batch_size", 2, *flags]])
    config = model_config(args, Data.vocab_size_of(args.data))
    return config, m.costs(args, config, 4, torch.float32, received=received, sent=sent)


def test_costs_price_each_routing_option_alone():
    """Each option alone, in costs() (what the launches above prove against the ledger, stated here
    where a launch cannot vary it): --shared_experts S adds S MLPs per layer, replicated (Ψ_rank, not
    Ψ_x: the dense all-reduce carries them); --capacity_factor bounds the dry run's rows received by
    the capacity, b·E·⌈C·k·s/E⌉ a layer (at most N·k·b·s) and prices a step on the rows it sent and
    received; --balance bias holds no parameter more (its bias is a buffer); every one of them sums
    the routing counts over the world, 8·n_layer·(E + 1) bytes in one call."""
    config, plain = costs_of()
    h, L, m = config.n_embd, config.n_layer, 2
    _, shared = costs_of("--shared_experts", 2)
    assert shared["held"]["params"][1] - plain["held"]["params"][1] == 4 * 2 * L * (8 * h * h + 5 * h)
    assert shared["sent"]["all_reduce[dp]"][1] - plain["sent"]["all_reduce[dp]"][1] == 4 * 2 * L * (8 * h * h + 5 * h)
    assert shared["layout"].split("(of them")[1] == plain["layout"].split("(of them")[1]  # Ψ_x: the routed alone
    rows = plain["sent"]["all_to_all_single[ep]"][1] - 8 * 4 * L * m  # 2 passes x 4 bytes x h x (S + R)
    assert rows == 2 * 4 * h * 2 * (L * m * 2 * 2 * 64)  # S = R = L·m·k·b·s: balanced
    _, half = costs_of("--capacity_factor", "0.25")  # ⌈0.25·2·64/4⌉ = 8 rows a sequence per expert
    assert half["sent"]["all_to_all_single[ep]"][1] - 8 * 4 * L * m == 2 * 4 * h * (L * m * 2 * 2 * 64 + L * m * 2 * 4 * 8)
    _, step = costs_of("--capacity_factor", "0.25", received=[[50, 60]] * L, sent=[[70, 80]] * L)
    assert step["sent"]["all_to_all_single[ep]"][1] - 8 * 4 * L * m == 2 * 4 * h * L * (50 + 60 + 70 + 80)
    _, bias = costs_of("--balance", "bias")
    assert bias["held"] == plain["held"]
    for cost in (plain, shared, half, bias):
        assert cost["sent"]["all_reduce"][1] == 8 * L * (4 + 1) and cost["calls"]["all_reduce"][1] == 1


@pytest.mark.parametrize("flags, message", [
    (MOE + ["--ep", 3, "--world_size", 4], "--ep 3 does not divide the 4 data-parallel x context-parallel ranks"),
    (MOE + ["--ep", 4, "--n_expert", 6, "--world_size", 4], "--n_expert 6 is not divisible by --ep 4"),
    (["--ep", 2, "--world_size", 4], "--ep 2 places experts: pass --n_expert E"),
    (MOE + ["--tp", 2, "--ep", 2, "--shared_experts", 1, "--optimizer", "muon", "--world_size", 4],
     "--shared_experts with --optimizer muon at --tp > 1 is not implemented in 08_3d.py"),
])
def test_refusals_are_one_line(flags, message):
    p = dry("08_3d.py", *TINY, "--micro_batch_size", 1, *flags)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0], p.stderr


@pytest.mark.big
def test_rehearsed_at_1024_ranks_equal_costs(tmp_path):
    """08 with experts at tp 2 x pp 2 x dp 256, ep 4 (64 EP groups a place, expert_dp of 64),
    SP and ZeRO-1, bf16: `roles` rehearsed, every rehearsed rank holds and sends what costs()
    says, the rest by the mesh's symmetry, no deadlock under NCCL's rules (about 20 s)."""
    flags = ["--n_expert", 8, "--top_k", 2, "--tp", 2, "--pp", 2, "--ep", 4, "--sequence_parallel", "--zero1",
             "--global_batch_size", 256, "--dtype", "bfloat16"]
    run, rows = rehearse(tmp_path, "08_3d.py", flags, ranks="roles", world_size=1024)
    assert rows and "costs(): every rehearsed rank holds and sends what its formulas say" in run.stdout, run.stdout
    assert "replay under NCCL's rules: no deadlock" in run.stdout and "expert_dp" in run.stdout
