"""08_3d.py: losses equal 01's for every factorisation of 8 ranks that the tiny model admits,
with and without --zero1, --sequence_parallel and --cp (ring and Ulysses, up to dp x pp x cp
x tp); the mesh; the ledger; the point-to-point order under NCCL's rules; resume; export;
refusals."""

import os

import pytest

import nccl_replay
from harness import ROOT, TINY, assert_losses_match, launch
from test_real_conditions import dry

BASE = TINY + ["--global_batch_size", "24", "--max_iters", "4", "--grad_clip", "0.05",
               "--eval_interval", "4", "--eval_iters", "1"]


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"]).ok()


def rank0_parameters(T, P):
    """Parameters held by global rank 0 (first stage, TP rank 0), from the config."""
    h, L, V, ctx = 64, 4, 65, 64
    block = 2 * h + (3 * h * h + 3 * h) // T + h * h // T + h + 2 * h + (4 * h * h + 4 * h) // T + 4 * h * h // T + h
    n = (L // P) * block + (-(-V // T) * T // T) * h + ctx * h  # layers, wte shard, wpe
    return n + (2 * h if P == 1 else 0)  # ln_f lives on the last stage


# (dp, pp, tp): the factorisations of 8 that 4 layers and 4 heads admit
# the full mesh with ZeRO-1 and TP across 4 (pp 2 x tp 2 and pp 3 with ZeRO-1 run in
# test_real_conditions.py with the default preset's shape; more stages: 07's tests)
CASES = [(2, 2, 2, True), (2, 1, 4, False)]


@pytest.mark.parametrize("D, P, T, zero1", CASES, ids=lambda x: str(x))
def test_losses_mesh_and_ledger(reference, D, P, T, zero1):
    micro = max(1, 24 // D // 2)  # two (three for D = 8) micro-batches per replica
    run = launch("08_3d.py", BASE + ["--tp", T, "--pp", P, "--micro_batch_size", micro] + (["--zero1"] if zero1 else []),
                 nprocs=8, timeout=400).ok()
    assert_losses_match(reference, run, what=f"{D}x{P}x{T} zero1={zero1}")
    assert run.evals[-1]["val_loss"] == pytest.approx(reference.evals[-1]["val_loss"], rel=2e-5)
    assert f"mesh: 8 ranks = {D} data-parallel x {P} pipeline x {T} tensor-parallel" in run.stdout
    # TP innermost: rank 1 is the next TP rank if T > 1, else the next stage or replica
    second = (0, 0, 1) if T > 1 else ((0, 1, 0) if P > 1 else (1, 0, 0))
    assert f"  1:(dp {second[0]}, pp {second[1]}, tp {second[2]})" in run.stdout
    n = rank0_parameters(T, P)
    step = run.steps[0]
    if zero1:
        padded = -(-n // D) * D
        assert step["state_bytes"] == {"params": 4 * padded, "grads": 4 * padded + 4 * padded // D,
                                       "optim": 8 * padded // D}
        assert step["comm_bytes"]["reduce_scatter_tensor[dp]"] == 4 * padded
        assert step["comm_bytes"]["all_gather_into_tensor[dp]"] == 4 * padded
    else:
        assert step["state_bytes"] == {"params": 4 * n, "grads": 4 * n, "optim": 8 * n}
        assert step["comm_bytes"]["all_reduce[dp]"] == 4 * n + 4
    bsh, bs, m = micro * 64 * 64 * 4, micro * 64 * 4, 24 // (D * micro)
    head = (bsh + 3 * bs) if P == 1 else 0
    assert step["comm_bytes"]["all_reduce[tp]"] == m * (4 * (4 // P) * bsh + bsh + head)
    if P > 1:
        assert step["comm_bytes"]["send"] == step["comm_bytes"]["recv"] == m * bsh
    else:
        assert "send" not in step["comm_bytes"]


# --sequence_parallel (Korthikanti et al. 2022) in every TP group: through the pipeline (pp 2 x tp 2,
# four micro-batches) and beside ZeRO-1 (dp 2 x tp 2, two micro-batches per replica)
SP_CASES = [(1, 2, 2, False), (2, 1, 2, True)]


@pytest.mark.parametrize("D, P, T, zero1", SP_CASES, ids=lambda x: str(x))
def test_sequence_parallel_matches_01(reference, D, P, T, zero1):
    flags = ["--tp", T, "--pp", P, "--micro_batch_size", 6, "--sequence_parallel"] + (["--zero1"] if zero1 else [])
    run = launch("08_3d.py", BASE + flags, nprocs=4, timeout=400).ok()
    assert_losses_match(reference, run, what=f"{D}x{P}x{T} zero1={zero1} --sequence_parallel")
    assert run.evals[-1]["val_loss"] == pytest.approx(reference.evals[-1]["val_loss"], rel=2e-5)
    assert "sequence parallelism in each TP group" in run.stdout
    assert_sp_ledger(run, P, T, m=24 // (D * 6))


def assert_sp_ledger(run, P, T, m, recompute=False):
    """The ledger exact on every rank (each checks its own, print_ledger) and rank 0's SP
    traffic from docs/strategies.md's 08 formulas, written out here: per micro-batch and layer
    all-gathers of 2·2·4 + 2·4 b·s·h (f forward and again in backward, g's backward) and
    reduce-scatters of 2·4 + 2·4 b·s·h, the embedding's 4 b·s·h of each (rank 0 is the first
    stage), the head's 2·4 and 4 b·s·h when it is also the last; the boundary sends b·s·h/T
    (fp32); the replicated parameters' gradients (LayerNorms, c_proj biases, wpe) all-reduced
    over the TP group."""
    assert "ledger mismatch" not in run.stderr, run.stderr[-2000:]
    h, L, bsh, bs = 64, 4 // P, 6 * 64 * 64, 6 * 64
    for row in run.steps:
        assert row["state_bytes"] == row["state_bytes_theory"]
        assert row["comm_bytes"] == row["comm_bytes_theory"] and row["comm_calls"] == row["comm_calls_theory"]
        assert row["activation_bytes"] == row["activation_bytes_theory"] > 0
    comm, last = run.steps[0]["comm_bytes"], P == 1
    again = 2 * 4 * L * bsh * m if recompute else 0  # the recomputed forward's f and g
    assert comm["all_gather_into_tensor[tp]"] == 4 * m * (6 * L + 1 + 2 * last) * bsh + again
    assert comm["reduce_scatter_tensor[tp]"] == 4 * m * (4 * L + 1 + last) * bsh + again
    replicated = L * 6 * h + 64 * h + (2 * h if last else 0)  # ln_1, ln_2, 2 biases; wpe; ln_f
    assert comm["all_reduce[tp]"] == 4 * replicated + (12 * m * bs if last else 0)
    if P > 1:
        assert comm["send"] == comm["recv"] == 4 * m * bsh // T


def test_sequence_parallel_recompute_resumes_in_01(reference, tmp_path):
    """pp 2 x tp 2 + SP with --recompute (the recomputed forward's all-gathers and
    reduce-scatters in the ledger) for steps 0-1, its checkpoint resumed by 01 for steps 2-3:
    both legs 01's losses (SP changes no parameter's layout in the checkpoint)."""
    chain = ["--lr_decay_iters", "4", "--out_dir", tmp_path]
    sp = launch("08_3d.py", BASE + chain + ["--tp", 2, "--pp", 2, "--micro_batch_size", 6, "--sequence_parallel",
                                            "--recompute", "--max_iters", 2, "--ckpt_interval", 2],
                nprocs=4, timeout=400).ok()
    assert_sp_ledger(sp, P=2, T=2, m=4, recompute=True)
    single = launch("01_single_gpu.py", BASE + chain + ["--resume", "--sample_tokens", "0"]).ok()
    assert [row["step"] for row in sp.steps + single.steps] == [0, 1, 2, 3]
    assert_losses_match(reference, type(reference)(sp.cmd, 0, "", "", 0, sp.steps + single.steps),
                        what="08 pp 2 x tp 2 + SP --recompute, then 01 --resume")


# --cp C (context parallelism inside each stage's attention, 09's ring and Ulysses on each TP
# rank's heads): the mesh DP x PP x CP x TP, the gradients reduced over DP x CP
CP_CASES = [
    (4, ["--tp", 2, "--cp", 2]),  # ring on 2 heads per TP rank
    (8, ["--tp", 2, "--pp", 2, "--cp", 2, "--sequence_parallel", "--zero1"]),  # 4D + SP: 16 of 64 tokens a rank
    (8, ["--tp", 2, "--pp", 2, "--cp", 2, "--cp_impl", "ulysses"]),  # 1 head per rank inside attention
    (4, ["--cp", 2, "--cp_impl", "ulysses", "--zero1"]),  # dp 2 x cp 2: ZeRO-1 over all 4
]


@pytest.mark.parametrize("ranks, flags", CP_CASES, ids=lambda x: "-".join(map(str, x)) if isinstance(x, list) else str(x))
def test_context_parallel_matches_01(reference, ranks, flags):
    run = launch("08_3d.py", BASE + flags + ["--micro_batch_size", 6], nprocs=ranks, timeout=400).ok()
    get = lambda flag: int(flags[flags.index(flag) + 1]) if flag in flags else 1  # noqa: E731
    T, P, C, zero1 = get("--tp"), get("--pp"), get("--cp"), "--zero1" in flags
    D, ring, sp = ranks // (T * P * C), "ulysses" not in flags, "--sequence_parallel" in flags
    assert_losses_match(reference, run, what=f"08 {flags}")
    assert run.evals[-1]["val_loss"] == pytest.approx(reference.evals[-1]["val_loss"], rel=2e-5)
    assert (f"mesh: {ranks} ranks = {D} data-parallel x {P} pipeline x {C} context-parallel x {T} tensor-parallel"
            in run.stdout)
    second = "cp 0, tp 1" if T > 1 else "cp 1, tp 0"  # TP innermost, then CP
    assert f"  1:(dp 0, pp 0, {second})" in run.stdout
    assert f"context parallelism ({'ring' if ring else 'ulysses'}) over {C} ranks, 32 of 64 tokens" in run.stdout
    # every rank's ledger exact (print_ledger), and rank 0's traffic from docs/strategies.md's
    # 08 formulas written out: per micro-batch and layer, the ring's K and V C-1 hops forward
    # and backward and fp32 dK, dV C hops, or Ulysses' 8 all-to-alls, all of this TP rank's
    # heads of its 32 tokens; the boundary the residual stream's 32 tokens (/T with SP); the
    # gradients reduced over DP x CP (ZeRO-1: padded to D·C)
    assert "ledger mismatch" not in run.stderr, run.stderr[-2000:]
    for row in run.steps:
        assert row["state_bytes"] == row["state_bytes_theory"] and row["comm_bytes"] == row["comm_bytes_theory"]
        assert row["comm_calls"] == row["comm_calls_theory"]  # and every call, each paying its latency
        assert row["activation_bytes"] == row["activation_bytes_theory"] > 0
    comm, m, L, A = run.steps[0]["comm_bytes"], 24 // (D * 6), 4 // P, 6 * 32 * 64 // T * 4
    boundary = m * 4 * 6 * 32 * 64 // (T if sp else 1) if P > 1 else 0
    if ring:
        assert comm["send"] == comm["recv"] == m * L * (4 * (C - 1) * A + 2 * C * A) + boundary
        assert "all_to_all_single[cp]" not in comm
    else:
        assert comm["all_to_all_single[cp]"] == m * L * 8 * A and comm.get("send", 0) == boundary
    n = rank0_parameters(T, P)
    if zero1:
        assert comm["reduce_scatter_tensor[dp]"] == comm["all_gather_into_tensor[dp]"] == 4 * -(-n // (D * C)) * D * C
    else:
        assert comm["all_reduce[dp]"] == 4 * n + 4


def test_context_parallel_point_to_point_replays_under_nccl(tmp_path):
    """pp 2 x cp 2: the pipeline's boundary exchanges (world communicator) and the ring's K/V
    passes (each CP group's), recorded rank by rank over a step and its evaluations,
    replay under NCCL's semantics (tests/nccl_replay.py: rendezvous sends, one queue a rank)."""
    record = tmp_path / "record"
    flags = TINY + ["--pp", 2, "--cp", 2, "--global_batch_size", 8, "--micro_batch_size", 2, "--max_iters", 1,
                    "--eval_interval", 1, "--eval_iters", 1]
    launch(os.path.join(ROOT, "tests", "nccl_replay.py"), [record, "08_3d.py"] + flags, nprocs=4, timeout=400).ok()
    posts = nccl_replay.read_records(record)
    for rank in range(4):  # both kinds of batch on every rank: the boundary's peer 2 ranks away, the ring's 1
        peers = {abs(op["peer"] - rank) for entry in posts[rank] if entry["kind"] == "batch" for op in entry["ops"]}
        assert peers == {1, 2}, (rank, peers)
    result = nccl_replay.replay(posts)
    assert result.ok, result.report()


def test_context_parallel_dry_run_and_same_layout_resume(tmp_path):
    """--dry_run draws the 4D mesh and says where its TP and CP groups fall; tp 2 x cp 2 with
    dropout resumes bit for bit at the same layout (each CP rank's shared and own streams)."""
    p = dry("08_3d.py", "--world_size", 16, "--ranks_per_node", 4, *TINY, "--tp", 2, "--pp", 2, "--cp", 2,
            "--cp_impl", "ulysses")
    assert p.returncode == 0, p.stderr
    assert ("mesh: 16 ranks = 2 data-parallel x 2 pipeline x 2 context-parallel x 2 tensor-parallel "
            "(rank = dp·8 + pp·4 + cp·2 + tp)") in p.stdout
    assert "every TP group inside one node" in p.stdout and "every CP group inside one node" in p.stdout
    assert "context parallelism (ulysses) over 2 ranks, 32 of 64 tokens per sequence each" in p.stdout
    p = dry("08_3d.py", "--world_size", 16, "--ranks_per_node", 4, *TINY, "--cp", 8)
    assert p.returncode == 0 and "every CP group spans 2 nodes (slow: keep cp x tp <= ranks per node)" in p.stdout
    flags = BASE + ["--tp", 2, "--cp", 2, "--micro_batch_size", 6, "--dropout", 0.1, "--max_iters", 4,
                    "--lr_decay_iters", 4, "--eval_interval", 0]
    whole = launch("08_3d.py", flags + ["--out_dir", tmp_path / "w"], nprocs=4, timeout=400).ok()
    first = launch("08_3d.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", 2, "--ckpt_interval", 2],
                   nprocs=4, timeout=400).ok()
    second = launch("08_3d.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=4, timeout=400).ok()
    assert first.losses + second.losses == whole.losses


def test_resume_and_export(reference, tmp_path):
    # pp 2 x tp 2 with ZeRO-1's flat buffer (over dp 1): both dropout streams, the shared and
    # the rank's own, must come back for every TP rank of every stage
    flags = BASE + ["--tp", "2", "--pp", "2", "--micro_batch_size", "6", "--zero1", "--max_iters", "4",
                    "--lr_decay_iters", "4", "--dropout", "0.1", "--eval_interval", "4"]
    whole = launch("08_3d.py", flags + ["--out_dir", tmp_path / "w", "--export", tmp_path / "full.pt",
                                        "--ckpt_interval", "4"], nprocs=4, timeout=400).ok()
    first = launch("08_3d.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2", "--ckpt_interval", "2"],
                   nprocs=4, timeout=400).ok()
    second = launch("08_3d.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=4, timeout=400).ok()
    assert first.losses + second.losses == whole.losses  # bit for bit, dropout streams included
    ev = launch("01_single_gpu.py", TINY + ["--global_batch_size", "24", "--eval_only", "--eval_iters", "1",
                                            "--eval_interval", "6", "--sample_tokens", "0",
                                            "--init_from", tmp_path / "full.pt"]).ok()
    assert ev.evals[0]["val_loss"] == pytest.approx(whole.evals[-1]["val_loss"], rel=1e-5)
    # (resuming at another layout, resharded, with the losses checked: test_checkpoints.py)


@pytest.mark.parametrize("ranks, flags, message", [
    (6, ["--tp", "4"], "world size 6 is not divisible by tp 4 x pp 1 = 4"),
    (8, ["--tp", "8"], "n_head 4 is not divisible by tp 8"),
    # the fit check prices a layout before main() checks it: costs() checks first (was a formula's ValueError)
    (24, ["--model", "gpt2-xl", "--block_size", "8192", "--tp", "3", "--machine", "aurora"],
     "n_head 25 is not divisible by tp 3"),
    (8, ["--pp", "8"], "n_layer 4 is fewer than pp 8"),
    (8, ["--tp", "4", "--sequence_parallel", "--block_size", "62"],
     "--sequence_parallel needs block_size 62 divisible by tp 4"),
    (8, ["--cp", "0"], "--tp, --pp and --cp must be positive, got 1, 1 and 0"),
    (8, ["--tp", "2", "--cp", "3"], "world size 8 is not divisible by tp 2 x pp 1 x cp 3 = 6"),
    (8, ["--cp", "4", "--block_size", "60"], "block_size 60 is not divisible by 2 x cp = 8 (ring attention"),
    (8, ["--cp", "4", "--cp_impl", "ulysses", "--block_size", "62"], "block_size 62 is not divisible by --cp 4"),
    (8, ["--tp", "2", "--cp", "4", "--cp_impl", "ulysses"],
     "--cp_impl ulysses needs --cp 4 to divide the heads of each TP rank, n_head / tp = 2"),
    (8, ["--tp", "4", "--cp", "2", "--sequence_parallel", "--block_size", "36"],
     "--sequence_parallel with --cp 2 needs the 18 tokens of a CP rank divisible by tp 4"),
])
def test_bad_layouts_give_one_line(ranks, flags, message):
    """A real launch for the first (every rank ends, one line); the same check as a dry run for
    the others (the validation a launch runs, without starting 8 processes)."""
    if ranks == 6:
        run = launch("08_3d.py", BASE + flags, nprocs=ranks, timeout=120)
        assert run.returncode != 0 and len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr
    else:
        p = dry("08_3d.py", "--world_size", ranks, *BASE, *flags)
        errors = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 2 and len(errors) == 1 and message in errors[0], p.stderr
