"""The scripts as their users run them: the bare commands at the rank counts of real nodes,
the default preset's shape (24 heads, no bias) against 01, the ledger (model state, messages
and activations) exact in float32 *and* bfloat16 for every training script, --dry_run for
every script up to GPT-3 175B, float16 refused."""

import pytest

from harness import assert_losses_match, dry, launch

# the default preset's shape (no bias, 24 heads), made small enough for two CPU cores
BABY = ["--model", "baby", "--n_layer", "5", "--n_embd", "48", "--block_size", "32", "--dropout", "0",
        "--device", "cpu", "--eval_interval", "0", "--log_interval", "1", "--global_batch_size", "12",
        "--max_iters", "2", "--lr", "3e-3", "--warmup_iters", "1", "--timeout", "60", "--grad_clip", "0.05"]

CASES = [  # (script, ranks, strategy flags) for each dtype
    ("03_ddp.py", 3, ["--micro_batch_size", "2"]),
    ("04_zero.py", 2, ["--stage", "1"]),
    ("04_zero.py", 3, ["--stage", "2", "--micro_batch_size", "2"]),
    ("04_zero.py", 2, ["--stage", "3", "--micro_batch_size", "3"]),
    ("05_fsdp.py", 4, ["--replicate", "2", "--micro_batch_size", "1"]),
    ("06_tensor_parallel.py", 4, ["--micro_batch_size", "6"]),
    ("06_tensor_parallel.py", 2, ["--sequence_parallel"]),
    ("07_pipeline.py", 3, []),  # 5 layers on 3 stages: 1, 2, 2
    ("07_pipeline.py", 2, ["--schedule", "interleaved", "--virtual_stages", "2", "--micro_batch_size", "3"]),
    ("08_3d.py", 4, ["--tp", "2", "--pp", "2"]),  # dp 2 x pp 2 x tp 2: test_3d.py, test_checkpoints.py
    ("08_3d.py", 6, ["--pp", "3", "--zero1"]),
    ("08_3d.py", 4, ["--sequence_parallel", "--tp", "2", "--pp", "2"]),  # SP through the pipeline
    ("08_3d.py", 4, ["--cp", "2", "--tp", "2"]),  # ring attention on each TP rank's 12 heads
    ("08_3d.py", 8, ["--cp_impl", "ulysses", "--cp", "2", "--tp", "2", "--pp", "2", "--sequence_parallel"]),  # 4D
]


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", BABY + ["--dtype", "float32", "--sample_tokens", "0"]).ok()


def assert_ledger_exact(run, what):
    assert run.steps, what
    assert "ledger mismatch" not in run.stderr, f"{what}: {run.stderr[-2000:]}"  # any rank's own check
    for row in run.steps:
        assert row["state_bytes"] == row["state_bytes_theory"], f"{what}: held {row['state_bytes']} vs {row['state_bytes_theory']}"
        assert row["comm_bytes"] == row["comm_bytes_theory"], f"{what}: sent {row['comm_bytes']} vs {row['comm_bytes_theory']}"
        assert row["comm_calls"] == row["comm_calls_theory"], f"{what}: calls {row['comm_calls']} vs {row['comm_calls_theory']}"
        assert row["activation_bytes"] == row["activation_bytes_theory"] > 0, \
            f"{what}: activations {row['activation_bytes']} vs {row['activation_bytes_theory']}"


# bf16 for every case but two whose bf16 traffic another case already has (03 all-reduces fp32
# gradients in both; 07's boundaries run bf16 in the interleaved case)
RUNS = [(*case, dtype) for case in CASES for dtype in ("float32", "bfloat16")
        if not (dtype == "bfloat16" and case[:2] in (("03_ddp.py", 3), ("07_pipeline.py", 3)))]


@pytest.mark.parametrize("script, ranks, flags, dtype", RUNS,
                         ids=[f"{c[0][:2]}x{c[1]}{''.join(c[2][:2])}-{c[3]}" for c in RUNS])
def test_default_shape_matches_01_and_the_ledger_is_exact(reference, script, ranks, flags, dtype):
    run = launch(script, BABY + flags + ["--dtype", dtype], nprocs=ranks).ok()
    assert_ledger_exact(run, f"{script} x{ranks} {flags} {dtype}")
    if dtype == "float32":
        assert_losses_match(reference, run, what=f"{script} x{ranks} {flags}")


def test_single_gpu_ledger_in_bfloat16():
    run = launch("01_single_gpu.py", BABY + ["--dtype", "bfloat16", "--sample_tokens", "0"]).ok()
    assert_ledger_exact(run, "01 bf16")


NODE_SIZES = [1, 2, 4, 8, 12, 16, 24]  # one and two nodes of Polaris/Perlmutter (4), Frontier (8), Aurora (12)


@pytest.mark.parametrize("script", ["03_ddp.py", "04_zero.py", "05_fsdp.py", "06_tensor_parallel.py",
                                    "07_pipeline.py", "08_3d.py", "09_context_parallel.py"])
def test_defaults_fit_every_node_size(script):
    """The bare command (no flag but the rank count) is a valid configuration at every node
    size: 06 at tp = N, 07 at pp = N, 09 at the largest cp that splits the sequence;
    validated by the script itself in a dry run."""
    for n in NODE_SIZES:
        if script in ("06_tensor_parallel.py", "07_pipeline.py") and n > 12:
            continue  # one group spanning two nodes: see test_bare_commands_really_run (06 at 8, 07 at 4)
        p = dry(script, "--world_size", n)
        assert p.returncode == 0, f"{script} at {n} ranks: {p.stdout}{p.stderr}"
        assert f"on {n} rank(s)" in p.stdout and "holds model state in all" in p.stdout


@pytest.mark.parametrize("script, ranks", [("06_tensor_parallel.py", 8), ("07_pipeline.py", 4)])
def test_bare_commands_really_run(script, ranks):
    """The design card's command, `mpiexec -n 8 python 06_tensor_parallel.py`, with the
    default preset and batch, for one step on CPU (a context of 16 tokens, to fit two cores: the
    layout, the preset's widths and the batch are what the bare command sets)."""
    run = launch(script, ["--device", "cpu", "--max_iters", "1", "--eval_interval", "0", "--block_size", "16",
                          "--log_interval", "1"], nprocs=ranks, timeout=600).ok()
    assert len(run.steps) == 1 and run.steps[0]["comm_bytes"] == run.steps[0]["comm_bytes_theory"]
    assert run.steps[0]["comm_calls"] == run.steps[0]["comm_calls_theory"]


@pytest.mark.parametrize("script, flags", [
    ("01_single_gpu.py", ["--world_size", 1, "--model", "gpt2-xl"]),
    ("04_zero.py", ["--world_size", 1024, "--ranks_per_node", 4, "--model", "gpt3-175b", "--stage", 3,
                    "--global_batch_size", 1024]),
    ("05_fsdp.py", ["--world_size", 64, "--ranks_per_node", 8, "--model", "gpt3-13b", "--replicate", 8,
                    "--global_batch_size", 256]),
    ("08_3d.py", ["--world_size", 1024, "--ranks_per_node", 4, "--model", "gpt3-175b", "--tp", 4, "--pp", 16,
                  "--global_batch_size", 1536, "--zero1"]),
])
def test_dry_run_plans_large_models_without_building_them(script, flags):
    p = dry(script, *flags)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "per rank:" in p.stdout and "holds model state in all" in p.stdout
    if "gpt3-175b" in flags:
        assert "Ψ = 173,987,500,032" in p.stdout  # 96 layers of 12288 (Brown et al.: 175.0B)


@pytest.mark.parametrize("script, flags, message", [
    ("06_tensor_parallel.py", ["--world_size", 8, "--model", "gpt2-xl"], "n_head 25 is not divisible by the tensor-parallel size 8"),
    ("07_pipeline.py", ["--world_size", 16], "n_layer 12 is fewer than pp 16"),
    # with --device cpu the fit check prices the stages before main() checks the layout
    ("07_pipeline.py", ["--world_size", 8, "--model", "tiny", "--device", "cpu"], "n_layer 4 is fewer than pp 8"),
    ("03_ddp.py", ["--world_size", 5], "--global_batch_size 48 is not divisible by the data-parallel size 5"),
    ("08_3d.py", ["--world_size", 8, "--tp", 3], "world size 8 is not divisible by tp 3 x pp 1 = 3"),
    ("04_zero.py", [], "--dry_run needs --world_size N"),
])
def test_dry_run_refuses_what_would_fail(script, flags, message):
    p = dry(script, *flags)
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], p.stderr


def test_float16_is_refused_with_the_reason():
    run = launch("03_ddp.py", BABY + ["--dtype", "float16"], nprocs=2, timeout=60)
    assert run.returncode != 0
    assert len(run.error_lines) == 1 and "loss scaling" in run.error_lines[0]
