"""What a GPU run would wait for: the host syncs of every training step, counted on CPU.

A device-wide synchronize, or reading a device tensor's value on the host (.item(),
.tolist(), .cpu(), bool(), ...), makes the host wait until the GPU has run everything queued,
so the next kernels cannot be queued behind the running ones. On CPU these cost nothing, which
is why a CPU run can count them: with GPTPAR_COUNT_SYNCS=1 infra.stop.HostSyncs counts them inside
each step (forwards, backwards, the guard, the optimizer step; the logging after the step is
not counted) and writes the count into the metrics row as `host_syncs`. torch's fused AdamW,
which the scripts use on GPUs, reads nothing back; its CPU path is exempt (infra.stop.HostSyncs).

The table is the contract: the guard reads its flags once per step (1), and a strategy may
add only what it states here."""

import pytest

from harness import TINY, launch

GUARD = 1  # infra.stop.Guard: one read of the agreed flags, before the update

# script, ranks, flags, host syncs per step and why
CASES = [
    ("01_single_gpu.py", 1, [], GUARD, "the guard"),
    ("03_ddp.py", 2, [], GUARD, "the guard"),
    ("04_zero.py", 2, ["--stage", "2"], GUARD, "the guard"),
    ("04_zero.py", 2, ["--stage", "3"], GUARD, "the guard"),
    ("05_fsdp.py", 2, [], GUARD, "the guard"),
    ("06_tensor_parallel.py", 2, ["--sequence_parallel"], GUARD, "the guard"),
    ("09_context_parallel.py", 2, [], GUARD, "the guard"),
    ("09_context_parallel.py", 2, ["--cp_impl", "ulysses"], GUARD, "the guard"),
    ("07_pipeline.py", 2, [], GUARD, "the guard"),
    ("07_pipeline.py", 2, ["--schedule", "zb"], GUARD, "the guard"),
    ("07_pipeline.py", 2, ["--schedule", "interleaved", "--virtual_stages", "2"], GUARD, "the guard"),
    # device events around each forward and backward, read after the step (GPU semantics II)
    ("07_pipeline.py", 2, ["--measure_bubble"], GUARD, "the guard: --measure_bubble waits for nothing in the step"),
    ("07_pipeline.py", 2, ["--measure_bubble", "--schedule", "zb"], GUARD, "the guard: zb's W timed by events too"),
    ("08_3d.py", 4, ["--tp", "2", "--pp", "2"], GUARD, "the guard"),
    ("08_3d.py", 4, ["--pp", "2", "--cp", "2"], GUARD, "the guard"),
    # L = 4 MoE layers, m = 2 micro-batches per rank: the dispatch's split sizes, read on the host
    # once per layer (torch's all_to_all_single takes them as lists, and the receiver allocates
    # its rows by them); the tokens per expert stay on the device (GPU semantics II: was 3)
    ("10_expert_parallel.py", 2, ["--n_expert", "4", "--ep", "2"], GUARD + 1 * 4 * 2, "the dispatch's split sizes"),
]


@pytest.mark.parametrize("script,ranks,flags,expected,why", CASES,
                         ids=[f"{c[0]}{''.join(c[2])}" for c in CASES])
def test_host_syncs_per_step(script, ranks, flags, expected, why):
    run = launch(script, TINY + ["--max_iters", "3", "--micro_batch_size", "2"] + flags, nprocs=ranks,
                 env={"GPTPAR_COUNT_SYNCS": "1"}).ok()
    counts = [row["host_syncs"] for row in run.steps]
    assert counts == [expected] * 3, f"{script} {flags}: {counts} host syncs per step, expected {expected} ({why})"
    if script == "07_pipeline.py":  # the busy time is measured only when asked: the flag works
        busy = [row["busy_fraction"] for row in run.steps]
        if "--measure_bubble" in flags:
            assert all(0 < b <= 1 for b in busy), busy
        else:
            assert busy == [None] * 3, busy
