"""plan.py's two fixed costs (--call_overhead_us, --op_overhead_us): 0 on every datasheet
machine, each landing where a rank pays it (a call on each call, a batch of sends once, by
the size of the group that meets when given as G:US pairs; a layer's fixed cost on every
micro-batch a rank runs through it, however thin TP slices it, and on a pipeline's F and B),
and the pricing path of tests/benchmarks/plan_vs_measured.py (its --smoke mode's, with
made-up host figures: no launch, no timing). Pure functions and single dry runs."""

import importlib.util
import os

import pytest

import plan

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ["--model", "tiny", "--n_layer", "4", "--n_embd", "64", "--block_size", "32", "--dropout", "0",
         "--global_batch_size", "8", "--micro_batch_size", "2", "--device", "cpu", "--dtype", "float32"]
BY_HAND = ["--gpus_per_node", "2", "--peak_tflops", "0.01", "--link_gbps", "1", "--efficiency", "1"]


def benchmark():
    spec = importlib.util.spec_from_file_location("plan_vs_measured", os.path.join(HERE, "benchmarks",
                                                                                   "plan_vs_measured.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_fixed_costs_are_zero_on_every_datasheet_machine():
    for name in plan.MACHINES:
        _, machine = plan.parse(["--model", "gpt2", "--gpus", "8", "--machine", name])
        assert machine["call_s"] == machine["op_s"] == 0.0
        assert "kind_call_s" not in machine and "tp_op_s" not in machine
    _, machine = plan.parse([*MODEL, "--gpus", "2", *BY_HAND, "--call_overhead_us", "250", "--op_overhead_us", "40"])
    assert machine["call_s"] == pytest.approx(250e-6) and machine["op_s"] == pytest.approx(40e-6)


@pytest.mark.parametrize("flag", ["--call_overhead_us", "--op_overhead_us"])
def test_a_negative_or_infinite_fixed_cost_is_refused_in_one_line(flag, capsys):
    for value in ("-1", "inf"):
        with pytest.raises(SystemExit) as e:
            plan.parse([*MODEL, "--gpus", "2", *BY_HAND, flag, value])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: {flag} must be a number of microseconds in 0..1e9, got {value}"]


@pytest.mark.parametrize("words, says", [
    (["2:900", "2:800"], "each group size G in 2..10,000,000 once, got 2:900 2:800"),
    (["1:5"], "each group size G in 2..10,000,000 once, got 1:5"),
    (["900", "4:5"], "takes one number or G:US pairs"),
    (["2.5:3"], "takes one number or G:US pairs"),
    (["2:"], "takes one number or G:US pairs"),
    (["4:-3"], "must be a number of microseconds in 0..1e9, got -3"),
    (["2:900", "all_to_all:2:300", "all_to_all:2:400"], "all_to_all: takes one number or G:US pairs"),
    (["all_to_all:300", "all_to_all:2:400"], "all_to_all: takes one number or G:US pairs"),
    (["all_to_all:2:-1"], "all_to_all: must be a number of microseconds in 0..1e9, got -1"),
    (["scatter:2:5"], "takes one number or G:US pairs")])
def test_a_bad_call_cost_by_group_size_is_refused_in_one_line(words, says, capsys):
    with pytest.raises(SystemExit) as e:
        plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--call_overhead_us", *words])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --call_overhead_us") and says in err[0]


def test_the_call_cost_by_group_size_is_interpolated_and_held_at_the_ends():
    """G:US pairs, in any order: linear in g between two measured sizes, the nearest beyond
    them; one number is every group's."""
    _, machine = plan.parse([*MODEL, "--gpus", "8", *BY_HAND, "--call_overhead_us", "4:4500", "2:900"])
    assert [g for g, _ in machine["call_s"]] == [2, 4] and dict(machine["call_s"]) == pytest.approx({2: 900e-6, 4: 4500e-6})
    assert [plan.call_seconds(machine, g) for g in (2, 3, 4, 8)] == pytest.approx([900e-6, 2700e-6, 4500e-6, 4500e-6])
    assert plan.call_seconds(dict(call_s=((4, 1e-3),)), 2) == plan.call_seconds(dict(call_s=1e-3), 64) == 1e-3


def test_a_kinds_own_call_cost_prices_that_kind_only():
    """--call_overhead_us KIND:G:US (or KIND:US): that kind's calls pay its own fixed cost by
    group size (10's all-to-alls, measured as themselves), every other kind the plain words'
    figure (0 when only a kind's own are given)."""
    machine = dict(intra_gbps=1.0, inter_gbps=1.0, gpus_per_node=4, alpha_intra=1e-4, alpha_inter=1e-4)
    _, parsed = plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--call_overhead_us", "2:900", "4:4500",
                            "all_to_all:4:1000", "all_to_all:2:300"])
    assert parsed["call_s"] == ((2, 900e-6), (4, 4500e-6))
    assert dict(parsed["kind_call_s"]["all_to_all"]) == pytest.approx({2: 300e-6, 4: 1000e-6})
    priced = dict(machine, call_s=parsed["call_s"], kind_call_s=parsed["kind_call_s"])
    for op, g, each in (("all_to_all_single[ep]", 2, 300e-6), ("all_to_all_single[ep]", 4, 1000e-6),
                        ("all_reduce", 2, 900e-6), ("all_gather_into_tensor", 4, 4500e-6)):
        assert plan.comm_seconds(op, 1e6, g, None, priced, 10) - plan.comm_seconds(op, 1e6, g, None, machine, 10) \
            == pytest.approx(10 * each)
    _, alone = plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--call_overhead_us", "all_to_all:250"])
    assert alone["call_s"] == 0.0 and alone["kind_call_s"] == {"all_to_all": pytest.approx(250e-6)}


def test_each_call_pays_the_fixed_cost_and_a_batch_of_sends_pays_it_once():
    machine = dict(intra_gbps=1.0, inter_gbps=1.0, gpus_per_node=4, alpha_intra=1e-4, alpha_inter=1e-4)
    fixed = dict(machine, call_s=1e-3)
    for op in ("all_reduce", "all_gather_into_tensor", "send"):
        assert plan.comm_seconds(op, 1e6, 4, None, fixed, 10) - plan.comm_seconds(op, 1e6, 4, None, machine, 10) \
            == pytest.approx(10e-3)
    assert plan.comm_seconds("send", 1e6, 2, None, fixed, 10, posts=5) - \
        plan.comm_seconds("send", 1e6, 2, None, machine, 10) == pytest.approx(5e-3)
    assert plan.comm_seconds("all_reduce", 1e6, 1, None, fixed, 10) == 0.0  # a one-rank group posts nothing
    by_size = dict(machine, call_s=((2, 1e-3), (4, 5e-3)))  # each call pays its own group's cost
    assert plan.comm_seconds("send", 1e6, 2, None, by_size, 10) - plan.comm_seconds("send", 1e6, 2, None, machine, 10) \
        == pytest.approx(10e-3)
    assert plan.comm_seconds("all_reduce", 1e6, 4, None, by_size, 10) - \
        plan.comm_seconds("all_reduce", 1e6, 4, None, machine, 10) == pytest.approx(50e-3)


def test_a_layers_fixed_cost_lands_on_every_micro_batch_a_rank_runs_through_it():
    """DDP's rank runs its share of the micro-batches through every layer; TP's rank runs every
    micro-batch through every layer (its halves of the matrices launch as many kernels); a
    pipeline's stage runs every micro-batch through its own layers, a third on F, two on B."""
    op_s = 1e-3
    for script, flags, micro_batches in (("03_ddp.py", [], 2), ("06_tensor_parallel.py", [], 4)):
        args, config, _ = plan.dry_run(script, [*MODEL, *flags], 2, 2)
        bare, _ = plan.compute_seconds(script, args, config, 2, 1e10)
        fixed, _ = plan.compute_seconds(script, args, config, 2, 1e10, op_s)
        assert fixed - bare == pytest.approx(micro_batches * config.n_layer * op_s)
    args, config, _ = plan.dry_run("07_pipeline.py", [*MODEL, "--schedule", "gpipe"], 2, 2)
    bare = plan.chunk_forwards("07_pipeline.py", args, config, 2, 1e10)
    fixed = plan.chunk_forwards("07_pipeline.py", args, config, 2, 1e10, op_s)
    assert [f[0] - b[0] for f, b in zip(fixed, bare)] == pytest.approx([2 * op_s / 3, 2 * op_s / 3])
    _, bubble = plan.compute_seconds("07_pipeline.py", args, config, 2, 1e10, op_s)
    assert 0 < bubble < 1


def test_06s_layer_pays_its_own_fixed_cost_where_06_and_08_run_it(capsys):
    """--op_overhead_us US tp:US: 06's layer (06 and 08 run it, at any --tp) pays tp:US more
    than every layer's fixed cost, on every micro-batch a rank runs through it; 03's and 07's
    layers do not. A bad word is one line, exit 2."""
    _, machine = plan.parse([*MODEL, "--gpus", "2", *BY_HAND, "--op_overhead_us", "40", "tp:25"])
    assert machine["op_s"] == pytest.approx(40e-6) and machine["tp_op_s"] == pytest.approx(25e-6)
    assert [plan.layer_fixed_seconds(name, machine) for name in ("03_ddp.py", "06_tensor_parallel.py", "08_3d.py",
                                                                 "07_pipeline.py")] == \
        pytest.approx([40e-6, 65e-6, 65e-6, 40e-6])
    hand = [*MODEL, "--gpus", "2", "--gpus_per_node", "2", "--peak_tflops", "0.01", "--link_gbps", "1",
            "--efficiency", "1"]
    for name, flags, layer_micro_batches in (("06_tensor_parallel.py", [], 4 * 4), ("08_3d.py", ["--pp", "2"], 2 * 4),
                                             ("03_ddp.py", [], 0)):
        steps = [plan.score(name, flags, name, *plan.parse([*hand, "--op_overhead_us", "40", *tp]))[0]["step_time_s"]
                 for tp in ([], ["tp:1000"])]
        assert steps[1] - steps[0] >= (0.99 if name.startswith("08") else 1) * layer_micro_batches * 1e-3 - 1e-12
        assert (steps[1] > steps[0]) == bool(layer_micro_batches)
    for words, says in ((["tp:5"], "takes one number of microseconds, then at most one tp:US"),
                        (["40", "pp:5"], "takes one number of microseconds, then at most one tp:US"),
                        (["40", "tp:1", "tp:2"], "takes one number of microseconds, then at most one tp:US"),
                        (["40", "tp:-1"], "must be a number of microseconds in 0..1e9, got -1")):
        with pytest.raises(SystemExit) as e:
            plan.parse([*MODEL, "--gpus", "2", *BY_HAND, "--op_overhead_us", *words])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --op_overhead_us") and says in err[0], err


def test_the_benchmarks_pricing_path():
    """plan_vs_measured's pricing, as its --smoke mode runs it, from made-up host figures:
    links_now recovers the fixed cost per call of each group size and the bandwidth that made
    the timed sizes, and the smoke's layouts and 01 are priced with them (the layouts slower
    than 01's share); at 4 ranks a pipeline's calls meet 2 ranks and the world's 4 (call_groups),
    and its sends pay the pairs' cost, not the world's."""
    pvm = benchmark()
    host = dict(rate=5e9, op_s=300e-6, alpha=200e-6, beta=1.0, m=4, layers=2)
    call_s, beta, sizes = {2: 400e-6, 4: 3e-3}, 0.5, (16384, 16 * 16384)
    timed = lambda g, cost: tuple(2 * (g - 1) * host["alpha"] + cost + 2 * (g - 1) / g * b / (beta * 1e9)  # noqa: E731
                                  for b in sizes)
    now = dict(slow=1.5, bytes=sizes, call={g: timed(g, s) for g, s in call_s.items()})
    found, found_beta, _ = pvm.links_now(host, now)
    assert found == pytest.approx(call_s) and found_beta == pytest.approx(beta)
    a2a_s, a2a_gbps = {2: 250e-6, 4: 2e-3}, 0.3  # 10's all-to-alls, as themselves: (g-1) alpha, (g-1)/g x bytes
    a2a = {g: tuple((g - 1) * host["alpha"] + s + (g - 1) / g * b / (a2a_gbps * 1e9) for b in sizes)
           for g, s in a2a_s.items()}
    found, found_gbps = pvm.all_to_all_now(host, dict(now, a2a=a2a))
    assert found == pytest.approx(a2a_s) and found_gbps == pytest.approx(a2a_gbps)
    assert pvm.all_to_all_now(host, now) == ({}, None)
    rated = pvm.at_rate_of(host, 0.05, pvm.SMOKE_MODEL)
    one = pvm.priced("01_single_gpu.py", pvm.SMOKE_MODEL, 1, rated)
    assert one["step_time_s"] == pytest.approx(0.05)  # the rate is the one 01's step says
    pairs = dict(now, call={2: now["call"][2]})
    for label, script, strategy, extra in pvm.layouts(2)[:2]:
        c = pvm.priced(script, pvm.SMOKE_MODEL + extra + strategy, 2, rated, pairs)
        assert c["call_s"] == pytest.approx({2: call_s[2]}) and c["beta"] == pytest.approx(beta)
        assert one["step_time_s"] / 2 < c["step_time_s"] < 10 * one["step_time_s"], label
    pipeline = pvm.SMOKE_MODEL + ["--n_layer", "4", "--schedule", "1f1b"]  # a layer for each of 4 stages
    assert pvm.call_groups("07_pipeline.py", pipeline, 4) == [2, 4]
    as_pairs = pvm.priced("07_pipeline.py", pipeline, 4, rated, now)["step_time_s"]
    as_world = pvm.priced("07_pipeline.py", pipeline, 4, rated, dict(now, call={4: now["call"][4]}))["step_time_s"]
    assert as_pairs < as_world


@pytest.mark.parametrize("flags", [["--ranks", "4", "--group", "3"], ["--ranks", "4", "--group", "1"],
                                   ["--ranks", "2", "--group", "4"]])
def test_call_cost_refuses_a_group_that_does_not_divide_the_ranks_in_one_line(flags):
    """call_cost.py --group G: n ranks as n/G groups of G, so G must be at least 2 and divide n
    (checked before any rank starts)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, os.path.join(HERE, "benchmarks", "call_cost.py"), *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --group must be at least 2 and divide --ranks {flags[1]}, got {flags[3]}"]


@pytest.mark.parametrize("words", [["reduce_scatter"], ["reduce_scatter:0"], ["reduce_scatter:-1"],
                                   ["reduce_scatter:nan"], ["scatter:1"], ["all_gather:1", "all_gather:2"]])
def test_a_bad_bandwidth_by_kind_is_refused_in_one_line(words, capsys):
    with pytest.raises(SystemExit) as e:
        plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--op_gbps", *words])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --op_gbps takes KIND:GBPS pairs, each KIND of all_reduce, reduce_scatter, all_gather, "
                   f"all_to_all, send once and GBPS a positive number of GB/s, got {' '.join(words)}"]


@pytest.mark.parametrize("value", ["-1", "10000001"])
def test_a_bad_core_count_is_refused_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as e:
        plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--cores_per_node", value])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --cores_per_node must be in 0..10,000,000 (0: a device per rank), got {value}"]


def test_a_kinds_own_bandwidth_prices_that_kind_only():
    """--op_gbps reduce_scatter:B: a reduce-scatter's bytes cross at B (its bus factor (g-1)/g
    kept), inside a node and, no faster than the NICs, across; every other kind at the link's."""
    _, machine = plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--link_gbps", "2", "--op_gbps", "reduce_scatter:0.5"])
    assert machine["op_gbps"] == {"reduce_scatter": 0.5}
    bare = dict(machine, alpha_intra=0.0, alpha_inter=0.0)
    assert plan.comm_seconds("reduce_scatter_tensor[world]", 4e6, 4, None, bare) == pytest.approx(3 / 4 * 4e6 / 0.5e9)
    assert plan.comm_seconds("all_gather_into_tensor[world]", 4e6, 4, None, bare) == pytest.approx(3 / 4 * 4e6 / 2e9)
    assert plan.comm_seconds("all_reduce[world]", 4e6, 4, None, bare) == pytest.approx(6 / 4 * 4e6 / 2e9)
    assert plan.comm_seconds("reduce_scatter_tensor[world]", 4e6, 4, 1, bare) == pytest.approx(3 / 4 * 4e6 / 0.5e9)
    _, sheet = plan.parse(["--model", "gpt2", "--gpus", "8", "--machine", "polaris"])
    assert "op_gbps" not in sheet and "cores" not in sheet  # the datasheet machines: neither term


def test_a_rings_exchange_pays_its_own_fixed_cost_by_the_rings_size():
    """09's ring: each step waits on the step before of the rank before, so every rank of the
    ring meets at each step: with --exchange_overhead_us its sends pay a ring's exchange's
    fixed cost at the ring's size (once a batch of K and V), without it a pair's call's; their
    bytes cross one link either way. A pipeline's sends are no ring's."""
    by_size = dict(intra_gbps=1.0, inter_gbps=1.0, gpus_per_node=4, alpha_intra=0.0, alpha_inter=0.0,
                   call_s=((2, 1e-3), (4, 5e-3)))
    args, config, _ = plan.dry_run("09_context_parallel.py", [*MODEL, "--cp_impl", "ring"], 4, 4)
    assert plan.ring_meets("09_context_parallel.py", "send[cp]", args, 4) == 4
    cost = plan.rank_costs("09_context_parallel.py", args, config, 4, plan.planned_dtype(args), 0)
    sends = {op: value for op, (_, value) in cost["sent"].items() if op.startswith("send")}
    posts = sum(plan.op_calls(cost).get(op, 1) for op in sends) / 2
    priced = [plan.stage_comm("09_context_parallel.py", args, config, 4, m, cost, sends, 0)[0]["inside"][0]
              for m in (dict(by_size, call_s=0.0), by_size, dict(by_size, exchange_s=((2, 2e-3), (4, 3e-3))))]
    assert sends and priced[1] - priced[0] == pytest.approx(posts * 1e-3)
    assert priced[2] - priced[0] == pytest.approx(posts * 3e-3)
    _, machine = plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--exchange_overhead_us", "4:3000", "2:2000"])
    assert dict(machine["exchange_s"]) == pytest.approx({2: 2e-3, 4: 3e-3})
    args, config, _ = plan.dry_run("07_pipeline.py", [*MODEL, "--schedule", "1f1b"], 4, 4)
    assert plan.ring_meets("07_pipeline.py", "send[pp]", args, 4) is None


def test_a_bad_exchange_cost_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        plan.parse([*MODEL, "--gpus", "4", *BY_HAND, "--exchange_overhead_us", "1:5"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --exchange_overhead_us takes one number or G:US pairs, each group size G in 2..10,000,000 once, got 1:5"]


def test_ranks_sharing_cores_compute_as_many_at_once_as_are_busy():
    """--cores_per_node C below a node's ranks: a layout without a pipeline computes ranks / C
    slower (all at once); a pipeline is timed by processor sharing over 07's own events, which
    with a core per rank is 07's rank_finishes exactly, and on one core, no messages, takes the
    whole work of every rank (a core never idles while an operation can run); so 1F1B's
    bubble yields cores and the step is shorter than all-at-once pricing."""
    import argparse
    pipeline = plan.script("07_pipeline.py")
    events = plan.pipeline_events("1f1b", 1, 4, 8)
    cost = lambda r, kind, c: {"F": 1.0, "B": 2.0}[kind] * (1 + 0.1 * r)  # noqa: E731
    run = argparse.Namespace(schedule="1f1b", schedule_csv=None, virtual_stages=1)
    own = pipeline.rank_finishes(run, 4, 8, cost, lambda g, to: 0.05, events)
    assert plan.finishes_sharing_cores(events[0], 4, cost, lambda g, to: 0.05, 4, 1.0) == pytest.approx(own)
    work = sum(8 * 3 * (1 + 0.1 * r) for r in range(4))
    assert max(plan.finishes_sharing_cores(events[0], 4, cost, None, 1, 1.0)) == pytest.approx(work)
    hand = [*MODEL, "--n_layer", "4", "--gpus", "4", "--gpus_per_node", "4", "--link_gbps", "1", "--efficiency", "1"]
    steps = {}
    for name, flags in (("03_ddp.py", []), ("07_pipeline.py", ["--schedule", "1f1b"])):
        for cores, peak in ((0, "0.01"), (2, "0.02"), (4, "0.01")):
            args, machine = plan.parse([*hand, "--peak_tflops", peak] + (["--cores_per_node", str(cores)] if cores else []))
            steps[name, cores] = plan.score(name, flags, name, args, machine)[0]["step_time_s"]
    assert steps["03_ddp.py", 2] == pytest.approx(steps["03_ddp.py", 0]) == pytest.approx(steps["03_ddp.py", 4])
    assert steps["07_pipeline.py", 4] == steps["07_pipeline.py", 0]  # as many cores as ranks: nothing shared
    assert steps["07_pipeline.py", 2] < 0.9 * steps["07_pipeline.py", 0]


def test_call_cost_refuses_a_collective_named_twice_in_one_line():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, os.path.join(HERE, "benchmarks", "call_cost.py"), "--ranks", "2", "--op",
                           "all_reduce", "all_reduce"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: --op names each collective once, got all_reduce all_reduce"]
