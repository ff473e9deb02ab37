"""--rehearse: a rank's real steps on torch's fake backend with fake tensors (infra.rehearsal),
checked against what real gloo runs measure and against NCCL's rules.

  * at 2 ranks, what each rehearsed rank holds, its activation peak and the bytes it sends
    by operation equal a real run's ledger (rank 0's metrics row) in its steady state;
  * every script at two layouts: every rehearsed rank equals its costs(), at the flags of a
    real-run test that proves its ledger equals the same costs() (named per layout);
  * a `roles` rehearsal, extended to every rank by the mesh's symmetry, replays exactly the
    posting orders of an `all` rehearsal; a broken order is still caught there (where a
    role's ranks do not post alike, the replay is refused, saying so: tests/test_rehearse_hostile.py);
  * a posting order that hangs on NCCL (one batch per operation, the rule 07 had before
    Megatron's paired batches) is reported as a deadlock naming the rank and the operation;
  * a bad layout is one line and exit 2, as in a launch;
  * two of the issue's big meshes, no deadlock: 08 at pp 16 x cp 4 x tp 8 (512 ranks, `roles`
    and the mesh's symmetry) and 10 at ep 16 (`all`); the others, minutes in all, are the big
    tier (tests/test_rehearse_big.py, `pytest -m big`)."""

import json
import os

import pytest

from harness import ROOT, TINY, launch

GUARD = "all_reduce[guard]"
REAL_KEYS = ("state_bytes", "comm_bytes", "activation_bytes")


def rehearse(tmp_path, script, flags, ranks="all", world_size=2, ok=True, env=None):
    """Rehearse `script` and return (the run, {rank: its metrics row})."""
    metrics = tmp_path / f"{os.path.basename(script)}-{ranks}-{world_size}.jsonl"
    # (--metrics=FILE: one row per rehearsed rank, read here, not by the harness's reader of a launch's rows)
    run = launch(script, [*TINY, *flags, "--rehearse", ranks, "--world_size", world_size, f"--metrics={metrics}"],
                 metrics=False, env=env)
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
            r["comm_bytes"].pop("all_to_all_single[ep]")
        keys = ("state_bytes", "comm_bytes")
    for key in keys:
        assert row[key] == measured[key], (key, row[key], measured[key])
    assert "= costs()" in run.stdout and "no deadlock" in run.stdout.splitlines()[-1], run.stdout


# the shared flags of test_real_conditions.py (BABY) and test_memory.py (SHORT)
BABY = ["--model", "baby", "--n_layer", "5", "--n_embd", "48", "--block_size", "32", "--dropout", "0",
        "--global_batch_size", "12", "--grad_clip", "0.05"]
SHORT = ["--max_iters", "2"]
REAL_LEDGER = "test_real_conditions.py::test_default_shape_matches_01_and_the_ledger_is_exact"
RECOMPUTE = "test_memory.py::test_recompute_matches_01_and_activations_exact"
LAYOUTS = [  # (script, world size, flags, the real run at this layout whose ledger equals costs())
    ("01_single_gpu.py", 1, BABY + ["--dtype", "bfloat16"], "test_real_conditions.py::test_single_gpu_ledger_in_bfloat16"),
    ("01_single_gpu.py", 1, SHORT + ["--recompute"], RECOMPUTE + "[01]"),
    ("03_ddp.py", 3, BABY + ["--micro_batch_size", "2"], REAL_LEDGER + "[03x3--micro_batch_size2-float32]"),
    ("03_ddp.py", 2, SHORT + ["--micro_batch_size", "2", "--recompute"], RECOMPUTE + "[03--micro_batch_size2]"),
    ("04_zero.py", 2, BABY + ["--stage", "1"], REAL_LEDGER + "[04x2--stage1-float32]"),
    ("04_zero.py", 2, BABY + ["--stage", "3", "--micro_batch_size", "3", "--dtype", "bfloat16"],
     REAL_LEDGER + "[04x2--stage3-bfloat16]"),
    ("05_fsdp.py", 4, BABY + ["--replicate", "2", "--micro_batch_size", "1"], REAL_LEDGER + "[05x4--replicate2-float32]"),
    ("05_fsdp.py", 2, SHORT + ["--recompute"], RECOMPUTE + "[05]"),
    ("06_tensor_parallel.py", 4, BABY + ["--micro_batch_size", "6"], REAL_LEDGER + "[06x4--micro_batch_size6-float32]"),
    ("06_tensor_parallel.py", 2, BABY + ["--sequence_parallel", "--dtype", "bfloat16"],
     REAL_LEDGER + "[06x2--sequence_parallel-bfloat16]"),
    ("07_pipeline.py", 3, BABY, REAL_LEDGER + "[07x3-float32]"),
    ("07_pipeline.py", 2, BABY + ["--schedule", "interleaved", "--virtual_stages", "2", "--micro_batch_size", "3"],
     REAL_LEDGER + "[07x2--scheduleinterleaved-float32]"),  # m 4 > p 2, where the old order hung
    ("08_3d.py", 4, BABY + ["--tp", "2", "--pp", "2"], REAL_LEDGER + "[08x4--tp2-float32]"),
    ("08_3d.py", 8, BABY + ["--cp_impl", "ulysses", "--cp", "2", "--tp", "2", "--pp", "2", "--sequence_parallel"],
     REAL_LEDGER + "[08x8--cp_implulysses-float32]"),  # roles: 3 ranks rehearsed, 5 by symmetry
    ("09_context_parallel.py", 2, SHORT + ["--cp_impl", "ring", "--recompute"], RECOMPUTE + "[09--cp_implring]"),
    ("09_context_parallel.py", 2, SHORT + ["--cp_impl", "ulysses", "--recompute"], RECOMPUTE + "[09--cp_implulysses]"),
    ("10_expert_parallel.py", 2, ["--n_expert", "4", "--top_k", "2", "--ep", "2"],
     "test_expert_parallel.py::test_losses_equal_single_gpu[2-2-None-extra0]"),
    ("10_expert_parallel.py", 4, ["--n_expert", "4", "--top_k", "2", "--ep", "2", "--micro_batch_size", "1"],
     "test_expert_parallel.py::test_losses_equal_single_gpu[4-2-1-extra2]"),
]


@pytest.mark.parametrize("script, world_size, flags, real", LAYOUTS,
                         ids=[f"{c[0][:2]}x{c[1]}{''.join(c[2][-2:])}" for c in LAYOUTS])
def test_every_script_rehearses_equal_to_its_costs_at_two_layouts(tmp_path, script, world_size, flags, real):
    """Each script (01, 03-10) at two layouts, rehearsed (`roles`; every rank where roles
    covers them, the rest by symmetry): every rehearsed rank holds, sends by operation and
    saves for backward what costs() says, and the posting orders replay with no deadlock.
    The real run named beside each layout (`real`) proves, on gloo, that its ledger equals
    the same costs() at the same flags: together, rehearsal = costs() = real run, as the
    three direct comparisons above show in one step. 10's real routing follows the data and
    its ledger is compared with costs() on that routing; here the routing is balanced."""
    run, rows = rehearse(tmp_path, script, flags, ranks="roles", world_size=world_size)
    assert rows and "costs(): every rehearsed rank holds and sends what its formulas say" in run.stdout, run.stdout
    for rank, row in rows.items():
        assert row["state_bytes"] == row["state_bytes_theory"], (rank, real)
        assert row["comm_bytes"] == row["comm_bytes_theory"], (rank, real)
        assert row["comm_calls"] == row["comm_calls_theory"], (rank, real)
        assert row["activation_bytes"] == row["activation_bytes_theory"] > 0, (rank, real)
    last = run.stdout.splitlines()[-1]
    assert last.startswith("replay under NCCL's rules: no deadlock"), run.stdout[-3000:]
    if len(rows) < world_size:
        assert f"symmetry: replayed {world_size} ranks: {len(rows)} rehearsed" in run.stdout, run.stdout[-3000:]


def test_roles_extended_by_symmetry_replay_as_every_rank_rehearsed(tmp_path):
    """08 at dp 2 x pp 2 x tp 2: a `roles` rehearsal (ranks 0, 2, 7) extended to the 8 ranks
    through the mesh's rotations posts, rank by rank and group by group, exactly what an
    `all` rehearsal records, and gets its verdict; the last rank, rehearsed and also moved
    from its stage's first, is the built-in check. (Where a role's ranks do not post alike, 04's
    Muon owners, the refusal is tests/test_rehearse_hostile.py's refused symmetry.)"""
    flags = ["--tp", "2", "--pp", "2", "--n_layer", "2", "--global_batch_size", "8", "--dropout", "0",
             "--max_iters", "2"]
    orders = {}
    for ranks in ("roles", "all"):
        posts = tmp_path / f"{ranks}.json"
        run, _ = rehearse(tmp_path, "08_3d.py", flags, ranks=ranks, world_size=8,
                          env={"GPTPAR_REHEARSAL_POSTS": str(posts)})
        orders[ranks] = (json.loads(posts.read_text()), run.stdout.splitlines()[-1])
        # G5: every rank makes dp 4 + pp 4 + tp 4 groups, 4 embedding ones (the ends of each pipeline), the
        # model's 2 and the guard's; rank 0 is in one of each kind
        assert "process groups: 19 new_group calls on every rank (6 kind(s); rank 0 is in 6)" in run.stdout, run.stdout
    (roles, verdict), (every, verdict_all) = orders["roles"], orders["all"]
    assert roles["rehearsed"] == [0, 2, 7] and every["rehearsed"] == list(range(8))
    assert verdict == verdict_all and verdict.startswith("replay under NCCL's rules: no deadlock"), verdict
    assert sorted(roles["posts"]) == sorted(every["posts"]) == [str(r) for r in range(8)]
    for rank, entries in every["posts"].items():  # every rank's operations, in order, on every group
        assert roles["posts"][rank] == entries, rank


ONE_BATCH_PER_OPERATION = """
_post = Pipeline.post


def _one_batch_per_operation(self, batch, sends):
    # 07 before Megatron's paired batches: every send and receive posted as a batch of its own
    post = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [r for op in ops for r in post([op])]
    try:
        return _post(self, batch, sends)
    finally:
        dist.batch_isend_irecv = post


Pipeline.post = _one_batch_per_operation
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


def test_a_broken_order_is_caught_in_the_ranks_filled_in_by_symmetry(tmp_path):
    """08 at dp 2 x pp 2 with every send and receive posted alone: a `roles` rehearsal
    (ranks 0, 1, 3; rank 2 moved from rank 0) still finds 1F1B's send-send deadlock."""
    source = open(os.path.join(ROOT, "08_3d.py")).read()
    head, main = source.split('\nif __name__ == "__main__":')
    copy = tmp_path / "08_old_order.py"
    copy.write_text(head + ONE_BATCH_PER_OPERATION + '\nif __name__ == "__main__":' + main)
    run, _ = rehearse(tmp_path, str(copy), ["--pp", "2", "--micro_batch_size", "1", "--global_batch_size", "8",
                                            "--dropout", "0", "--max_iters", "2"], ranks="roles", world_size=4, ok=False)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "symmetry: replayed 4 ranks: 3 rehearsed, 1 by symmetry" in run.stdout, run.stdout[-3000:]
    last = run.stdout.splitlines()[-1]
    assert "DEADLOCK: rank 0 blocks first" in last and "send to 1" in last and "on group pp" in last, last


def test_a_bad_layout_is_one_line_and_exit_2(tmp_path):
    run, rows = rehearse(tmp_path, "06_tensor_parallel.py", [], world_size=3, ok=False)
    assert run.returncode == 2 and len(run.error_lines) == 1 and not rows, run.stderr[-2000:]
    run, _ = rehearse(tmp_path, "03_ddp.py", [], ranks="0,5", world_size=2, ok=False)
    assert run.returncode == 2 and run.error_lines == ["error: --rehearse 0,5: ranks run from 0 to 1 "
                                                       "(--world_size 2)"], run.stderr


def test_the_replay_verdict_names_a_size_mismatch_and_a_collective_one_rank_never_posts():
    """infra.replay.replay_verdict, the rehearsal's last line, on posting orders built by hand: a
    collective whose sizes differ between members, and one that a member never posts."""
    import infra.replay

    def collective(kind, nbytes, where="step 0, forward"):
        return {"kind": kind, "group": "1", "desc": "tp", "ranks": (0, 1), "bytes": nbytes, "where": where}
    sizes = {0: [collective("all_reduce", 4)], 1: [collective("all_reduce", 8)]}
    verdict = infra.replay.replay_verdict(infra.replay.replay(sizes), sizes)
    assert verdict.startswith("replay under NCCL's rules: mismatch: collective 0 of group 1") and "8 bytes" in verdict
    missing = {0: [collective("all_reduce", 4), collective("all_gather", 4, "step 1, backward")],
               1: [collective("all_reduce", 4)]}
    verdict = infra.replay.replay_verdict(infra.replay.replay(missing), missing)
    assert verdict == ("replay under NCCL's rules: DEADLOCK: rank 0 blocks first, at its operation 1: all_gather of "
                       "4 bytes over ranks 0-1 on group tp (step 1, backward); 1 rank(s) blocked"), verdict
    fine = {0: [collective("all_reduce", 4)], 1: [collective("all_reduce", 4)]}
    assert "no deadlock" in infra.replay.replay_verdict(infra.replay.replay(fine), fine)


# ---- the big meshes that are fast enough for the suite (the rest: test_rehearse_big.py)

NO_DEADLOCK = "replay under NCCL's rules: no deadlock; every collective and send/recv matched on every group"
EQUAL = "costs(): every rehearsed rank holds and sends what its formulas say"


def rehearsed(tmp_path, script, flags, ranks, world_size):
    """Rehearse, check the verdicts every case shares, return (stdout, {rank: row})."""
    run, rows = rehearse(tmp_path, script, [*flags, "--dropout", "0"], ranks=ranks, world_size=world_size)
    out = run.stdout
    assert EQUAL in out and out.splitlines()[-1].startswith(NO_DEADLOCK), out[-4000:]
    for rank, row in rows.items():
        assert row["state_bytes"] == row["state_bytes_theory"], rank
        assert row["comm_bytes"] == row["comm_bytes_theory"] and row["comm_calls"] == row["comm_calls_theory"], rank
        assert row["activation_bytes"] == row["activation_bytes_theory"] > 0, rank
    return out, rows


@pytest.mark.big  # a big mesh (35 s): the suite's symmetry tests run small ones
def test_08_at_pp16_cp4_tp8_roles_by_symmetry(tmp_path):
    """A 4D mesh of 512 ranks: 17 ranks executed (each stage's first, and the last rank), the
    other 495 posting orders moved from theirs through the mesh's rotations, all 512 replayed."""
    flags = ["--n_layer", "16", "--n_head", "8", "--n_embd", "128", "--global_batch_size", "16",
             "--micro_batch_size", "1", "--pp", "16", "--cp", "4", "--tp", "8"]
    out, _ = rehearsed(tmp_path, "08_3d.py", flags, "roles", 512)
    assert "symmetry: replayed 512 ranks: 17 rehearsed, 495 by symmetry" in out, out[-4000:]


@pytest.mark.big  # a big mesh, every rank (19 s)
def test_10_at_ep16_every_rank(tmp_path):
    """16 experts over 16 ranks, every rank executed: the all-to-all's sizes, balanced by the
    stand-in, match pairwise on every rank (replay rule 5)."""
    flags = ["--n_expert", "16", "--top_k", "2", "--ep", "16", "--global_batch_size", "16"]
    _, rows = rehearsed(tmp_path, "10_expert_parallel.py", flags, "all", 16)
    assert sorted(rows) == list(range(16))
