"""plan.py's step time as the ranks run it (issue: the time model): a pipeline simulated from
the schedule each rank executes with each stage's own layers, an all-to-all across nodes by the
NIC rule, a multi-node --bench read per GPU, causal attention counted as it runs, and --imbalance.
Pure functions and single dry runs: no launch."""

import argparse
import json
import math

import pytest

import plan
from common import PRESETS, GPTConfig
from infra.formulas import flops_per_token

PIPELINE = plan.script("07_pipeline.py")


def forward_times(layers, head=0.0):
    return tuple((float(n), head * (g == len(layers) - 1)) for g, n in enumerate(layers))


def test_the_slowest_stage_sets_a_pipelines_pace():
    """1F1B on stages of 1, 1, 2, 2 layers (F 1 unit a layer, B 2): the simulation gives the
    pipeline's fill and drain through every stage, then m - 1 micro-batches at the slowest
    stage's F + B, not the even split's (p - 1)/(m + p - 1) of the mean stage."""
    m = 8
    length = plan.pipeline_length.__wrapped__("1f1b", 1, 4, m, forward_times([1, 1, 2, 2]), False)
    assert length == (m - 1) * 3 * 2 + 3 * (1 + 1 + 2 + 2)
    even = 3 * 1.5 * (m + 4 - 1)  # the mean stage's time with the formula's bubble
    assert length > even


@pytest.mark.parametrize("schedule, v, p, m", [("1f1b", 1, 4, 40), ("interleaved", 2, 4, 40), ("zb", 1, 6, 50),
                                                ("zbv", 2, 4, 40), ("dualpipev", 2, 8, 64)])
def test_a_long_pipeline_is_extended_exactly(monkeypatch, schedule, v, p, m):
    """Past SIMULATED_OPS the step is simulated at two micro-batch counts and extended: the
    same length as the whole simulation, for every schedule, on uneven stages with a head."""
    forward = forward_times([n for _, n in PIPELINE.chunk_layers(37, p * v)], head=0.7)
    whole = plan.pipeline_length.__wrapped__(schedule, v, p, m, forward, True)
    monkeypatch.setattr(plan, "SIMULATED_OPS", 100)
    assert math.isclose(plan.pipeline_length.__wrapped__(schedule, v, p, m, forward, True), whole, rel_tol=1e-12)


def test_causal_attention_is_counted_as_it_runs():
    """The time counts half of attention's s² (causal kernels skip the rest); MFU keeps PaLM's."""
    config = GPTConfig(**{k: v for k, v in PRESETS["gpt2"].items() if k in GPTConfig.__dataclass_fields__})
    n_params = 124_000_000
    blocks, head = plan.flops_as_run(config, n_params)
    L, H, T = config.n_layer, config.n_head, config.block_size
    assert blocks + head == flops_per_token(config, n_params) - 6 * L * H * (config.n_embd // H) * T


def polaris():
    return dict(plan.MACHINES["polaris"])


def test_an_all_to_all_across_nodes_leaves_through_each_gpus_nic_share():
    """EP 32 over 8 Polaris nodes: a rank's rows for the 28 ranks on other nodes cross its own
    12.5 GB/s share of the NICs, not 4 GPUs' worth as a ring's would."""
    machine, nbytes = polaris(), 2**30
    t = plan.comm_seconds("all_to_all_single[ep]", nbytes, 32, 4, machine)
    assert math.isclose(t, 31 * machine["alpha_inter"] + nbytes * 28 / 32 / (machine["inter_gbps"] * 1e9))
    ring = plan.comm_seconds("all_gather_into_tensor[dp]", nbytes, 32, 4, machine)
    assert t > 3 * ring  # the ring's rule priced it 4x faster


def test_a_bench_across_nodes_is_stored_per_gpu(tmp_path):
    """02 --bench across 2 nodes of 4 ranks: the ring's bus bandwidth is 4 GPUs' NIC share."""
    path = tmp_path / "bench.jsonl"
    rows = [dict(op="all_reduce", bytes=b, world_size=8, ranks_per_node=4, time_us=10.0 + b / 1e4, busbw_GBps=40.0)
            for b in (1024, 2**20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, machine = plan.parse(["--gpus", "8", "--machine", "polaris", "--bench", str(path)])
    assert machine["inter_gbps"] == 10.0


def test_the_imbalance_is_read_from_a_runs_metrics(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(dict(step=s, expert_imbalance=x)) + "\n" for s, x in enumerate((1.3, 1.9, 1.1))))
    args, _ = plan.parse(["--gpus", "8", "--machine", "polaris", "--imbalance", str(path)])
    assert args.imbalance == 1.9
    for bad in ("0.5", "nan", str(tmp_path)):
        with pytest.raises(SystemExit):
            plan.parse(["--gpus", "8", "--machine", "polaris", "--imbalance", bad])
        assert capsys.readouterr().err.count("\n") == 1


def test_imbalance_slows_the_busiest_expert_rank():
    """64 experts on 32 Polaris GPUs: the busiest rank's all-to-all bytes and expert FLOPs grow."""
    flags = ["--model", "gpt2", "--n_expert", "64", "--top_k", "2", "--gpus", "32", "--machine", "polaris",
             "--global_batch_size", "64"]
    steps = []
    for f in ("1", "2"):
        args, machine = plan.parse(flags + ["--imbalance", f])
        c, reason = plan.score("10_expert_parallel.py", ["--ep", "32", "--micro_batch_size", "2"], "EP", args, machine)
        assert c is not None, reason
        steps.append(c)
    assert steps[1]["comm_bytes_per_step"]["all_to_all_single[ep]"] == 2 * steps[0]["comm_bytes_per_step"]["all_to_all_single[ep]"]
    assert steps[1]["compute_s"] > steps[0]["compute_s"] and steps[1]["comm_s"] > steps[0]["comm_s"]


def test_uneven_stages_move_gpt2_xl_on_256_gpus():
    """gpt2-xl (48 layers) on 256 Polaris GPUs, one sequence a GPU: over 32 stages, 16 hold 2
    layers and 16 hold 1, and the 2-layer stages set the pace, so dp 16 x pp 16 (3 layers each)
    is faster than dp 8 x pp 32, which the even-split formula preferred."""
    args, machine = plan.parse(["--model", "gpt2-xl", "--gpus", "256", "--machine", "polaris",
                                "--global_batch_size", "256"])
    priced = {}
    for pp in ("16", "32"):
        c, reason = plan.score("08_3d.py", ["--tp", "1", "--pp", pp, "--micro_batch_size", "1"], "3D", args, machine)
        assert c is not None, reason
        priced[pp] = c
    assert priced["16"]["step_time_s"] < priced["32"]["step_time_s"]
    m = 256 // 8
    assert priced["32"]["bubble"] > 31 / (m + 31)  # more idle than the even split's bubble


def test_a_3d_choice_without_tp_does_not_say_tp():
    candidate = dict(script="08_3d.py", flags=["--tp", "1", "--pp", "4"], fits=True, step_time_s=1.0)
    _, why = plan.recommend([candidate], 16)
    assert "TP inside a node" not in why and "no TP" in why


def test_latency_is_paid_per_call():
    """ZeRO-1 of gpt2-xl on 256 Polaris GPUs posts 101 collectives a step (costs()' calls, which
    the ledger checks: a reduce-scatter and an all-gather per unit of 49, the loss's and the
    norm's all-reduces, the guard's flags), and each pays its ring's 255 steps of latency:
    260 ms a step besides the guard's (which travel while the next step runs), not the 10 ms
    of one latency per operation."""
    args, machine = plan.parse(["--model", "gpt2-xl", "--gpus", "256", "--machine", "polaris",
                                "--global_batch_size", "256"])
    a, config, _ = plan.dry_run("04_zero.py", [*args.model_flags, "--stage", "1"], 256, 4, machine["gpu_mem_gb"])
    cost = plan.rank_costs("04_zero.py", a, config, 256, plan.planned_dtype(a), 0)
    calls = plan.op_calls(cost)
    assert calls == {"reduce_scatter_tensor": 49, "all_gather_into_tensor": 49, "all_reduce": 2,
                     "all_reduce[guard]": 1}

    def latency(per_call):
        return sum(plan.comm_seconds(op, 1e-9, *plan.group_of("04_zero.py", op, a, 256, 4), machine,
                                     calls[op] if per_call else 1) for op in calls if op != plan.GUARD_OP)
    assert math.isclose(latency(True), (49 * 255 * 2 + 2 * 510) * machine["alpha_inter"], rel_tol=1e-6)
    assert latency(True) > 0.25 > 0.011 > latency(False)


def test_the_ledger_counts_calls_and_checks_them_against_costs():
    """Every call of a key is counted (a batch's sends and receives one each), and a count that
    differs from costs()' calls is named, as a byte count that differs is; a costs() that
    states no calls is not checked."""
    from infra.ledger import CommLedger, calls_differ
    from infra.stop import with_guard
    ledger = CommLedger()
    for op, nbytes in (("all_reduce", 8), ("all_reduce", 4), ("isend", 16), ("irecv", 16)):
        ledger.add(op, nbytes)
    assert ledger.take(calls=True) == ({"all_reduce": 12, "send": 16, "recv": 16},
                                       {"all_reduce": 2, "send": 1, "recv": 1})
    assert ledger.take(calls=True) == ({}, {})
    cost = with_guard({"sent": {"all_reduce": ("4Ψ", 12)}, "calls": {"all_reduce": ("buckets + loss", 2)}}, 2)
    assert calls_differ({"all_reduce": 2, "all_reduce[guard]": 1}, cost) == []
    assert calls_differ({"all_reduce": 3, "all_reduce[guard]": 1}, cost) == ["calls all_reduce 3, formula 2"]
    assert calls_differ({"all_reduce": 3}, {"sent": {"all_reduce": ("4Ψ", 12)}}) == []


@pytest.mark.parametrize("script, flags, ranks, expected", [
    ("03_ddp.py", ["--bucket_mb", "0.1"], 2, {"all_reduce": 8}),
    ("05_fsdp.py", ["--replicate", "2", "--global_batch_size", "24", "--micro_batch_size", "2"], 4,
     {"all_gather_into_tensor[shard]": 25, "reduce_scatter_tensor[shard]": 15, "all_reduce[replicate]": 15,
      "all_reduce[shard]": 1, "all_reduce": 1}),
    ("06_tensor_parallel.py", ["--sequence_parallel"], 4,
     {"all_gather_into_tensor": 27, "reduce_scatter_tensor": 18, "all_reduce": 5})])
def test_costs_count_the_calls_a_run_posts(script, flags, ranks, expected):
    """costs()' calls at a tiny layout, as the rehearsal counted them: 03's buckets (the first
    1 MiB, then --bucket_mb each, from the buckets' own split), 05's units per micro-batch
    (the root once, each block in forward and backward), 06's f and g per layer."""
    a, config, _ = plan.dry_run(script, ["--model", "tiny", *flags], ranks, ranks)
    cost = plan.script(script).costs(a, config, ranks, plan.planned_dtype(a))
    assert {op: n for op, (_, n) in cost["calls"].items()} == expected
