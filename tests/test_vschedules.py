"""07_pipeline.py's schedules and their tables (torch.distributed.pipelining's CSV notation,
import and export only): every schedule's rounds written as a table and read back are the
same rounds; ZB-V's and DualPipeV's tables equal torch's ScheduleZBVZeroBubble and
ScheduleDualPipeV (built here on CPU, with stand-in stages: the orders need no process
group); their posting orders replay under NCCL's rules (tests/nccl_replay.py), and every
split or V schedule's at 16 stages; their drawn bubble is docs/strategies.md's formula,
DualPipeV's pairs drawn overlapped (max(F, B)) and in order (F + B); and run for real they
reproduce 01's losses, the ledger's every byte included, posting what exchanges_for_nccl()
says."""

import importlib
import os
import types

import pytest
import torch
from torch.distributed.pipelining.schedules import _Action, ScheduleDualPipeV, ScheduleZBVZeroBubble

import nccl_replay
from harness import ROOT, TINY, assert_losses_match, launch

pp = importlib.import_module("07_pipeline")
STRATEGIES = open(os.path.join(ROOT, "docs", "strategies.md")).read()  # the derivations, with their pictures
OLDER = [(kind, v) for kind, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3]), ("zb", [1]))
         for v in vs]


def rounds_of(kind, p, m, v=1):
    """Every rank's rounds, as the run builds them (run_schedule)."""
    flags = types.SimpleNamespace(schedule=kind, schedule_csv=None, virtual_stages=v)
    return pp.run_schedule(flags, p, m)[0]


def table(kind, p, m, v=1):
    """The schedule's table, as --write_schedule writes it."""
    return pp.table(rounds_of(kind, p, m, v), p, kind in pp.V_SHAPED)


def test_every_schedules_table_reads_back_as_its_rounds():
    """Written as a table and read back, every schedule's rounds are the same rounds, at p
    2-8 and m from p to 4p (2p for DualPipeV); zb's I and W are torch's, the interleaved
    steady state's pairs OVERLAP_F_B; and the older schedules' exchanges need none of
    exchanges_for_nccl()'s moves."""
    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            for kind, v in OLDER + [("zbv", 2), ("dualpipev", 2)]:
                if (kind == "interleaved" and m % p) or (kind == "dualpipev" and m < 2 * p):
                    continue
                rounds, vee = rounds_of(kind, p, m, v), kind in pp.V_SHAPED
                rows = pp.table(rounds, p, vee)
                assert [pp.table_rounds(rows[r], p, r, v, vee) for r in range(p)] == rounds, (kind, p, m, v)
                if p <= 4 and not vee:
                    assert rounds == [pp.schedule_rounds(kind, p, r, m, v) for r in range(p)], (kind, p, m, v)
                    assert pp.exchanges_for_nccl(rounds, p, v, m) == [
                        [list(b) for b in pp.exchanges(rounds[r], p, r, v, m)] for r in range(p)], (kind, p, m)
    assert table("zb", 2, 2)[1] == ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]  # stage 1 defers one W
    assert "(0F2;2B0)OVERLAP_F_B" in table("interleaved", 2, 4, 2)[0]


def test_zero_bubble_with_fewer_micro_batches_than_stages_runs_its_own_rounds():
    """At m < p, zb's W of a stage's last micro-batch has no I to ride with: the rounds run
    are schedule_rounds()'s, [(F0), (I0), (W0)] on stage 1 of 2 at m = 1 (read back from a
    table, the W would ride with its I: one exchange fewer, the same order)."""
    rounds = rounds_of("zb", 2, 1)
    assert rounds[1] == [(("F", 0, 0),), (("I", 0, 0),), (("W", 0, 0),)]
    assert pp.table_rounds(pp.table(rounds, 2)[1], 2, 1, 1) == [(("F", 0, 0),), (("I", 0, 0), ("W", 0, 0))]


def torch_orders(cls, p, m):
    """torch's own schedule object at p ranks and m micro-batches (rank 0's view: every rank's
    order is computed on each), as its actions' strings."""
    stages = [types.SimpleNamespace(stage_index=g, num_stages=2 * p, group_size=p, group_rank=0,
                                    submod=torch.nn.Linear(1, 1)) for g in (0, 2 * p - 1)]
    order = cls(stages, m).pipeline_order
    return [[str(a) for a in order[r] if a is not None] for r in range(p)]


def test_v_orders_equal_torchs():
    for p in range(1, 9):
        for m in range(1, 4 * p + 1):
            assert table("zbv", p, m, 2) == torch_orders(ScheduleZBVZeroBubble, p, m), (p, m)
            if m >= 2 * p:
                assert table("dualpipev", p, m, 2) == torch_orders(ScheduleDualPipeV, p, m), (p, m)


def posts(batches, p):
    """Every rank's posted batches (the V's turn, a rank's message to itself, stays in memory)."""
    return {r: [{"kind": "batch", "group": "world", "ops": [{"op": op, "peer": q, "tag": tag, "bytes": 4}
                                                           for op, q, tag in b if q != r]}
                for b in batches[r] if any(q != r for _, q, _ in b)] for r in range(p)}


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_v_schedules_replay_under_nccl(kind):
    """Training and evaluation, p 2-8, m from p (2p for DualPipeV) to 4p: no deadlock, every
    pair matched in FIFO order. Each micro-batch crosses 2p-1 chunk boundaries each way, one
    of them (chunk p-1 to p) in memory. Without exchanges_for_nccl()'s moves ZB-V mismatches."""
    for p in range(2, 9):
        for m in sorted({p, 2 * p - 1, 2 * p, 3 * p + 1, 4 * p}):
            if kind == "dualpipev" and m < 2 * p:
                continue
            rounds = rounds_of(kind, p, m, 2)
            train = posts(pp.exchanges_for_nccl(rounds, p, 2, m, True), p)
            result = nccl_replay.replay(train)
            assert result.ok, (p, m, result.report())
            assert sum(len(b["ops"]) for r in train for b in train[r]) == 2 * 2 * m * (2 * p - 2)
            evaluation = posts(pp.exchanges_for_nccl([pp.eval_rounds(p, m, 2, True)] * p, p, 2, m, True), p)
            assert nccl_replay.replay(evaluation).ok, (p, m)
    plain = posts([pp.exchanges(r, 2, rank, 2, 4, True) for rank, r in enumerate(rounds_of("zbv", 2, 4, 2))], 2)
    assert not nccl_replay.replay(plain).ok


def test_v_drawn_bubble_is_the_formula_and_the_first_and_last_chunk_sit_on_rank_0():
    for kind in pp.V_SHAPED:
        for p in (2, 3, 4, 6):
            for m in range(2 * p if kind == "dualpipev" else 1, 4 * p + 1):
                rounds = rounds_of(kind, p, m, 2)
                bubble = pp.timeline(rounds, p, 2, True, True)[1]
                assert bubble == pytest.approx(pp.bubble_theory(kind, p, m, 2)), (kind, p, m)
                # the pairs run in order (F + B, as on CPU): DualPipeV's bubble is ZB-V's
                in_order = pp.timeline(rounds, p, 2, True, True, overlapped=False)[1]
                assert in_order == pytest.approx(pp.bubble_theory("zbv", p, m, 2)), (kind, p, m)
                if m >= 2 * p:  # the docstring's memory: 2p chunk-sized micro-batches (DualPipeV 2p+1)
                    orders = [[action for actions in r for action in actions] for r in rounds]
                    assert {pp.held_peak(order) for order in orders} == {2 * p + (kind == "dualpipev")}
    rounds = rounds_of("zbv", 2, 4, 2)  # docs/strategies.md's picture is the drawing
    text, _ = pp.draw(pp.simulate([[a for actions in r for a in actions] for r in rounds], 2, 2, True), 2, 2)
    assert all("    " + line.rstrip() in STRATEGIES for line in text.split("\n"))
    assert [[pp.chunk_stage(4, r, c, True) for c in range(2)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [pp.stage_rank(4, g, True) for g in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_dualpipev_pairs_are_drawn_overlapped_taking_max_f_b():
    """DualPipeV's "(aFi;bBj)OVERLAP_F_B": the forward starts with the backward it overlaps
    and the pair takes max(F, B) = B (a full backward: I + W, two half units), so the
    timeline is 2m + 3p/2 long, against 3m + idle run in order; the forward is drawn in a
    'with' row under its backward (the docstring's picture). The interleaved steady state's
    pairs share messages only: not overlapped, drawn as before."""
    for p in range(2, 9):
        for m in (2 * p, 3 * p + 1, 4 * p):
            rounds = rounds_of("dualpipev", p, m, 2)
            text, bubble, starts, overlap = pp.timeline(rounds, p, 2, True, True)
            assert sum(len(pairs) for pairs in overlap) == sum(a.endswith("OVERLAP_F_B") for row in pp.table(
                rounds, p, True) for a in row) > 0
            end = max(s for row in starts for s, _ in row) + 0.5
            assert end == 2 * m + 1.5 * p, (p, m)
            for r in range(p):
                begins = {op: s for s, op in starts[r]}
                for forward, backward in overlap[r].items():
                    assert begins[forward] == begins[backward[0]], (p, m, r, forward)
            in_order = pp.timeline(rounds, p, 2, True, True, overlapped=False)
            assert max(s for row in in_order[2] for s, _ in row) + 0.5 > end and "with" not in in_order[0]
            lines = text.split("\n")
            assert len(lines) == 2 * p and all(lines[2 * r + 1].startswith("  with ") for r in range(p))
            assert sum(line.count("F") for line in lines[1::2]) == sum(len(pairs) for pairs in overlap)
    text = pp.timeline(rounds_of("dualpipev", 2, 4, 2), 2, 2, True, True)[0]
    assert all("    " + line.rstrip() in STRATEGIES for line in text.split("\n"))  # docs/strategies.md's picture
    interleaved = rounds_of("interleaved", 2, 4, 2)
    assert pp.overlaps(interleaved, False) == [{}, {}] and any(len(ops) == 2 for ops in interleaved[0])
    same = [["0F0", "(3F0;3B0)OVERLAP_F_B", "0B0"], ["1F0", "2F0", "2B0", "1B0"]]  # a user's pair of one chunk:
    same_rounds = [pp.table_rounds(same[r], 2, r, 2, True) for r in range(2)]
    assert pp.table_problem(same, 2, 1) is None and pp.timeline(same_rounds, 2, 2, True, False)[3] == [{}, {}]


@pytest.mark.parametrize("kind, v", [("interleaved", 2), ("zb", 1), ("zbv", 2), ("dualpipev", 2)])
def test_every_schedule_replays_under_nccl_at_16_stages(kind, v):
    """p = 16, training and evaluation, a sample of m from p to 4p (all m took about 26 s
    here: p, 2p-1 where ZB-V's V first fills, 2p, 3p+1, 4p), no deadlock and every pair
    matched under NCCL's rules (tests/nccl_replay.py)."""
    p, vee = 16, kind in pp.V_SHAPED
    for m in (p, 2 * p - 1, 2 * p, 3 * p + 1, 4 * p):
        if (kind == "interleaved" and m % p) or (kind == "dualpipev" and m < 2 * p):
            continue
        result = nccl_replay.replay(posts(pp.exchanges_for_nccl(rounds_of(kind, p, m, v), p, v, m, vee), p))
        assert result.ok, (kind, m, result.report())
        evaluation = posts(pp.exchanges_for_nccl([pp.eval_rounds(p, m, v, vee)] * p, p, v, m, vee), p)
        assert nccl_replay.replay(evaluation).ok, (kind, m)


BASE = TINY + ["--global_batch_size", "24", "--max_iters", "3", "--grad_clip", "0.05",
               "--eval_interval", "3", "--eval_iters", "1"]
EIGHT = ["--n_layer", "8"]


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", BASE + EIGHT + ["--sample_tokens", "0"]).ok()


@pytest.mark.parametrize("ranks, kind, micro", [(2, "zbv", 6), (4, "zbv", 2),
                                                (2, "dualpipev", 6), (4, "dualpipev", 3)])
def test_v_runs_reproduce_01(reference, ranks, kind, micro):
    """01's losses and evaluation, with the activation ledger matching its theory on every
    stage; rank 0 holds the tied embedding once (no all-reduce of it) and the loss."""
    run = launch("07_pipeline.py", BASE + EIGHT + ["--schedule", kind, "--micro_batch_size", micro],
                 nprocs=ranks).ok()
    assert_losses_match(reference, run, what=f"pp={ranks} {kind} m={24 // micro}")
    assert run.evals[-1]["val_loss"] == pytest.approx(reference.evals[-1]["val_loss"], rel=2e-5)
    step = run.steps[0]
    assert step["comm_bytes"]["all_reduce"] == 4  # the norm only: wte and its head are one tensor on rank 0
    assert "all_reduce[embedding]" not in step["comm_bytes"] and "all_reduce[embedding]" not in step["comm_bytes_theory"]
    assert step["comm_bytes"]["send"] == step["comm_bytes_theory"]["send"] > 0
    assert step["activation_bytes"] == step["activation_bytes_theory"]
    assert "ledger mismatch" not in run.stderr, run.stderr[-2000:]
    assert step["bubble_drawn"] == pytest.approx(step["bubble_theory"])
    if kind == "dualpipev":  # the pairs overlapped and, as they run here, in order: both stated
        assert "taking max(F, B)" in run.stdout and "with each pair run in order (F + B)" in run.stdout


def test_recorded_zbv_run_posts_nccl_batches_and_replays(tmp_path):
    ranks, m = 2, 4
    flags = BASE + ["--n_layer", "4", "--schedule", "zbv", "--micro_batch_size", "6", "--max_iters", "1",
                    "--eval_interval", "1"]
    record = tmp_path / "record"
    launch(os.path.join(ROOT, "tests", "nccl_replay.py"), [record, "07_pipeline.py"] + flags, nprocs=ranks).ok()
    recorded = nccl_replay.read_records(record)
    evaluation = posts(pp.exchanges_for_nccl([pp.eval_rounds(ranks, m, 2, True)] * ranks, ranks, 2, m, True), ranks)
    train = posts(pp.exchanges_for_nccl(rounds_of("zbv", ranks, m, 2), ranks, 2, m, True), ranks)
    for r in range(ranks):
        def plain(entries):
            return [[(o["op"], o["peer"], o["tag"]) for o in e["ops"]] for e in entries if e["kind"] == "batch"]
        expected = plain(evaluation[r]) * 2 + plain(train[r]) + plain(evaluation[r]) * 2
        assert plain(recorded[r]) == expected, f"rank {r}"
    assert nccl_replay.replay(recorded).ok


def test_tables_travel_through_torchs_csv_format(tmp_path):
    """07 reads the CSV torch's _dump_csv writes (ZB-V's, idle steps as empty cells); torch's
    _load_csv reads the one 07 writes (and lowers it to its runtime's sends and receives);
    every action 07 writes parses with torch's _Action.from_str back to the same text."""
    stages = [types.SimpleNamespace(stage_index=g, num_stages=6, group_size=3, group_rank=0,
                                    submod=torch.nn.Linear(1, 1)) for g in (0, 5)]
    schedule = ScheduleZBVZeroBubble(stages, 6)
    schedule._dump_csv(tmp_path / "torch.csv", format="compute_only")
    assert pp.read_table(tmp_path / "torch.csv") == table("zbv", 3, 6, 2)
    pp.write_table(table("zbv", 3, 6, 2), tmp_path / "ours.csv")
    schedule.pipeline_order = {}
    schedule._load_csv(tmp_path / "ours.csv")
    assert [[str(a) for a in schedule.pipeline_order[r]] for r in range(3)] == table("zbv", 3, 6, 2)
    for kind, v in OLDER + [("zbv", 2), ("dualpipev", 2)]:
        pp.write_table(table(kind, 3, 6, v), tmp_path / f"{kind}.csv")
        actions = pp.read_table(tmp_path / f"{kind}.csv")
        assert actions == table(kind, 3, 6, v) and pp.table_problem(actions, 3, 6) is None
        assert all(str(_Action.from_str(text)) == text for row in actions for text in row), kind


def test_a_table_that_cannot_run_is_refused_naming_the_rank_and_action():
    good = table("zb", 2, 3)  # [0F0 0F1 0I0 0W0 0F2 ...], [1F0 1I0 1F1 ...]

    def problem(rank, change):
        actions = [list(row) for row in good]
        actions[rank] = change(actions[rank])
        return pp.table_problem(actions, 2, 3)
    assert problem(1, lambda row: ["1W0"] + [a for a in row if a != "1W0"]) == \
        "rank 1, action 1W0: needs 1I0 first, which this rank runs after it"  # W before its B
    crossed = [["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]]  # each waits for the other's
    assert pp.table_problem(crossed, 2, 2) == ("rank 0, action 0B0: needs 1B0 first, which rank 1 runs only "
                                               "after what waits on this (the order deadlocks)")
    assert problem(1, lambda row: [a for a in row if a != "1F2"]) == "rank 1: never runs 1F2"  # 0's send unmatched
    assert problem(1, lambda row: row + ["1F2"]) == "rank 1, action 1F2: 1F2 runs twice"
    assert problem(1, lambda row: [a for a in row if a != "1W2"]) == "rank 1: never runs 1W2 after its 1I2"
    assert problem(0, lambda row: row + ["0F9"]).startswith("rank 0, action 0F9: micro-batch 9, but the run has 3")
    assert problem(0, lambda row: row + ["0X1"]).startswith("rank 0: not an action: '0X1'")
    assert problem(0, lambda row: [a.replace("0", "1", 1) if a[0] == "0" else a for a in row]).startswith(
        "its stages are not placed as 07 places chunks")
    # the posting orders themselves (the backstop behind the check above): where no
    # receive can move, exchanges_for_nccl names the first rank waiting, and its batch
    crossed = [[(("B", 0, 0),), (("F", 0, 0),)], [(("F", 0, 0),), (("B", 0, 0),)]]
    with pytest.raises(pp.Deadlock) as caught:
        pp.exchanges_for_nccl(crossed, 2, 1, 1)
    assert (caught.value.rank, caught.value.batch) == (0, 0) and "deadlocks under NCCL's rules" in str(caught.value)


def test_schedule_csv_runs_a_users_table_and_refuses_a_bad_one(reference, tmp_path):
    """07 writes ZB-V's table (--write_schedule, a dry run) and runs it back from the file as
    a user's table: 01's losses. A table with a W before its I: one line, before anything
    is built, exit 2."""
    flags = BASE + EIGHT + ["--micro_batch_size", "4"]
    path = tmp_path / "zbv.csv"
    launch("07_pipeline.py", flags + ["--schedule", "zbv", "--write_schedule", path, "--dry_run",
                                      "--world_size", "2"]).ok()
    run = launch("07_pipeline.py", flags + ["--schedule_csv", path], nprocs=2).ok()
    assert_losses_match(reference, run, what="pp=2 zbv from its CSV")
    assert "schedule csv" in run.stdout and "bubble: 0.027 drawn" in run.stdout
    rows = pp.read_table(path)
    rows[1] = ["1W0"] + [a for a in rows[1] if a != "1W0"]
    pp.write_table(rows, path)
    bad = launch("07_pipeline.py", BASE + EIGHT + ["--schedule_csv", path], nprocs=2, timeout=60)
    assert bad.returncode == 2 and bad.error_lines == [
        f"error: --schedule_csv {path}: rank 1, action 1W0: needs 1I0 first, which this rank runs after it"]
    few = launch("07_pipeline.py", BASE + ["--schedule", "zbv", "--n_layer", "7", "--dry_run", "--world_size", "4"])
    assert few.returncode == 2 and few.error_lines == [
        "error: n_layer 7 is fewer than pp 4 x 2 chunks per rank (zbv): every chunk needs at least one layer"]
