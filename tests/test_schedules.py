"""07's schedules under NCCL's point-to-point semantics (tests/nccl_replay.py: the model).

gloo buffers sends, so a posting order that deadlocks on GPUs passes every CPU run. Here:
the checker itself on small orders (a deadlock, its pairwise fix, a FIFO mismatch, a
collective order); the interleaved schedule as 07 posted it before it adopted Megatron's
steady-state batches (a lone send per operation), which deadlocks at p = 2, v = 2, m = 4;
every schedule's posting order, as 07 computes it (exchanges()), replayed at p 2-4, v 2-3,
m from p to 4p, training and evaluation (zero bubble's W posts nothing: it runs between a
round's posts and its receives); real runs recorded rank by rank, whose posts are
exactly exchanges()'s batches and whose whole recording (collectives included) replays; and
recorded runs of the other scripts that post point-to-point batches (08's pipeline, 09's ring)."""

import importlib
import os

import pytest

import nccl_replay
from harness import ROOT, TINY, launch

pp = importlib.import_module("07_pipeline")


def batch(*ops, group="world"):
    """batch(("send", 1, 7), ("recv", 1, 8)) -> a recorded batch_isend_irecv."""
    return {"kind": "batch", "group": group,
            "ops": [{"op": op, "peer": peer, "tag": tag, "bytes": 4} for op, peer, tag in ops]}


def collective(kind, ranks, group="world"):
    return {"kind": kind, "group": group, "ranks": ranks, "bytes": 4}


def posts_of(rounds_by_rank, p, v, m):
    """Every rank's batches as 07's Pipeline posts them (an empty batch is not posted)."""
    return {r: [batch(*b) for b in pp.exchanges(rounds_by_rank[r], p, r, v, m) if b] for r in range(p)}


# ----------------------------------------------------------------------------------------
# The checker
# ----------------------------------------------------------------------------------------

def test_two_lone_sends_first_deadlock_and_one_batch_each_does_not():
    """The textbook case: both ranks send before they receive. Rendezvous: each send waits
    for a receive the other rank posts only after its own send completes."""
    lone = {0: [batch(("send", 1, 0)), batch(("recv", 1, 1))],
            1: [batch(("send", 0, 1)), batch(("recv", 0, 0))]}
    result = nccl_replay.replay(lone)
    assert not result.ok and set(result.blocked) == {0, 1}
    report = result.report()
    assert "DEADLOCK" in report and "send to 1" in report and "send to 0" in report, report
    assert "rank 1's operation 1" in report and "rank 0's operation 1" in report, report
    paired = {0: [batch(("send", 1, 0), ("recv", 1, 1))], 1: [batch(("recv", 0, 0), ("send", 0, 1))]}
    assert nccl_replay.replay(paired).ok
    # the same with lone (blocking or not) sends and receives, as dist.send / dist.isend record them

    def lone(kind, peer, tag):
        return {"kind": kind, "group": "world", "peer": peer, "tag": tag, "bytes": 4}
    assert not nccl_replay.replay({0: [lone("send", 1, 0), lone("recv", 1, 1)],
                                   1: [lone("send", 0, 1), lone("recv", 0, 0)]}).ok
    assert nccl_replay.replay({0: [lone("send", 1, 0), lone("recv", 1, 1)],
                               1: [lone("recv", 0, 0), lone("send", 0, 1)]}).ok


def test_fifo_matching_ignores_tags_and_reports_the_mismatch():
    """NCCL matches the k-th send of a pair with the k-th receive, whatever the tags: two
    messages received in the other order arrive in the wrong buffers."""
    swapped = {0: [batch(("send", 1, 0), ("send", 1, 1))], 1: [batch(("recv", 0, 1), ("recv", 0, 0))]}
    result = nccl_replay.replay(swapped)
    assert not result.ok and not result.blocked and len(result.mismatches) == 2, result.report()
    assert "sent tag 0" in result.mismatches[0] and "received as tag 1" in result.mismatches[0]


def test_a_receive_never_posted_and_collectives_out_of_order_are_reported():
    unmatched = {0: [batch(("send", 1, 0))], 1: []}
    assert "never posted" in nccl_replay.replay(unmatched).report()
    crossed = {0: [collective("all_reduce", [0, 1]), collective("broadcast", [0, 1])],
               1: [collective("broadcast", [0, 1]), collective("all_reduce", [0, 1])]}
    result = nccl_replay.replay(crossed)
    assert not result.ok and result.mismatches, result.report()
    # a collective waits for every member: one rank in a batch its peer never reaches
    stuck = {0: [collective("all_reduce", [0, 1])],
             1: [batch(("recv", 0, 0)), collective("all_reduce", [0, 1])]}
    result = nccl_replay.replay(stuck)
    assert not result.ok and set(result.blocked) == {0, 1}, result.report()
    # two groups of the same ranks are two communicators: their collectives do not match
    groups = {0: [collective("all_reduce", [0, 1], "a")], 1: [collective("all_reduce", [0, 1], "b")]}
    assert not nccl_replay.replay(groups).ok


# ----------------------------------------------------------------------------------------
# 07 before the fix: one batch per operation, lone sends where no receive follows
# ----------------------------------------------------------------------------------------

def posts_one_batch_per_operation(kind, p, v, m):
    """07's posting rule before it adopted Megatron's steady-state batches (recorded from a
    real run, p = 2, v = 2, m = 4, through nccl_replay.py, these are its batches): before
    each operation, the sends still pending with that operation's receive, if it has one;
    a forward of the first chunk or a backward of the last has none, so its pending send
    went alone."""
    posts = {}
    for rank in range(p):
        n, pending, batches = p * v, [], []

        def post(*receive):
            if pending or receive:
                batches.append(batch(*pending, *receive))
            pending.clear()
        for kind_, i, c in pp.schedule(kind, p, rank, m, v):
            g = c * p + rank
            if kind_ == "F":
                post() if g == 0 else post(("recv", (rank - 1) % p, i * n + g - 1))
                if g < n - 1:
                    pending.append(("send", (rank + 1) % p, i * n + g))
            else:
                post() if g == n - 1 else post(("recv", (rank + 1) % p, n * m + i * n + g + 1))
                if g > 0:
                    pending.append(("send", (rank - 1) % p, n * m + i * n + g))
        post()
        posts[rank] = batches
    return posts


def test_interleaved_one_batch_per_operation_deadlocks_at_p2_v2_m4():
    """Rank 0 posts a send alone (its next forward is of chunk 0: nothing to receive) while
    rank 1 waits in a batch whose receive rank 0 posts only in its next batch."""
    result = nccl_replay.replay(posts_one_batch_per_operation("interleaved", 2, 2, 4))
    assert not result.ok and set(result.blocked) == {0, 1}, result.report()
    assert "head: batch_isend_irecv[send to 1 tag 18]" in result.blocked[0][0], result.report()
    assert "which waits behind 1 operation(s)" in result.report()


@pytest.mark.parametrize("p, v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
def test_one_batch_per_operation_deadlocks_whenever_m_exceeds_p(p, v):
    """... and at every p and v once m > p; at m = p (all warm-up and cool-down) it ran."""
    assert nccl_replay.replay(posts_one_batch_per_operation("interleaved", p, v, p)).ok
    for m in range(2 * p, 4 * p + 1, p):
        assert not nccl_replay.replay(posts_one_batch_per_operation("interleaved", p, v, m)).ok, (p, v, m)


# ----------------------------------------------------------------------------------------
# 07 now: every schedule, training and evaluation
# ----------------------------------------------------------------------------------------

SIZES = [(kind, p, v, m) for p in (2, 3, 4)
         for kind, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3]), ("zb", [1])) for v in vs
         for m in range(p, 4 * p + 1) if kind != "interleaved" or m % p == 0]


@pytest.mark.parametrize("kind, p, v, m", SIZES)
def test_every_schedule_replays_under_nccl(kind, p, v, m):
    train = posts_of({r: pp.schedule_rounds(kind, p, r, m, v) for r in range(p)}, p, v, m)
    result = nccl_replay.replay(train)
    assert result.ok, result.report()
    # each micro-batch crosses the p·v - 1 chunk boundaries forward, then backward: one
    # send per crossing (and so one receive: every pair matched)
    assert sum(op["op"] == "send" for r in train for b in train[r] for op in b["ops"]) == 2 * m * (p * v - 1)
    evaluation = posts_of({r: pp.forward_rounds(p, m, v) for r in range(p)}, p, v, m)
    result = nccl_replay.replay(evaluation)
    assert result.ok and sum(op["op"] == "send" for r in evaluation for b in evaluation[r]
                             for op in b["ops"]) == m * (p * v - 1), result.report()


# ----------------------------------------------------------------------------------------
# Real runs, recorded rank by rank
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks, kind, v, micro, layers", [(2, "interleaved", 2, 6, 4), (3, "1f1b", 1, 4, 3),
                                                           (3, "zb", 1, 4, 3)])
def test_recorded_runs_post_exchanges_batches_and_replay(tmp_path, ranks, kind, v, micro, layers):
    """A step and an evaluation before and after it: every rank posts exactly exchanges()'s
    batches, in order (so the replays above are of what runs), and its whole recording,
    the run's collectives included, replays under NCCL's semantics."""
    flags = TINY + ["--global_batch_size", "24", "--micro_batch_size", micro, "--schedule", kind,
                    "--virtual_stages", v, "--n_layer", layers, "--max_iters", "1", "--eval_interval", "1",
                    "--eval_iters", "1", "--grad_clip", "1.0"]
    record = tmp_path / "record"
    recorder = os.path.join(ROOT, "tests", "nccl_replay.py")  # wraps torch.distributed, runs 07
    launch(recorder, [record, "07_pipeline.py"] + flags, nprocs=ranks).ok()
    posts = nccl_replay.read_records(record)
    assert sorted(posts) == list(range(ranks))
    m = 24 // micro
    for rank in range(ranks):
        def plan(rounds):
            return [list(b) for b in pp.exchanges(rounds, ranks, rank, v, m) if b]
        evaluation = plan(pp.forward_rounds(ranks, m, v)) * 2  # train and val, one batch each
        expected = evaluation + plan(pp.schedule_rounds(kind, ranks, rank, m, v)) + evaluation
        recorded = [[(op["op"], op["peer"], op["tag"]) for op in entry["ops"]]
                    for entry in posts[rank] if entry["kind"] == "batch"]
        assert recorded == expected, f"rank {rank}"
        assert {entry["kind"] for entry in posts[rank]} >= {"batch", "all_reduce", "broadcast"}
    result = nccl_replay.replay(posts)
    assert result.ok, result.report()


@pytest.mark.parametrize("script, flags", [
    ("08_3d.py", ["--pp", "2", "--global_batch_size", "24", "--micro_batch_size", "4"]),  # 1F1B, m = 6
    ("09_context_parallel.py", ["--cp", "2", "--cp_impl", "ring"]),  # the ring's K/V passes
])
def test_the_other_point_to_point_schedules_replay_under_nccl(tmp_path, script, flags):
    """08's pipeline and 09's ring attention post batch_isend_irecv too: a recorded step and
    its evaluations, the collectives included, replay under NCCL's semantics."""
    record = tmp_path / "record"
    flags = TINY + flags + ["--max_iters", "1", "--eval_interval", "1", "--eval_iters", "1"]
    launch(os.path.join(ROOT, "tests", "nccl_replay.py"), [record, script] + flags, nprocs=2).ok()
    posts = nccl_replay.read_records(record)
    assert all(any(entry["kind"] == "batch" for entry in posts[rank]) for rank in (0, 1))
    result = nccl_replay.replay(posts)
    assert result.ok, result.report()
