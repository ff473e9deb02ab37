"""08_3d.py with experts (--n_expert E --top_k K --ep N): the experts of every block over EP
groups carved out of each DP x CP group, attention keeping its TP (and SP) and the pipeline
its stages. Each launch checks two things at once: the losses equal 01_single_gpu.py's with
the same experts (the oracle), and the ledger equals costs() on every rank (each rank checks
its own: the all-to-alls on this step's routing, the experts' expert_dp all-reduce). Then the
dry runs of the big presets and the one-line refusals."""

import pytest

from harness import TINY, assert_losses_match, launch

MOE = ["--n_expert", "4", "--top_k", "2"]
BASE = TINY + MOE + ["--global_batch_size", "8", "--max_iters", "3", "--grad_clip", "0.05"]


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", BASE + ["--sample_tokens", "0"]).ok()


def assert_ledger(run):
    assert "ledger mismatch" not in run.stderr, run.stderr[-3000:]
    for row in run.steps:  # rank 0's, on every logged step's own routing
        assert row["state_bytes"] == row["state_bytes_theory"]
        assert row["comm_bytes"] == row["comm_bytes_theory"], row["step"]
        assert row["comm_bytes"]["all_to_all_single[ep]"] > 0


# (ranks, flags): tp2 x ep2 (dp 2, the experts replicated over TP), pp2 x ep2 with a second EP
# group (dp 4: the experts' gradients over expert_dp) and ZeRO-1, and tp2 x pp2 x ep2 at 8
# ranks with sequence parallelism
CASES = [
    (4, ["--tp", 2, "--ep", 2, "--micro_batch_size", 2]),
    (8, ["--pp", 2, "--ep", 2, "--micro_batch_size", 1, "--zero1"]),
    (8, ["--tp", 2, "--pp", 2, "--ep", 2, "--micro_batch_size", 2, "--sequence_parallel"]),
]


@pytest.mark.parametrize("ranks, flags", CASES, ids=lambda x: " ".join(map(str, x)) if isinstance(x, list) else str(x))
def test_losses_equal_01_and_ledger_equals_costs(reference, ranks, flags):
    run = launch("08_3d.py", BASE + flags, nprocs=ranks, timeout=400).ok()
    assert_losses_match(reference, run, what=f"08 {flags}")
    assert_ledger(run)
