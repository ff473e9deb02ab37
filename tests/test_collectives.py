"""02_collectives.py: every collective correct at 2, 3 and 4 ranks (at 2 through a real launcher,
and there through mpi4py too under mpiexec), the hand-written ring equal to dist.all_reduce, the
bench output well formed."""

import pytest

from harness import default_launcher, launch

OPS = ["all_reduce (sum)", "reduce (sum to rank 0)", "broadcast (from rank 0)", "all_gather",
       "gather (to rank 0)", "scatter (from rank 0)", "reduce_scatter", "all_to_all",
       "send/recv and batch_isend_irecv", "barrier", "ring all_reduce by hand"]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_collective_is_correct(ranks):
    # at 2 ranks a real launcher: under mpiexec, 02 checks every collective against mpi4py's as
    # well (3 and 4 ranks forked: the same checks without each rank importing torch afresh, which
    # costs a real launch seconds of CPU a rank)
    real = ranks == 2
    run = launch("02_collectives.py", ["--device", "cpu"], nprocs=ranks, launcher=default_launcher() if real else None,
                 metrics=False, out_dir=False, timeout=120).ok()
    out = run.stdout
    assert "all collectives correct" in out and "WRONG" not in out and "DIFFERS" not in out
    for op in OPS:
        assert op in out, op
    assert out.count("  ok") == len(OPS)
    if real and default_launcher() == "mpiexec":  # the mpi4py side ran next to every data-moving op
        assert out.count("mpi4py agrees") == len(OPS) - 2  # all but barrier and the ring
    # the picture of all_reduce from the docstring, N = 3
    if ranks == 3:
        assert "rank 2  [20 21 22]  ->  [30 33 36]" in out


def test_one_rank_says_what_needs_two():
    run = launch("02_collectives.py", ["--device", "cpu"], metrics=False, out_dir=False, timeout=60).ok()
    assert "send/recv: needs at least 2 ranks" in run.stdout and "all collectives correct" in run.stdout


def test_bench_output_is_well_formed(tmp_path):
    path = tmp_path / "bench.jsonl"
    run = launch("02_collectives.py", ["--device", "cpu", "--bench", "--max_bytes", "65536", "--iters", "3",
                                       "--metrics", path], nprocs=3, out_dir=False, timeout=180).ok()
    rows = run.metrics
    ops = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "ring_all_reduce"]
    assert [r["op"] for r in rows] == [op for op in ops for _ in range(4)]  # 1, 4, 16, 64 KiB
    factor = {"all_reduce": 4 / 3, "ring_all_reduce": 4 / 3, "broadcast": 1.0,
              "all_gather": 2 / 3, "reduce_scatter": 2 / 3, "all_to_all": 2 / 3}
    for r in rows:
        assert r["world_size"] == 3 and r["bytes"] % 12 == 0 and r["time_us"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor[r["op"]])
    assert "busbw GB/s" in run.stdout


def test_bad_input_gives_one_line():
    run = launch("02_collectives.py", ["--iters", "0"], nprocs=2, metrics=False, out_dir=False, timeout=60)
    assert run.returncode != 0 and len(run.error_lines) == 1 and "--iters must be positive" in run.error_lines[0]
