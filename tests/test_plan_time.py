"""plan.py's step time as the ranks run it (issue: the time model): a pipeline simulated from
the schedule each rank executes with each stage's own layers, its messages between stages on
the critical path, DP buckets overlapped with the last backward, each stage's reductions when
it is done, an all-to-all across nodes by the NIC rule, a multi-node --bench read per GPU,
causal attention counted as it runs, and --imbalance; 64 experts on 32 Polaris GPUs, scored
(and in the big tier planned whole): the recommendation the fastest, the all-to-alls by the NIC
rule, the busiest rank's imbalance. Pure functions and single dry runs: no launch."""

import argparse
import collections
import json
import math

import pytest

import plan
from common import PRESETS, GPTConfig
from infra.formulas import expert_params, flops_per_token
from whole_plans import whole_plan

PIPELINE = plan.script("07_pipeline.py")


def forward_times(layers, head=0.0):
    return tuple((float(n), head * (g == len(layers) - 1)) for g, n in enumerate(layers))


def simulated_length(*shape):
    """plan.pipeline_length of this shape, simulated now (not from plan.py's memory)."""
    return max(plan.pipeline_finishes.__wrapped__(*shape))


def test_the_slowest_stage_sets_a_pipelines_pace():
    """1F1B on stages of 1, 1, 2, 2 layers (F 1 unit a layer, B 2): the simulation gives the
    pipeline's fill and drain through every stage, then m - 1 micro-batches at the slowest
    stage's F + B, not the even split's (p - 1)/(m + p - 1) of the mean stage."""
    m = 8
    length = simulated_length("1f1b", 1, 4, m, forward_times([1, 1, 2, 2]), False)
    assert length == (m - 1) * 3 * 2 + 3 * (1 + 1 + 2 + 2)
    even = 3 * 1.5 * (m + 4 - 1)  # the mean stage's time with the formula's bubble
    assert length > even


@pytest.mark.parametrize("schedule, v, p, m", [("1f1b", 1, 4, 40), ("interleaved", 2, 4, 40), ("zb", 1, 6, 50),
                                                ("zbv", 2, 4, 40), ("dualpipev", 2, 8, 64)])
def test_a_long_pipeline_is_extended_exactly(monkeypatch, schedule, v, p, m):
    """Past SIMULATED_OPS the step is simulated at two micro-batch counts and extended: the
    same length as the whole simulation, for every schedule, on uneven stages with a head."""
    forward = forward_times([n for _, n in PIPELINE.chunk_layers(37, p * v)], head=0.7)
    whole = simulated_length(schedule, v, p, m, forward, True)
    monkeypatch.setattr(plan, "SIMULATED_OPS", 100)
    assert math.isclose(simulated_length(schedule, v, p, m, forward, True), whole, rel_tol=1e-12)


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


def test_uneven_stages_set_the_pace_of_gpt2_xl_on_256_gpus():
    """gpt2-xl (48 layers) on 256 Polaris GPUs, one sequence a GPU: over 32 stages, 16 hold 2
    layers and 16 hold 1, and the 2-layer stages set the pace (more idle than the even split's
    bubble); between dp 16 x pp 16 and dp 8 x pp 32 the plan takes the one the simulated step
    prices faster, whichever that is."""
    args, machine = plan.parse(["--model", "gpt2-xl", "--gpus", "256", "--machine", "polaris",
                                "--global_batch_size", "256"])
    priced = {}
    for pp in ("16", "32"):
        c, reason = plan.score("08_3d.py", ["--tp", "1", "--pp", pp, "--micro_batch_size", "1"], "3D", args, machine)
        assert c is not None, reason
        priced[pp] = c
    choice, _ = plan.recommend(list(priced.values()), 256)
    assert choice is min(priced.values(), key=lambda c: c["step_time_s"])
    m = 256 // 8
    assert priced["32"]["bubble"] > 31 / (m + 31)  # more idle than the even split's bubble


def test_a_message_between_stages_is_on_the_critical_path():
    """Two stages, one micro-batch, F 1 and B 2 a stage, each message t: the forward's output
    reaches stage 1 at 1 + t, its gradient comes back at 4 + 2t, and stage 0's backward ends
    at 6 + 2t; the stage waits for its own sends too (07 completes an exchange, sends
    included, before the next round), so a second micro-batch's forward starts at 1 + t."""
    for t in (0.0, 0.25, 3.0):
        assert simulated_length("1f1b", 1, 2, 1, forward_times([1, 1]), False, (t,)) == 6 + 2 * t
    run = argparse.Namespace(schedule="1f1b", schedule_csv=None, virtual_stages=1)
    starts = PIPELINE.simulate([PIPELINE.schedule("1f1b", 2, r, 2) for r in range(2)], 2, 1, cost=lambda r, k, c: 1.0,
                               transfer=lambda g, to: 0.5)
    assert starts[0][1] == (1.5, ("F", 1, 0))
    assert PIPELINE.step_length(run, 2, 2, lambda r, k, c: 1.0) < PIPELINE.step_length(
        run, 2, 2, lambda r, k, c: 1.0, lambda g, to: 0.5)


def roles_of(inside=0.0, overlapped=(0.0, 0), replica=0.0, after=0.0):
    return {0: dict(muon_flops=0, message=0, phases=dict(inside=[inside, 1], overlapped=list(overlapped),
                                                          replica=[replica, 1], after=[after, 1]))}


@pytest.mark.parametrize("seconds", [0.001, 0.01, 1.0])
def test_gradient_buckets_overlap_the_last_backward(seconds):
    """03's buckets, posted as backward reaches them during the last micro-batch's backward and
    run one after another on the communicator's stream: what shows past the backward is the
    last bucket alone while they keep up (seconds/calls), else what the backward cannot hide
    (seconds - window + window/calls); the collectives inside a pass lengthen it, and what
    follows the backward is added whole."""
    args, machine = plan.parse(["--model", "gpt2", "--gpus", "8", "--machine", "polaris", "--global_batch_size", "16"])
    a, config, _ = plan.dry_run("03_ddp.py", [*args.model_flags, "--micro_batch_size", "1"], 8, 4)
    rate = 1e14
    compute, _ = plan.compute_seconds("03_ddp.py", a, config, 8, rate)
    calls, m = 4, 2  # 16 sequences over 8 ranks at micro-batch 1
    step = plan.simulate_step("03_ddp.py", a, config, 8, machine, rate,
                              roles_of(inside=0.002, overlapped=(seconds, calls), after=0.003))
    busy = compute + 0.002
    window = busy * 2 / 3 / m
    assert math.isclose(step, busy + max(seconds / calls, seconds - window + window / calls) + 0.003, rel_tol=1e-12)


def test_each_stage_reduces_its_gradients_when_it_is_done():
    """08 at pp 4 on 14 layers (3, 3, 4, 4 a stage): the last stage finishes first under 1F1B,
    so its data-parallel reduction, the largest, runs while the first stages drain; the step is
    each stage's finish plus its own reduction at the slowest, not the latest finish plus the
    largest reduction; a tp of one rank posts nothing."""
    args, machine = plan.parse(["--model", "gpt2", "--n_layer", "14", "--gpus", "32", "--machine", "polaris",
                                "--global_batch_size", "64"])
    a, config, _ = plan.dry_run("08_3d.py", [*args.model_flags, "--tp", "1", "--pp", "4", "--micro_batch_size", "1"],
                                32, 4)
    rate = 1e14
    roles = {}
    for rank in plan.ranks_to_price("08_3d.py", a, config, 32):
        cost = plan.rank_costs("08_3d.py", a, config, 32, plan.planned_dtype(a), rank)
        comm = {op: v for op, (_, v) in cost["sent"].items()}
        assert not any(op.endswith("[tp]") for op in comm)
        phases, message = plan.stage_comm("08_3d.py", a, config, 32, machine, cost, comm, rank)
        roles[rank] = dict(phases=phases, message=message, muon_flops=0)
    lanes = {}
    step = plan.simulate_step("08_3d.py", a, config, 32, machine, rate, roles, lanes=lanes)
    finish = {role: max(s + t for s, t, kind, _ in boxes if kind != "collective") for role, boxes in lanes.items()}
    replica = {f"stage {s}": roles[r]["phases"]["replica"][0] for s, r in enumerate(plan.stage_roles("08_3d.py", a, config))}
    after = max(r["phases"]["after"][0] for r in roles.values())
    assert math.isclose(step, max(finish[s] + replica[s] for s in finish) + after, rel_tol=1e-9)
    assert step < max(finish.values()) + max(replica.values()) + after
    assert finish["stage 3"] < finish["stage 0"]


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


# ----------------------------------------------------------------------------------------
# 64 experts on 32 Polaris GPUs (8 nodes of 4): the EP 32 case
# ----------------------------------------------------------------------------------------

EP32 = "--model gpt2 --n_expert 64 --top_k 2 --gpus 32 --machine polaris --global_batch_size 64"
EP32_LAYOUTS = [("10_expert_parallel.py", ["--ep", "32", "--micro_batch_size", "2"], "EP ep 32 dp 1"),
                ("10_expert_parallel.py", ["--ep", "16", "--micro_batch_size", "2"], "EP ep 16 dp 2"),
                ("08_3d.py", ["--tp", "1", "--pp", "4", "--ep", "8", "--zero1", "--micro_batch_size", "1"],
                 "3D+EP dp 8 pp 4 tp 1 ep 8 + ZeRO-1")]
A2A = "all_to_all_single[ep]"


def by_the_nics(nbytes, calls, ranks, machine):
    """An all-to-all over `ranks` as it runs across nodes: g ranks, at most k of them on one node
    (from where the ranks sit); each rank's rows for the g - k ranks on other nodes leave through
    its own share of its node's NICs, those for the k - 1 others cross the links inside at the
    same time, and each call's g - 1 steps pay the latency across nodes."""
    g = len(ranks)
    k = max(collections.Counter(r // machine["gpus_per_node"] for r in ranks).values())
    assert k < g  # the group crosses nodes
    return calls * (g - 1) * machine["alpha_inter"] + max(nbytes * (g - k) / g / (1e9 * machine["inter_gbps"]),
                                                          nbytes * (k - 1) / g / (1e9 * machine["intra_gbps"]))


def check_expert_parallel(c, args, machine):
    """10's step as priced: its compute, the all-to-alls inside the layers by the NIC rule (rank
    0's EP group: 10's expert_groups, ep consecutive ranks), the other collectives after the
    backward by the ring's rule; at --imbalance F, F x the all-to-all's rows and the experts'
    FLOPs on the busiest rank."""
    n, G = args.gpus, machine["gpus_per_node"]
    a, config, _ = plan.dry_run(c["script"], c["flags"], n, G, machine["gpu_mem_gb"])
    cost = plan.rank_costs(c["script"], a, config, n, plan.planned_dtype(a), 0)
    calls = plan.op_calls(cost)
    sent = c["comm_bytes_per_step"]
    assert sent[A2A] == args.imbalance * cost["sent"][A2A][1]
    a2a = by_the_nics(sent[A2A], calls[A2A], list(range(a.ep)), machine)
    rest = sum(plan.comm_seconds(op, nbytes, *plan.group_of(c["script"], op, a, n, G), machine, calls.get(op, 1))
               for op, nbytes in sent.items() if op not in (A2A, plan.GUARD_OP))
    assert math.isclose(c["comm_s"], a2a + rest, rel_tol=1e-9)
    rate = machine["peak_tflops"] * 1e12 * args.efficiency
    per_token, head = plan.flops_as_run(config, plan.count_params_once(config)[1])
    experts = 6 * config.n_layer * config.top_k * expert_params(config)  # the routed rows' FLOPs per token
    tokens = a.global_batch_size * config.block_size
    assert math.isclose(c["compute_s"], ((per_token + head) + (args.imbalance - 1) * experts) * tokens / (n * rate),
                        rel_tol=1e-9)
    assert c["muon_s"] == 0 and math.isclose(c["step_time_s"], c["compute_s"] + c["comm_s"], rel_tol=1e-12)
    return a2a


def test_64_experts_on_32_gpus_priced_by_the_nics_and_the_busiest_rank():
    """EP 32 over 8 Polaris nodes and its neighbours, scored directly (the whole plan: the big
    tier, below): the plan takes the fastest; EP 32's all-to-alls cross the NICs by the NIC
    rule (at a ring's k x the per-GPU share they would take a quarter of the time); at
    --imbalance 2 the busiest rank's all-to-all and experts take twice the rows."""
    steps = {}
    for imbalance in ("1", "2"):
        args, machine = plan.parse(EP32.split() + ["--imbalance", imbalance])
        scored = []
        for name, flags, label in EP32_LAYOUTS:
            c, reason = plan.score(name, flags, label, args, machine)
            assert c is not None, reason
            scored.append(c)
        choice, why = plan.recommend(scored, args.gpus)
        assert choice is min(scored, key=lambda c: c["step_time_s"]), (choice["label"], why)
        ep32 = scored[0]
        a2a = check_expert_parallel(ep32, args, machine)
        ring = plan.comm_seconds("all_gather_into_tensor[ep]", ep32["comm_bytes_per_step"][A2A], 32, 4, machine)
        assert a2a > 3 * ring  # not the ring's rule
        steps[imbalance] = [c["step_time_s"] for c in scored]
    assert all(busy > balanced for busy, balanced in zip(steps["2"], steps["1"]))


@pytest.mark.big  # the whole plan, 100 layouts dry-run and priced (~7 s, twice)
def test_64_experts_on_32_gpus_whole_plan():
    """plan.py's whole plan of the issue's case: the recommendation is the fastest layout that
    fits under the simulated step, at --imbalance 1 and 2; every EP 32 layout is priced by the
    NIC rule; and the busiest rank's imbalance slows every layout."""
    plans = {}
    for imbalance in ("1", "2"):
        args, machine = plan.parse(EP32.split() + ["--imbalance", imbalance])
        _, scored, refused, choice, why = plans[imbalance] = whole_plan(EP32 + " --imbalance " + imbalance)
        assert not refused and choice is min((c for c in scored if c["fits"]), key=lambda c: c["step_time_s"]), why
        ep32 = [c for c in scored if c["script"] == "10_expert_parallel.py" and c["flags"][c["flags"].index("--ep") + 1] == "32"]
        assert len(ep32) == 2
        for c in ep32:
            check_expert_parallel(c, args, machine)
    slower = {(c["script"], tuple(c["flags"])): c["step_time_s"] for c in plans["2"][1]}
    assert all(slower[(c["script"], tuple(c["flags"]))] > c["step_time_s"] for c in plans["1"][1])
