"""--rehearse: a rank's real steps on torch's fake backend with fake tensors (infra.py's
rehearsal section), checked against what real gloo runs measure and against NCCL's rules.

  * at 2 ranks, what each rehearsed rank holds, its activation peak and the bytes it sends
    by operation equal a real run's ledger (rank 0's metrics row) in its steady state;
  * `all` at a mesh bigger than the CPU tests launch replays with no deadlock;
  * a posting order that hangs on NCCL (one batch per operation, the rule 07 had before
    Megatron's paired batches) is reported as a deadlock naming the rank and the operation;
  * a bad layout is one line and exit 2, as in a launch."""

import json
import os

import pytest

from harness import ROOT, TINY, launch

GUARD = "all_reduce[guard]"
REAL_KEYS = ("state_bytes", "comm_bytes", "activation_bytes")


def rehearse(tmp_path, script, flags, ranks="all", world_size=2, ok=True):
    """Rehearse `script` and return (the run, {rank: its metrics row})."""
    metrics = tmp_path / f"{os.path.basename(script)}-{ranks}-{world_size}.jsonl"
    # (--metrics=FILE: one row per rehearsed rank, read here, not by the harness's reader of a launch's rows)
    run = launch(script, [*TINY, *flags, "--rehearse", ranks, "--world_size", world_size, f"--metrics={metrics}"],
                 metrics=False)
    if ok:
        run.ok()
    rows = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            rows[row["rank"]] = row
    return run, rows


@pytest.mark.parametrize("script,flags", [
    ("03_ddp.py", ["--global_batch_size", "8"]),
    ("07_pipeline.py", ["--schedule", "1f1b", "--micro_batch_size", "1"]),
    ("10_expert_parallel.py", ["--n_expert", "4", "--top_k", "2", "--micro_batch_size", "2"]),
])
def test_a_rehearsed_rank_holds_and_sends_what_a_real_run_measures(tmp_path, script, flags):
    """The same flags, launched on 2 gloo ranks and rehearsed as both ranks of 2: rank 0's
    model state, activation peak and bytes by operation are the same numbers (the steady
    step). 10's routing of the real data is not balanced, the rehearsal's is: there the
    all-to-all bytes and the activations (the experts' batches) are compared with costs() for
    the balanced routing (the rehearsal's own check), and the rest with the real run."""
    flags = [*flags, "--max_iters", "2", "--dropout", "0"]
    real = launch(script, [*TINY, *flags], nprocs=2).ok()
    measured = real.steps[-1]
    run, rows = rehearse(tmp_path, script, flags)
    assert sorted(rows) == [0, 1], run.stdout
    row = rows[0]
    assert row.pop("rank") == 0 and set(measured) - {"loss", "lr", "grad_norm"} <= set(row), set(measured) ^ set(row)
    assert row["comm_bytes"].pop(GUARD) == 12
    keys = REAL_KEYS
    if script.startswith("10"):  # routing-dependent: balanced here, the data's there
        for r in (row, measured):
            r["comm_bytes"].pop("all_to_all_single")
        keys = ("state_bytes", "comm_bytes")
    for key in keys:
        assert row[key] == measured[key], (key, row[key], measured[key])
    assert "= costs()" in run.stdout and "no deadlock" in run.stdout.splitlines()[-1], run.stdout


def test_a_pipeline_bigger_than_the_tests_launch_replays_without_deadlock(tmp_path):
    """07 interleaved at p 2, v 2, m 6 (m > p, where the old posting order hung) and 08 at
    tp 2 x pp 2 x dp 2 (its roles): the posting orders complete under NCCL's rules and each
    rehearsed rank equals its costs()."""
    run, rows = rehearse(tmp_path, "07_pipeline.py", ["--schedule", "interleaved", "--virtual_stages", "2",
                                                      "--global_batch_size", "6", "--micro_batch_size", "1",
                                                      "--dropout", "0"], world_size=2)
    assert sorted(rows) == [0, 1]
    last = run.stdout.splitlines()[-1]
    assert last.startswith("replay under NCCL's rules: no deadlock") and "costs(): every rehearsed rank" in run.stdout
    run, rows = rehearse(tmp_path, "08_3d.py", ["--tp", "2", "--pp", "2", "--global_batch_size", "8",
                                                "--dropout", "0"], ranks="roles", world_size=8)
    assert sorted(rows) == [0, 2, 7], run.stdout  # each stage's first rank (dp, pp, tp order), the last rank
    assert "replay: not done" in run.stdout and "every rehearsed rank holds and sends" in run.stdout


ONE_BATCH_PER_OPERATION = """
_exchange = Pipeline._exchange


def _one_batch_per_operation(self, batch, outputs, meanwhile=lambda: None):
    # 07 before Megatron's paired batches: every send and receive posted as a batch of its own
    post = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [r for op in ops for r in post([op])]
    try:
        return _exchange(self, batch, outputs, meanwhile)
    finally:
        dist.batch_isend_irecv = post


Pipeline._exchange = _one_batch_per_operation
"""


def test_the_old_interleaved_posting_order_is_a_deadlock(tmp_path):
    """07 with every send and receive posted alone: gloo runs it, NCCL would hang at m > p.
    The rehearsal's replay names the first rank that blocks and its operation; exit 1."""
    source = open(os.path.join(ROOT, "07_pipeline.py")).read()
    head, main = source.split('\nif __name__ == "__main__":')
    copy = tmp_path / "07_old_order.py"
    copy.write_text(head + ONE_BATCH_PER_OPERATION + '\nif __name__ == "__main__":' + main)
    run, _ = rehearse(tmp_path, str(copy), ["--schedule", "interleaved", "--virtual_stages", "2",
                                            "--micro_batch_size", "1", "--global_batch_size", "4",
                                            "--dropout", "0"], ok=False)
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.stdout.splitlines()[-1]
    assert "DEADLOCK: rank 0 blocks first" in last and "send to 1" in last and "(step 0, forward)" in last, last


def test_a_bad_layout_is_one_line_and_exit_2(tmp_path):
    run, rows = rehearse(tmp_path, "06_tensor_parallel.py", [], world_size=3, ok=False)
    assert run.returncode == 2 and len(run.error_lines) == 1 and not rows, run.stderr[-2000:]
    run, _ = rehearse(tmp_path, "03_ddp.py", [], ranks="0,5", world_size=2, ok=False)
    assert run.returncode == 2 and run.error_lines == ["error: --rehearse 0,5: ranks run from 0 to 1 "
                                                       "(--world_size 2)"], run.stderr


def test_the_replay_verdict_names_a_size_mismatch_and_a_collective_one_rank_never_posts():
    """infra.replay_verdict, the rehearsal's last line, on posting orders built by hand: a
    collective whose sizes differ between members, and one that a member never posts."""
    import infra

    def collective(kind, nbytes, where="step 0, forward"):
        return {"kind": kind, "group": "1", "desc": "tp", "ranks": (0, 1), "bytes": nbytes, "where": where}
    sizes = {0: [collective("all_reduce", 4)], 1: [collective("all_reduce", 8)]}
    verdict = infra.replay_verdict(infra.replay(sizes), sizes)
    assert verdict.startswith("replay under NCCL's rules: mismatch: collective 0 of group 1") and "8 bytes" in verdict
    missing = {0: [collective("all_reduce", 4), collective("all_gather", 4, "step 1, backward")],
               1: [collective("all_reduce", 4)]}
    verdict = infra.replay_verdict(infra.replay(missing), missing)
    assert verdict == ("replay under NCCL's rules: DEADLOCK: rank 0 blocks first, at its operation 1: all_gather of "
                       "4 bytes over ranks 0-1 on group tp (step 1, backward); 1 rank(s) blocked"), verdict
    fine = {0: [collective("all_reduce", 4)], 1: [collective("all_reduce", 4)]}
    assert "no deadlock" in infra.replay_verdict(infra.replay(fine), fine)
