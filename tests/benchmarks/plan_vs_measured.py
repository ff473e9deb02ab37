"""Benchmark: plan.py's step time against the measured one, every script's default layout at 2
and 4 ranks, each as the ratio to 01's step (ratios survive a noisy, shared machine where
absolute times do not). Rerun with

    nice -n -10 python tests/benchmarks/plan_vs_measured.py     # 2 and 4 ranks, 10 layouts each
    python tests/benchmarks/plan_vs_measured.py --ranks 2 --only 06 "4:08"
    python tests/benchmarks/plan_vs_measured.py --smoke         # 2 layouts at 2 ranks, the tiny model

(`nice -n -10`, as root: the other work on a shared host then takes less of the cores while it
runs.) It calibrates once, on programs that are none of the layouts it prices: alpha and beta
from `02_collectives.py --doctor --json` on 2 ranks; the matmul rate and plan.py's fixed cost
per layer and micro-batch (--op_overhead_us) from 01 at the model's micro-batches and at one
micro-batch of the same tokens (the fixed cost is what the extra micro-batches add); what
06's layer costs beyond it (--op_overhead_us tp:US) from 06 at one rank; and the bus
bandwidth of gloo's reduce-scatter and all-gather at each rank count (call_cost.py --op,
plan.py's --op_gbps). Then for
each layout, one after the other (interleaved: a load that comes and goes falls on all of
them): 01's step (the rate now), the host beside it (beside(): how much slower each of n
copies of 01 computes at once, the cores term; and what an all-reduce costs inside a loop of
compute on n ranks at two sizes, call_cost.py, at each size of group the layout's calls
meet (n ranks as n/g groups of g: a pipeline's pairs at 4 ranks), which gives plan.py's fixed
cost per call by group size, --call_overhead_us G:US ..., and the bandwidth a step sees; for
09's ring a ring's exchange at its size, --exchange_overhead_us; for 10 an all-to-all at its
group's size, --call_overhead_us all_to_all:G:US and --op_gbps all_to_all), the layout, then the host,
01 and the layout again (of each the quieter of the two). Both are priced with plan.score
with these figures (with more ranks than cores, --cores_per_node: a pipeline's ranks in the
bubble yield their cores): predicted =
plan(layout) / plan(01), measured = step(layout) / step(01), a step being the fastest of the
slowest rank's steps after --skip (dt_ms_max: a shared host's load only adds time). It prints
a Markdown table and a last line `max |error| X% over N layouts`; a layout off by more than
--target says which term plan.py leaves out, as far as the numbers tell."""

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the harness
sys.path.insert(0, ROOT)  # the scripts, plan.py
sys.path.insert(0, HERE)  # call_cost
from harness import launch, start  # noqa: E402

import plan  # noqa: E402
import call_cost  # noqa: E402

MODEL = ["--model", "tiny", "--n_layer", "8", "--n_embd", "128", "--block_size", "64", "--dropout", "0",
         "--global_batch_size", "16", "--micro_batch_size", "2"]
SMOKE_MODEL = ["--model", "tiny", "--n_layer", "2", "--n_embd", "64", "--block_size", "32", "--dropout", "0",
               "--global_batch_size", "8", "--micro_batch_size", "2"]
MOE = ["--n_expert", "4", "--top_k", "2"]


def layouts(n):
    """(label, script, strategy flags, model flags added to 01's too) at n ranks: the defaults."""
    return [("03 DDP", "03_ddp.py", [], []),
            ("04 ZeRO-1", "04_zero.py", ["--stage", "1"], []),
            ("04 ZeRO-3", "04_zero.py", ["--stage", "3"], []),
            ("05 FSDP", "05_fsdp.py", [], []),
            ("06 TP", "06_tensor_parallel.py", [], []),
            ("07 1F1B", "07_pipeline.py", ["--schedule", "1f1b"], []),
            ("07 ZB", "07_pipeline.py", ["--schedule", "zb"], []),
            (f"08 {'pp 2' if n == 2 else 'tp 2 pp 2'}", "08_3d.py",
             ["--pp", "2"] if n == 2 else ["--tp", "2", "--pp", "2"], []),
            ("09 ring", "09_context_parallel.py", ["--cp_impl", "ring"], []),
            ("10 EP", "10_expert_parallel.py", [], MOE)]


def step_of(rows, skip):
    """The step of a run: the fastest of the slowest rank's steps after `skip` (as timeit takes
    the best of its repeats: on a shared host the load only ever adds time, so the fastest
    step is the one nearest what a machine of its own would take)."""
    rows = rows[skip:] or rows[-1:]
    return min((row.get("dt_ms_max") or row["dt_ms"]) for row in rows) / 1e3


def measure(script, flags, n, iters, skip):
    """A run of `script` on n ranks: its step (step_of), in seconds."""
    run = launch(script, [*flags, *RUN, "--max_iters", str(iters)], nprocs=n, timeout=900).ok()
    return step_of(run.steps, skip)


RUN = ["--device", "cpu", "--dtype", "float32", "--warmup_iters", "1", "--log_interval", "1", "--eval_interval", "0"]


def together(model, n, iters, skip):
    """The step of 01 with a 1/n share of the global batch, run n times at once (no
    communication): the slowest copy's (step_of; its first and last steps may run alone)."""
    share = [*model, "--global_batch_size", str(int(model[model.index("--global_batch_size") + 1]) // n)]
    tmp = tempfile.mkdtemp(prefix="gptpar-together-")
    jobs, paths = [], []
    for i in range(n):
        paths.append(os.path.join(tmp, f"{i}.jsonl"))
        jobs.append(start("01_single_gpu.py", [*share, *RUN, "--max_iters", str(iters), "--metrics", paths[-1],
                                               "--out_dir", os.path.join(tmp, str(i))], timeout=900))
    for job in jobs:
        out, err = job.communicate()
        if job.returncode != 0:
            raise SystemExit(f"01 (one of {n} at once) failed:\n{err[-2000:]}")
    steps = []
    for path in paths:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        steps.append(step_of([r for r in rows if "loss" in r][:-1], skip))
    shutil.rmtree(tmp, ignore_errors=True)
    return max(steps)


def beside(model, n, iters, skip, calls, rounds, groups, rings=(), a2a=()):
    """The host as it is while a layout of n ranks runs, measured right before and after it as
    01 is: together, the step of n copies of 01 at once on 1/n of the batch each (together();
    over 01's step / n, how much slower a rank computes when n compute at once: the cores
    term, n ranks on this host's cores beside the other work on it); and
    the seconds one all-reduce costs inside a loop of compute on n ranks (call_cost.py:
    latency, bytes, wrapper, the ranks meeting), meeting g ranks for each g in `groups`
    (call_groups), at two sizes: a micro-batch's activations of one layer (the message of
    TP's f and g, of a pipeline's send, of CP's blocks) and 16 times that (about a block's
    parameters, ZeRO-3's and FSDP's gathers); and in the same launches a ring's exchange at
    each size of ring in `rings` (call_cost.py --op ring_exchange: 09's step, to the next rank
    and from the one before) and an all-to-all at each size of group in `a2a` (call_cost.py
    --op all_to_all_single: 10's dispatch and combine). call, exchange and a2a: {g: (seconds
    at each size)}."""
    config = {k: int(model[model.index(k) + 1]) for k in ("--micro_batch_size", "--block_size", "--n_embd")}
    small = 4 * config["--micro_batch_size"] * config["--block_size"] * config["--n_embd"]
    if n == 1:
        return dict(together=0.0, bytes=(small, 16 * small), call={}, exchange={}, a2a={})
    call, exchange, all_to_all = {}, {}, {}
    for g in sorted({*groups, *rings, *a2a}):
        ops = ("all_reduce",) * (g in groups) + ("ring_exchange",) * (g in rings) + ("all_to_all_single",) * (g in a2a)
        got = call_cost.measure(n, calls, rounds, (small, 16 * small), matmuls=4, group=g, op=ops)["by_op"]
        call.update({g: tuple(got["all_reduce"])} if g in groups else {})
        exchange.update({g: tuple(got["ring_exchange"])} if g in rings else {})
        all_to_all.update({g: tuple(got["all_to_all_single"])} if g in a2a else {})
    return dict(together=together(model, n, iters, skip), bytes=(small, 16 * small), call=call, exchange=exchange,
                a2a=all_to_all)


def call_groups(script, flags, n):
    """The sizes of the groups whose calls a layout of `script` on n ranks posts (plan.py's
    group_of over every rank it prices; a send meets 2; a ring's exchange is measured as
    itself, ring_sizes), each once, sorted: beside() measures a call at each."""
    args, config, _ = plan.dry_run(script, [*flags, "--device", "cpu", "--dtype", "float32"], n, n)
    sizes = set()
    for rank in plan.ranks_to_price(script, args, config, n):
        for op in plan.rank_costs(script, args, config, n, plan.planned_dtype(args), rank)["sent"]:
            if op != plan.GUARD_OP and not plan.ring_meets(script, op, args, n):  # (a ring's: ring_sizes)
                sizes.add(plan.group_of(script, op, args, n, n)[0])
    return sorted(g for g in sizes if g > 1)


def all_to_all_sizes(script, flags, n):
    """The sizes of the groups whose all-to-alls a layout posts (10's dispatch and combine over
    the expert-parallel group), sorted: beside() measures an all-to-all at each, as itself."""
    args, config, _ = plan.dry_run(script, [*flags, "--device", "cpu", "--dtype", "float32"], n, n)
    cost = plan.rank_costs(script, args, config, n, plan.planned_dtype(args), 0)
    return sorted({plan.group_of(script, op, args, n, n)[0] for op in cost["sent"]
                   if op.split("[")[0] == "all_to_all_single"} - {1})


def ring_sizes(script, flags, n):
    """The sizes of the rings whose exchanges a layout posts (plan.ring_meets: 09's ring),
    sorted: beside() measures a ring's exchange at each."""
    args, config, _ = plan.dry_run(script, [*flags, "--device", "cpu", "--dtype", "float32"], n, n)
    cost = plan.rank_costs(script, args, config, n, plan.planned_dtype(args), 0)
    return sorted({plan.ring_meets(script, op, args, n) for op in cost["sent"]} - {None})


def links_now(host, now):
    """({g: fixed seconds per call beyond alpha}, beta GB/s, {ring size: a ring exchange's
    fixed seconds beyond alpha and its bytes at beta}) that make plan.py's all-reduce,
    2(g-1) alpha + call_s + 2(g-1)/g x bytes / beta with the doctor's alpha, take what
    beside()'s two sizes took in groups of g (the bandwidth from the largest group's
    difference, the one a step's bytes mostly cross; the doctor's beta where the larger was
    not the slower)."""
    (s, l), top = now["bytes"], max(now["call"])
    t_s, t_l = now["call"][top]
    beta = 2 * (top - 1) / top * (l - s) / (t_l - t_s) / 1e9 if t_l > t_s else host["beta"]
    exchange = {g: max(0.0, t[0] - host["alpha"] - s / (beta * 1e9)) for g, t in sorted(now.get("exchange", {}).items())}
    return {g: max(0.0, t[0] - 2 * (g - 1) * host["alpha"] - 2 * (g - 1) / g * s / (beta * 1e9))
            for g, t in sorted(now["call"].items())}, beta, exchange


def all_to_all_now(host, now):
    """({g: an all-to-all's fixed seconds per call beyond its alpha}, its bus bandwidth GB/s or
    None) that make plan.py's all-to-all, (g-1) alpha + call_s + (g-1)/g x bytes / GBPS, take
    what beside()'s two sizes took in groups of g (the bandwidth from the largest group's
    difference; None where the larger was not the slower: every kind's then): plan.py's
    --call_overhead_us all_to_all:G:US and --op_gbps all_to_all:GBPS."""
    if not now.get("a2a"):
        return {}, None
    (s, l), top = now["bytes"], max(now["a2a"])
    t_s, t_l = now["a2a"][top]
    gbps = (top - 1) / top * (l - s) / (t_l - t_s) / 1e9 if t_l > t_s else None
    beta = gbps or (links_now(host, now)[1] if now["call"] else host["beta"])
    return {g: max(0.0, t[0] - (g - 1) * host["alpha"] - (g - 1) / g * s / (beta * 1e9))
            for g, t in sorted(now["a2a"].items())}, gbps


def links():
    """(alpha s, beta GB/s) of this host's gloo, fitted by 02's doctor on 2 ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "doctor.json")
        run = launch("02_collectives.py", ["--doctor", "--json", path], nprocs=2, metrics=False, out_dir=False,
                     timeout=600)  # (on a shared host it may name a straggler: the fit is still its)
        if not os.path.isfile(path):
            raise SystemExit(f"02 --doctor wrote no {path}:\n{run.stderr[-2000:]}")
        fit = json.load(open(path))["links"]["intra"]
    return fit["alpha_s"], fit["beta_GBps"]


def priced(script, flags, n, host, now=None, cores=None):
    """plan.py's candidate for `script` at n ranks on this host: calibrate()'s rate, fixed cost
    per layer and links; with `now` (beside()'s), each rank at 1/slow of the rate and slow x
    the fixed cost per layer when all n compute at once (n ranks share the cores: with more
    ranks than `cores`, plan.py's --cores_per_node, so that a pipeline's ranks waiting in its
    bubble give theirs to the others), the fixed cost per call by group size and the
    bandwidth of links_now(), and each kind of collective's own bandwidth (op_gbps())."""
    slow = now["slow"] if now else 1.0
    call_s, beta, exchange = links_now(host, now) if now and now["call"] else ({}, host["beta"], {})
    cores = cores or len(os.sched_getaffinity(0))
    alone = n / cores if now and n > cores else 1.0  # a rank alone on a core: n / cores faster than all at once
    kinds = op_gbps(host, n) if now else {}
    a2a_s, a2a_gbps = all_to_all_now(host, now) if now else ({}, None)
    kinds.update({"all_to_all": a2a_gbps} if a2a_gbps else {})
    args, machine = plan.parse([*flags_of(flags), "--gpus", str(n), "--gpus_per_node", str(n), "--device", "cpu",
                                "--dtype", "float32", "--peak_tflops", str(host["rate"] / slow * alone / 1e12),
                                "--link_gbps", str(beta), "--efficiency", "1",
                                "--op_overhead_us", str(host["op_s"] * slow / alone * 1e6),
                                f"tp:{host.get('tp_op_s', 0.0) * slow / alone * 1e6}",
                                "--call_overhead_us", *([f"{g}:{s * 1e6}" for g, s in call_s.items()] or ["0"]),
                                *(f"all_to_all:{g}:{s * 1e6}" for g, s in a2a_s.items()),
                                *(["--cores_per_node", str(cores)] if alone > 1 else []),
                                *(["--exchange_overhead_us", *(f"{g}:{s * 1e6}" for g, s in exchange.items())]
                                  if exchange else []),
                                *(["--op_gbps", *(f"{k}:{v}" for k, v in kinds.items())] if kinds else [])])
    machine.update(alpha_intra=host["alpha"], alpha_inter=host["alpha"])
    strategy = [f for i, f in enumerate(flags) if f not in MODEL_FLAGS and (i == 0 or flags[i - 1] not in MODEL_FLAGS)]
    c, reason = plan.score(script, strategy, script, args, machine)
    if c is None:
        raise SystemExit(f"plan.py refuses {script} {' '.join(flags)} at {n} ranks: {reason}")
    c["call_s"], c["beta"], c["op_gbps"], c["exchange_s"], c["a2a_s"] = call_s, beta, kinds, exchange, a2a_s
    return c


KINDS = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}


def per_byte(n, calls, rounds, sizes):
    """{kind: GB/s} of gloo's reduce-scatter and all-gather at n ranks: the bus bandwidth
    ((g-1)/g x the whole buffer's bytes, as the ledger counts them, over the seconds) that
    plan.py's --op_gbps takes, from the difference between two sizes (the bytes' cost without
    the call's), timed by call_cost.py --op in one launch (interleaved with the all-reduce's
    loops, reported beside them)."""
    got = call_cost.measure(n, calls, rounds, sizes, matmuls=4, op=("all_reduce", *KINDS))["by_op"]
    (s, l), bus_factor = sizes, plan.script("02_collectives.py").bus_factor
    return {kind: bus_factor(kind, n) * (l - s) / (got[op][1] - got[op][0]) / 1e9
            for op, kind in (*KINDS.items(), ("all_reduce", "all_reduce")) if got[op][1] > got[op][0]}


def op_gbps(host, n):
    """plan.py's --op_gbps at n ranks: calibrate()'s reduce-scatter and all-gather bandwidths
    (the all-reduce's is beside()'s, measured with each layout)."""
    return {kind: gbps for kind, gbps in host.get("per_byte", {}).get(n, {}).items() if kind != "all_reduce"}


def calibrate(model, iters, skip, ranks=(), calls=100, rounds=3):
    """This host's figures, measured once on programs that are none of the layouts priced:
    alpha and beta (02's doctor, 2 ranks); the reduce-scatter's and all-gather's bandwidth at
    each of `ranks` (per_byte); the matmul rate and the fixed cost
    per layer and micro-batch, from 01 at the model's micro-batches and at one micro-batch of
    the whole batch, the same tokens (t = FLOPs / rate + m x L x op_s: two unknowns; each the
    fastest of two runs, alternating); and what 06's layer (06 and 08 run it) costs beyond
    01's per layer and micro-batch, from 06 at one rank (its f and g autograd functions and its
    vocabulary-parallel loss with no collective to post: a program that is none of the
    layouts) against 01 at the model's micro-batches, alternating with them (plan.py's
    --op_overhead_us tp:US)."""
    alpha, beta = links()
    sizes = beside(model, 1, iters, skip, calls, rounds, [])["bytes"]
    kinds = {n: per_byte(n, calls, rounds + 2, sizes) for n in ranks if n > 1}  # (once: two rounds more)
    batch = int(model[model.index("--global_batch_size") + 1])
    m = batch // int(model[model.index("--micro_batch_size") + 1])
    layers = int(model[model.index("--n_layer") + 1])
    whole = [*model, "--micro_batch_size", str(batch)]  # (argparse: the last one counts)
    t_m, t_1, t_tp = float("inf"), float("inf"), float("inf")
    for _ in range(2):
        t_m = min(t_m, measure("01_single_gpu.py", model, 1, iters, skip))
        t_1 = min(t_1, measure("01_single_gpu.py", whole, 1, iters, skip))
        t_tp = min(t_tp, measure("06_tensor_parallel.py", model, 1, iters, skip))
    op_s = max(0.0, (t_m - t_1) / ((m - 1) * layers)) if m > 1 else 0.0
    tp_op_s = max(0.0, (t_tp - t_m) / (m * layers))
    free = dict(rate=1.0, op_s=0.0, alpha=alpha, beta=beta)
    flops = priced("01_single_gpu.py", whole, 1, free)["step_time_s"]  # at 1 FLOP/s: the FLOPs as they run
    return dict(rate=flops / (t_1 - layers * op_s), op_s=op_s, tp_op_s=tp_op_s, alpha=alpha, beta=beta, t_m=t_m,
                t_1=t_1, t_tp=t_tp, m=m, layers=layers, per_byte=kinds)


def at_rate_of(host, one, flags):
    """calibrate()'s figures with the rate that 01's step `one` (with `flags`), measured beside
    a layout, says the host runs at now, its fixed cost per layer as calibrated."""
    flops = priced("01_single_gpu.py", flags, 1, dict(host, rate=1.0, op_s=0.0))["step_time_s"]
    return dict(host, rate=flops / max(1e-9, one - host["m"] * host["layers"] * host["op_s"]))


MODEL_FLAGS = {"--model", "--n_layer", "--n_embd", "--block_size", "--dropout", "--global_batch_size",
               "--micro_batch_size", "--n_expert", "--top_k"}


def flags_of(flags):
    """The model and batch flags among `flags` (plan.py takes these; the rest are the strategy's)."""
    out = []
    for i, f in enumerate(flags):
        if f in MODEL_FLAGS:
            out += [f, flags[i + 1]]
    return out


def calls_text(call_s):
    """The fixed cost per call by group size, as the table shows it: "g 2: 0.26, g 4: 1.39 ms"."""
    return ", ".join(f"g {g}: {s * 1e3:.2f}" for g, s in call_s.items()) + " ms"


# Terms found for a layout on this host (docs/measured.md says how), which plan.py does not
# price: named for the layout ("label", or "ranks:label") when it misses.
GLOO_THREADS = ("gloo runs each collective on its own threads, which take a core from the compute while the ranks "
                "outnumber the cores (05's prefetch: about 45 ms a step at 4 ranks, docs/measured.md), and 04 stage 3 "
                "and 05 copy each gathered unit out (5-13 ms a step): neither priced; the reduce-scatter's and "
                "all-gather's own bandwidths are (call_cost.py --op)")
MEASURED_TERMS = {
    "04 ZeRO-1": "not priced, timed by phase on 2 ranks: stage 1's gradient hook adds each parameter's gradient into "
                 "the kept fp32 sum every micro-batch (16-37 ms a step); gloo posts each reduce-scatter partly on "
                 "the calling thread (about 4 ms a call under torch.profiler)",
    "04 ZeRO-3": GLOO_THREADS,
    "05 FSDP": GLOO_THREADS,
    "4:09 ring": "the ring's exchanges are priced as call_cost.py --op ring_exchange measures one at the ring's size "
                 "(every rank of the ring waits on the one before); what is left is gloo's batch of two sends and two "
                 "receives under the layout's own pattern (K and V, dK and dV, the compute between), not timed alone",
    "2:09 ring": "at 2 ranks the ring is a pair: its exchange measured beside it (ring 2) and priced so; the row's "
                 "error was -70..-4% in the six runs of 2026-11-29/30: within this host's noise unless it repeats",
    "10 EP": "the all-to-alls are priced at their own cost per call and bandwidth (call_cost.py --op all_to_all_single "
             "beside the layout: cheaper per call than the all-reduce, and priced so the row moved down); what is left "
             "is 10's layer around them, not timed alone: the counts' all-to-all and the host read of the split sizes "
             "before each dispatch, the transpose of the pieces, and each all-to-all waiting on the rank with more rows "
             "routed to it (--imbalance 1 here)",
    "4:08 tp 2 pp 2": "the cores term prices a stage's TP pair as computing together (core_sharing: the node's ranks over "
                      "the stages), and still moves this row by 14-18 points down in each of three runs (-16% -> -31%, "
                      "-25% -> -39%, -4% -> -22%): a stage computing alone on the cores does not reach the speed that "
                      "n / cores x the all-at-once rate says; not measured alone",
}


def missing_term(pred, meas, c, label="", n=0):
    """What plan.py leaves out: a term found for the layout (MEASURED_TERMS, by "n:label" or
    label), else as far as its numbers tell."""
    if meas > pred and (label in MEASURED_TERMS or f"{n}:{label}" in MEASURED_TERMS):
        return MEASURED_TERMS.get(f"{n}:{label}", MEASURED_TERMS.get(label))
    if meas > pred:
        if c["comm_s"] < 0.2 * c["step_time_s"]:
            return "slower than its FLOPs, cores and calls priced: the host's load moved between the measurements beside it"
        return "more per call than the calibration loop's all-reduces: gloo under the layout's own pattern of calls"
    if c["bubble"] > 0.05:
        return ("faster than priced with the cores shared by the ranks computing at once (--cores_per_node): the "
                "ranks' own compute slower alone than 01's rate says (one thread each), or a quieter host")
    return "faster than priced: communication overlapped with compute (priced unhidden), or a quieter host"


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    a.add_argument("--iters", type=int, default=8)
    a.add_argument("--skip", type=int, default=3, help="warm-up steps left out")
    a.add_argument("--target", type=float, default=25.0, help="per cent: a larger error names its missing term")
    a.add_argument("--smoke", action="store_true", help="2 layouts at 2 ranks, a 2-layer tiny model, 3 steps")
    a.add_argument("--only", nargs="+", default=None, help="the layouts whose label starts so (\"08\", \"04 ZeRO-1\"), "
                   "as RANKS:LABEL (\"4:03\") or LABEL at every --ranks")
    a = a.parse_args()
    model = SMOKE_MODEL if a.smoke else MODEL
    calls, rounds = 100, 3
    if a.smoke:
        a.ranks, a.iters, a.skip, calls, rounds = [2], 3, 1, 10, 1
    host = calibrate(model, a.iters, a.skip, a.ranks, calls, rounds)
    ratios = "; ".join(f"at {n} ranks " + ", ".join(f"{k} {r:.2f}" for k, r in kinds.items())
                       for n, kinds in host["per_byte"].items())
    print(f"calibration: 01's step {host['t_m'] * 1e3:.0f} ms in {host['m']} micro-batches, {host['t_1'] * 1e3:.0f} ms "
          f"in one: {host['rate'] / 1e9:.2f} GFLOP/s and {host['op_s'] * 1e6:.0f} us per layer and micro-batch "
          f"(one rank); 06 at one rank {host['t_tp'] * 1e3:.0f} ms: 06's layer {host['tp_op_s'] * 1e6:.0f} us more; gloo alpha {host['alpha'] * 1e6:.0f} us, beta {host['beta']:.2f} GB/s (02 --doctor, 2 ranks); "
          f"bus bandwidth by kind, GB/s (call_cost.py --op, the all-reduce's beside for comparison): "
          f"{ratios or 'not measured'}; "
          f"{len(os.sched_getaffinity(0))} cores\n")
    print("| layout | ranks | predicted / 01 | measured / 01 | error | host beside it: slow, call, beta | "
          "plan: compute + comm (bubble) | missing term |")
    print("|---|---|---|---|---|---|---|---|")
    errors = []
    for n in a.ranks:
        for label, script, strategy, extra in layouts(n)[:2 if a.smoke else None]:
            if a.only and not any(label.startswith(o.split(":")[-1]) and (":" not in o or o.split(":")[0] == str(n))
                                  for o in a.only):
                continue
            if a.smoke and script == "03_ddp.py":
                script, strategy, label = "07_pipeline.py", ["--schedule", "1f1b"], "07 1F1B"
            # interleaved: 01, the host's cores and calls, the layout, then the host, 01 and the
            # layout again: of each the quieter (the faster) of the two, as a shared host's load
            # only adds time, and a burst of it can last a whole run
            groups = call_groups(script, model + extra + strategy, n)
            rings = ring_sizes(script, model + extra + strategy, n)
            a2a = all_to_all_sizes(script, model + extra + strategy, n)
            one = measure("01_single_gpu.py", model + extra, 1, a.iters, a.skip)
            now = beside(model, n, a.iters, a.skip, calls, rounds, groups, rings, a2a)
            step = measure(script, model + extra + strategy, n, a.iters, a.skip)
            again = beside(model, n, a.iters, a.skip, calls, rounds, groups, rings, a2a)
            one = min(one, measure("01_single_gpu.py", model + extra, 1, a.iters, a.skip))
            step = min(step, measure(script, model + extra + strategy, n, a.iters, a.skip))
            now = dict(now, slow=max(1.0, min(now["together"], again["together"]) / (one / n)) if n > 1 else 1.0,
                       call={g: tuple(map(min, now["call"][g], again["call"][g])) for g in groups},
                       exchange={g: tuple(map(min, now["exchange"][g], again["exchange"][g])) for g in rings},
                       a2a={g: tuple(map(min, now["a2a"][g], again["a2a"][g])) for g in a2a})
            rated = at_rate_of(host, one, model + extra)
            c1 = priced("01_single_gpu.py", model + extra, 1, rated)
            c = priced(script, model + extra + strategy, n, rated, now)
            pred, meas = c["step_time_s"] / c1["step_time_s"], step / one
            error = 100 * (pred / meas - 1)
            errors.append(abs(error))
            term = missing_term(pred, meas, c, label, n) if abs(error) > a.target else ""
            print(f"| {label} | {n} | {pred:.2f} | {meas:.2f} ({step * 1e3:.0f} / {one * 1e3:.0f} ms) | {error:+.0f}% | "
                  f"{now['slow']:.2f}x, {calls_text(c['call_s'])}, {c['beta']:.2f} GB/s"
                  + "".join(f", ring {g}: {s * 1e3:.2f} ms" for g, s in c["exchange_s"].items())
                  + "".join(f", all-to-all g {g}: {s * 1e3:.2f} ms" for g, s in c["a2a_s"].items())
                  + "".join(f", {k.replace('_', '-')} {v:.2f} GB/s" for k, v in c["op_gbps"].items()
                            if any(op.startswith(k) for op in c["comm_bytes_per_step"])) + " | "
                  f"{c['compute_s'] * 1e3:.0f} + {c['comm_s'] * 1e3:.0f} ms ({100 * c['bubble']:.0f}%) | {term} |",
                  flush=True)
    print(f"\nmax |error| {max(errors):.0f}% over {len(errors)} layouts")


if __name__ == "__main__":
    main()
