"""plan.py: which strategy, at which layout, for this model on these GPUs? Will it fit, and
how fast will it be?

For --gpus N it enumerates every training script and every valid layout of it, asks the
script itself what one rank holds and sends (its costs(), the same function its live ledger
checks and its --dry_run prints: this file restates no formula), and scores each candidate:

    candidates   01 (N = 1); 03 DDP; 04 ZeRO stages 1, 2, 3; 05 FSDP (--replicate 1) and HSDP
                 (--replicate R, every divisor R of N); 06 TP with and without sequence
                 parallelism (tp = N, inside one node); 07 PP with GPipe, 1F1B, interleaved
                 1F1B, zero bubble (ZB-H1), ZB-V and DualPipeV (pp = N); 08 3D for every
                 tp x pp dividing N (tp inside a node), with and without --zero1, and 4D with
                 --cp 2, 4, 8; 09 context parallelism (ring and Ulysses) when the file
                 exists. A mixture of experts: 01 (N = 1), 10 at every --ep dividing N and E,
                 and 08 with --ep. Each with the scripts' default micro-batch and with
                 micro-batch 1 (unless --micro_batch_size is given).
    valid        the script's own --dry_run accepts the flags for N ranks (the plan runs the
                 script's main() with --dry_run and takes the costs it computed; a refused
                 layout is listed with the script's one-line reason under --show_invalid)
    memory       per GPU = params + grads + optimizer state (+ 05's gathered units) + the
                 activations held for backward, from costs()["activations"] when the script
                 provides it (else the table says "activations not counted"); the rank that
                 holds the most. Fits by the scripts' own rule, the verdict of their --dry_run
                 and of a launch's fit check: that + 25% + 128 MiB for transients on a
                 GPU (infra.fit.fit_need; on CPU 50% + 768 MiB, measured) within 90% of the
                 GPU's memory (infra.fit.planned_room; the rest: the CUDA/ROCm context, the
                 communicators' buffers, fragmentation); with --device
                 cpu and no GPU memory given, within this host's available memory shared by
                 --gpus_per_node ranks. The scripts choose their micro-batch against the
                 same room (--micro_batch_size auto)
    step time    one step simulated as its ranks run it, one role per distinct rank (every stage
                 of a pipeline), every collective an event with its dependencies (simulate_step):
                   compute = the FLOPs as the kernels run them (flops_as_run: nanoGPT's count less
                             the half of attention's s² that causal kernels skip; with
                             --recompute one more forward of the blocks, not of the head) /
                             (N x peak x --efficiency); a pipeline (07, 08 with pp > 1) is
                             simulated as its ranks run it (07's rank_finishes over the rounds
                             of the schedule each rank executes), every F, B, I and W taking its
                             own stage's time (the last L mod p stages hold one more layer, the
                             last the head): the slowest stage sets the pace, and the bubble comes
                             out of the schedule; + --op_overhead_us for each layer of each
                             micro-batch a rank runs (0 on the datasheet machines: see MACHINES;
                             its tp:US word, 06's layer's own, on 06's and 08's);
                             --cores_per_node below a node's ranks (a CPU host): each rank at
                             min(1, cores / ranks computing at once), a pipeline's by processor
                             sharing, so ranks in the bubble yield their cores
                   muon    = with --optimizer muon, the Newton-Schulz FLOPs of the busiest rank
                             priced (costs()'s muon_flops: the matrices it orthogonalises, each
                             5(4r²c + 2r³)) / (peak x --efficiency), the model FLOPs' rate; after
                             the rank's last backward
                   comm    = each operation per call, an alpha-beta model over its group of g
                             ranks: a ring collective steps x alpha + busfactor(g) x bytes / beta,
                             busfactor from 02_collectives.py (all-reduce 2(g-1)/g,
                             all-gather / reduce-scatter (g-1)/g, send 1); beta is the link
                             bandwidth inside a node; across nodes, a group with k ranks on a
                             node runs k rings side by side through k GPUs' share of the node's
                             NICs: k x the NIC bandwidth per GPU (at most the node's NICs, at
                             most the links inside). An all-to-all across nodes is not a ring:
                             a rank's rows for the g - k ranks elsewhere leave through its own
                             share of the NICs, bytes x (g-k)/g at the per-GPU bandwidth, while
                             the rest cross the links inside. With experts, --imbalance F (1:
                             balanced; or a run's --metrics, its expert_imbalance) gives the
                             busiest rank F x the rows, in its all-to-all and its experts'
                             FLOPs. Alpha is paid per call: costs() states the calls a step
                             posts of every operation (a bucket's, a unit's, a layer's per
                             micro-batch; the ledger checks them as it checks the bytes), so
                             ZeRO-1 at 256 ranks pays its 101 collectives' latency, not one;
                             and --call_overhead_us per call (0 on the datasheet machines; a
                             batch of sends pays it once; by the size of the group that meets,
                             when given as G:US pairs; a ring's exchange, 09's, its own by the
                             ring's size with --exchange_overhead_us; a kind's own, KIND:G:US,
                             10's all-to-alls); --op_gbps: a kind's own bandwidth (gloo's
                             reduce-scatter and all-gather on a CPU host)
                   where   = each collective where its script posts it (phase_of): inside a
                             forward or backward (TP's f and g, CP's ring and all-to-alls, EP's
                             all-to-alls, FSDP's and ZeRO-3's gathers), lengthening that pass; a
                             pipeline's messages between stages, each alpha + bytes / beta over
                             the link it crosses, so a stage waits for its input's arrival (and
                             for its own sends, as 07 completes each exchange); the gradient
                             buckets 03, 04 and 05 post asynchronously, placed after the
                             backward they wait on, one by one during the last micro-batch's
                             backward (equal buckets at equal spacing: an approximation), on the
                             communicator's one stream; 08's replica reductions when the rank's
                             own stage is done (a later stage's hide in the earlier stages'
                             cool-down); the rest (norm, loss, tied embedding, ZeRO's gathers of
                             the updated parameters) after the slowest rank, which they wait for
                 the slowest rank's finish is the step time (compute_s: the step with free
                 communication; comm_s: what communication adds to it); MFU = model FLOPs
                 (PaLM's count, attention non-causal, as the scripts' MFU) / (time x N x peak)
    recommendation  the ALCF rules ("Deciding on a parallelism strategy"): fits on one GPU ->
                 DDP; otherwise sharded data parallelism (ZeRO / FSDP, HSDP across nodes) or,
                 when layers are too big or there are many GPUs, 3D: TP inside a node (fast
                 links), PP across nodes, DP outermost, + ZeRO-1; between the two, the faster
                 estimate. A mixture of experts: expert parallelism (10: E/ep experts a rank,
                 the dense layers replicated) or 3D with EP (08 --ep), the faster estimate.
                 The fastest candidate overall is shown too.

Run:

    python plan.py --model gpt2-xl --gpus 4 --machine polaris
    python plan.py --model gpt3-13b --gpus 64 --machine frontier --global_batch_size 512
    python plan.py --model gpt3-175b --gpus 1024 --machine polaris --global_batch_size 1536 --json
    python plan.py --model tiny --gpus 2 --gpus_per_node 2 --gpu_mem_gb 1 --peak_tflops 0.05 \\
        --link_gbps 1 --device cpu --dtype float32        # a machine described by hand
"""

import argparse
import contextlib
import functools
import gc
import glob
import importlib.util
import inspect
import io
import json
import math
import os
import sys

import infra.run
from common import PRESETS, count_params
from infra.cli import GPU_MEMORY_GB
from infra.dry_run import planned_device_type, planned_dtype
from infra.fit import allowance_text, fit_need, planned_room
from infra.formulas import expert_params, flops_per_token, format_bytes
from infra.metrics import finite_or_null, PEAK_FLOPS
from infra.stop import with_guard

HERE = os.path.dirname(os.path.abspath(__file__))

# ----------------------------------------------------------------------------------------
# The machines: the facilities' published figures (per GPU; a GCD of an MI250X, a tile of a
# Max 1550, counted as one GPU since each is one rank). Bandwidths in GB/s in one direction.
# intra: the GPU-to-GPU links a ring inside a node runs over; inter: the node's Slingshot-11
# NICs (25 GB/s = 200 Gb/s each) shared by its GPUs. Achieved bandwidths are lower: measure
# yours with `02_collectives.py --bench` and pass --bench (see --help).
# ----------------------------------------------------------------------------------------

MACHINES = {
    # ALCF Polaris user guide, "Polaris Machine Overview": 4 A100 (40 GB) per node connected
    # by NVLink (600 GB/s per GPU, both directions: 300 one way), "a pair of Slingshot 11
    # network adapters" per node (2 x 25 GB/s for 4 GPUs); A100 BF16 tensor core 312 TFLOP/s
    "polaris": dict(gpus_per_node=4, gpu_mem_gb=GPU_MEMORY_GB["polaris"], peak_tflops=PEAK_FLOPS["A100"][0] / 1e12,
                    intra_gbps=300.0, inter_gbps=2 * 25.0 / 4),
    # ALCF Aurora user guide, "Aurora Machine Overview": 6 Max 1550 per node, 2 tiles each (12
    # ranks), 768 GiB HBM per node = 64 GiB per tile, GPUs "connected all-to-all with Intel
    # Xe Link", 8 Slingshot-11 NICs per node (8 x 25 GB/s for 12 tiles). Peak bf16 per tile:
    # infra.metrics.PEAK_FLOPS. The Xe Link figure a ring achieves between GPUs is the least certain
    # number here (tiles of one GPU talk faster over MDFI): 30 GB/s, measure it. Its device kind is xpu:
    # the scripts price what their kernels do there (09's ring runs the explicit block, its scores counted)
    "aurora": dict(gpus_per_node=12, gpu_mem_gb=GPU_MEMORY_GB["aurora"], peak_tflops=PEAK_FLOPS["MAX 1550"][0] / 1e12,
                   intra_gbps=30.0, inter_gbps=8 * 25.0 / 12, device="xpu"),
    # OLCF Frontier user guide, "Node architecture": 4 MI250X = 8 GCDs per node, 64 GB HBM
    # per GCD, Infinity Fabric between GCDs 50+50 GB/s (200+200 between the two GCDs of one
    # MI250X; a ring over 8 runs over the 50 GB/s links), 4 Slingshot-11 NICs (4 x 25 GB/s
    # for 8 GCDs); MI250X 383 TFLOP/s bf16 = 191.5 per GCD
    "frontier": dict(gpus_per_node=8, gpu_mem_gb=GPU_MEMORY_GB["frontier"], peak_tflops=PEAK_FLOPS["MI250X"][0] / 1e12,
                     intra_gbps=50.0, inter_gbps=4 * 25.0 / 8),
    # NERSC Perlmutter "Architecture": GPU nodes with 4 A100 (40 GB; 256 nodes have 80 GB:
    # --gpu_mem_gb 80), NVLink-3 (300 GB/s one way per GPU), 4 Slingshot-11 NICs per node
    "perlmutter": dict(gpus_per_node=4, gpu_mem_gb=GPU_MEMORY_GB["perlmutter"], peak_tflops=PEAK_FLOPS["A100"][0] / 1e12,
                       intra_gbps=300.0, inter_gbps=4 * 25.0 / 4),
}
ALPHA_INTRA, ALPHA_INTER = 5e-6, 10e-6  # seconds per ring step (NCCL/RCCL-like latencies)
for _machine in MACHINES.values():
    _machine.update(alpha_intra=ALPHA_INTRA, alpha_inter=ALPHA_INTER)
# Two fixed costs a host pays whatever the bytes and FLOPs, both 0 on the datasheet machines
# (no GPU measurement grounds another figure; a GPU's launch is microseconds): call_s, the
# seconds one collective or send costs beyond its alpha (the Python wrapper, the autograd
# function around it, the ranks meeting; one figure, or one by group size: call_seconds; a
# kind of collective may have its own, kind_call_s);
# op_s, the seconds one layer's forward and backward of one micro-batch cost beyond its FLOPs
# (Python, autograd, each small kernel's launch).
# --call_overhead_us and --op_overhead_us set them; tests/benchmarks/plan_vs_measured.py
# measures both on its host (docs/planning.md, "Predicted against measured").
MAX_GPUS = 10**7  # more ranks than any machine has: a typo, refused in one line
MAX_SIZE = 10**7  # likewise for a model or batch dimension
EFFICIENCY = 0.5  # fraction of peak FLOP/s the matrix multiplies reach (Megatron-LM reports ~0.5)


# ----------------------------------------------------------------------------------------
# The scripts, loaded once (their file names start with digits: importlib)
# ----------------------------------------------------------------------------------------

_MODULES = {}


def script(name):
    """The training script `name` as a module (its main() is not run on import)."""
    if name not in _MODULES:
        spec = importlib.util.spec_from_file_location(name[:-3].replace("-", "_"), os.path.join(HERE, name))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if hasattr(module, "count_params"):
            module.count_params = count_params_once  # the same model is counted for every candidate
        if hasattr(module, "costs"):
            _REMEMBERED[name] = costs_once(module.costs)  # what its dry runs ask (dry_run)
        _MODULES[name] = module
    return _MODULES[name]


def costs_once(costs):
    """A script's costs(), remembered per flags, model, world, dtype and rank, for its dry runs
    (dry_run): its fit check (every stage, at each micro-batch it tries) and its dry run's
    lines (08: every stage again) ask for the same rank's costs again and again, and so do the
    plan's other candidates at the same micro-batch. A call with a run's own routing (10's and
    08's `received`, `sent`) is not remembered. The answer is shared: nobody changes a costs()
    dict (with_guard makes a new one)."""
    signature, answers = inspect.signature(costs), {}

    @functools.wraps(costs)
    def remembered(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if any(given.get(routing) is not None for routing in ("rows", "received", "sent")):
            return costs(*args, **kwargs)
        key = (repr(sorted(vars(given["args"]).items())), repr(given["config"]), given["world_size"], given["dtype"],
               given.get("rank"))
        if key not in answers:
            if len(answers) >= COSTS_KEPT:  # (a session of many plans: start again, as infra.formulas does)
                answers.clear()
            answers[key] = costs(*args, **kwargs)
        return answers[key]
    return remembered


COSTS_KEPT = 20_000  # costs() answers remembered per script (a 1,024-GPU plan asks for a few thousand)


_COUNTS, _REMEMBERED = {}, {}


def count_params_once(config):
    """common.count_params, remembered per config (GPT-3 175B takes a second on the meta device)."""
    key = repr(config)
    if key not in _COUNTS:
        _COUNTS[key] = count_params(config)
    return _COUNTS[key]


def script_name(prefix):
    """The file of a numbered script ("09" -> "09_context_parallel.py"), or None."""
    found = sorted(glob.glob(os.path.join(HERE, prefix + "_*.py")))
    return os.path.basename(found[0]) if found else None


class _DryRunDone(Exception):
    pass


def dry_run(name, flags, gpus, gpus_per_node, gpu_mem_gb=None):
    """Run script `name`'s own main() with --dry_run for `gpus` ranks, as a user would, and
    return (args, config, cost) as it validated and computed them; or the one-line reason it
    refused the flags (its `error: ...`)."""
    module = script(name)
    captured = {}

    def capture(args, _script, config, cost, _lines=()):
        captured.update(args=args, config=config, cost=cost)
        raise _DryRunDone

    argv = [name, *flags, "--dry_run", "--world_size", str(gpus), "--ranks_per_node", str(gpus_per_node)]
    if gpu_mem_gb:  # the room its --micro_batch_size auto chooses against
        argv += ["--gpu_mem_gb", str(gpu_mem_gb)]
    # the scripts print their plan through infra.dry_run's dry_run (as infra.run names it for
    # Run.dry_run, or in their own plan printing, which imports it): catch it in both places.
    # The fit line's advice for a layout that does not fit (infra.fit.fit_fixes: costs() again
    # at other micro-batches and with --recompute) is text the plan never reads: not asked for
    # (and the script's costs() remembered while it runs: costs_once)
    saved_argv, saved = sys.argv, (infra.run.dry_run, getattr(module, "dry_run", None), infra.run.fit_fixes,
                                   getattr(module, "costs", None))
    sys.argv, infra.run.dry_run, infra.run.fit_fixes = argv, capture, lambda *_, **__: "(plan.py: not asked)"
    if saved[1] is not None:
        module.dry_run = capture
    if name in _REMEMBERED:
        module.costs = _REMEMBERED[name]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            module.main()
    except _DryRunDone:
        return captured["args"], captured["config"], captured["cost"]
    except SystemExit:
        return err.getvalue().strip().removeprefix("error: ") or "refused"
    finally:
        sys.argv, infra.run.dry_run, infra.run.fit_fixes = saved_argv, saved[0], saved[2]
        if saved[1] is not None:
            module.dry_run = saved[1]
        if name in _REMEMBERED:
            module.costs = saved[3]
    return "the dry run did not reach its cost function"


# ----------------------------------------------------------------------------------------
# Enumerating the candidates
# ----------------------------------------------------------------------------------------

def divisors(n):
    """The divisors of n, ascending, from its trial divisions up to sqrt(n) (a billion GPUs
    take microseconds, not minutes)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def candidates(n, gpus_per_node, n_layer, n_expert=0):
    """(script, strategy flags, label) for every strategy and layout on n GPUs. The scripts
    validate the rest (heads divisible by tp, batch divisible by dp, ...). A mixture of
    experts runs in 01, 10 and 08 (--ep)."""
    if n == 1:
        yield "01_single_gpu.py", [], "single GPU"
    if n_expert:
        for ep in divisors(math.gcd(n, n_expert)):
            yield "10_expert_parallel.py", ["--ep", str(ep)], f"EP ep {ep} dp {n // ep}"
        # 08 with experts: EP groups carved out of DP, with ZeRO-1, with and without SP
        for tp in divisors(n):
            for pp in divisors(n // tp):
                if tp <= gpus_per_node and pp <= n_layer and tp * pp > 1:
                    for ep in divisors(math.gcd(n // (tp * pp), n_expert))[1:]:
                        for sp in (False, True) if tp > 1 else (False,):  # SP: the experts' gradients over TP too
                            yield ("08_3d.py", ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--zero1"]
                                   + (["--sequence_parallel"] if sp else []),
                                   f"3D+EP dp {n // (tp * pp)} pp {pp} tp {tp} ep {ep}" + (" + SP" if sp else "")
                                   + " + ZeRO-1")
        return
    yield "03_ddp.py", [], "DDP"
    for stage in (1, 2, 3):
        yield "04_zero.py", ["--stage", str(stage)], f"ZeRO-{stage}"
    for r in divisors(n):
        yield "05_fsdp.py", ["--replicate", str(r)], "FSDP" if r == 1 else f"HSDP {r} x {n // r}"
    if 1 < n <= gpus_per_node:  # TP inside a node's fast links only
        yield "06_tensor_parallel.py", [], "TP"
        yield "06_tensor_parallel.py", ["--sequence_parallel"], "TP + SP"
    if 1 < n <= n_layer:
        for schedule in ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"):
            yield "07_pipeline.py", ["--schedule", schedule], f"PP {schedule}"
    for tp in divisors(n):
        for pp in divisors(n // tp):
            if tp <= gpus_per_node and pp <= n_layer and tp * pp > 1:
                for zero1 in (False, True):
                    for sp in (False, True) if tp > 1 else (False,):  # Megatron's SP in the TP groups
                        yield ("08_3d.py", ["--tp", str(tp), "--pp", str(pp)] + (["--zero1"] if zero1 else [])
                               + (["--sequence_parallel"] if sp else []),
                               f"3D dp {n // (tp * pp)} pp {pp} tp {tp}" + (" + SP" if sp else "")
                               + (" + ZeRO-1" if zero1 else ""))
            # 4D: 08 --cp, context parallelism inside each stage's attention, a long context's
            # answer: in its memory-lean form only (ZeRO-1, SP when tp > 1), cp 2, 4, 8; the
            # ring across nodes too, Ulysses' all-to-alls inside a node and without TP
            for cp in (2, 4, 8):
                if tp <= gpus_per_node and pp <= n_layer and (n // (tp * pp)) % cp == 0:
                    for impl in ("ring", "ulysses") if tp == 1 and cp <= gpus_per_node else ("ring",):
                        yield ("08_3d.py", ["--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--cp_impl", impl,
                                            "--zero1"] + (["--sequence_parallel"] if tp > 1 else []),
                               f"4D dp {n // (tp * pp * cp)} pp {pp} cp {cp} {impl} tp {tp}"
                               + (" + SP" if tp > 1 else "") + " + ZeRO-1")
    cp_script = script_name("09")
    if cp_script and n > 1:  # priced through its dry run only
        for cp in divisors(n)[1:]:
            for impl in ("ring", "ulysses"):
                yield cp_script, ["--cp", str(cp), "--cp_impl", impl], f"CP {impl} cp {cp} dp {n // cp}"


def ranks_to_price(name, args, config, n):
    """The ranks whose costs differ: every stage of a pipeline (07: rank = stage; 08: the
    first rank of stage s of replica 0, rank s·cp·tp, one stage of each kind), one rank elsewhere."""
    if name.startswith("07"):
        return list(range(n))
    if name.startswith("08"):
        return sorted(set(stage_roles(name, args, config)))
    return [0]


def stage_roles(name, args, config):
    """For each stage of 08's pipeline, the rank priced for it: stages cost the same when they
    hold as many layers and neither end of the pipeline, and the first of each kind stands for
    the others (rank s·cp·tp, replica 0)."""
    layers = script(name).stage_layers(config.n_layer, args.pp)
    kind = lambda s: (s == 0, s == args.pp - 1, layers[s][1])  # noqa: E731
    first = {kind(s): s for s in reversed(range(args.pp))}
    return [first[kind(s)] * args.cp * args.tp for s in range(args.pp)]


def rank_costs(name, args, config, n, dtype, rank):
    """A rank's costs() as its run's ledger states them: the script's, and the guard's flags
    every step (infra.stop.with_guard: all_reduce[guard], 12 bytes, a run of 2 ranks or more)."""
    module = script(name)
    if name.startswith(("07", "08")):
        return with_guard(module.costs(args, config, n, dtype, rank), n)
    return with_guard(module.costs(args, config, n, dtype), n)


def op_calls(cost):
    """{op: the calls a step posts} from costs()' "calls" (the ledger checks them); an op it
    does not count (08 with Muon) is priced as one call."""
    return {op: value for op, (_, value) in cost.get("calls", {}).items()}


GUARD_OP = "all_reduce[guard]"  # its bytes are counted; no time: the flags travel while the next step runs (Guard)


def phase_of(name, op, args):
    """Where a collective falls in the step, as the script posts it: "inside" a forward or
    backward, which waits for it (06's and 08's f and g, CP's ring and all-to-alls, EP's
    all-to-alls, FSDP's and ZeRO-3's gather of a unit before it runs: its prefetch is not
    counted), "overlapped" with the backward (the gradient buckets 03, 04 and 05 post
    asynchronously as backward reaches them), "p2p" (a pipeline's activations forward and
    gradients back, between stages), "replica" (08: once the rank's own stage is done, over its
    replicas, which run the same stage: the data-parallel reductions, ZeRO-1's gather) or
    "after" (once every rank is done: the loss, the norm, the tied embedding, ZeRO-1/2's gather
    of the updated parameters, 09's and 10's reductions, Muon's exchanges)."""
    base = op.split("[")[0]
    group = op[op.index("[") + 1:-1] if "[" in op else "world"
    sp = getattr(args, "sequence_parallel", False)
    if name.startswith("03"):
        return "overlapped" if base == "all_reduce" else "after"
    if name.startswith("04"):
        if base == "all_gather_into_tensor" and args.stage == 3:
            return "inside"
        return "overlapped" if base == "reduce_scatter_tensor" else "after"
    if name.startswith("05"):
        return {"all_gather_into_tensor": "inside", "reduce_scatter_tensor": "overlapped"}.get(base, "after") \
            if group == "shard" else "after"
    if name.startswith("06"):
        return "after" if sp and base == "all_reduce" else "inside"  # SP: its all-reduce sums gradients only
    if name.startswith("07"):
        return "p2p" if base in ("send", "recv") else "after"
    if name.startswith("08"):
        if base in ("send", "recv"):
            return "p2p"  # the pipeline's, and with --cp the ring's (split in stage_comm)
        if group in ("dp", "expert_dp"):
            return "replica"
        if group in ("tp", "cp", "ep") and not (base == "all_reduce" and (group != "tp" or sp)):
            return "inside"  # (an all_reduce over cp or ep, and over tp with SP, sums gradients or norms)
        return "replica" if group == "tp" else "after"
    if name.startswith(("09", "10")):
        return "inside" if base in ("send", "recv", "all_to_all_single") else "after"
    return "after"


# ----------------------------------------------------------------------------------------
# Scoring: memory, communication time, step time
# ----------------------------------------------------------------------------------------

def per_gpu_bytes(cost):
    """params, grads, optim (+ gathered) and activations held by one rank, from its costs();
    activations None where the script's costs() does not give them."""
    held = {kind: value for kind, (_, value) in cost["held"].items()}
    if "gathered" in cost:  # 05: the units gathered in the compute dtype at the peak
        held["gathered"] = cost["gathered"][1]
    held["activations"] = cost["activations"][1] if "activations" in cost else None
    held["total"] = sum(v for v in held.values() if v is not None)
    return held


def ranks_per_node(ranks, gpus_per_node):
    """None when `ranks` sit on one node; else the most of them on one node (k): a collective
    across nodes runs k rings side by side (NCCL's channels), one per rank of the node, each
    through its share of the node's NICs, so the group has k GPUs' worth of the network."""
    nodes = {}
    for r in ranks:
        nodes[r // gpus_per_node] = nodes.get(r // gpus_per_node, 0) + 1
    return None if len(nodes) == 1 else max(nodes.values())


def group_of(name, op, args, n, gpus_per_node):
    """(g, k): the size of the group an operation runs on, and where its ranks sit (k, from
    ranks_per_node: None inside a node, else the most ranks it has on one node), for rank 0's
    group. Groups are ranks `stride` apart as the scripts build them (05: shard groups of S
    consecutive ranks; 07: the tied embedding's group, the first and the last stage; 08: rank =
    dp·pp·tp + pp·tp + tp; 10: ep groups of N consecutive ranks, expert_dp groups of the ranks
    N apart that hold the same experts); a pipeline's sends cross nodes on the boundaries
    between them whenever the pipeline spans nodes (one pair: k = 1), and the step waits for
    those."""
    group = op[op.index("[") + 1:-1] if "[" in op else "world"
    base = op.split("[")[0]
    size, stride, G = n, 1, gpus_per_node
    if name.startswith("05"):
        S = n // args.replicate
        size, stride = {"shard": (S, 1), "replicate": (args.replicate, S)}.get(group, (n, 1))
    elif name.startswith("07"):
        if base in ("send", "recv"):
            return 2, 1 if n > G else None
        size, stride = {"embedding": (2, n - 1)}.get(group, (n, 1))  # the tied wte: first and last stage
    elif name.startswith("08"):  # rank = ((dp·P + pp)·C + cp)·T + tp
        T, P, C = args.tp, args.pp, args.cp
        if base in ("send", "recv"):  # the pipeline's boundaries, and the CP ring's
            return 2, 1 if T * C * P > G else None
        if group == "dp":  # DP x CP: D·C ranks
            D = n // (T * P * C)
            return D * C, ranks_per_node([d * P * C * T + c * T for d in range(D) for c in range(C)], G)
        if group == "model":  # a replica's stages and TP ranks at one CP rank
            return T * P, ranks_per_node([p * C * T + t for p in range(P) for t in range(T)], G)
        if group in ("ep", "expert_dp"):  # experts: N consecutive DP x CP ranks, or those N apart
            D, N = n // (T * P * C), args.ep
            places = range(N) if group == "ep" else range(0, D * C, N)
            return len(places), ranks_per_node([r // C * P * C * T + r % C * T for r in places], G)
        size, stride = {"tp": (T, 1), "cp": (C, T), "pp": (P, C * T),
                        "embedding": (2, (P - 1) * C * T)}.get(group, (n, 1))
    elif name.startswith("09"):
        C = args.cp or n
        if base in ("send", "recv"):  # the ring of a context-parallel group
            return 2, 1 if C > G else None
        size, stride = {"cp": (C, 1), "dp": (n // C, C)}.get(group, (n, 1))
    elif name.startswith("10"):
        E = PRESETS[args.model].get("n_expert", 0) if args.n_expert is None else args.n_expert
        N = script(name).check_layout(args, argparse.Namespace(n_expert=E), n)  # --ep, or 10's default
        size, stride = {"ep": (N, 1), "expert_dp": (n // N, N)}.get(group, (n, 1))
    return size, ranks_per_node([i * stride for i in range(size)], G)


def ring_meets(name, op, args, n):
    """The size of the ring whose exchange a send is (None for any other send): each step of
    09's ring (and 08's with --cp) sends to the next rank and receives from the one before, and
    completes the exchange before the next step, so rank r's step waits on r - 1's step before,
    which waited on r - 2's: every rank of the ring meets at each step (the bytes still cross
    one link). Its fixed cost is priced as measured for a ring of that size
    (--exchange_overhead_us), or as a pair's call."""
    if op.split("[")[0] not in ("send", "recv"):
        return None
    if name.startswith("09"):
        return args.cp or n
    if name.startswith("08") and args.cp > 1:
        return args.cp
    return None


def call_seconds(machine, g):
    """The fixed cost of one call in a group of g ranks (the fixed costs under MACHINES):
    machine["call_s"] is one figure for every group, or ((g, seconds), ...) measured at a few
    group sizes, sorted: linear in g between two of them, and held at the nearest beyond them
    (on a CPU host the ranks that must meet, and the cores they share, set it)."""
    call = machine.get("call_s", 0.0)
    if not isinstance(call, tuple):
        return call
    if g <= call[0][0]:
        return call[0][1]
    for (a, s_a), (b, s_b) in zip(call, call[1:]):
        if g <= b:
            return s_a + (s_b - s_a) * (g - a) / (b - a)
    return call[-1][1]


def read_microseconds(word, error, flag):
    """A fixed cost's word in microseconds, as seconds: a finite number in 0..1e9, else one line."""
    try:
        value = float(word)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 1e9):
        error(f"{flag} must be a number of microseconds in 0..1e9, got {word}")
    return value * 1e-6


def read_call_overhead(values, error, flag="--call_overhead_us"):
    """--call_overhead_us's words (or --exchange_overhead_us's), in seconds: one number (every
    group), or G:US pairs, each group size G >= 2 once (a one-rank group posts nothing), sorted by G."""
    if len(values) == 1 and ":" not in values[0]:
        return read_microseconds(values[0], error, flag)
    pairs = {}
    for word in values:
        size, _, us = word.partition(":")
        if not (size.isdigit() and 2 <= int(size) <= MAX_GPUS and us) or int(size) in pairs:
            error(f"{flag} takes one number or G:US pairs, each group size G in 2..{MAX_GPUS:,} once, "
                  f"got {' '.join(values)}")
        pairs[int(size)] = read_microseconds(us, error, flag)
    return tuple(sorted(pairs.items()))


def read_call_overheads(values, error):
    """--call_overhead_us's words as (every kind's figure, {kind: its own}): a word that starts
    with a kind of OP_KINDS and a colon ("all_to_all:2:600") is that kind's own, read as the
    rest are (read_call_overhead: one number, or G:US pairs); the others are every kind's
    (0 when only kinds' own are given)."""
    own = {}
    for word in values:
        kind, _, rest = word.partition(":")
        if kind in OP_KINDS:
            own.setdefault(kind, []).append(rest)
    every = [word for word in values if word.partition(":")[0] not in OP_KINDS] or ["0"]
    return read_call_overhead(every, error), {kind: read_call_overhead(words, error, f"--call_overhead_us {kind}:")
                                              for kind, words in own.items()}


def read_op_overhead(values, error):
    """--op_overhead_us's words, in seconds: (every layer's, 06's layer's beyond it): one number,
    then at most one word tp:US."""
    if not 1 <= len(values) <= 2 or ":" in values[0] or (len(values) == 2 and not values[1].startswith("tp:")):
        error(f"--op_overhead_us takes one number of microseconds, then at most one tp:US, got {' '.join(values)}")
    flag = "--op_overhead_us"
    return (read_microseconds(values[0], error, flag),
            read_microseconds(values[1][3:], error, flag) if len(values) == 2 else 0.0)


def layer_fixed_seconds(name, machine):
    """The fixed cost of one layer's forward and backward of one micro-batch on `machine`
    (op_s, under MACHINES), and for 06's layer, which 06 and 08 run at any --tp, its own
    beyond it (tp_op_s: the f and g autograd functions, the vocabulary-parallel loss)."""
    return machine.get("op_s", 0.0) + (machine.get("tp_op_s", 0.0) if name.startswith(("06", "08")) else 0.0)


OP_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")


def read_op_gbps(values, error):
    """--op_gbps's KIND:GBPS pairs as {kind: GB/s}, each kind of OP_KINDS once, each a positive
    finite number."""
    kinds = {}
    for word in values:
        kind, _, gbps = word.partition(":")
        try:
            value = float(gbps)
        except ValueError:
            value = math.nan
        if kind not in OP_KINDS or kind in kinds or not (math.isfinite(value) and 0 < value <= 1e9):
            error(f"--op_gbps takes KIND:GBPS pairs, each KIND of {', '.join(OP_KINDS)} once and GBPS a positive "
                  f"number of GB/s, got {' '.join(values)}")
        kinds[kind] = value
    return kinds


def comm_seconds(op, nbytes, g, per_node, machine, calls=1, posts=None, ring=None):
    """Alpha-beta time of one step's `nbytes` of `op`, posted in `calls` calls (costs()' count:
    each call pays its latency), on a ring of g ranks: inside a node (per_node None) over the
    GPU links (or the bandwidth measured for this kind of collective, --op_gbps); across
    nodes over per_node GPUs' share of the node's NICs (k x inter_gbps, at most the node's
    NICs, and no faster than the links inside). Each post pays the fixed cost per call of a
    group of g ranks (call_s, or its kind's own, kind_call_s; posts: as many as calls, unless
    several sends ride one batch_isend_irecv); a ring's exchange (`ring`: its size, ring_meets) its own where
    measured (exchange_s), the pair's call's if not."""
    base = op.split("[")[0]
    if g <= 1 or nbytes == 0 or base == "recv":  # a receive is its sender's send
        return 0.0
    kind = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all"}.get(base, base)
    # (the fixed costs under MACHINES; a ring's exchange its own, by the ring's size, and a kind
    # its own, by the group's, where measured)
    each = call_seconds(dict(call_s=machine["exchange_s"]), ring) if ring and "exchange_s" in machine \
        else call_seconds(dict(call_s=machine["kind_call_s"][kind]), g) if kind in machine.get("kind_call_s", {}) \
        else call_seconds(machine, g)
    fixed = (calls if posts is None else posts) * each
    intra = machine.get("op_gbps", {}).get(kind, machine["intra_gbps"])  # --op_gbps: this kind's own, measured
    across = bool(per_node)  # None (or False: the old "inside a node") inside; k, or True for one rank per node
    gbps = intra if not across else min(intra, min(int(per_node), machine["gpus_per_node"]) * machine["inter_gbps"])
    beta = 1e9 * gbps
    alpha = machine["alpha_inter"] if across else machine["alpha_intra"]
    if base == "send":
        return fixed + calls * alpha + nbytes / beta
    steps = 2 * (g - 1) if kind == "all_reduce" else g - 1
    if kind == "all_to_all" and across:
        # not a ring: every rank's rows for the g - k ranks on other nodes leave through its own
        # share of the node's NICs (all k GPUs of the node send at once), the k - 1 others' rows
        # over the links inside, at the same time
        k = min(int(per_node), g)
        return fixed + calls * steps * alpha + max(nbytes * (g - k) / g / (1e9 * machine["inter_gbps"]),
                                                   nbytes * (k - 1) / g / (1e9 * intra))
    return fixed + calls * steps * alpha + script("02_collectives.py").bus_factor(kind, g) * nbytes / beta


def flops_as_run(config, n_params):
    """(training FLOPs per token of the blocks, of the head) as the kernels run them: the
    MFU's count (PaLM's, infra.formulas.flops_per_token, which keeps its 12·L·H·Q·T of
    attention, the non-causal s²) less the half of s² that causal attention skips (the
    flash/memory-efficient kernels and 09's zigzag ring compute only the blocks on or under
    the diagonal). MFU keeps PaLM's convention; the step time counts what runs."""
    L, H, T = config.n_layer, config.n_head, config.block_size
    head = 6 * config.vocab_size * config.n_embd
    return flops_per_token(config, n_params) - head - 6 * L * H * (config.n_embd // H) * T, head


SIMULATED_OPS = 8192  # a pipeline's step is simulated whole up to this many operations per rank


@functools.lru_cache(maxsize=None)
def pipeline_finishes(schedule, virtual_stages, p, m, forward, recompute, transfers=None, sharing=None):
    """07's rank_finishes of `schedule` on p stages and m micro-batches, each global chunk g
    taking forward[g] to run forward, twice that backward (+ one more forward of its blocks
    with --recompute; a split backward's I and W half each), and each message between chunks
    g and g + 1 on two ranks transfers[g] (none: free). Past SIMULATED_OPS the step is
    simulated at two micro-batch counts p apart and extended linearly: in the steady state
    each further p micro-batches add the same time to every rank (the slowest stage's).
    `sharing` (core_sharing's (cores, ranks per busy stage)): the ranks share a CPU host's
    cores, timed by finishes_sharing_cores instead."""
    pipeline = script("07_pipeline.py")
    run = argparse.Namespace(schedule=schedule, schedule_csv=None, virtual_stages=virtual_stages)
    v, vee = pipeline.chunks_per_rank(run)
    blocks, head = zip(*forward)

    def seconds(r, kind, c):
        g = pipeline.chunk_stage(p, r, c, vee)
        f = blocks[g] + head[g]
        b = 2 * f + (blocks[g] if recompute else 0)
        return f if kind == "F" else b if kind == "B" else b / 2
    table = {(r, kind, c): seconds(r, kind, c) for r in range(p) for kind in "FBIW" for c in range(v)}
    cost = lambda r, kind, c: table[r, kind, c]  # noqa: E731 (each op's, worked out once)
    transfer = (lambda g, to: transfers[min(g, to)]) if transfers else None  # noqa: E731
    if sharing:
        finishes = lambda k: finishes_sharing_cores(pipeline_events(schedule, virtual_stages, p, k)[0], p, cost,  # noqa: E731
                                                    transfer, *sharing)
    else:
        finishes = lambda k: pipeline.rank_finishes(run, p, k, cost, transfer,  # noqa: E731
                                                    pipeline_events(schedule, virtual_stages, p, k))
    if 3 * m * v <= SIMULATED_OPS or m <= 5 * p:  # (two runs of 2p and 3p micro-batches cost as much)
        return tuple(finishes(m))
    m1 = p * max(2, SIMULATED_OPS // (3 * v * p * p))  # the steady state from the second p micro-batches on
    m1 += (m - m1) % p  # m1 and m2 as m modulo p (interleaved runs in rounds of p micro-batches)
    first, second = (finishes(k) for k in (m1, m1 + p))
    return tuple(b + (m - m1 - p) / p * (b - a) for a, b in zip(first, second))


def finishes_sharing_cores(events, p, cost, transfer, cores, per_stage, stretch=None):
    """07's run_events (the same dependencies: a rank's operations in its order, each once its
    inputs have arrived and, where it waits, its own sends) on ranks that share a CPU host's
    `cores`: while b stages compute at once, b x per_stage ranks of the node do, each at
    min(1, cores / (b x per_stage)) of the speed it has alone on a core, so a rank waiting in
    the bubble (blocked in a receive, off its core) lets the computing ranks run faster than
    "every rank computes all the time" would say. `stretch` (per rank: its operations
    lengthened by the collectives inside them, simulate_step's): the part of each operation
    that is those collectives takes its own time, computing nothing. Time advances from one
    start or end to the next (processor sharing). Returns each rank's finish, as
    rank_finishes: its last operation's end or its last send's arrival."""
    queue = [[] for _ in range(p)]
    for e, event in enumerate(events):
        queue[event[0]].append(e)
    work = [max(sum(cost(r, kind, c) for kind, _, c in forwards), sum(cost(r, op[0], op[2]) for op in backwards))
            for r, forwards, backwards, *_ in events]
    done, clock, sending, nxt = [None] * len(events), [0.0] * p, [0.0] * p, [0] * p
    running, ready, now, left = {}, {}, 0.0, len(events)  # running: {rank: [compute left, collectives left]}
    while left:
        for r in range(p):  # the next operation of each idle rank, once it knows when it may start
            if r in running or r in ready or nxt[r] == len(queue[r]):
                continue
            _, _, _, wanted, waits, _ = events[queue[r][nxt[r]]]
            if any(done[j] is None for j, *_ in wanted):
                continue
            ready[r] = max([clock[r], sending[r] if waits else 0.0] +
                           [done[j] + (transfer(g, to) if transfer and elsewhere else 0.0) for j, g, to, elsewhere in wanted])
        for r in [r for r, start in ready.items() if start <= now]:
            w = work[queue[r][nxt[r]]]
            running[r] = [w / (stretch[r] if stretch else 1.0), w - w / (stretch[r] if stretch else 1.0)]
            del ready[r]
        if not running and not ready:
            raise ValueError("the pipeline's operations wait on each other: no rank can start")
        computing = sum(1 for c, _ in running.values() if c > 0)
        speed = min(1.0, cores / (per_stage * computing)) if computing else 1.0
        until = min([now + (c / speed if c > 0 else t) for c, t in running.values()] + list(ready.values()))
        for r in list(running):
            c, t = running[r]
            if c > 0:
                running[r][0] = c - (until - now) * speed
            else:
                running[r][1] = t - (until - now)
            if running[r][0] <= 1e-12 * max(1.0, until):  # (its compute ended, to rounding)
                running[r][0] = 0.0
                if running[r][1] <= 1e-12 * max(1.0, until):  # and its collectives
                    e = queue[r][nxt[r]]
                    done[e] = clock[r] = until
                    for g, to in events[e][5] if transfer else ():
                        sending[r] = max(sending[r], until + transfer(g, to))
                    nxt[r] += 1
                    left -= 1
                    del running[r]
        now = until
    return [max(end, last) for end, last in zip(clock, sending)]


def core_sharing(name, args, n, machine):
    """None when every rank has a device (or a core) of its own: no --cores_per_node, or at
    least as many cores as a node's ranks. Else (the node's cores, the node's ranks per stage
    computing at once): one stage for a layout without a pipeline, whose ranks all compute
    at once; a pipeline's stages each hold that share of the node's ranks (exact when one
    node holds every stage, as on one host)."""
    cores, ranks = machine.get("cores", 0), min(n, machine["gpus_per_node"])
    if not cores or cores >= ranks:
        return None
    return cores, ranks / (pipeline_shape(name, args, n)[2] if is_pipeline(name, args) else 1)


def pipeline_events(schedule, virtual_stages, p, m):
    """07's rank_events of `schedule` on p stages and m micro-batches: which operation waits
    for which, the same at every cost, so a layout's step with free communication and with its
    messages, and its neighbours' (--zero1, SP, the other micro-batch, other layouts of the
    same pipeline), replay it once. Kept while they hold at most EVENTS_KEPT events in all
    (the oldest dropped first: 200k events take ~100 MB). They are made with the garbage
    collector paused: hundreds of thousands of small tuples and no cycle, and each full
    collection they would set off walks every object torch has made (it halves the time)."""
    key = (schedule, virtual_stages, p, m)
    if key not in _EVENTS:
        run = argparse.Namespace(schedule=schedule, schedule_csv=None, virtual_stages=virtual_stages)
        collecting = gc.isenabled()
        gc.disable()
        try:
            _EVENTS[key] = script("07_pipeline.py").rank_events(run, p, m)
        finally:
            if collecting:
                gc.enable()
        while sum(len(events) for events, _, _ in _EVENTS.values()) > EVENTS_KEPT and len(_EVENTS) > 1:
            del _EVENTS[next(iter(_EVENTS))]
    return _EVENTS[key]


_EVENTS, EVENTS_KEPT = {}, 400_000


def pipeline_length(schedule, virtual_stages, p, m, forward, recompute, transfers=None, sharing=None):
    """The pipeline's step (pipeline_finishes): the slowest rank's finish."""
    return max(pipeline_finishes(schedule, virtual_stages, p, m, forward, recompute, transfers, sharing))


def pipeline_shape(name, args, n):
    """(schedule, v, p, m, the ranks splitting a stage's work) of a pipeline: 07's schedule on
    n stages; 08's 1F1B over pp, a stage's work split over tp x cp, its micro-batches per replica."""
    if name.startswith("07"):
        v, _ = script("07_pipeline.py").chunks_per_rank(args)
        return args.schedule, v, n, args.global_batch_size // args.micro_batch_size, 1
    m = args.global_batch_size // (args.micro_batch_size * (n // (args.tp * args.pp * args.cp)))
    return "1f1b", 1, args.pp, m, args.tp * args.cp


def is_pipeline(name, args):
    return name.startswith("07") or (name.startswith("08") and args.pp > 1)


def chunk_forwards(name, args, config, n, rate, op_s=0.0):
    """Each global chunk's forward seconds of one micro-batch, (its blocks, the head): the
    FLOPs as they run (flops_as_run) of the chunk's own layers (07's chunk_layers: the last
    L mod p hold one more), the head on the last, at `rate` FLOP/s per GPU; and a third of
    op_s per layer (the fixed costs under MACHINES; the backward, twice the forward, takes
    the other two thirds)."""
    per_token, head = flops_as_run(config, count_params_once(config)[1])
    schedule, v, p, m, split = pipeline_shape(name, args, n)
    micro = args.micro_batch_size * config.block_size / (split * rate)  # seconds per FLOP-per-token
    layers = script("07_pipeline.py").chunk_layers(config.n_layer, p * v)
    return tuple((count * (per_token / config.n_layer * micro + op_s) / 3, (g == p * v - 1) * head / 3 * micro)
                 for g, (_, count) in enumerate(layers))


def compute_seconds(name, args, config, n, rate, op_s=0.0, sharing=None):
    """(compute seconds of the step, its bubble): the global batch's FLOPs as they run
    (flops_as_run) at `rate` FLOP/s per GPU, and op_s (the fixed costs under MACHINES) for each layer a rank runs
    in each of its micro-batches: every layer of every micro-batch of its replica's share,
    however thin TP or CP slices the layer. A pipeline (07; 08 with pp > 1) is simulated as
    its ranks run it (pipeline_length), communication free: each stage's own layers (the
    last L mod p stages hold one more, the last the head), so the slowest stage sets the pace
    and the bubble comes out of the schedule; the bubble is the stages' mean idle share.
    `sharing` (core_sharing's): the ranks share a CPU host's cores; without a pipeline every
    rank computes at once, ranks / cores slower; a pipeline's stages as many at once as
    compute (finishes_sharing_cores; the bubble stays the schedule's)."""
    per_token, head = flops_as_run(config, count_params_once(config)[1])
    recompute = bool(getattr(args, "recompute", False))  # one more forward of the blocks, not of the head
    run_per_token = per_token * (4 / 3 if recompute else 1) + head
    fixed = op_s * (1 + recompute / 3) * config.n_layer  # one micro-batch's fixed cost, all its layers
    if not is_pipeline(name, args):
        m = max(1, args.global_batch_size // (args.micro_batch_size * replicas(name, args, n)))
        slower = sharing[1] / sharing[0] if sharing else 1.0  # every rank computing at once
        return (run_per_token * args.global_batch_size * config.block_size / (n * rate) + m * fixed) * slower, 0.0
    schedule, v, p, m, split = pipeline_shape(name, args, n)
    forward = chunk_forwards(name, args, config, n, rate, op_s)
    length = pipeline_length(schedule, v, p, m, forward, recompute)
    busy = run_per_token * m * args.micro_batch_size * config.block_size / (p * split * rate) + m * fixed / p
    shared = pipeline_length(schedule, v, p, m, forward, recompute, None, sharing) if sharing else length
    return shared, 1 - busy / length


def link_of(ranks, gpus_per_node):
    """ranks_per_node's answer for a message between two ranks: None inside a node, 1 across."""
    return ranks_per_node(ranks, gpus_per_node) and 1


def stage_comm(name, args, config, n, machine, cost, comm, rank):
    """{phase: [seconds, calls]} of one rank's step (phase_of), each operation priced per call
    over its own group's links (comm_seconds), and the bytes of one pipeline message. A
    pipeline's sends are its messages between stages, priced per boundary by the simulation;
    08 with --cp shares send/recv with its ring, inside the stage: the pipeline's part is what
    the same layout sends with Ulysses (whose all-to-alls leave send/recv to the pipeline), the
    rest the ring's."""
    G, calls = machine["gpus_per_node"], op_calls(cost)
    phases = {phase: [0.0, 0] for phase in ("inside", "overlapped", "replica", "after")}
    message = 0
    for op, nbytes in comm.items():
        if op == GUARD_OP or op.split("[")[0] == "recv":  # a receive is its sender's send
            continue
        phase, k = phase_of(name, op, args), calls.get(op, 1)
        if phase == "p2p":
            if name.startswith("07"):
                message = nbytes / k
                continue
            s = rank // (args.cp * args.tp) % args.pp
            posted = (args.global_batch_size // (args.micro_batch_size * (n // (args.tp * args.pp * args.cp)))
                      * ((s < args.pp - 1) + (s > 0)))  # 1F1B: a forward out and a gradient back per micro-batch
            piped = nbytes
            if args.cp > 1:
                ulysses = argparse.Namespace(**{**vars(args), "cp_impl": "ulysses"})
                try:
                    with contextlib.redirect_stderr(io.StringIO()):
                        piped = script(name).costs(ulysses, config, n, planned_dtype(args), rank)["sent"][op][1]
                except (SystemExit, ValueError, KeyError):  # Ulysses refused (heads): split by the calls
                    piped = nbytes * posted / max(k, posted)
            message = piped / posted if posted else 0
            if nbytes > piped:  # the ring's K/V, inside the stage, between neighbours tp ranks apart
                ring = comm_seconds(op, nbytes - piped, 2, link_of([0, args.tp * (args.cp - 1)], G), machine,
                                    max(1, k - posted), posts=max(1, k - posted) / 2,  # K and V: one batch
                                    ring=ring_meets(name, op, args, n))
                phases["inside"][0] += ring
                phases["inside"][1] += max(1, k - posted)
            continue
        batched = name.startswith("09") and op.split("[")[0] == "send"  # the ring's K and V (dK, dV): one batch
        phases[phase][0] += comm_seconds(op, nbytes, *group_of(name, op, args, n, G), machine, k,
                                         posts=k / 2 if batched else None, ring=ring_meets(name, op, args, n))
        phases[phase][1] += k
    return phases, message


def simulate_step(name, args, config, n, machine, rate, roles, imbalance_s=0.0, lanes=None):
    """The step as its ranks run it, every collective an event with its dependencies: the step
    time, and with `lanes` (a dict) each role's boxes, {role: [(start, seconds, kind, what)]},
    kind compute, p2p or collective, to draw (plot.py --plan).

    Without a pipeline, one role: its compute, lengthened by the collectives inside its
    forwards and backwards; the gradient buckets overlapped with backward posted one by one as
    the last micro-batch's backward reaches them (equal buckets at equal spacing: an
    approximation of where the hooks fire; a script that reduces every micro-batch is priced as
    if all its buckets came in the last), each waiting for the one before on the
    communicator's one stream; then what follows the backward. With a pipeline, 07's
    schedule replayed (pipeline_finishes) with each stage's operations lengthened by the
    collectives inside them and each message between stages α + bytes/β over the link it
    crosses, so a stage waits for its input's arrival; each stage's replica reductions start
    when it is done, and what every rank takes part in (the norm, the tied embedding) waits
    for the slowest. The step is the slowest rank's finish."""
    G, recompute = machine["gpus_per_node"], bool(getattr(args, "recompute", False))
    sharing = core_sharing(name, args, n, machine)
    slower = min(n, G) / sharing[0] if sharing else 1  # Muon: every rank at once
    muon = {rank: r["muon_flops"] / rate * slower for rank, r in roles.items()}
    after = max(r["phases"]["after"][0] for r in roles.values())
    if not is_pipeline(name, args):
        (rank, role), = roles.items()
        phases = role["phases"]
        compute, _ = compute_seconds(name, args, config, n, rate, layer_fixed_seconds(name, machine), sharing)
        busy = compute + imbalance_s + phases["inside"][0]
        m = max(1, args.global_batch_size // (args.micro_batch_size * replicas(name, args, n)))
        window = busy * (2 + recompute) / (3 + recompute) / m  # the last micro-batch's backward
        seconds, calls = phases["overlapped"]
        buckets, clock = [], busy - window
        for i in range(calls):  # bucket i ready once backward has reached it; one stream: in order
            clock = max(clock, busy - window + (i + 1) * window / calls) + seconds / calls
            buckets.append(clock)
        done = max([busy] + buckets[-1:])
        step = done + phases["replica"][0] + muon[rank] + after
        if lanes is not None:
            f = busy / m / (3 + recompute) * (1 + recompute)  # a micro-batch's forward (+ its recompute in B)
            boxes = [(i * busy / m, f, "compute", f"F{i}") for i in range(m)] + \
                    [(i * busy / m + f, busy / m - f, "compute", f"B{i}") for i in range(m)]
            boxes += [(b - seconds / calls, seconds / calls, "collective", "bucket") for b in buckets]
            tail = done
            for what, t in (("replica", phases["replica"][0]), ("Muon", muon[rank]), ("after", after)):
                if t:
                    boxes.append((tail, t, "collective", what))
                    tail += t
            lanes[f"rank {rank}"] = boxes
        return step
    schedule, v, p, m, split = pipeline_shape(name, args, n)
    forward = chunk_forwards(name, args, config, n, rate, layer_fixed_seconds(name, machine))
    owner = list(range(p)) if name.startswith("07") else stage_roles(name, args, config)
    rank_of = (lambda s: s) if name.startswith("07") else (lambda s: s * args.cp * args.tp)  # noqa: E731
    pipeline = script("07_pipeline.py")
    vee = chunks_per_rank_vee(schedule)
    stage_of = [pipeline.stage_rank(p, g, vee) for g in range(p * v)]
    # a stage's operations lengthened by the collectives inside them, in proportion to their FLOPs
    work = [0.0] * p
    for g, (blocks, head) in enumerate(forward):
        work[stage_of[g]] += m * ((3 + recompute) * blocks + 3 * head)
    stretch = [1 + roles[owner[s]]["phases"]["inside"][0] / work[s] if work[s] else 1 for s in range(p)]
    sharing = sharing and (*sharing, tuple(stretch))  # (their collectives inside take their own time)
    forward = tuple((b * stretch[stage_of[g]], h * stretch[stage_of[g]]) for g, (b, h) in enumerate(forward))
    transfers = tuple(comm_seconds("send", roles[owner[stage_of[g]]]["message"], 2,
                                   link_of([rank_of(stage_of[g]), rank_of(stage_of[g + 1])], G), machine)
                      for g in range(p * v - 1))
    finishes = pipeline_finishes(schedule, v, p, m, forward, recompute, transfers, sharing)
    ends = [finishes[s] + roles[owner[s]]["phases"]["replica"][0] + muon[owner[s]] for s in range(p)]
    step = max(ends) + after + imbalance_s
    if lanes is not None:
        blocks, head = zip(*forward)
        cost = lambda r, kind, c: (lambda g: (lambda f: f if kind == "F" else (2 * f + recompute * blocks[g]) * (  # noqa: E731
            1 if kind == "B" else 0.5))(blocks[g] + head[g]))(pipeline.chunk_stage(p, r, c, vee))
        run = argparse.Namespace(schedule=schedule, schedule_csv=None, virtual_stages=v)
        every, _, _, split_bw = pipeline.run_schedule(run, p, m)
        orders = [[a for actions in rounds for a in pipeline.unit_actions(actions, split_bw)] for rounds in every]
        transfer = (lambda g, to: transfers[min(g, to)]) if transfers else None  # noqa: E731
        starts = pipeline.simulate(orders, p, v, vee, None, cost, transfer)
        for s in range(p):
            boxes = [(t, cost(s, kind, c), "compute", f"{kind}{i}") for t, (kind, i, c) in starts[s]]
            for t, (kind, i, c) in starts[s]:
                g = pipeline.chunk_stage(p, s, c, vee)
                to = g + 1 if kind == "F" else g - 1 if kind in "BI" else -1
                if 0 <= to < p * v and stage_of[to] != s:
                    boxes.append((t + cost(s, kind, c), transfers[min(g, to)], "p2p", "send"))
            tail = finishes[s]
            for what, t in (("replica", roles[owner[s]]["phases"]["replica"][0]), ("Muon", muon[owner[s]])):
                if t:
                    boxes.append((tail, t, "collective", what))
                    tail += t
            if after:
                boxes.append((max(ends), after, "collective", "after"))
            lanes[f"stage {s}"] = boxes
    return step


def replicas(name, args, n):
    """The data-parallel ranks among n, which split the global batch (06: none; 08: n / (tp·pp·cp))."""
    if name.startswith("06"):
        return 1
    if name.startswith("08"):
        return n // (args.tp * args.pp * args.cp)
    if name.startswith("09"):
        return n // (args.cp or n)
    return n


def chunks_per_rank_vee(schedule):
    """Whether `schedule`'s chunks sit in a V (07's V_SHAPED)."""
    return schedule in script("07_pipeline.py").V_SHAPED


def score(name, flags, label, plan_args, machine, lanes=None):
    """One candidate, validated and priced by the script and timed by the model of the
    docstring: (candidate, None), or (None, the script's reason) when it refuses the layout.
    `lanes`: a dict, filled with each role's timeline (simulate_step)."""
    n, G = plan_args.gpus, machine["gpus_per_node"]
    argv = [*plan_args.model_flags, *flags]
    result = dry_run(name, argv, n, G, machine.get("gpu_mem_gb"))
    if isinstance(result, str):
        return None, result
    args, config, _ = result
    dtype = planned_dtype(args)
    # memory and communication of every rank that differs; the fullest one is reported
    ranks = []
    for rank in ranks_to_price(name, args, config, n):
        cost = rank_costs(name, args, config, n, dtype, rank)
        comm = {op: value for op, (_, value) in cost["sent"].items()}
        # the busiest expert-parallel rank receives (and sends back) imbalance x the balanced rows
        comm.update({op: value * plan_args.imbalance for op, value in comm.items() if op == "all_to_all_single[ep]"})
        calls = op_calls(cost)
        comm_s = sum(comm_seconds(op, b, *group_of(name, op, args, n, G), machine, calls.get(op, 1))
                     for op, b in comm.items() if op != GUARD_OP)
        phases, message = stage_comm(name, args, config, n, machine, cost, comm, rank)
        ranks.append(dict(rank=rank, layout=cost["layout"], held=per_gpu_bytes(cost), comm=comm, comm_s=comm_s,
                          phases=phases, message=message,
                          muon_flops=cost["muon_flops"][1] if "muon_flops" in cost else 0,
                          need=fit_need(cost, planned_device_type(args))))
    fullest = max(ranks, key=lambda r: (r["need"], r["held"]["total"], r["comm_s"]))
    # compute: what the kernels run (causal attention), a pipeline as its stages run it; the
    # MFU's model FLOPs are nanoGPT's count (PaLM's convention, as the scripts' MFU)
    model_flops = flops_per_token(config, count_params_once(config)[1]) * args.global_batch_size * config.block_size
    peak = machine["peak_tflops"] * 1e12
    rate = peak * plan_args.efficiency
    sharing = core_sharing(name, args, n, machine)
    compute_s, f = compute_seconds(name, args, config, n, rate, layer_fixed_seconds(name, machine), sharing)
    extra = 0.0
    if config.n_expert and plan_args.imbalance > 1:  # the busiest rank's experts run imbalance x their share of rows
        expert_flops = 6 * config.n_layer * config.top_k * expert_params(config) * args.global_batch_size * config.block_size
        extra = (plan_args.imbalance - 1) * expert_flops / (n * rate)
    muon_s = max(r["muon_flops"] for r in ranks) / rate * (min(n, G) / sharing[0] if sharing else 1)  # Newton-Schulz
    step_s = simulate_step(name, args, config, n, machine, rate, {r["rank"]: r for r in ranks}, extra, lanes)
    compute_s += extra
    if "--micro_batch_size" not in argv:  # the command states the micro-batch the script chose
        argv += ["--micro_batch_size", str(args.micro_batch_size)]
    return dict(script=name, flags=argv, label=label, layout=fullest["layout"],
                command=launch_command(name, argv, n, G),
                per_gpu_bytes=fullest["held"], activations_counted=fullest["held"]["activations"] is not None,
                comm_bytes_per_step=fullest["comm"], priced_rank=fullest["rank"],
                compute_s=compute_s, muon_s=muon_s, comm_s=step_s - compute_s - muon_s, bubble=f,
                step_time_s=step_s, mfu=model_flops / (step_s * n * peak),
                experts=bool(config.n_expert), need_bytes=fullest["need"], need_device=planned_device_type(args), room_bytes=planned_room(args),
                fits=fullest["need"] <= planned_room(args)), None


def launch_command(name, argv, n, gpus_per_node):
    line = " ".join([name, *argv])
    if n == 1:
        return f"python {line}"
    if n <= gpus_per_node:
        return f"mpiexec -n {n} python {line}"
    return f"mpiexec -n {n} --ppn {gpus_per_node} python {line}"


# ----------------------------------------------------------------------------------------
# The recommendation
# ----------------------------------------------------------------------------------------

def recommend(scored, n):
    """The ALCF rules, applied to the candidates that fit (see the docstring)."""
    fits = [c for c in scored if c["fits"]]
    if not fits:
        return None, ("nothing fits: use more GPUs, --recompute, a smaller --micro_batch_size, "
                      "or a GPU with more memory")
    fastest = lambda cs: min(cs, key=lambda c: c["step_time_s"])  # noqa: E731
    replicas = [c for c in fits if c["script"] in ("01_single_gpu.py", "03_ddp.py")]
    if replicas:
        return fastest(replicas), ("the model fits on one GPU: plain data parallelism (DDP), the least "
                                   "communication per step and none inside the step")
    sharded = [c for c in fits if c["script"] in ("04_zero.py", "05_fsdp.py")]
    three_d = [c for c in fits if c["script"] == "08_3d.py"]
    if sharded and (not three_d or fastest(sharded)["step_time_s"] <= fastest(three_d)["step_time_s"]):
        return fastest(sharded), ("a replica does not fit, sharded data parallelism does: ZeRO/FSDP "
                                  "(HSDP keeps the parameter gathers inside a node)")
    experts = [c for c in fits if c["script"] == "10_expert_parallel.py"]  # (a mixture of experts: 10 or 08 --ep)
    if experts and (not three_d or fastest(experts)["step_time_s"] <= fastest(three_d)["step_time_s"]):
        return fastest(experts), ("a mixture of experts: expert parallelism, each rank holding its share of every "
                                  "layer's experts and the dense layers replicated"
                                  + (", faster than 3D with EP" if three_d else ""))
    if three_d:
        best = fastest(three_d)
        tp = best["flags"][best["flags"].index("--tp") + 1] if "--tp" in best["flags"] else "1"
        return best, ("layers too big or many GPUs: 3D parallelism, "
                      + ("TP inside a node over the fast links, " if tp != "1" else "no TP (a stage's layers fit one GPU), ")
                      + "PP across nodes, DP outermost (+ ZeRO-1 when it saves memory)")
    return fastest(fits), "the only strategies that fit"


# ----------------------------------------------------------------------------------------
# Command line and output
# ----------------------------------------------------------------------------------------

MAX_BENCH_BYTES = 64 * 2**20  # 02's --bench writes a few KiB: a larger file is not one


MAX_IMBALANCE = 1e4  # an expert-parallel rank cannot take more than all the rows: a typo


def read_imbalance(value, error):
    """--imbalance: a number >= 1, or the largest expert_imbalance of a --metrics file (10's)."""
    try:
        number = float(value)
    except ValueError:
        rows = read_bench(value, error, flag="--imbalance", what="a --metrics file of a mixture-of-experts run")
        found = [r["expert_imbalance"] for r in rows if isinstance(r, dict) and isinstance(r.get("expert_imbalance"), (int, float))
                 and not isinstance(r.get("expert_imbalance"), bool) and math.isfinite(r["expert_imbalance"])]
        if not found:
            error(f"--imbalance {value}: no expert_imbalance in its rows (the --metrics of 10_expert_parallel.py)")
        number = max(found)
    if not (math.isfinite(number) and 1 <= number <= MAX_IMBALANCE):
        error(f"--imbalance must be a number in 1..{MAX_IMBALANCE:g} (the busiest rank's rows over the balanced "
              f"share) or a metrics file, got {value[:80]!r}")
    return number


def read_bench(path, error, flag="--bench", what="02_collectives.py --bench metrics"):
    """The JSON rows of a --bench file, or one error line: a device or a pipe (/dev/zero
    reads forever), a file too large to be 02's output, lines that are not JSON (or nested
    too deep for the parser) all name the file and the cause."""
    try:
        if not os.path.isfile(path):
            error(f"{flag} {path}: {'no such file' if not os.path.exists(path) else 'not a regular file'} "
                  f"(expected {what}, a JSONL file)")
        if os.path.getsize(path) > MAX_BENCH_BYTES:
            error(f"{flag} {path}: {os.path.getsize(path):,} bytes, not {what} "
                  f"(at most {MAX_BENCH_BYTES // 2**20} MiB read)")
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except RecursionError:
        error(f"{flag} {path}: a line nests JSON thousands of levels deep: not {what}")
    except (OSError, ValueError) as e:
        error(f"{flag} {path}: cannot read it as {what} ({str(e)[:150]})")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and batch (passed to the scripts as they are)")
    g.add_argument("--model", default=None, choices=sorted(PRESETS), help="preset (default: the scripts')")
    for flag in ("--n_layer", "--n_head", "--n_embd", "--block_size", "--global_batch_size", "--micro_batch_size",
                 "--n_expert", "--top_k"):
        g.add_argument(flag, type=int)
    g.add_argument("--dropout", type=float)
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--data", default=None, help="as the scripts' --data (sets the vocabulary size: "
                   "the embedded corpus has 65 tokens, a directory without meta.pkl GPT-2's 50304)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on GPUs")
    g.add_argument("--device", default=None, choices=["cpu"], help="plan a CPU run (float32 by default)")
    g.add_argument("--recompute", action="store_true", help="activation checkpointing per block")
    g.add_argument("--optimizer", default=None, choices=["adamw", "muon"],
                   help="muon: each layout's Muon traffic (its whole matrices moved to their owners) priced too")
    g = p.add_argument_group("cluster")
    g.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) to plan for")
    g.add_argument("--machine", choices=sorted(MACHINES), help="a machine's published figures")
    g.add_argument("--gpus_per_node", type=int)
    g.add_argument("--gpu_mem_gb", type=float)
    g.add_argument("--peak_tflops", type=float, help="peak dense FLOP/s per GPU in the dtype used")
    g.add_argument("--link_gbps", type=float, help="GB/s inside a node (one direction)")
    g.add_argument("--inter_gbps", type=float, help="GB/s per GPU across nodes (default: --link_gbps)")
    g.add_argument("--bench", nargs="+", default=[],
                   help="metrics JSONL of `02_collectives.py --bench`: its best all_reduce bus bandwidth "
                        "replaces the link bandwidth and its fastest all_reduce's time per ring step the "
                        "latency (inside a node if it ran on one node, else across)")
    g.add_argument("--measured", default=None,
                   help="the --json of `02_collectives.py --doctor`: its fitted alpha and beta, inside a node and "
                        "across nodes, replace the datasheet's; the plan says where the ranking changed and why")
    g = p.add_argument_group("model of the step")
    g.add_argument("--efficiency", type=float, default=EFFICIENCY, help="fraction of peak the compute reaches")
    g.add_argument("--call_overhead_us", nargs="+", default=["0"], metavar="US|G:US|KIND:...",
                   help="microseconds each collective or send costs beyond its alpha (the wrapper, the ranks meeting): "
                        "one figure for every group, or G:US pairs measured at group sizes G (\"2:900 4:4500\"), "
                        "interpolated between them and held beyond; words KIND:US or KIND:G:US (KIND as --op_gbps's, "
                        "\"all_to_all:2:300\") are that kind's own, where it is not the others'; 0 on a GPU machine; "
                        "tests/benchmarks/plan_vs_measured.py measures it on a CPU host")
    g.add_argument("--op_overhead_us", nargs="+", default=["0"], metavar="US [tp:US]",
                   help="microseconds one layer's forward and backward of one micro-batch cost beyond their FLOPs "
                        "(Python, kernel launches), on every rank that runs the layer however thin TP or CP slices it; "
                        "tp:US, what 06's layer (06 and 08 run it, at any --tp) costs beyond that: its f and g "
                        "autograd functions, the vocabulary-parallel loss (plan_vs_measured.py: 06 at one rank)")
    g.add_argument("--exchange_overhead_us", nargs="+", default=None, metavar="US|G:US",
                   help="microseconds one step of a ring's exchange costs beyond its alpha (09's ring, 08's with "
                        "--cp: K and V to the next rank, from the one before, one batch), by the ring's size G as "
                        "--call_overhead_us's pairs, where it is not a pair's call's: every rank of the ring waits on "
                        "the one before (tests/benchmarks/call_cost.py --op ring_exchange); default: --call_overhead_us "
                        "at 2")
    g.add_argument("--op_gbps", nargs="+", default=[], metavar="KIND:GBPS",
                   help="GB/s one kind of collective reaches inside a node where it is not the ring's over "
                        "--link_gbps (KIND: all_reduce, reduce_scatter, all_gather, all_to_all, send), as its bus "
                        "bandwidth: seconds = busfactor x bytes / GBPS (gloo on a CPU host reduces and copies; "
                        "tests/benchmarks/plan_vs_measured.py measures it with call_cost.py --op); none on a GPU machine")
    g.add_argument("--cores_per_node", type=int, default=0,
                   help="a CPU host's cores, shared by its --gpus_per_node ranks: with fewer cores than ranks, each "
                        "rank computes at min(1, cores / ranks computing at once) of --peak_tflops (a rank waiting in "
                        "a pipeline's bubble yields its core); 0: every rank has a device of its own")
    g.add_argument("--imbalance", default="1",
                   help="mixture of experts: the busiest expert-parallel rank's rows over the balanced share (its "
                        "all-to-all bytes and expert FLOPs), a number >= 1, or a run's --metrics file, whose "
                        "largest expert_imbalance is taken (1: balanced routing)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    g.add_argument("--show_invalid", action="store_true", help="list refused layouts with the reason")
    g.add_argument("--top", type=int, default=25, help="rows of the table")
    g.add_argument("--rehearse", action="store_true",
                   help="then rehearse the recommended layout: its script's real steps as each distinct rank "
                        "(--rehearse roles, on the fake backend with fake tensors), next to its costs(); with --measured, "
                        "the measured plan's recommendation")
    args = p.parse_args(argv)

    def error(message):
        p.exit(2, f"error: {message}\n")

    if not 1 <= args.gpus <= MAX_GPUS:
        error(f"--gpus must be in 1..{MAX_GPUS:,}, got {args.gpus}")
    if not 0 < args.efficiency <= 1:
        error("--efficiency must be in (0, 1]")
    for flag in ("gpus_per_node", "gpu_mem_gb", "peak_tflops", "link_gbps", "inter_gbps"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            error(f"--{flag} must be a positive number, got {value}")
    op_s, tp_op_s = read_op_overhead(args.op_overhead_us, error)
    call_s, kind_call_s = read_call_overheads(args.call_overhead_us, error)
    exchange_s = None if args.exchange_overhead_us is None else read_call_overhead(args.exchange_overhead_us, error,
                                                                                   "--exchange_overhead_us")
    op_gbps = read_op_gbps(args.op_gbps, error)
    if not 0 <= args.cores_per_node <= MAX_GPUS:
        error(f"--cores_per_node must be in 0..{MAX_GPUS:,} (0: a device per rank), got {args.cores_per_node}")
    if args.top < 0:
        error(f"--top must not be negative, got {args.top}")
    for flag in ("n_layer", "n_head", "n_embd", "block_size", "global_batch_size", "micro_batch_size"):
        value = getattr(args, flag)
        if value is not None and not 1 <= value <= MAX_SIZE:
            error(f"--{flag} must be in 1..{MAX_SIZE:,}, got {value}")
    args.imbalance = read_imbalance(args.imbalance, error)
    machine = dict(MACHINES[args.machine]) if args.machine else dict(alpha_intra=ALPHA_INTRA, alpha_inter=ALPHA_INTER)
    by_hand = dict(gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem_gb, peak_tflops=args.peak_tflops,
                   intra_gbps=args.link_gbps, inter_gbps=args.inter_gbps or args.link_gbps)
    machine.update({k: v for k, v in by_hand.items() if v is not None})
    machine.update(call_s=call_s, op_s=op_s)
    if tp_op_s:
        machine["tp_op_s"] = tp_op_s
    if op_gbps:
        machine["op_gbps"] = op_gbps
    if kind_call_s:
        machine["kind_call_s"] = kind_call_s
    if exchange_s is not None:
        machine["exchange_s"] = exchange_s
    if args.cores_per_node:
        machine["cores"] = args.cores_per_node
    for path in args.bench:
        rows = read_bench(path, error)
        rows = [r for r in rows if isinstance(r, dict) and r.get("op") == "all_reduce"]
        if not rows:
            error(f"{path} has no all_reduce rows of 02_collectives.py --bench")
        fields = {"world_size": int, "busbw_GBps": (int, float), "time_us": (int, float)}
        if not all(isinstance(r.get(k), kind) and not isinstance(r.get(k), bool) and r[k] > 0
                   for r in rows for k, kind in fields.items()):
            error(f"{path}: its all_reduce rows lack positive {', '.join(fields)} (not 02_collectives.py --bench output?)")
        g = rows[0]["world_size"]
        where = "inter" if g > machine.get("gpus_per_node", g) else "intra"
        # across nodes the ring's bus bandwidth is its k ranks per node sharing the node's NICs
        # (comm_seconds' rule, k x inter_gbps): the per-GPU figure is busbw / k (02 --bench
        # writes ranks_per_node; an older file: full nodes)
        k = rows[0].get("ranks_per_node") or min(g, machine.get("gpus_per_node", g)) if where == "inter" else 1
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= g:
            error(f"{path}: ranks_per_node {str(k)[:40]!r} is not a rank count of its {g} ranks")
        machine[f"{where}_gbps"] = max(r["busbw_GBps"] for r in rows) / k
        fastest = min(r["time_us"] for r in rows)  # a small message: latency only
        machine[f"alpha_{where}"] = fastest * 1e-6 / max(1, 2 * (g - 1))
    needed = ("gpus_per_node", "peak_tflops", "intra_gbps", "inter_gbps") + (() if args.device == "cpu" else ("gpu_mem_gb",))
    missing = [k for k in needed if not machine.get(k)]  # --device cpu: this host's memory by default
    if missing:
        error(f"describe the cluster: --machine, or by hand ({', '.join(missing)} missing: --gpus_per_node, "
              "--gpu_mem_gb, --peak_tflops, --link_gbps)")
    # the flags every candidate's command carries
    args.model_flags = []
    for key in ("model", "n_layer", "n_head", "n_embd", "block_size", "dropout", "global_batch_size",
                "micro_batch_size", "n_expert", "top_k", "data", "dtype", "device", "optimizer"):
        if getattr(args, key) is not None:
            args.model_flags += [f"--{key}", str(getattr(args, key))]
    if args.device is None and machine.get("device"):  # a machine's own device kind (Aurora: xpu), not CUDA's
        args.model_flags += ["--device", machine["device"]]
    if args.bias is not None:
        args.model_flags.append("--bias" if args.bias else "--no-bias")
    if args.recompute:
        args.model_flags.append("--recompute")
    return args, machine


def plan(args, machine):
    """Every candidate scored (valid ones), the refused ones with their reasons, the
    recommendation and Ψ."""
    n, G = args.gpus, machine["gpus_per_node"]
    base = dry_run("01_single_gpu.py", args.model_flags, 1, 1)  # the model as the scripts build it
    if isinstance(base, str):  # the model or batch flags themselves are wrong
        print(f"error: {base}", file=sys.stderr)
        sys.exit(2)
    config = base[1]
    scored, refused, seen = [], [], set()
    for name, flags, label in candidates(n, G, config.n_layer, config.n_expert):
        micro_batches = [None] if args.micro_batch_size else [None, 1]
        for micro in micro_batches:
            extra = ["--micro_batch_size", str(micro)] if micro else []
            c, reason = score(name, flags + extra, label, args, machine)
            if c is None:
                refused.append((name, label + (f", micro-batch {micro}" if micro else ""), reason))
            elif (name, tuple(c["flags"])) not in seen:  # the default micro-batch may be 1 already
                seen.add((name, tuple(c["flags"])))
                scored.append(c)
    scored.sort(key=lambda c: (not c["fits"], c["step_time_s"]))
    choice, why = recommend(scored, n)
    return count_params_once(config)[0], scored, refused, choice, why


def gb(b):
    return "-" if b is None else f"{b / 1e9:.3g}"


def print_table(args, machine, psi, scored, refused, choice, why):
    n, G = args.gpus, machine["gpus_per_node"]
    counted = all(c["activations_counted"] for c in scored)
    print(f"plan: {args.model or 'default'} model, Ψ = {psi:,} parameters, on {n} GPU(s), {G} per node "
          f"({math.ceil(n / G)} node(s)); "
          + (f"{machine['gpu_mem_gb']:g} GB" if machine.get("gpu_mem_gb") else "this host's memory")
          + f", {machine['peak_tflops']:g} TFLOP/s "
          f"x {args.efficiency:g} efficiency per GPU; links {machine['intra_gbps']:g} GB/s in a node, "
          f"{machine['inter_gbps']:.3g} GB/s per GPU across nodes")
    if any(c["experts"] for c in scored):
        print(f"routing: the busiest expert-parallel rank takes {args.imbalance:g} x the balanced rows (--imbalance"
              + ("; 1: balanced routing, which a run measures as expert_imbalance in its --metrics)" if args.imbalance == 1 else ")"))
    if not counted:
        print("ACTIVATIONS NOT COUNTED: the scripts' costs() do not give them yet; memory is model state only")
    print(f"{'':2}{'strategy':<30} {'params':>7} {'grads':>7} {'optim':>7} {'act':>7} {'total':>7} {'need':>7} "
          f"{'comm/step':>10} {'step s':>8} {'MFU':>6}  command  (GB per GPU, need: "
          f"{allowance_text(scored[0]['need_device'] if scored else 'cuda').replace('costs()', 'total')} against "
          f"{gb(scored[0]['room_bytes']) if scored else '-'} GB of room; sorted by step time, fitting first)")
    for c in scored[:args.top]:
        h = c["per_gpu_bytes"]
        mark = "* " if c is choice else ("  " if c["fits"] else "x ")
        print(f"{mark}{c['label']:<30} {gb(h['params']):>7} {gb(h['grads']):>7} {gb(h['optim']):>7} "
              f"{gb(h['activations']):>7} {gb(h['total']):>7} {gb(c['need_bytes']):>7} "
              f"{format_bytes(sum(c['comm_bytes_per_step'].values())):>10} "
              f"{c['step_time_s']:>8.3g} {100 * c['mfu']:>5.1f}%  {c['command']}")
    if len(scored) > args.top:
        print(f"  ... {len(scored) - args.top} more (--top)")
    print(f"{sum(c['fits'] for c in scored)} of {len(scored)} valid layouts fit (x: does not fit); "
          f"{len(refused)} refused by the scripts" + ("" if args.show_invalid else " (--show_invalid)"))
    if args.show_invalid:
        for name, label, reason in refused:
            print(f"  refused {label} ({name}): {reason}")
    if choice is None:
        print(f"recommendation: {why}")
        return
    print(f"recommendation: {choice['label']}, ~{choice['step_time_s']:.3g} s per step, MFU {100 * choice['mfu']:.0f}% "
          f"(estimate), {gb(choice['per_gpu_bytes']['total'])} GB per GPU: {why}\n  {choice['command']}")
    fastest = min((c for c in scored if c["fits"]), key=lambda c: c["step_time_s"])
    if fastest is not choice:
        print(f"  (fastest estimate: {fastest['label']}, {fastest['step_time_s']:.3g} s: {fastest['command']})")


def strict_json(plan):
    """The plan as strict JSON: a number that is not finite (a link priced at 1e-300 GB/s
    takes forever) is null, never Infinity or NaN, which JSON parsers other than Python's refuse."""
    return json.dumps(finite_or_null(plan), allow_nan=False)


def as_json(psi, scored, refused, choice, why):
    keys = ("script", "flags", "label", "layout", "command", "per_gpu_bytes", "activations_counted",
            "comm_bytes_per_step", "priced_rank", "compute_s", "muon_s", "comm_s", "bubble", "step_time_s", "mfu", "need_bytes", "room_bytes", "fits")
    pick = lambda c: {k: c[k] for k in keys}  # noqa: E731
    return {"params": psi, "candidates": [pick(c) for c in scored],
            "refused": [{"script": s, "label": label, "reason": r} for s, label, r in refused],
            "recommendation": dict(pick(choice), reason=why) if choice else {"reason": why}}


# ----------------------------------------------------------------------------------------
# --measured: this allocation's links, as the doctor fitted them, in place of the datasheet
# ----------------------------------------------------------------------------------------
#
# `02_collectives.py --doctor --json FILE` fits each link type to the same alpha-beta model
# comm_seconds() prices with (t = steps·alpha + busfactor·bytes/beta), so its alpha and beta
# drop in for the datasheet's: ALPHA_INTRA/intra_gbps inside a node, ALPHA_INTER/inter_gbps
# across nodes. The plan is made twice, with the datasheet and with the measurement (the
# scripts' dry runs, which do not depend on the links, are made once), and the candidates
# whose place changed are listed with their bytes and seconds per link: the why.

LINKS = {"intra": "inside a node", "inter": "across nodes"}


# What a measured link may be: slower than a second per message or a MB/s, or faster than
# 100 TB/s, is no network's (a fit of noise, or a hand edit) and would price every step
# in years or in nothing.
MAX_ALPHA_S, MIN_BETA_GBPS, MAX_BETA_GBPS = 1.0, 1e-3, 1e5


def measured_machine(path, machine, machine_name):
    """`machine` with the doctor's alpha and beta from `path` in place of its figures, and the
    links read; one line and exit 2 on a file that is not the doctor's."""
    def refuse(message):
        print(f"error: --measured {path}: {message}", file=sys.stderr)
        sys.exit(2)

    try:
        if not os.path.isfile(path):  # a device or a pipe (/dev/zero reads forever)
            refuse("no such file" if not os.path.exists(path) else "not a regular file (the doctor's --json is one)")
        if os.path.getsize(path) > MAX_BENCH_BYTES:
            refuse(f"{os.path.getsize(path):,} bytes: not the doctor's --json (a few KiB)")
        with open(path) as f:
            report = json.load(f)
    except RecursionError:
        refuse("JSON nested thousands of levels deep: not the doctor's --json")
    except (OSError, ValueError) as e:
        refuse(f"cannot read it as the doctor's --json ({str(e)[:150]})")
    links = report.get("links") if isinstance(report, dict) else None
    if not isinstance(links, dict) or not links or not set(links) <= set(LINKS):
        refuse("no measured links in it (02_collectives.py --doctor --json FILE on 2 or more ranks writes them)")
    for kind, fit in links.items():
        ok = isinstance(fit, dict) and all(isinstance(fit.get(k), (int, float)) and not isinstance(fit.get(k), bool)
                                           and math.isfinite(fit[k]) for k in ("alpha_s", "beta_GBps"))
        if not ok or fit["alpha_s"] < 0 or fit["beta_GBps"] <= 0:
            refuse(f"its {kind} link lacks a non-negative alpha_s and a positive beta_GBps")
        if fit["alpha_s"] > MAX_ALPHA_S or not MIN_BETA_GBPS <= fit["beta_GBps"] <= MAX_BETA_GBPS:
            refuse(f"its {kind} link's alpha {fit['alpha_s']:.3g} s, beta {fit['beta_GBps']:.3g} GB/s are not a "
                   f"network's (alpha at most {MAX_ALPHA_S:g} s, beta {MIN_BETA_GBPS:g} to {MAX_BETA_GBPS:g} GB/s): "
                   "a damaged or hand-edited file?")
    if machine_name and report.get("machine") and report["machine"] != machine_name:
        refuse(f"it was measured on {report['machine']}, the plan is for --machine {machine_name}")
    measured = dict(machine)
    for kind, fit in links.items():
        measured[f"{kind}_gbps"] = fit["beta_GBps"]
        measured[f"alpha_{kind}"] = fit["alpha_s"]
    return measured, links


@contextlib.contextmanager
def dry_runs_remembered():
    """Inside: dry_run() answers a repeated question from memory (the second plan asks the
    scripts exactly what the first did)."""
    global dry_run
    original, answers = dry_run, {}

    def remembered(name, flags, gpus, gpus_per_node, gpu_mem_gb=None):
        key = (name, tuple(flags), gpus, gpus_per_node, gpu_mem_gb)
        if key not in answers:
            answers[key] = original(name, flags, gpus, gpus_per_node, gpu_mem_gb)
        return answers[key]

    dry_run = remembered
    try:
        yield
    finally:
        dry_run = original


def per_link(c, plan_args, machine):
    """{link: (bytes, seconds)} per step of candidate c on its slowest rank under `machine`:
    what it sends inside a node and across nodes, and what that costs there."""
    n, G = plan_args.gpus, machine["gpus_per_node"]
    args, config, _ = dry_run(c["script"], c["flags"], n, G, machine.get("gpu_mem_gb"))
    worst = None
    for rank in ranks_to_price(c["script"], args, config, n):
        cost = rank_costs(c["script"], args, config, n, planned_dtype(args), rank)
        split = {kind: [0, 0.0] for kind in LINKS}
        for op, (_, nbytes) in cost["sent"].items():
            g, across = group_of(c["script"], op, args, n, G)
            kind = "inter" if across else "intra"
            split[kind][0] += nbytes if g > 1 and op.split("[")[0] != "recv" else 0
            split[kind][1] += comm_seconds(op, nbytes, g, across, machine, op_calls(cost).get(op, 1)) \
                if op != GUARD_OP else 0.0
        if worst is None or sum(s for _, s in split.values()) > sum(s for _, s in worst.values()):
            worst = split
    return {kind: tuple(v) for kind, v in worst.items()}


def ranking_changes(plan_args, sheet, measured, before, after, top=5):
    """What the measured links changed: the recommendation (old -> new), and the candidates
    among the measured plan's first `top` whose place moved, each with its bytes and seconds
    per link under both: a dict for --json, and its lines."""
    key = lambda c: (c["script"], tuple(c["flags"]))  # noqa: E731
    place = lambda scored: {key(c): i + 1 for i, c in enumerate(c for c in scored if c["fits"])}  # noqa: E731
    old_place, new_place = place(before[1]), place(after[1])

    def why(c):
        was, now = per_link(c, plan_args, sheet), per_link(c, plan_args, measured)
        parts = [f"{LINKS[k]} {format_bytes(now[k][0])}: {was[k][1] * 1e3:.3g} -> {now[k][1] * 1e3:.3g} ms"
                 for k in LINKS if now[k][0]]
        return "; ".join(parts) or "sends nothing", {k: dict(bytes=now[k][0], datasheet_s=was[k][1],
                                                           measured_s=now[k][1]) for k in LINKS}

    old, new = before[3], after[3]
    result = dict(recommendation_changed=bool(old and new and key(old) != key(new)), moves=[])
    lines = []
    if old and new and key(old) != key(new):
        old_why, result["old_links"] = why(old)
        new_why, result["new_links"] = why(new)
        result.update(old=old["label"], new=new["label"])
        lines.append(f"the recommendation changes from {old['label']} to {new['label']}: with the measured links "
                     f"{old['label']} takes {old['step_time_s']:.3g} -> "
                     f"{next(c for c in after[1] if key(c) == key(old))['step_time_s']:.3g} s per step "
                     f"({old_why}), {new['label']} {new['step_time_s']:.3g} s ({new_why})")
    elif new:
        lines.append(f"the recommendation stays {new['label']} ({new['step_time_s']:.3g} s per step with the measured "
                     f"links, {old['step_time_s']:.3g} s with the datasheet's)")
    for c in [c for c in after[1] if c["fits"]][:top]:
        was, now = old_place.get(key(c)), new_place[key(c)]
        if was != now:
            text, links = why(c)
            result["moves"].append(dict(label=c["label"], command=c["command"], datasheet_place=was,
                                        measured_place=now, links=links))
            lines.append(f"  #{was} -> #{now} {c['label']}: {text}")
    if len(lines) == 1 and lines[0].startswith("the recommendation stays"):
        lines.append(f"  the first {top} places are the datasheet's")
    return result, lines


def main_measured(args, machine):
    """plan.py ... --measured FILE: the plan with the doctor's links, and what they changed."""
    measured, links = measured_machine(args.measured, machine, args.machine)
    with dry_runs_remembered():
        before = plan(args, machine)
        after = plan(args, measured)
        changes, lines = ranking_changes(args, machine, measured, before, after)
    said = [f"{LINKS[k]}: alpha {f['alpha_s'] * 1e6:.3g} us, beta {f['beta_GBps']:.3g} GB/s (datasheet "
            f"{machine[f'alpha_{k}'] * 1e6:.3g} us, {machine[f'{k}_gbps']:.3g} GB/s)" for k, f in links.items()]
    rehearsal = rehearse(after[3], args.gpus, measured) if args.rehearse else None  # the measured plan's choice
    if args.json:
        out = as_json(*after)
        out["measured"] = dict(file=args.measured, links={k: {"alpha_s": f["alpha_s"], "beta_GBps": f["beta_GBps"]}
                                                           for k, f in links.items()},
                               datasheet_recommendation=as_json(*before)["recommendation"], **changes)
        print(strict_json({**out, **({"rehearsal": rehearsal} if rehearsal else {})}))
        return rehearsal
    print(f"measured links ({args.measured}): " + "; ".join(said))
    print_table(args, measured, *after)
    print("what the measured links changed:")
    for line in lines:
        print(line)
    if rehearsal:
        print_rehearsal(rehearsal)
    return rehearsal


def rehearse(choice, n, machine):
    """The recommended layout rehearsed: its script run, in a fresh interpreter, with the
    plan's flags and `--rehearse roles --world_size N` (infra.rehearsal: each distinct
    rank's real steps on the fake backend with fake tensors; every other rank's posting order
    from its role's, by the mesh's symmetry, and all N replayed under NCCL's rules). Returns
    {"rehearsed": True when it ran and every rehearsed rank equals its costs() (and the replay,
    where done, found no deadlock), "replayed": True when every rank's order was replayed,
    "status", "lines"}; with no layout (nothing fits), not done, its line saying so (status None)."""
    if choice is None:
        return {"rehearsed": False, "replayed": False, "status": None,
                "lines": ["plan: --rehearse: not done: nothing fits, so there is no layout to rehearse"]}
    import subprocess
    argv = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), choice["script"]),
            *choice["flags"], "--rehearse", "roles", "--world_size", str(n),
            "--ranks_per_node", str(min(n, machine["gpus_per_node"]))]
    if machine.get("gpu_mem_gb"):  # --micro_batch_size auto: the plan's choice
        argv += ["--gpu_mem_gb", str(machine["gpu_mem_gb"])]
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = done.stdout.splitlines() or [line for line in done.stderr.splitlines() if line.startswith("error:")][-1:]
    agreed = done.returncode == 0 and any(line.startswith("costs(): every rehearsed rank") for line in lines)
    replayed = any(line.startswith("replay under NCCL's rules: no deadlock") for line in lines)
    return {"rehearsed": agreed, "replayed": replayed, "status": done.returncode, "lines": lines}


def print_rehearsal(rehearsal):
    """The rehearsal's lines and the plan's verdict on them."""
    print("\n".join(rehearsal["lines"]))
    if rehearsal["status"] is None:  # not done: its line says why
        return
    print("plan: REHEARSED: the recommended layout's real steps equal its costs() on every distinct rank"
          + (", and every rank's posting order replays under NCCL's rules" if rehearsal["replayed"] else
             " (the posting orders not replayed: see above)")
          if rehearsal["rehearsed"] else
          f"plan: the rehearsal of the recommended layout did not agree (exit {rehearsal['status']}): see above")


def main(argv=None):
    args, machine = parse(argv)
    if args.measured:
        rehearsal = main_measured(args, machine)
    else:
        psi, scored, refused, choice, why = plan(args, machine)
        rehearsal = rehearse(choice, args.gpus, machine) if args.rehearse else None
        if args.json:
            print(strict_json({**as_json(psi, scored, refused, choice, why),
                               **({"rehearsal": rehearsal} if rehearsal else {})}))
        else:
            print_table(args, machine, psi, scored, refused, choice, why)
            if rehearsal:
                print_rehearsal(rehearsal)
    if rehearsal and not rehearsal["rehearsed"]:
        sys.exit(1)  # asked for, and it did not agree or could not be done


if __name__ == "__main__":
    main()
