"""Activation memory: the bytes autograd holds for backward (infra.activations.ActivationMeter, through
saved-tensor hooks) equal each script's costs()["activations"] to the byte, in fp32 and
bf16, with dropout and without, with and without --recompute (without it and without
dropout, for every strategy: test_real_conditions.py); --recompute leaves the
losses unchanged (01's oracle in fp32 with dropout 0, and the same dropout masks with
dropout on). --offload (04 at every stage, 05) leaves the losses unchanged and the ledger,
split into device and host bytes, exact."""

import pytest
import torch

from harness import TINY, assert_losses_match, launch

SHORT = TINY + ["--max_iters", "2"]  # the second step is a steady one: every count shows there
DROP = ["--dropout", "0.2"]
BF16 = ["--dtype", "bfloat16"]


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", SHORT + ["--sample_tokens", "0"]).ok()


def assert_activations_exact(run, what):
    assert run.steps, what
    for row in run.steps:
        assert row["activation_bytes"] is not None and row["activation_bytes"] > 0, what
        assert row["activation_bytes"] == row["activation_bytes_theory"], \
            f"{what}: measured {row['activation_bytes']} vs theory {row['activation_bytes_theory']}"


def test_reference_activations_exact(reference):
    assert_activations_exact(reference, "01 fp32")


# (script, ranks, flags): each strategy with --recompute against 01's losses (fp32, dropout 0)
ORACLE = [
    ("01_single_gpu.py", 1, ["--sample_tokens", "0"]),
    ("03_ddp.py", 2, ["--micro_batch_size", "2"]),
    ("04_zero.py", 2, ["--stage", "1"]),
    ("04_zero.py", 2, ["--stage", "3"]),
    ("05_fsdp.py", 2, []),
    ("06_tensor_parallel.py", 2, []),
    ("06_tensor_parallel.py", 2, ["--sequence_parallel"]),
    ("07_pipeline.py", 2, ["--micro_batch_size", "2"]),
    ("07_pipeline.py", 2, ["--schedule", "interleaved", "--virtual_stages", "2", "--micro_batch_size", "2"]),
    ("07_pipeline.py", 3, ["--schedule", "zb", "--micro_batch_size", "2"]),  # W's tensors pile up under B's
    ("08_3d.py", 4, ["--tp", "2", "--pp", "2"]),
    ("08_3d.py", 4, ["--tp", "2", "--cp", "2", "--sequence_parallel"]),  # the ring and SP's gathers again
    ("09_context_parallel.py", 2, ["--cp_impl", "ring"]),  # the ring's K/V go around again
    ("09_context_parallel.py", 2, ["--cp_impl", "ulysses"]),  # the four all-to-alls again
]


@pytest.mark.parametrize("script, ranks, flags", ORACLE, ids=[c[0][:2] + "".join(c[2][:2]) for c in ORACLE])
def test_recompute_matches_01_and_activations_exact(reference, script, ranks, flags):
    run = launch(script, SHORT + flags + ["--recompute"], nprocs=ranks).ok()
    assert_losses_match(reference, run, what=f"{script} --recompute")
    assert_activations_exact(run, f"{script} x{ranks} {flags} --recompute")
    for row in run.steps:  # the recomputed forward's collectives (06, 08's TP, 09) are in the formula
        assert row["comm_bytes"] == row["comm_bytes_theory"], f"{script} {flags} --recompute"
        assert row["comm_calls"] == row["comm_calls_theory"], f"{script} {flags} --recompute"
    # recompute keeps block inputs only: far less than the reference's full activations
    assert run.steps[0]["activation_bytes"] < reference.steps[0]["activation_bytes"]


# without --recompute, in bf16 and with dropout (CPU's masks, the math attention kernel)
EXACT = [
    ("04_zero.py", 2, ["--stage", "1", "--recompute"] + BF16 + DROP),
    ("07_pipeline.py", 2, ["--schedule", "interleaved", "--virtual_stages", "2", "--micro_batch_size", "2"]),
    ("07_pipeline.py", 3, ["--schedule", "gpipe", "--n_layer", "5", "--micro_batch_size", "2"] + BF16 + DROP),
    ("07_pipeline.py", 3, ["--schedule", "zb", "--n_layer", "5", "--micro_batch_size", "2"] + BF16 + DROP),
    ("08_3d.py", 4, ["--pp", "2", "--zero1", "--micro_batch_size", "1"] + BF16 + DROP),
    ("08_3d.py", 4, ["--tp", "2", "--cp", "2", "--cp_impl", "ulysses"] + BF16 + DROP),  # 1 head a rank
    ("09_context_parallel.py", 2, ["--cp_impl", "ulysses"] + BF16 + DROP),  # SDPA on all-to-all'd heads
]


@pytest.mark.parametrize("script, ranks, flags", EXACT, ids=[f"{c[0][:2]}-{'-'.join(c[2][:2])}" for c in EXACT])
def test_activations_exact(script, ranks, flags):
    run = launch(script, SHORT + flags, nprocs=ranks).ok()
    assert_activations_exact(run, f"{script} x{ranks} {flags}")


@pytest.mark.parametrize("script, ranks, flags", [
    ("06_tensor_parallel.py", 2, ["--sequence_parallel"] + BF16),  # the shared and the rank's own stream
    ("09_context_parallel.py", 2, ["--cp_impl", "ring"] + BF16),  # a stream per rank, ring attention
], ids=["06sp", "09ring"])
def test_recompute_redraws_the_same_dropout_masks(script, ranks, flags):
    plain = launch(script, SHORT + flags + DROP, nprocs=ranks).ok()
    again = launch(script, SHORT + flags + DROP + ["--recompute"], nprocs=ranks).ok()
    assert plain.losses == again.losses, f"{script}: {plain.losses} vs {again.losses} with --recompute"
    assert_activations_exact(plain, f"{script} {flags} dropout")
    assert_activations_exact(again, f"{script} {flags} dropout --recompute")


def test_meter_counts_storages_once_and_skips_parameters():
    """In-process: views of one storage count once, parameters (and their transposes) are
    not counted, everything is released after backward, and the peak is kept."""
    from infra.activations import ActivationMeter
    lin = torch.nn.Linear(8, 24)
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationMeter() as meter:
        qkv = lin(x)  # saves x (the weight is a parameter: not counted)
        q, k, v = qkv.split(8, dim=1)  # views of one storage
        y = (q * k).sum() + (v * 2).sum()  # saves q and k: qkv's storage, once
        held = meter.current
        y.backward()
    assert held == 4 * 8 * 4 + 4 * 24 * 4
    assert meter.peak == held and meter.current == 0


OFFLOAD = [
    ("04_zero.py", 2, ["--stage", "1"]),
    ("04_zero.py", 2, ["--stage", "2", "--micro_batch_size", "2"]),
    ("04_zero.py", 2, ["--stage", "3"]),
    ("05_fsdp.py", 2, []),
]


@pytest.mark.parametrize("script, ranks, flags", OFFLOAD, ids=[f"{c[0][:2]}{''.join(c[2][:2])}" for c in OFFLOAD])
def test_offload_matches_01_and_the_ledger_splits_device_and_host(reference, script, ranks, flags):
    run = launch(script, SHORT + flags + ["--offload"], nprocs=ranks).ok()
    assert_losses_match(reference, run, what=f"{script} {flags} --offload")
    for row in run.steps:
        held = row["state_bytes"]
        assert held == row["state_bytes_theory"], f"{script} {flags} --offload: {held} vs {row['state_bytes_theory']}"
        assert held["optim"] == 0 and held["optim (host)"] > 0 and held["grads (host)"] > 0, held
        # what the host holds, which mem_peak_bytes (the device's) leaves out: costs()'s host kinds
        assert row["mem_host_bytes"] == sum(v for kind, v in row["state_bytes_theory"].items() if "(host)" in kind)
        assert row["comm_bytes"] == row["comm_bytes_theory"] and row["comm_calls"] == row["comm_calls_theory"]
    assert_activations_exact(run, f"{script} {flags} --offload")
