"""The numbers docs/planning.md and docs/strategies.md quote from plan.py and from the scripts'
costs() are what they compute today. Each quoted figure is generated here, in process (the
scripts' --dry_run through plan.dry_run, plan.score for one layout, costs(): nothing is
launched), in the words the doc uses, and the test checks that the doc's section carries that
text. After a change to a formula or to plan.py's time model, print what the docs must say:

    python tests/test_doc_numbers.py

and paste the lines that changed (the published-runs table is printed whole).

Whole plans (how many layouts are valid and fit, which is recommended, which 3D is best)
come from plan.plan itself, each made once a session (tests/whole_plans.py) and shared with
tests/test_plan.py, which checks the same 175B plan; the worked layouts of those plans are
read from them. The step's peak of a published run's priced rank (and of the 175B plan's
choice) is checked term by term as 08's costs() hands the terms to infra.formulas.phase_peaks, in the
phase where it falls, and again without the boundary term.

What is not checked here, and why: the counts of the GPT-3 175B plan at the doc's batch of
1536 (164 valid, 13 fit) need ~23 s of CPU, more than the suite's budget: they run in the big
tier (`python -m pytest -q -m big tests`, CI's second step) and in `python tests/test_doc_numbers.py`; the CPU table of "Predicted
against measured" depends on a --bench file of that day's machine; the rehearsal timings are
measurements. Each says in the doc when and how it was made.

In docs/strategies.md's table every count and fraction of the "holds" and the "what each rank
sends per step" columns is checked, most in its script's own cell: derived from that
script's costs() by varying one quantity (layers, sequences, C, T, v, E, k, the dtype, the
replicas, prefetch) and reading the bytes of the term or the collective the cell names;
"forward" and "backward" from what --recompute adds (one more forward); and the bubbles and
the V schedules' chunks held; the process group a cell names, from the key costs() counts the
collective under (07's tied-embedding gradient on all_reduce[embedding], on the first and the
last stage and no other; 10's all-to-alls on all_to_all_single[ep], its experts' gradients on
all_reduce[expert_dp], present only with a second replica, its dense ones on the world's
all_reduce). What the table says that costs() cannot tell is not checked: which ranks a named
group holds (the name is the script's group_desc; plan.group_of maps it to ranks, and
tests/test_plan.py checks that mapping for 07 and 10), which pass and which end of the model
06's one extra all-gather outside the layers falls in (the head's, in backward: its costs()'
comment), 08's DP group spanning DP x CP, 10's (N-1)/N and max/mean (they depend on the
routing), zero bubble's p-r whole and r as W tensors (costs() gives their sum, p, and the W
tensors per block), the "/T" of 08's "stage/T" (the replicated parameters are not split), and
the words that explain a figure (05's "(node)", why 06 gathers again).
"""

import functools
import math
import os
import re
import sys
from fractions import Fraction

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import plan  # noqa: E402
import infra.fit  # noqa: E402
import infra.formulas  # noqa: E402
from whole_plans import whole_plan  # noqa: E402

# ----------------------------------------------------------------------------------------
# docs/planning.md, "Worked plans": each layout the text quotes, priced alone (plan.score),
# and the phrases in which the text quotes it
# ----------------------------------------------------------------------------------------

XL = "--model gpt2-xl --gpus 4 --machine polaris --global_batch_size 48"
F13 = "--model gpt3-13b --gpus 64 --machine frontier --global_batch_size 512"
P175 = "--model gpt3-175b --gpus 1024 --machine polaris --global_batch_size 1536"
L32 = "--model gpt3-6.7b --block_size 32768 --gpus 64 --machine polaris --global_batch_size 64"
L128 = "--model gpt3-6.7b --block_size 131072 --gpus 64 --machine polaris --global_batch_size 16 --recompute"
MB1 = " --micro_batch_size 1"

WORKED = [  # (plan flags, script, strategy flags, phrases: str.format over the candidate's numbers)
    (XL, "03_ddp.py", "--micro_batch_size 1", ["Ψ = {psi:.2f}B. A replica's model state is 16Ψ = {psi16:.1f} GB", "adds {act:.1f} GB of activations",
                                               "{total:.1f} GB, ~{step:.2f} s per step at {mfu:.0f}% MFU", "needs {need:.1f} GB with the allowance"]),
    (XL, "04_zero.py", "--stage 1 --micro_batch_size 4", ["{total:.1f} GB (need {need:.1f}), ~{step:.2f} s, {mfu:.0f}% MFU"]),
    (XL, "07_pipeline.py", "--schedule zbv" + MB1, ["at micro-batch 1 ({total:.1f} GB,\n~{step:.3f} s)"]),
    (XL, "03_ddp.py", "--micro_batch_size 12", ["the activations ({act:.0f} GB)"]),
    (XL, "04_zero.py", "--stage 3 --micro_batch_size 12", ["(ZeRO-3, the leanest: {total:.1f} GB)"]),
    (XL, "07_pipeline.py", "--schedule 1f1b --micro_batch_size 6", ["(1F1B: {total:.1f} GB)"]),
    (XL, "04_zero.py", "--stage 1" + MB1, ["ZeRO-1 ({total:.1f} GB at micro-batch 1)"]),
    (F13, "08_3d.py", "--tp 1 --pp 8" + MB1, ["Ψ = {psi:.1f}B, 16Ψ = {psi16:.0f} GB", "{total:.1f} GB per\nGCD of which {act:.1f} GB",
                                            "~{step:.1f} s, {mfu:.0f}% MFU", "the bubble of 7/71 = {bubble:.0f}% included"]),
    (F13, "08_3d.py", "--tp 1 --pp 4 --cp 4 --cp_impl ulysses --zero1" + MB1,
     ["{total:.1f} GB per GCD ({act:.1f} GB of activations), ~{step:.1f} s, {mfu:.0f}% MFU", "bubble is 3/131 = {bubble:.1f}%"]),
    (F13, "08_3d.py", "--tp 1 --pp 8 --cp 4 --cp_impl ulysses --zero1" + MB1,
     ["2 replicas, {total:.1f} GB per GCD\n({act:.1f} GB of activations), ~{step:.1f} s, {mfu:.0f}% MFU"]),
    (F13, "08_3d.py", "--tp 1 --pp 8 --cp 8 --cp_impl ulysses --zero1" + MB1,
     ["dp 1 x pp 8 x cp 8, the leanest ({total:.1f} GB per GCD, bubble 7/519 = {bubble:.1f}%), takes ~{step:.1f} s"]),
    (F13, "08_3d.py", "--tp 1 --pp 8 --zero1" + MB1, ["({total:.1f} GB with `--zero1`)"]),
    (F13, "08_3d.py", "--tp 2 --pp 4" + MB1, ["(dp 8 x pp 4 x tp 2: ~{step:.1f} s)"]),
    (F13, "05_fsdp.py", "--replicate 8" + MB1, ["({total:.1f} GB;", "a step: ~{step:.1f} s"]),
    (F13, "05_fsdp.py", "--replicate 8 --micro_batch_size 8", ["the activations alone are {act:.0f} GB"]),
    (P175, "08_3d.py", "--tp 4 --pp 16 --zero1" + MB1, ["Ψ = {psi:.1f}B, {tb:.1f} TB of model state", "holds {state:.0f} GB of model state plus {act:.1f} GB of activations"]),
    (P175, "08_3d.py", "--tp 4 --pp 64 --cp 2 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["{total:.1f} GB per GPU ({act:.1f} of activations; need {need:.1f}\nGB), ~{step:.1f} s per step, {mfu:.0f}% MFU",
      "{sent:.0f} GiB sent per GPU per step in all"]),
    (P175, "08_3d.py", "--tp 4 --pp 64 --zero1 --sequence_parallel" + MB1,
     ["{total:.1f} GB per GPU ({act:.1f} GB of it activations; need {need:.1f} GB), ~{step:.1f} s per step, {mfu:.0f}% MFU",
      "in all against {sent:.0f} GiB", "bubble of {bubble:.0f}% (the stages' mean idle share)"]),
    (P175, "08_3d.py", "--tp 4 --pp 32 --cp 2 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["{total:.1f} GB ({act:.1f} of activations, need {need:.1f}), ~{step:.1f} s, {mfu:.0f}% MFU, {sent:.0f} GiB sent per GPU per step (estimate)"]),
    (P175, "08_3d.py", "--tp 4 --pp 32 --cp 4 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["cp 4 at pp 32, {total:.1f} GB, ~{step:.1f} s"]),
    (P175 + " --recompute", "08_3d.py", "--tp 4 --pp 16 --zero1" + MB1,
     ["{total:.0f} GB per GPU ({act:.0f} GB of activations), ~{step:.1f} s per step, {mfu:.0f}% MFU, need {need:.1f} GB"]),
    ("--model gpt3-175b --gpus 1024 --machine polaris", "08_3d.py",
     "--tp 4 --pp 32 --cp 4 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["dp 2 x pp 32 x cp 4 (ring) x tp 4 + SP + ZeRO-1,\n{total:.1f} GB, ~{step:.2f} s"]),
    ("--model gpt3-175b --gpus 1024 --machine polaris", "08_3d.py",
     "--tp 4 --pp 64 --cp 4 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["dp 1 x pp 64 x cp 4 (ring) x tp 4 + SP + ZeRO-1, {total:.1f} GB,\n~{step:.2f} s, {mfu:.0f}% MFU"]),
    (L32 + " --recompute", "04_zero.py", "--stage 3" + MB1,
     ["{total:.1f} GB ({act:.1f} of activations, need {need:.1f}), ~{step:.1f} s, {mfu:.0f}% MFU"]),
    (L32 + " --recompute", "04_zero.py", "--stage 2" + MB1, ["({total:.1f} GB, ~{step:.1f} s), now needs {need:.1f} GB"]),
    (L32, "08_3d.py", "--tp 4 --pp 4 --cp 2 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["{total:.1f} GB per GPU ({act:.1f} of activations; need {need:.1f} GB), ~{step:.0f} s per step, {mfu:.0f}% MFU",
      "the 4D plan's ~{step:.0f} s", "{sent:.0f} GiB sent per GPU per step in all against"]),
    (L32, "08_3d.py", "--tp 4 --pp 1 --cp 4 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["{total:.1f} GB per GPU ({act:.1f} of activations; need {need:.1f} GB), ~{step:.0f} s per step, {mfu:.0f}% MFU",
      "{sent:.0f} GiB sent per GPU per step in all, and"]),
    (L32, "08_3d.py", "--tp 4 --pp 16 --sequence_parallel" + MB1,
     ["the leanest 3D, dp 1 x pp 16 x tp 4 + SP, needs {need:.1f} GB"]),
    (L32, "08_3d.py", "--tp 4 --pp 2 --cp 2 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["Ψ = {psi:.2f}B (wpe has 32k rows), 16Ψ = {psi16:.0f} GB",
      "{total:.1f} GB per GPU ({act:.1f} of activations; need {need:.1f} GB), ~{step:.0f} s per step, {mfu:.0f}% MFU"]),
    (L32, "08_3d.py", "--tp 4 --zero1 --sequence_parallel" + MB1,
     ["dp 16 x tp 4 + SP + ZeRO-1, {total:.1f} GB (need {need:.1f})", "({act:.0f} GB with SP)"]),
    (L32 + " --recompute", "08_3d.py", "--tp 4 --zero1 --sequence_parallel" + MB1,
     ["dp 16 x tp 4 + SP + ZeRO-1, {total:.1f} GB (need {need:.1f}), ~{step:.1f} s, {mfu:.0f}% MFU", "against {sent:.0f} GiB"]),
    (L128, "08_3d.py", "--tp 4 --zero1 --sequence_parallel" + MB1, ["{total:.1f} GB, need\n{need:.1f}"]),
    (L128, "08_3d.py", "--tp 4 --cp 4 --cp_impl ring --zero1 --sequence_parallel" + MB1,
     ["`--recompute`, {total:.1f} GB, ~{step:.1f} s per step, {mfu:.0f}% MFU"]),
]


def priced(plan_flags, script, strategy, data=None):
    """plan.py's candidate for one layout: the dict plan.score returns (taken from the whole
    plan where this session makes it anyway: the same score() of the same flags), and Ψ as
    plan.py counts it."""
    args, machine = plan.parse(plan_flags.split() + (["--data", data] if data else []))
    whole = [c for c in whole_plan(plan_flags)[1] if c["script"] == script
             and c["flags"] == args.model_flags + strategy.split()] if plan_flags in WHOLE_PLANS and not data else []
    if whole:
        c = dict(whole[0])
    else:
        c, reason = plan.score(script, strategy.split(), script, args, machine)
        assert c is not None, f"{script} {strategy} refused: {reason}"
    c["psi"] = plan.count_params_once(plan.dry_run("01_single_gpu.py", args.model_flags, 1, 1)[1])[0]
    return c


def numbers(c):
    """The figures the docs quote of a candidate: GB (1e9 bytes) per GPU, seconds, MFU in %."""
    h = c["per_gpu_bytes"]
    return dict(total=h["total"] / 1e9, act=(h["activations"] or 0) / 1e9, need=c["need_bytes"] / 1e9,
                state=(h["total"] - (h["activations"] or 0)) / 1e9, step=c["step_time_s"], mfu=100 * c["mfu"],
                sent=sum(c["comm_bytes_per_step"].values()) / 2**30, compute=c["compute_s"], comm=c["comm_s"],
                bubble=100 * c["bubble"], psi=c["psi"] / 1e9, psi16=16 * c["psi"] / 1e9,
                tb=16 * c["psi"] / 1e12)


def section(path, heading):
    """The text of `path` under the heading `heading` (to the next heading of its level or above)."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    end = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(text, start + len(heading))
    return text[start:end.start() if end else len(text)]


def worked_phrases():
    for plan_flags, script, strategy, phrases in WORKED:
        figures = numbers(priced(plan_flags, script, strategy))
        for phrase in phrases:
            yield f"{script} {strategy} ({plan_flags})", phrase.format(**figures)


@pytest.mark.big  # 40 s of plans: with the whole plans' phrases, in the big tier
def test_the_worked_plans_quote_what_plan_py_computes():
    flat = " ".join(section("docs/planning.md", "## Worked plans").split())  # wherever the lines break
    stale = [f"{layout}: {phrase!r}" for layout, phrase in worked_phrases() if " ".join(phrase.split()) not in flat]
    assert not stale, "docs/planning.md's worked plans no longer say what plan.py computes:\n" + "\n".join(stale)


# ----------------------------------------------------------------------------------------
# docs/planning.md, "Worked plans": what a whole plan says (how many layouts are valid and
# fit, which one it recommends, which 3D is best), from plan.plan itself (tests/whole_plans.py:
# made once a session; tests/test_plan.py reads the default-batch 175B plan too)
# ----------------------------------------------------------------------------------------

P175_DEFAULT = "--model gpt3-175b --gpus 1024 --machine polaris"
# the suite's budget pays for the three plans marked 0 below (~13 s of CPU on this machine, the
# 175B one shared with tests/test_plan.py); the others (the seconds each takes here) run in the
# big tier (`-m big`, tests/conftest.py), and in `python tests/test_doc_numbers.py`
FULL = __name__ == "__main__"


def words(label):
    """A 3D/4D candidate's label as the doc writes a layout: "4D dp 1 pp 64 cp 4 ring tp 4 +
    SP + ZeRO-1" -> "dp 1 x pp 64 x cp 4 (ring) x tp 4 + SP + ZeRO-1" (pp 1 left out)."""
    text = re.sub(r"\bpp 1 ", "", re.sub(r"^[34]D ", "", label))
    text = re.sub(r"cp (\d+) (ring|ulysses) ", r"cp \1 (\2) x ", text)
    return re.sub(r"((?:dp|pp) \d+) (?=pp|cp|tp)", r"\1 x ", text)


def plan_figures(flags):
    """The figures of a whole plan the doc quotes: counts, the recommendation, the fastest 3D
    that fits and the 3D that needs the least."""
    psi, scored, refused, choice, why = whole_plan(flags)
    fitting = [c for c in scored if c["fits"]]
    kinds = sorted({c["label"].split()[0] for c in fitting})
    three_d = [c for c in scored if c["label"].startswith("3D")]
    best3d = min((c for c in three_d if c["fits"]), key=lambda c: c["step_time_s"], default=None)
    nearest3d = min(three_d, key=lambda c: c["need_bytes"], default=None)
    gb = lambda c: c and c["per_gpu_bytes"]["total"] / 1e9  # noqa: E731
    fastest = min(fitting, key=lambda c: c["step_time_s"])
    return dict(valid=len(scored), fit=len(fitting), refused=len(refused), rec_kind=choice["label"].split()[0],
                fastest_micro=fastest["flags"][fastest["flags"].index("--micro_batch_size") + 1],
                fastest_total=gb(fastest), fastest_step=fastest["step_time_s"], fastest_label=fastest["label"],
                faster=100 * (1 - fastest["step_time_s"] / choice["step_time_s"]),
                which="all of them 4D" if kinds == ["4D"] else "of them " + ", ".join(kinds),
                only="only 4D layouts fit" if kinds == ["4D"] else ", ".join(kinds) + " fit",
                command=choice["command"], rec=words(choice["label"]), rec_label=choice["label"],
                rec_script=choice["script"], rec_micro=choice["flags"][choice["flags"].index("--micro_batch_size") + 1],
                rec_total=gb(choice), rec_step=choice["step_time_s"], rec_mfu=100 * choice["mfu"],
                best3d=best3d and words(best3d["label"]), best3d_total=gb(best3d), best3d_mfu=best3d and 100 * best3d["mfu"],
                nearest3d=nearest3d and words(nearest3d["label"]))


WHOLE = [  # (plan flags, phrases: str.format over plan_figures, compared with the lines joined, seconds if not in the suite)
    (P175_DEFAULT, ["With the scripts' default global batch (48) the best 3D is {best3d} ({best3d_total:.1f} GB) at "
                    "{best3d_mfu:.0f}% MFU",
                    "The plan recommends (2026-11-29) {rec}, {rec_total:.1f} GB, ~{rec_step:.2f} s, {rec_mfu:.0f}% MFU"], 0),
    (L32, ["Without `--recompute`, **{only}** ({fit} of {valid} valid,", "the leanest 3D, {nearest3d}, needs",
           "The plan recommends {command} {rec}:"], 0),
    (L32 + " --recompute", ["With `--recompute` (`... --recompute`, {valid} valid, {fit} fit) the plan (2026-11-26) "
                            "recommends {rec_label}, `{rec_script} ", " --micro_batch_size {rec_micro}`, {rec_total:.1f} GB",
                            "3D fits again too: {best3d}, {best3d_total:.1f} GB"], 0),
    (P175, ["--global_batch_size 1536`, {valid} valid layouts, {fit} fit, {which}) recommends {command} {rec}, ",
            "The 3D layout that needs the least, {nearest3d}, is that one"], 23),
    (XL, ["the peak) recommends {rec_label}, `{command}`",
          "The fastest estimate is the recommendation itself, {fastest_label} at micro-batch {fastest_micro} "
          "({fastest_total:.1f} GB, ~{fastest_step:.3f} s)"], 3),
    (F13, ["recommends {rec_kind}, `{command}`: the pipeline"], 8),
    (L128, ["CP is the answer either way: {rec} + `--recompute`, {rec_total:.1f} GB, ~{rec_step:.1f} s per step"], 4),
]
WHOLE_PLANS = {flags for flags, _, dear in WHOLE if FULL or not dear}  # priced() takes its candidates from these


def whole_phrases(flags, phrases):
    figures = plan_figures(flags)
    return [phrase.format(**figures) for phrase in phrases]


@pytest.mark.parametrize("flags, phrases", [
    pytest.param(flags, phrases, marks=[pytest.mark.big] if dear else [])
    for flags, phrases, dear in WHOLE])
def test_the_whole_plans_quote_their_counts_and_choices(flags, phrases):
    flat = " ".join(section("docs/planning.md", "## Worked plans").split())
    stale = [phrase for phrase in whole_phrases(flags, phrases) if " ".join(phrase.split()) not in flat]
    assert not stale, f"docs/planning.md's worked plans no longer say what `plan.py {flags}` prints:\n" + "\n".join(stale)


# ----------------------------------------------------------------------------------------
# docs/planning.md, "Checked against the papers": the ZeRO paper's Figure 1 from 03's and
# 04's costs(), Korthikanti et al.'s activations per layer from 01's
# ----------------------------------------------------------------------------------------

def papers_phrases():
    """The ZeRO paper's example (Ψ = 7.5B, N_d = 64) as tests/test_plan.py prices it, and the
    activations of one GPT-3 175B layer, in the words of the section."""
    model = ["--n_layer", "36", "--n_head", "35", "--n_embd", "4165", "--block_size", "1024",
             "--dtype", "bfloat16", "--global_batch_size", "64"]
    N, psi = 64, 7.5e9
    _, config, ddp = plan.dry_run("03_ddp.py", model, N, 4)
    scale = psi / plan.count_params_once(config)[0]
    costs = [ddp] + [plan.dry_run("04_zero.py", model + ["--stage", str(k)], N, 4)[2] for k in (1, 2, 3)]
    gb = [scale * sum(v for _, v in c["held"].values()) / 1e9 for c in costs]
    paper = [16 * psi / 1e9, (4 * psi + 12 * psi / N) / 1e9, (2 * psi + 14 * psi / N) / 1e9]  # K = 12
    yield "scaled to 7.5B: " + ", ".join(f"{x:.1f}" for x in gb) + " GB."
    yield f"+{gb[1] - paper[1]:.1f} GB\nat stage 1, +{gb[2] - paper[2]:.2f} GB at stage 2"
    yield f"add {scale * costs[3]['gathered'][1] / 1e9:.2f} GB at the peak"
    s, b, h, a = 2048, 1, 12288, 96
    per_model = [plan.dry_run("01_single_gpu.py", ["--model", "gpt3-175b", "--n_layer", str(n), "--dtype", "bfloat16",
                                                   "--global_batch_size", "1"], 1, 1)[2]["activations"][1]
                 for n in (1, 2)]
    yield f"sbh(34 + 5as/h) = {s * b * h * (34 + 5 * a * s / h) / 1e9:.2f} GB"
    yield f"36sbh + 16bs + 4bas = {(per_model[1] - per_model[0]) / 1e9:.2f} GB"


MACHINE_PHRASES = {  # how "How it works" words each of plan.MACHINES
    "polaris": "Polaris {gpus_per_node} x A100 {gpu_mem_gb:g} GB, {peak_tflops:g} TFLOP/s, NVLink\n  {intra_gbps:g} GB/s one "
               "way, 2 Slingshot-11 NICs per node ({inter_gbps:.3g} GB/s per GPU)",
    "aurora": "Aurora {gpus_per_node} tiles of\n  Max 1550, {gpu_mem_gb:g} GB and {peak_tflops:g} TFLOP/s (bf16) each, Xe Link "
              "({intra_gbps:g} GB/s assumed",
    "frontier": "Frontier {gpus_per_node} MI250X GCDs, {gpu_mem_gb:g} GB, {peak_tflops:g} TFLOP/s, Infinity Fabric "
                "{intra_gbps:g}\n  GB/s, 4 NICs ({inter_gbps:.3g} GB/s per GCD)",
    "perlmutter": "Perlmutter {gpus_per_node} x A100 {gpu_mem_gb:g} GB",
}


def intro_phrases(data):
    """The machines' figures (plan.MACHINES) and GPT-2 XL's Ψ with either vocabulary."""
    for name, phrase in MACHINE_PHRASES.items():
        yield phrase.format(**plan.MACHINES[name])
    yield f"({plan.MACHINES['aurora']['inter_gbps']:.3g} GB/s per tile)"
    m = plan.MACHINES["perlmutter"]
    yield (f"{m['peak_tflops']:g} TFLOP/s, NVLink {m['intra_gbps']:g} GB/s one way, 4 NICs ({m['inter_gbps']:.3g} GB/s "
           "per GPU)")
    psi = [plan.count_params_once(plan.dry_run("01_single_gpu.py", ["--model", "gpt2-xl"] + extra, 1, 1)[1])[0] / 1e9
           for extra in ([], ["--data", data])]
    yield f"(GPT-2 XL: {psi[0]:.2f}B here, {psi[1]:.2f}B with GPT-2's vocabulary)"


def test_how_it_works_quotes_the_machines_and_the_vocabularies(tmp_path):
    text = section("docs/planning.md", "# Planning: will it fit, and which strategy?")
    stale = [phrase for phrase in intro_phrases(str(tmp_path)) if phrase not in text]
    assert not stale, "docs/planning.md's machines or Ψ are stale:\n" + "\n".join(map(repr, stale))


def rehearsal_phrases():
    """The costs() of the two rehearsed layouts of "Rehearsing a layout", by rank, in GiB as the
    rehearsal prints them (the rehearsal's own measurement equals them: it says so per rank)."""
    def ranks(flags, n, per_node, mem=None):
        args, config, _ = plan.dry_run("08_3d.py", flags.split(), n, per_node, mem)
        for r in plan.ranks_to_price("08_3d.py", args, config, n):
            c = plan.rank_costs("08_3d.py", args, config, n, plan.planned_dtype(args), r)
            yield ({k: v / 2**30 for k, (_, v) in c["held"].items()}, c["activations"][1] / 2**30,
                   {k: v / 2**30 for k, (_, v) in c["sent"].items()})
    big = list(ranks("--model gpt3-175b --tp 8 --pp 16 --global_batch_size 64 --micro_batch_size 1 --recompute", 1024, 4))
    held, act, _ = big[-1]  # the last stage: no embedding
    tp = [sent["all_reduce[tp]"] for _, _, sent in big]
    yield (f"a stage holds {held['params']:.1f} GiB of parameters,\n{held['grads']:.1f} GiB of gradients and "
           f"{held['optim']:.1f} GiB of AdamW state; the last stage's activation peak is\n{act * 1024:.0f} MiB, "
           f"the first stage's {big[0][1]:.1f} GiB")
    yield f"it sends {min(tp):.1f}-{max(tp):.1f} GiB by\nall_reduce[tp] per step"
    (held, act, sent), (_, act1, _) = ranks("--model gpt3-6.7b --block_size 32768 --global_batch_size 64 --tp 4 --pp 2 "
                                            "--cp 2 --cp_impl ring --zero1 --sequence_parallel" + MB1, 64, 4, 40)
    yield (f"stage 0 holds {held['params']:.1f} GiB of parameters, {held['grads']:.1f} GiB of gradients, "
           f"{held['optim']:.1f} GiB of\nAdamW state and an activation peak of {act:.1f} GiB (stage 1: {act1:.1f} GiB), "
           f"and sends {sent['all_gather_into_tensor[tp]']:.0f} GiB by\nall-gather and "
           f"{sent['reduce_scatter_tensor[tp]']:.0f} GiB by reduce-scatter over tp and {sent['send']:.0f} GiB each way")


def test_the_rehearsed_layouts_quote_their_costs():
    text = section("docs/planning.md", "## Rehearsing a layout before it queues (`--rehearse`)")
    flat = " ".join(text.split())  # the phrases as read, wherever the lines break
    stale = [phrase for phrase in rehearsal_phrases() if " ".join(phrase.split()) not in flat]
    assert not stale, "docs/planning.md's rehearsed layouts are stale:\n" + "\n".join(map(repr, stale))


def test_the_papers_section_quotes_what_the_scripts_compute():
    text = section("docs/planning.md", "## Checked against the papers and against measurement")
    stale = [phrase for phrase in papers_phrases() if phrase not in text]
    assert not stale, "docs/planning.md's check against the papers is stale:\n" + "\n".join(map(repr, stale))


# ----------------------------------------------------------------------------------------
# docs/planning.md, "plan.py against published large runs": each run's model, machine and
# layout priced by plan.py beside what its paper reports
# ----------------------------------------------------------------------------------------

A100_SELENE = "--gpus_per_node 8 --gpu_mem_gb 80 --peak_tflops 312 --link_gbps 300 --inter_gbps 25"
H100_META = "--gpus_per_node 8 --gpu_mem_gb 80 --peak_tflops 989 --link_gbps 450 --inter_gbps 50"


def megatron_flops(B, s, l, h, V=51200):
    """Narayanan et al. 2021, eq. (3): FLOPs per iteration with full recomputation (a fourth
    pass over the layers), the count their teraFLOP/s per GPU are quoted in."""
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


# (run, source, plan flags, script, strategy flags, what the paper reports, how it is compared):
# "step" = (the paper's FLOPs per step, its rate per GPU): its step time, and plan.py's rate;
# "mfu" = the paper's model FLOPs utilisation against plan.py's MFU (both count no recompute)
PUBLISHED = [
    ("GPT 1T, 3,072 A100 80 GB", "Narayanan et al. 2021, Table 1 (last row) and abstract: 502 PFLOP/s, 163 TFLOP/s per GPU (52%)",
     "--n_layer 128 --n_embd 25600 --n_head 160 --block_size 2048 --global_batch_size 3072 --recompute --gpus 3072 " + A100_SELENE,
     "08_3d.py", "--tp 8 --pp 64" + MB1, ("step", (megatron_flops(3072, 2048, 128, 25600), 163e12))),
    ("GPT-3 175B, 1,024 A100 80 GB", "Narayanan et al. 2021, section 5.1: 140 TFLOP/s per GPU",
     "--model gpt3-175b --global_batch_size 1536 --recompute --gpus 1024 " + A100_SELENE,
     "08_3d.py", "--tp 8 --pp 16" + MB1, ("step", (megatron_flops(1536, 2048, 96, 12288), 140e12))),
    ("GPT 530B, 2,240 A100 80 GB, full recompute", "Korthikanti et al. 2022, abstract: MFU 42.1%",
     "--n_layer 105 --n_embd 20480 --n_head 128 --block_size 2048 --global_batch_size 1920 --recompute --gpus 2240 "
     + A100_SELENE, "08_3d.py", "--tp 8 --pp 35" + MB1, ("mfu", 42.1)),
    ("GPT 530B, 2,240 A100 80 GB, SP + selective recompute", "Korthikanti et al. 2022, abstract: MFU 54.2%",
     "--n_layer 105 --n_embd 20480 --n_head 128 --block_size 2048 --global_batch_size 1920 --gpus 2240 " + A100_SELENE,
     "08_3d.py", "--tp 8 --pp 35 --sequence_parallel" + MB1, ("mfu", 54.2)),
    ("Llama 3 405B (as a GPT of its size), 16,384 H100 80 GB", "Dubey et al. 2024, Table 4: 400 TFLOP/s per GPU (BF16 MFU 41%)",
     "--n_layer 126 --n_embd 16384 --n_head 128 --block_size 8192 --global_batch_size 2048 --gpus 16384 " + H100_META,
     "08_3d.py", "--tp 8 --pp 16 --sequence_parallel" + MB1, ("rate", 400e12)),
]


EFFICIENCY = plan.EFFICIENCY  # the published runs are priced at plan.py's default, 0.5


def published_rows(data):
    """The markdown rows of docs/planning.md's table of published runs, `data` a directory of
    GPT-2 tokens (no meta.pkl: the 50,304-token vocabulary, near the papers' 51,200)."""
    rows = []
    for run, source, plan_flags, script, strategy, (kind, value) in PUBLISHED:
        c = priced(plan_flags, script, strategy, data)
        f = numbers(c)
        n = int(plan_flags.split("--gpus ")[1].split()[0])
        peak = float(plan_flags.split("--peak_tflops ")[1].split()[0]) * 1e12
        model_flops = c["mfu"] * c["step_time_s"] * n * peak
        if kind == "step":  # the paper's FLOPs per step and rate: its step time; plan.py's rate
            flops, rate = value
            step = flops / (n * rate)
            paper = f"{step:.1f} s"
            off = f"{c['step_time_s'] / step - 1:+.0%} (step; {rate / 1e12 * step / c['step_time_s']:.0f} TFLOP/s per GPU)"
        elif kind == "rate":  # the paper's rate over plan.py's count of the model's FLOPs
            step = model_flops / (n * value)
            paper = f"{step:.2f} s"
            off = f"{c['step_time_s'] / step - 1:+.0%} (step; {value / 1e12 * step / c['step_time_s']:.0f} TFLOP/s per GPU)"
        else:  # the step time at the paper's MFU
            step = c["step_time_s"] * f["mfu"] / value
            paper, off = f"MFU {value:.1f}%", f"{f['mfu'] - value:+.1f} points (MFU)"
        # the --efficiency at which plan.py's step would be the paper's, its communication as priced
        busy = step - f["comm"]
        matching = f"{f['compute'] * EFFICIENCY / busy:.2f}" if busy > 0 else "none"
        layout = " ".join(strategy.split()[:-2]).replace("--", "").replace("sequence_parallel", "+ SP")
        rows.append(f"| {run} | {layout} | {paper} | {f['step']:.1f} s = {f['compute']:.1f} compute "
                    f"(bubble {f['bubble']:.0f}%) + {f['comm']:.1f} comm | {off} | {f['mfu']:.1f}% | {matching} | "
                    f"{f['total']:.1f} GB ({f['act']:.1f} activations), need {f['need']:.1f}: "
                    f"{'fits' if c['fits'] else 'does not fit'} |")
    return rows


def test_the_published_runs_table_is_what_plan_py_computes(tmp_path):
    text = section("docs/planning.md", "## plan.py against published large runs")
    stale = [row for row in published_rows(str(tmp_path)) if row not in text]
    assert not stale, ("docs/planning.md's table of published runs is not what plan.py computes today "
                       "(python tests/test_doc_numbers.py prints it):\n" + "\n".join(stale))


# ----------------------------------------------------------------------------------------
# docs/planning.md, "plan.py against published large runs", **Memory.**: the step's peak of a
# published run's priced rank, term by term, as 08's costs() builds it (infra.formulas.phase_peaks'
# named terms, recorded as costs() hands them over), and the same costs() without the
# pipeline's boundary term
# ----------------------------------------------------------------------------------------

# the terms of a phase's peak as infra.formulas.phase_peaks builds them: the model's transients
# (transient_terms) of that phase, and the names 08's costs() may hand it besides (a name of
# the model's replaces its term: SP's backward gradients replace the model's)
MODEL_TERMS = {"forward": ("casts", "logits"), "backward": ("casts", "gradients")}
STRATEGY_TERMS = {"forward": {"boundary", "scatter"}, "backward": {"boundary", "gradients"}}
WORDS = {"casts": "of autocast's bf16 weight copies", "logits": "of logits", "gradients": "of backward's working gradients",
         "scatter": "of SP's reduce-scatter buffers"}


def peak_terms(plan_flags, strategy, data, rank=None):
    """08's step peak on `rank` (the priced rank where None) of a published run, by term, in GB:
    the phase it falls in (forward or backward), state (params, grads, optim), activations, the
    phase's transients as costs() hands them to infra.formulas.phase_peaks (`working`: {name: GB}, the
    nonzero ones), the boundary term and its text (07's boundary_terms: out + dy in forward, dy in
    backward); the need with and without the boundary term; k (the micro-batches in flight on
    the stage, as costs() hands them to its activation_costs) and the stage."""
    args, machine = plan.parse(plan_flags.split() + (["--data", data] if data else []))
    n, G = args.gpus, machine["gpus_per_node"]
    r_args, config, _ = plan.dry_run("08_3d.py", args.model_flags + strategy.split(), n, G, machine.get("gpu_mem_gb"))
    if rank is None:
        rank = priced(plan_flags, "08_3d.py", strategy, data)["priced_rank"]
    three = plan.script("08_3d.py")
    original, activation_costs, seen, flights = infra.formulas.phase_peaks, three.activation_costs, [], []

    def recording(cost, t, forward=None, backward=None, optimizer=None):
        seen.append(dict(cost=cost, t=t, forward=dict(forward or {}), backward=dict(backward or {})))
        return original(cost, t, forward, backward, optimizer)

    def without_boundary(cost, t, forward=None, backward=None, optimizer=None):
        drop = lambda terms: {k: v for k, v in terms.items() if k != "boundary"} or None  # noqa: E731
        return original(cost, t, forward and drop(forward), backward and drop(backward), optimizer)

    def in_flight(*args, **kwargs):  # (args, config, dtype, x, in_flight, first, last; received=)
        flights.append(args[4])
        return activation_costs(*args, **kwargs)
    costs = {}
    for name, patch in (("with", recording), ("without", without_boundary)):
        infra.formulas.phase_peaks, three.activation_costs = patch, in_flight
        try:
            costs[name] = plan.rank_costs("08_3d.py", r_args, config, n, plan.planned_dtype(r_args), rank)
        finally:
            infra.formulas.phase_peaks, three.activation_costs = original, activation_costs
    (got,), (k,) = seen, set(flights)
    cost, t = got["cost"], got["t"]
    phase = max(("forward", "backward"), key=lambda p: cost["peak"][p][1])
    peak = cost["peak"][phase][1]
    assert peak == max(infra.fit.peak_numbers(cost).values())  # the step's peak: not the optimizer's, not start-up's
    unnamed = set(got[phase]) - STRATEGY_TERMS[phase]
    assert not unnamed and "gathered" not in cost, f"08's {phase} peak has terms this test does not name: {unnamed}"
    named = {**{name: t[name] for name in MODEL_TERMS[phase]}, **got[phase]}
    boundary = named.pop("boundary", ("none", 0))
    held = {k: v / 1e9 for k, (_, v) in cost["held"].items()}
    working = {name: v / 1e9 for name, (_, v) in named.items() if v}
    terms = dict(state=sum(held.values()), activations=cost["activations"][1] / 1e9, boundary=boundary[1] / 1e9)
    assert abs((sum(terms.values()) + sum(working.values())) * 1e9 - peak) < 1, (terms, working, peak)  # the whole peak
    device = plan.planned_device_type(r_args)
    pp = rank // (r_args.cp * r_args.tp)
    return dict(terms, **held, working=working, phase=phase, peak=peak / 1e9, text=boundary[0], k=k, stage=pp,
                P=r_args.pp, layers=three.stage_layers(config.n_layer, r_args.pp)[pp][1],
                need=infra.fit.fit_need(costs["with"], device) / 1e9, room=plan.planned_room(r_args) / 1e9,
                peak_nb=max(infra.fit.peak_numbers(costs["without"]).values()) / 1e9,
                need_nb=infra.fit.fit_need(costs["without"], device) / 1e9)


def breakdown(p):
    """A peak_terms' peak in the doc's words: "59.6 GB = 32.9 of model state + ... + 0.02 at the boundary (dy)"."""
    return (f"{p['peak']:.1f} GB = {p['state']:.1f} of model state + {p['activations']:.1f} of activations + "
            + "".join(f"{v:.2f} {WORDS[name]} + " for name, v in p["working"].items())
            + f"{p['boundary']:.2f} at the boundary ({p['text']})")


def memory_phrases(data):
    """The **Memory.** paragraph's figures: 530B with full recompute and with SP, the 1T, Llama 3."""
    runs = {run: (flags, strategy) for run, _, flags, _, strategy, _ in PUBLISHED}
    full = peak_terms(*runs["GPT 530B, 2,240 A100 80 GB, full recompute"], data)
    yield (f"on the priced rank (stage {full['stage']} of {full['P']}, k = {full['k']}), the step's peak is in "
           f"{full['phase']}: {breakdown(full)}, the model state being {full['params']:.2f} parameters, "
           f"{full['grads']:.2f} gradients and {full['optim']:.1f} AdamW. The allowance makes it the need of "
           f"{full['need']:.1f} GB, " + ("within" if full["need"] <= full["room"] else "over")
           + f" the {full['room']:.0f} GB room")
    yield f"Without the boundary term it would be {full['peak_nb']:.1f} GB, need {full['need_nb']:.1f}"
    one_t = peak_terms(*runs["GPT 1T, 3,072 A100 80 GB"], data)
    yield (f"The 1T's priced rank (stage {one_t['stage']} of {one_t['P']}, k = {one_t['k']}) peaks in {one_t['phase']} "
           f"at {breakdown(one_t)}: need {one_t['need']:.1f}")
    sp_flags, sp_strategy = runs["GPT 530B, 2,240 A100 80 GB, SP + selective recompute"]
    sp = peak_terms(sp_flags, sp_strategy, data)
    yield (f"on the 530B SP row's priced rank, stage {sp['stage']} (k = {sp['k']}), the peak is in {sp['phase']}: "
           f"{breakdown(sp)}")
    second = peak_terms(sp_flags, sp_strategy, data, rank=1 * 8)  # stage 1's first rank (tp 8, cp 1)
    yield f"makes it the need of {sp['need']:.1f} GB (stage 1's need is {second['need']:.1f} GB)"
    llama = peak_terms(*runs["Llama 3 405B (as a GPT of its size), 16,384 H100 80 GB"], data)
    yield (f"priced rank (stage {llama['stage']}, k = {llama['k']}, {llama['layers']} of the 126 layers) the boundary "
           f"term is {llama['boundary']:.2f} GB, and its {llama['activations']:.1f} GB of activations ({llama['k']} "
           "micro-batches")


def derived_phrases():
    """What "Worked plans" derives from the scripts besides a layout's totals: ZeRO-1's wire
    bytes against DDP's in bf16 (03's and 04's costs()), and the 175B plan's recommended
    layout's peak on its priced rank (08's costs(), the boundary term among its terms)."""
    from fractions import Fraction
    yield f"move {Fraction(round(wire_ratio(1, 'bfloat16'), 3)).limit_denominator(8)} of the wire bytes of 03's all-reduce"
    p = peak_terms(P175, "--tp 4 --pp 64 --zero1 --sequence_parallel" + MB1, None)
    yield (f"On the 64-stage layout's priced rank, stage {p['stage']} of {p['P']} ({p['layers']} layers), {p['k']} micro-batches are in "
           f"flight under 1F1B, and the step's peak is in {p['phase']}: {breakdown(p)}")


def test_the_worked_plans_quote_the_scripts_ratios_and_boundaries():
    flat = " ".join(section("docs/planning.md", "## Worked plans").split())
    stale = [phrase for phrase in derived_phrases() if " ".join(phrase.split()) not in flat]
    assert not stale, "docs/planning.md's worked plans are stale:\n" + "\n".join(stale)


def test_the_memory_paragraph_quotes_the_priced_ranks_peak_term_by_term(tmp_path):
    flat = " ".join(section("docs/planning.md", "## plan.py against published large runs").split())
    stale = [phrase for phrase in memory_phrases(str(tmp_path)) if " ".join(phrase.split()) not in flat]
    assert not stale, "docs/planning.md's breakdown of the published runs' peaks is stale:\n" + "\n".join(stale)


# ----------------------------------------------------------------------------------------
# docs/strategies.md: ZeRO's wire traffic against DDP's, from 03's and 04's costs()
# ----------------------------------------------------------------------------------------

def wire_ratio(stage, dtype, N=4):
    """04 --stage `stage`'s bytes on the wire per step (ring bus factors, 02's) over 03's."""
    bus = plan.script("02_collectives.py").bus_factor
    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    flags = ["--model", "gpt2", "--dtype", dtype, "--global_batch_size", "4", "--micro_batch_size", "1"]

    def wire(script, extra):
        cost = plan.dry_run(script, flags + extra, N, N)[2]
        return sum(bus(kinds.get(op.split("[")[0], op.split("[")[0]), N) * b for op, (_, b) in cost["sent"].items())
    return wire("04_zero.py", ["--stage", str(stage)]) / wire("03_ddp.py", [])


def times(ratio):
    """A ratio as the doc writes it: two decimals at most, one at least (0.75x, 1.0x, 1.5x)."""
    text = f"{ratio:.2f}".rstrip("0")
    return (text + "0" if text.endswith(".") else text) + "x"


def strategies_phrases():
    yield ("in fp32, 1-2: reduce-scatter + all-gather = DDP's wire traffic"
           if round(wire_ratio(2, "float32"), 2) == 1 else f"in fp32, 1-2: {times(wire_ratio(2, 'float32'))}")
    yield f"3: {times(wire_ratio(3, 'float32'))} (parameters gathered in forward and backward)"
    yield (f"{times(wire_ratio(1, 'bfloat16'))} (1-2) and {times(wire_ratio(3, 'bfloat16'))} (3) of DDP's fp32 "
           "all-reduce")


def test_strategies_zero_row_quotes_the_scripts_ratios():
    assert round(wire_ratio(1, "bfloat16"), 3) == round(wire_ratio(2, "bfloat16"), 3)
    text = section("docs/strategies.md", "# The strategies: what each rank holds and sends")
    stale = [phrase for phrase in strategies_phrases() if phrase not in text]
    assert not stale, "docs/strategies.md's ZeRO row no longer says what 03's and 04's costs() give:\n" + "\n".join(stale)


# ----------------------------------------------------------------------------------------
# docs/strategies.md: the rest of what it quotes from the scripts (its formulas in letters
# are the scripts' costs() docstrings, which the ledger tests hold to the bytes moved)
# ----------------------------------------------------------------------------------------

def defaults(name):
    """The parser `name`'s main() builds (common.make_parser + its add_flags), as argparse
    defaults and choices by destination."""
    import common
    module = plan.script(name)
    parser = module.add_flags(common.make_parser(module.__doc__, experts=name.startswith(("01", "10"))))
    return ({a.dest: a.default for a in parser._actions},
            {a.dest: "/".join(map(str, a.choices)) for a in parser._actions if a.choices})


def strategies_figures():
    """The other figures docs/strategies.md quotes from the scripts: the flags' defaults, the
    default CP and EP degrees 09 and 10 choose at 8 and 12 ranks, Muon's constants (common.py)
    and the pipeline bubbles of 07's schedules (07's bubble_formula, what its dry run prints)."""
    import common
    d = {name: defaults(name) for name in ("01_single_gpu.py", "03_ddp.py", "04_zero.py", "05_fsdp.py",
                                           "07_pipeline.py", "08_3d.py", "09_context_parallel.py", "10_expert_parallel.py")}
    yield f"`--sample_tokens N` ({d['01_single_gpu.py'][0]['sample_tokens']}; 0 = none)"
    yield f"`--bucket_mb` ({d['03_ddp.py'][0]['bucket_mb']:g})"
    yield f"`--stage 1/2/3` ({d['04_zero.py'][0]['stage']})"
    yield f"(05's default `--reduce_dtype {d['05_fsdp.py'][0]['reduce_dtype']}`)"
    yield f"`--reduce_dtype {d['05_fsdp.py'][1]['reduce_dtype']}`"
    pipe, choices = d["07_pipeline.py"]
    yield f"`--schedule {choices['schedule']}` ({pipe['schedule']};"
    yield f"`--virtual_stages v` ({pipe['virtual_stages']}, interleaved only)"
    three = d["08_3d.py"][0]
    yield f"`--tp T` ({three['tp']}), `--pp P` ({three['pp']}), `--cp C` ({three['cp']}; data parallel = world / (T·P·C))"
    yield f"`--cp_impl {d['08_3d.py'][1]['cp_impl']}` (ring: block_size divisible by 2C"
    yield f"`--cp_impl {d['09_context_parallel.py'][1]['cp_impl']}` ({d['09_context_parallel.py'][0]['cp_impl']}) |"

    def degree(name, n):  # the degree the script's check_layout takes without the flag
        args, config, _ = plan.dry_run(name, [], n, n)
        return plan.script(name).check_layout(args, config, n), args, config
    cp = {n: degree("09_context_parallel.py", n)[0] for n in (8, 12)}  # (C, D)
    yield f"8 ranks of the default, cp {cp[8][0]}; 12, cp {cp[12][0]} x dp {cp[12][1]}"
    (ep8, args, config), ep12 = degree("10_expert_parallel.py", 8), degree("10_expert_parallel.py", 12)[0]
    yield (f"{config.n_expert} experts of the default `{args.model}` at 8 ranks, ep {ep8}; at 12, ep {ep12} "
           f"x dp {12 // ep12}")
    yield f"--aux_loss_coef` ({config.aux_loss_coef:g})"  # (the flag's default is the model's config's)
    a, b, c = common.NS_COEFFICIENTS
    yield f"momentum (μ = {common.MUON_MOMENTUM:g})"
    yield f"{common.NS_STEPS} x X <- a·X + (b·A + c·A·A)·X, A = X·Xᵀ Newton-Schulz, (a, b, c) = ({a:.4f}, {b:.4f}, {c:.4f})"
    pipeline = plan.script("07_pipeline.py")
    yield f"a third of 1F1B's bubble {pipeline.bubble_formula('zb', 1)} for more memory"
    yield f"Bubble {pipeline.bubble_formula('zbv', 1)} for m >= (3p-1)/2"
    # the V schedules' micro-batch chunks held at once, every rank of p = 4 at m = 4p, in units of p
    held = {}
    for kind in ("zbv", "dualpipev"):
        args, config, _ = plan.dry_run("07_pipeline.py", ["--model", "tiny", "--n_layer", "8", "--schedule", kind,
                                                          "--global_batch_size", "16", "--micro_batch_size", "1"], 4, 4)
        counts = {pipeline.costs(args, config, 4, torch.float32, rank=r)["in_flight"] for r in range(4)}
        assert len(counts) == 1, (kind, counts)  # the same on every rank
        extra = counts.pop() - 2 * 4
        held[kind] = "2p" + (f"+{extra}" if extra > 0 else f"{extra}" if extra else "")
    yield f"{held['zbv']} chunk-sized micro-batches held on every rank (1F1B's stage-0 peak)"
    yield f"and the log and dry run state both; {held['dualpipev']} chunk-sized micro-batches held"
    def per_layer(script, op, extra, cp=1):  # collectives of one b·(s/C)·h fp32 tensor per layer per micro-batch
        def sent(n_layer):  # 2 ranks, all in the group (no data parallelism): 8 micro-batches a rank
            args, config, cost = plan.dry_run(script, ["--model", "tiny", "--n_layer", str(n_layer), "--dtype", "float32",
                                                       "--global_batch_size", "8", "--micro_batch_size", "1", *extra], 2, 2)
            return cost["sent"][op][1], 8 * 4 * config.block_size // cp * config.n_embd
        (two, unit), (three, _) = sent(2), sent(3)
        return (three - two) // unit
    yield f"| {per_layer('06_tensor_parallel.py', 'all_reduce', [])} all-reduces of b·s·h per layer per micro-batch"
    yield (f"Ulysses: {per_layer('09_context_parallel.py', 'all_to_all_single[cp]', ['--cp_impl', 'ulysses'], cp=2)} "
           "all-to-alls of b·(s/C)·h per layer")
    sweep = plan.script("02_collectives.py").SWEEP_BYTES
    yield f"(to {sweep['cpu'] >> 20} MiB on CPU, {sweep['accelerator'] >> 30} GiB on GPUs)"
    # zero bubble's W tensors per block, in units of one b·s·h tensor (e·bsh = 1)
    from infra.formulas import activation_terms
    tiny = common.GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=16)
    per_block = pipeline.zero_bubble_phases(activation_terms(tiny, 1, 4, torch.float32, "cpu"), 1, False, False,
                                            False, 1, 0)[2]
    yield f"(each Linear's input and output gradient, {per_block}e·bsh per block, about what a block saves)"
    yield f"bubble {pipeline.bubble_formula('dualpipev', 1)};"


def collapse(*texts):
    """costs()' held formulas summed as the table writes a total: "4Ψ", "4Ψ/N", "8Ψ/N" -> "4Ψ+12Ψ/N"."""
    whole = shard = 0
    for term in " + ".join(texts).split(" + "):
        if term == "0":
            continue
        coefficient, per_rank = re.fullmatch(r"(\d*)Ψ(/N)?", term).groups()
        whole, shard = (whole, shard + int(coefficient or 1)) if per_rank else (whole + int(coefficient or 1), shard)
    return "+".join([f"{whole}Ψ"] * bool(whole) + [f"{shard}Ψ/N"] * bool(shard))


def held_rows():
    """The table's "holds" of 01, 03, 04 (each stage, fp32 and bf16), 05, 06, 09 and 10 and 03's
    all-reduce, in the words of the table, from the formulas their costs() print."""
    def texts(script, dtype, n, extra=()):
        cost = plan.dry_run(script, ["--model", "gpt2", "--dtype", dtype, "--global_batch_size", "4",
                                     "--micro_batch_size", "1", *extra], n, n)[2]
        return {k: t for k, (t, _) in cost["held"].items()}, {k: t for k, (t, _) in cost["sent"].items()}
    yield f"everything: {collapse(*texts('01_single_gpu.py', 'float32', 1)[0].values())} bytes of model state"
    held, sent = texts("03_ddp.py", "float32", 4)
    yield f"a full replica: {collapse(*held.values())}"
    yield f"one all-reduce of all gradients, {sent['all_reduce'].split(' + ')[0]} bytes"
    zero = {(dtype, k): texts("04_zero.py", dtype, 4, ["--stage", str(k)])[0]
            for dtype in ("float32", "bfloat16") for k in (1, 2, 3)}
    one = zero["float32", 1]
    grads = one["grads"].split(" + ")
    yield (f"fp32: {one['params']}+{grads[0]}+{one['optim']} (1, plus the {grads[1]} reduced gradient shard), "
           f"{collapse(*zero['float32', 2].values())} (2), {collapse(*zero['float32', 3].values())} (3)")
    fsdp = [t.replace("/S", "/N") for t in texts("05_fsdp.py", "float32", 4)[0].values()]  # S: its shard group
    yield f"| {collapse(*fsdp).replace('/N', '/S')} + the gathered root"
    def bracketed(script, extra=()):  # 06's and 10's terms are one bracket each, 4(...) + 4(...) + 8(...): summed
        brackets = [re.fullmatch(r"(\d+)\((.*)\)", t).groups() for t in texts(script, "float32", 4, extra)[0].values()]
        assert len({inner for _, inner in brackets}) == 1, brackets
        return f"{sum(int(c) for c, _ in brackets)} x ({brackets[0][1]})"
    yield f"| {bracketed('06_tensor_parallel.py').replace('Ψ_s', 'Ψ_sharded').replace('Ψ_r', 'Ψ_replicated')} |"
    yield f"| {bracketed('10_expert_parallel.py', ['--n_expert', '4'])}, Ψ_e one expert"
    yield f"a full replica, {collapse(*texts('09_context_parallel.py', 'float32', 4)[0].values())}; activations of s/C"
    b = {k: zero["bfloat16", k] for k in (1, 2, 3)}
    assert b[1]["params"] == b[2]["params"] and b[2]["grads"] == b[3]["grads"] and \
        b[1]["optim"] == b[2]["optim"] == b[3]["optim"], b  # as the row groups them
    yield (f"bf16: {b[1]['params']} working parameters at stages 1-2 (stage 3 holds "
           f"{'none' if b[3]['params'] == '0' else b[3]['params']}: it gathers each unit as it runs), gradients summed "
           f"and reduced in fp32 as 03 and 05 do (stage 1: {b[1]['grads']}; 2-3: {b[2]['grads']}), {b[1]['optim']} of "
           "fp32 masters and moments")


def test_strategies_quotes_the_scripts_defaults_constants_and_bubbles():
    flat = " ".join(open(os.path.join(ROOT, "docs/strategies.md"), encoding="utf-8").read().split())
    stale = [phrase for phrase in [*strategies_figures(), *held_rows()] if " ".join(phrase.split()) not in flat]
    assert not stale, "docs/strategies.md no longer quotes what the scripts say:\n" + "\n".join(stale)



# ----------------------------------------------------------------------------------------
# docs/strategies.md's table, "what each rank sends per step": every count and fraction the
# column quotes, derived from the script's own costs() (its --dry_run, in process) by varying
# one quantity at a time (layers, sequences, C, T, v, E, k, the dtype, --recompute, the
# replicas) and reading the bytes of the collective the cell names; no formula of a script
# is written here. The same for the "holds" cells held_rows leaves (05's, 07's, 08's, 09's)
# ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def step_sent(script, n, flags=(), layers=2, sequences=8, dtype="float32", rank=None):
    """{collective: bytes per step} of `script`'s costs() for `n` ranks on one node, the tiny
    model with `layers` layers, a batch of `sequences` sequences in micro-batches of one, on
    `rank` where a script prices its ranks apart (07, 08); and the model's config."""
    got = plan.dry_run(script, ["--model", "tiny", "--n_layer", str(layers), "--dtype", dtype, "--global_batch_size",
                                str(sequences), "--micro_batch_size", "1", *flags], n, n)
    assert not isinstance(got, str), f"{script} {flags} at {n} ranks refused: {got}"
    args, config, cost = got
    if rank is not None:
        cost = plan.script(script).costs(args, config, n, getattr(torch, dtype), rank=rank)
    return {op: b for op, (_, b) in cost["sent"].items()}, config


def split_bytes(script, n, op, flags=(), replicas=1, **kw):
    """`op`'s bytes per step taken apart as m·(L·layer + ends) + step, from 2 and 3 layers at 8
    and 16 sequences (m: the micro-batches of one per rank, the sequences over the `replicas`
    the batch is split over): (per layer per micro-batch, the rest per micro-batch, per step)."""
    B = {(L, q): step_sent(script, n, tuple(flags), L, q, **kw)[0].get(op, 0) for L in (2, 3) for q in (8, 16)}
    m = 8 // replicas  # micro-batches at 8 sequences, and those 8 more add
    layer, r1 = divmod(B[3, 16] - B[2, 16] - B[3, 8] + B[2, 8], m)
    ends, r2 = divmod(B[2, 16] - B[2, 8] - m * 2 * layer, m)
    assert not r1 and not r2 and B[3, 8] - B[2, 8] == m * layer, (script, op, B)  # linear in both
    return layer, ends, B[2, 8] - m * (2 * layer + ends)


def linear(values, var, paren=False):
    """Whole numbers at two values of `var`, as the doc writes the line through them: {2: 4, 4: 12}
    -> "4(C-1)", {2: 16, 4: 32} -> "8C", {2: 3, 4: 7} -> "2v-1", {2: 1, 4: 3} -> "(C-1)" with paren."""
    (x0, y0), (x1, y1) = sorted(values.items())
    a = Fraction(y1 - y0, x1 - x0)
    c = y0 - a * x0
    if a <= 0 or a.denominator != 1 or c.denominator != 1:
        return f"{values} in {var}"  # not a line the doc could write: a phrase it does not hold
    a, c = int(a), int(c)
    if not c:
        return f"{a if a != 1 else ''}{var}"
    g = math.gcd(a, c)
    inner = f"{a // g if a != g else ''}{var}{c // g:+d}"
    return f"{g}({inner})" if g > 1 else f"({inner})" if paren else inner


def one_over(ratios, var):
    """{value of var: ratio} as the doc writes it: "1/T" where every ratio is 1/value."""
    return f"1/{var}" if all(r * x == 1 for x, r in ratios.items()) else f"{ratios} of {var}"


def tensors(nbytes, unit, small=0):
    """`nbytes` in tensors of `unit` bytes; the remainder must be a multiple of `small` bytes
    below one unit (06's loss statistics of b·s beside its b·s·h tensors)."""
    count, rest = divmod(nbytes, unit)
    assert rest == 0 or (small and rest % small == 0), (nbytes, unit, small)
    return count


def ddp_sends():
    """03: its ring all-reduce's wire factor (02's bus factor at 2 and 4 ranks), and whether the
    gradients' all-reduce moves more with more accumulation micro-steps (1 or 4 at 2 ranks)."""
    bus = plan.script("02_collectives.py").bus_factor
    ring = linear({n: Fraction(bus("all_reduce", n)).limit_denominator(n) * n for n in (2, 4)}, "N", paren=True)
    once = step_sent("03_ddp.py", 2, sequences=2)[0]["all_reduce"] == step_sent("03_ddp.py", 2, sequences=8)[0]["all_reduce"]
    accumulation = "none on accumulation micro-steps" if once else "one on every accumulation micro-step"
    return f"(ring: {ring}/N · 4Ψ on the wire), {accumulation}"


def fsdp_sends():
    """05 against 04 --stage 3 at 4 ranks: the same all-gathers and reduce-scatters per layer per
    micro-batch, per micro-batch and per step (on the synthetic data's 256-token vocabulary, which
    no padding changes: 05 pads each parameter's rows to a multiple of S, 04 its flat units), and
    the same bytes without prefetch (it moves when, not what); HSDP at S = 2 and 4 (2 replicas):
    which groups gather, and the replicas' all-reduce over the shard group's reduce-scatter."""
    same, synthetic = True, ("--data", "synthetic")
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        same &= split_bytes("05_fsdp.py", 4, op + "[shard]", synthetic, replicas=4) == \
            split_bytes("04_zero.py", 4, op, ("--stage", "3") + synthetic, replicas=4)
    same &= step_sent("05_fsdp.py", 4)[0] == step_sent("05_fsdp.py", 4, ("--no_prefetch",))[0]
    ratio, groups = {}, set()
    for S in (2, 4):
        sent = step_sent("05_fsdp.py", 2 * S, ("--replicate", "2"))[0]
        ratio[S] = Fraction(sent["all_reduce[replicate]"], sent["reduce_scatter_tensor[shard]"])
        groups |= {op[op.find("["):] for op in sent if "gather" in op}
    where = "gathers stay in a shard group" if groups == {"[shard]"} else f"gathers over {sorted(groups)}"
    return (("ZeRO-3's, overlapped by prefetch" if same else "not ZeRO-3's")
            + f"; HSDP: {where} (node), {one_over(ratio, 'S')} of the gradients crosses")


def tp_sends():
    """06 at 2 ranks, fp32 (every tensor 4 bytes an element): b·s·h tensors per layer and per
    micro-batch outside the layers (the embedding's, the head's), all-reduced without SP,
    all-gathered and reduce-scattered with; --recompute repeats the forward's, so what it adds
    is the forward's share."""
    config = step_sent("06_tensor_parallel.py", 2)[1]
    bsh, bs = 4 * config.block_size * config.n_embd, 4 * config.block_size  # b = 1

    def count(op, *flags):
        layer, ends, _ = split_bytes("06_tensor_parallel.py", 2, op, flags)
        return tensors(layer, bsh), tensors(ends, bsh, bs)  # all-reduce: the loss's b·s statistics beside
    ar = count("all_reduce", "--grad_clip", "0")
    ag, rs = (count(op, "--sequence_parallel") for op in ("all_gather_into_tensor", "reduce_scatter_tensor"))
    ag_forward = count("all_gather_into_tensor", "--sequence_parallel", "--recompute")[0] - ag[0]
    rs_forward = count("reduce_scatter_tensor", "--sequence_parallel", "--recompute")[0] - rs[0]
    same = "all-gather + reduce-scatter of the same size" if rs == ar else f"{rs} reduce-scatters"
    extra = ag[0] - ar[0]
    # SP's extra all-gathers are backward's if the forward gathers as often as it scatters
    when = "in backward" if ag_forward == rs_forward and extra == (ag[0] - ag_forward) - (rs[0] - rs_forward) \
        else "in forward"
    return (f"{ar[0]} all-reduces of b·s·h per layer per micro-batch (SP: {same}, + {extra} all-gathers per layer "
            f"and {ag[1] - ar[1]} for the head {when}")


def pipeline_sends(p=4):
    """07 at p = 4 stages: each rank's b·s·h sends and receives per micro-batch (8 to 16 micro-
    batches), under 1F1B and interleaved at v = 2 and 4 (8 and 16 layers); which ranks
    all-reduce the tied wte's gradient (fp32 V·h) on the embedding group (all_reduce[embedding]:
    the first and the last stage, and no other), the norm apart on the world."""
    def per_micro_batch(op, flags, layers):
        config = step_sent("07_pipeline.py", p, flags, layers, rank=0)[1]
        bsh = 4 * config.block_size * config.n_embd
        return [tensors(step_sent("07_pipeline.py", p, flags, layers, 16, rank=r)[0].get(op, 0)
                        - step_sent("07_pipeline.py", p, flags, layers, 8, rank=r)[0].get(op, 0), 8 * bsh)
                for r in range(p)]
    plain = per_micro_batch("send", (), 8)
    each_way = plain == per_micro_batch("recv", (), 8) and sum(plain) == 2 * (p - 1)  # p-1 boundaries
    middle, ends = {}, {}
    for v in (2, 4):
        sends = per_micro_batch("send", ("--schedule", "interleaved", "--virtual_stages", str(v)), 4 * v)
        middle[v] = {Fraction(sends[r], plain[r]) for r in range(1, p - 1)}.pop()
        ends[v] = {Fraction(sends[r], plain[r]) for r in (0, p - 1)}.pop()
    config = step_sent("07_pipeline.py", p, (), 8, rank=0)[1]
    reduced = [step_sent("07_pipeline.py", p, (), 8, rank=r)[0].get("all_reduce[embedding]", 0) for r in range(p)]
    wte = [r for r in range(p) if reduced[r] == 4 * config.vocab_size * config.n_embd]
    tied = "tied-embedding gradient between first and last stage" if wte == [0, p - 1] and \
        all(reduced[r] == 0 for r in range(p) if r not in wte) else f"tied-embedding gradient on {wte}: {reduced}"
    return (("b·s·h per micro-batch per stage boundary each way" if each_way else f"{plain} b·s·h per micro-batch")
            + f" (interleaved: a middle stage sends {linear(middle, 'v')} times as much, the first and the last "
            f"{linear(ends, 'v')} times); {tied}")


def ring_counts(script, tp=1, op="send"):
    """Per layer per micro-batch, at C = 2 and 4 (on `tp` TP ranks, no data parallelism): the
    K/V tensors the ring sends in the compute dtype and the bytes that stay fp32 whatever it is
    (fp32 against bf16), both in A = b·(s/C)·(h/T) elements; and the K/V tensors --recompute
    adds (the forward's again). {C: (K/V tensors, fixed bytes / A, forward's K/V tensors)}."""
    counts = {}
    for C in (2, 4):
        flags = ("--cp", str(C)) + (("--tp", str(tp)) if tp > 1 else ())
        config = step_sent(script, tp * C, flags)[1]
        A = config.block_size // C * config.n_embd // tp
        layer = {dtype: split_bytes(script, tp * C, op, flags, dtype=dtype)[0] for dtype in ("float32", "bfloat16")}
        kv = tensors(layer["float32"] - layer["bfloat16"], 2 * A)
        again = tensors(split_bytes(script, tp * C, op, flags + ("--recompute",))[0] - layer["float32"], 4 * A)
        counts[C] = (kv, Fraction(layer["bfloat16"] - 2 * kv * A, A), again)
    return counts


def cp_sends():
    """09: the ring's K/V hops (2 tensors) forward and in backward (the forward's: what
    --recompute adds), dK/dV's fp32 hops (2 tensors); Ulysses' all-to-alls forward and in all;
    its gradients' all-reduce against 03's at 4 ranks (cp 2 x dp 2)."""
    ring = ring_counts("09_context_parallel.py")
    forward = linear({C: again // 2 for C, (_, _, again) in ring.items()}, "C", paren=True)
    backward = linear({C: (kv - again) // 2 for C, (kv, _, again) in ring.items()}, "C", paren=True)
    kv = f"K and V {forward} hops forward and " + ("again backward" if forward == backward else f"{backward} backward")
    dkv = linear({C: fixed / 4 / 2 for C, (_, fixed, _) in ring.items()}, "C")
    config = step_sent("09_context_parallel.py", 2)[1]
    bsh = 4 * config.block_size // 2 * config.n_embd
    op = "all_to_all_single[cp]"
    ulysses = tensors(split_bytes("09_context_parallel.py", 2, op, ("--cp_impl", "ulysses"))[0], bsh)
    again = tensors(split_bytes("09_context_parallel.py", 2, op, ("--cp_impl", "ulysses", "--recompute"))[0], bsh)
    ours, ddp = step_sent("09_context_parallel.py", 4, ("--cp", "2"))[0], step_sent("03_ddp.py", 4)[0]
    plus_ddp = ("plus DDP's 4Ψ all-reduce over the world" if ours.get("all_reduce") == ddp["all_reduce"]
                else "plus an all-reduce that is not DDP's")
    return (f"{kv}, fp32 dK/dV {dkv} hops; Ulysses: {ulysses} all-to-alls of b·(s/C)·h per layer "
            f"({again - ulysses} forward, {2 * ulysses - again} backward); {plus_ddp}")


def three_d_sends():
    """08: the CP terms per layer per micro-batch (ring at T = 2, C = 2 and 4; Ulysses at T = 2,
    C = 2 and T = 1, C = 4), in A = b·(s/C)·(h/T)·e; a first stage's PP sends (pp 2) with SP
    against without at T = 2 and 4, and with C = 2 and 4 (Ulysses: the sends are the
    pipeline's alone) against C = 1."""
    ring = ring_counts("08_3d.py", tp=2)
    kv = linear({C: n for C, (n, _, _) in ring.items()}, "C")
    dkv = linear({C: fixed for C, (_, fixed, _) in ring.items()}, "C")  # in bytes per b·(s/C)·h/T element
    ulysses = set()
    for T, C in ((2, 2), (1, 4)):
        flags = ("--cp", str(C), "--cp_impl", "ulysses") + (("--tp", str(T)) if T > 1 else ())
        config = step_sent("08_3d.py", T * C, flags, rank=0)[1]
        A = 4 * config.block_size // C * config.n_embd // T
        ulysses.add(tensors(split_bytes("08_3d.py", T * C, "all_to_all_single[cp]", flags, rank=0)[0], A))
    ulysses = ulysses.pop() if len(ulysses) == 1 else ulysses

    def send(n, *flags):
        return step_sent("08_3d.py", n, ("--pp", "2") + flags, rank=0)[0]["send"]
    sp = {T: Fraction(send(2 * T, "--tp", str(T), "--sequence_parallel"), send(2 * T, "--tp", str(T))) for T in (2, 4)}
    cp = {C: Fraction(send(2 * C, "--cp", str(C), "--cp_impl", "ulysses"), send(2)) for C in (2, 4)}
    tokens = "s/C" if one_over(cp, "C") == "1/C" else f"{cp} of the"
    return (f"(SP: the sequence shard, {one_over(sp, 'T')} of the bytes; CP: the CP rank's {tokens} tokens)",
            f"ring {kv}·A of K/V + {dkv}·b·(s/C)·h/T of fp32 dK/dV, Ulysses {ulysses} all-to-alls of A")


def expert_sends():
    """10 at 2 ranks (ep 2), one micro-batch per rank per 2 sequences: per layer per micro-batch
    the all-to-alls' rows (fp32 against bf16, at top-1 and top-2) and the bytes that stay
    whatever the dtype (the counts, at 4 and 8 experts), and what --recompute adds (the
    forward's again), all on the EP group (all_to_all_single[ep]); the all-reduce over the
    world (unnamed) in units of the parameters of the rest (Ψ_d), and the one over the ranks
    holding the same experts (all_reduce[expert_dp]) in units of one expert's (Ψ_e), with a
    second replica of the experts (world 2N, at ep N = 2 and 4) and, absent, without (world N),
    counted on 10's model."""
    ten = plan.script("10_expert_parallel.py")

    def per_layer(n, *flags, dtype="float32"):
        return split_bytes("10_expert_parallel.py", n, "all_to_all_single[ep]", flags, replicas=n, dtype=dtype)[0]
    config = step_sent("10_expert_parallel.py", 2, ("--n_expert", "4"))[1]
    bsh = config.block_size * config.n_embd  # b = 1
    rows, counts = {}, {}
    for k, E in ((1, 4), (2, 4), (2, 8)):  # rows at top-1 and top-2, counts at 4 and 8 experts
        flags = ("--n_expert", str(E), "--top_k", str(k))
        rows[k] = tensors(per_layer(2, *flags) - per_layer(2, *flags, dtype="bfloat16"), 2 * bsh)
        counts[E] = per_layer(2, *flags, dtype="bfloat16") - 2 * rows[k] * bsh
    n = {Fraction(r, k) for k, r in rows.items()}
    n = int(n.pop()) if len(n) == 1 else rows
    flags = ("--n_expert", "4", "--top_k", "2")
    again = tensors(per_layer(2, *flags, "--recompute") - per_layer(2, *flags), 4 * 2 * bsh, 1)
    with torch.device("meta"):
        model = ten.GPT(config)
    psi_d = sum(p.numel() for name, p in model.named_parameters() if not ten.is_expert(name))
    psi_e = sum(p.numel() for name, p in model.named_parameters() if ".h.0.mlp.experts.0." in name)  # one expert
    L, E = config.n_layer, config.n_expert

    def reduced(n, ep, op):
        return step_sent("10_expert_parallel.py", n, ("--n_expert", "4", "--ep", str(ep)), layers=L)[0].get(op, 0)
    experts = {N: Fraction(reduced(2 * N, N, "all_reduce[expert_dp]"), L * psi_e * E // N) for N in (2, 4)
               if not reduced(N, N, "all_reduce[expert_dp]")}  # one replica: nothing to reduce
    experts = experts[2] if len(experts) == 2 and len(set(experts.values())) == 1 else experts
    dense, rest = divmod(reduced(2, 2, "all_reduce"), psi_d)  # beside it the loss and the tokens per expert
    dense = dense if rest < psi_d // 100 else Fraction(reduced(2, 2, "all_reduce"), psi_d)  # or a term unnamed
    return (f"{n} all-to-alls of the k·b·s·h routed rows ({again} forward, {n - again} backward;",
            f"+ {linear(counts, 'E')} bytes of counts; {dense}Ψ_d all-reduce over the world, the experts' "
            f"{experts}L·Ψ_e·E/N over the ranks that hold the same experts")


SENDS = {"01_single_gpu.py": lambda: ["nothing" if not step_sent("01_single_gpu.py", 1)[0] else "something"],
         "03_ddp.py": lambda: [ddp_sends()], "05_fsdp.py": lambda: [fsdp_sends()], "06_tensor_parallel.py":
         lambda: [tp_sends()], "07_pipeline.py": lambda: [pipeline_sends()], "08_3d.py": three_d_sends,
         "09_context_parallel.py": lambda: [cp_sends()], "10_expert_parallel.py": expert_sends}


def more_holds():
    """The holds cells of 05, 07, 08 and 09, from their costs(): 05's blocks gathered at once with
    prefetch and without (the root: what --no_reshard's L blocks leave); the model state's
    multiple of a stage's (or a rank's) parameters; 07's micro-batches in flight per rank at
    p = 4, m = 8 (GPipe, 1F1B, zero bubble); 08's AdamW state with --zero1 against without
    (D = 2 at C = 1 and 2, T = 2), and a layer's activations with SP (T = 2 and 4) and with ring
    CP (C = 2 and 4, 08's and 09's) against one rank's."""
    def cost(script, n, flags, layers=8, rank=0):
        args, config, _ = plan.dry_run(script, ["--model", "tiny", "--n_layer", str(layers), "--dtype", "float32",
                                                "--global_batch_size", "8", "--micro_batch_size", "1", *flags], n, n)
        return plan.script(script).costs(args, config, n, torch.float32, rank=rank)

    def multiple(held, symbol):  # "4Ψ_stage", "4Ψ_stage", "8Ψ_stage" -> 16 (of Ψ_stage)
        terms = [re.fullmatch(rf"(\d*){symbol}", text) for text, _ in held.values()]
        return sum(int(t.group(1) or 1) for t in terms) if all(terms) else "?"
    gathered = {flag: cost("05_fsdp.py", 4, (flag,) if flag else ())["gathered"][1]
                for flag in ("", "--no_prefetch", "--no_reshard")}
    block = gathered[""] - gathered["--no_prefetch"]
    root = gathered["--no_reshard"] - 8 * block  # all 8 layers' blocks gathered at once
    blocks = [Fraction(gathered[flag] - root, block) for flag in ("--no_prefetch", "")]
    yield "05_fsdp.py", ("the gathered root and one or two blocks" if blocks == [1, 2] else f"the root and {blocks} blocks")
    p = 4
    flights = {kind: [cost("07_pipeline.py", p, ("--schedule", kind), rank=r)["in_flight"] for r in range(p)]
               for kind in ("gpipe", "1f1b", "zb")}
    gpipe = "m" if flights["gpipe"] == [8] * p else flights["gpipe"]
    one_f = "p-r" if flights["1f1b"] == [p - r for r in range(p)] else flights["1f1b"]
    zb = "near p on every stage" if flights["zb"] == [p] * p else f"{flights['zb']} on the stages"
    yield "07_pipeline.py", (f"{multiple(cost('07_pipeline.py', p, ())['held'], 'Ψ_stage')} x one stage + {gpipe} "
                             f"(GPipe) or {one_f} (1F1B) micro-batches of activations")
    yield "07_pipeline.py", zb

    def optim(C, *flags):  # D = 2, T = 2
        return cost("08_3d.py", 4 * C, ("--tp", "2", "--cp", str(C)) + flags, 4)["held"]["optim"][1]
    zero1 = {C: Fraction(optim(C, "--zero1"), optim(C)) for C in (1, 2)}
    per_d = "/D with --zero1" if zero1[1] * 2 == 1 else f"{zero1[1]} with --zero1"
    per_dc = "/(D·C) with CP" if zero1[2] * 2 * 2 == 1 else f"{zero1[2]} with CP"

    def layer(n, *flags):  # a layer's activations on the first stage's rank 0
        return -(cost("08_3d.py", n, flags, 2)["activations"][1] - cost("08_3d.py", n, flags, 3)["activations"][1])
    sp = {T: Fraction(layer(T, "--tp", str(T), "--sequence_parallel"), layer(1)) for T in (2, 4)}
    cp = {C: Fraction(layer(C, "--cp", str(C)), layer(1)) for C in (2, 4)}
    tokens = "every activation of s/C tokens" if one_over(cp, "C") == "1/C" else f"{cp} of the activations"

    def layer09(C):  # 09's (ring) on C ranks: one rank's, no data parallelism
        per = [plan.dry_run("09_context_parallel.py", ["--model", "tiny", "--n_layer", str(n), "--global_batch_size",
                                                       "8", "--micro_batch_size", "1", "--cp", str(C)], C, C)[2]
               ["activations"][1] for n in (2, 3)]
        return per[1] - per[0]
    ring = {C: Fraction(layer09(C), layer09(1)) for C in (2, 4)}
    yield "09_context_parallel.py", ("activations of s/C tokens per sequence" if one_over(ring, "C") == "1/C"
                                     else f"{ring} of the activations")
    block = "/T" if one_over(sp, "T") == "1/T" else f"x {sp}"
    yield "08_3d.py", (f"{multiple(cost('08_3d.py', 2, ('--tp', '2'), 4)['held'], 'Ψ_rank')} x (stage/T) (optimizer "
                       f"{per_d}; {per_dc}); SP: a block's activations {block}; CP: {tokens}")


def test_strategies_holds_of_05_07_08_09_are_what_their_costs_give():
    stale = [f"{script}: {phrase!r}" for script, phrase in more_holds() if phrase not in sends_cell(script, column=2)]
    assert not stale, "docs/strategies.md's holds of 05, 07, 08, 09 are not what their costs() give:\n" + "\n".join(stale)


def sends_cell(script, column=3):
    """The "what each rank sends per step" cell (column 3; 2: "what each rank holds") of
    `script`'s row of docs/strategies.md's table."""
    text = section("docs/strategies.md", "# The strategies: what each rank holds and sends")
    row = re.search(rf"^\| `{re.escape(script)}` \|.*$", text, re.M).group(0)
    return row.split(" | ")[column]


def test_strategies_sends_column_is_what_the_scripts_costs_give():
    stale = [f"{script}: {phrase!r}" for script, phrases in SENDS.items() for phrase in phrases()
             if phrase not in sends_cell(script)]
    assert not stale, "docs/strategies.md's sends column no longer says what the scripts' costs() give:\n" + \
        "\n".join(stale)


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as data:
        print("docs/planning.md, ## plan.py against published large runs:")
        print("\n".join(published_rows(data)))
    print("\ndocs/planning.md, ## Worked plans:")
    for layout, phrase in worked_phrases():
        print(f"  {layout}:\n      {phrase!r}")
    with tempfile.TemporaryDirectory() as data:
        print("\ndocs/planning.md, the machines and Ψ:")
        for phrase in intro_phrases(data):
            print(f"  {phrase!r}")
    print("\ndocs/planning.md, ## Rehearsing a layout before it queues:")
    for phrase in rehearsal_phrases():
        print(f"  {phrase!r}")
    print("\ndocs/planning.md, ## Checked against the papers and against measurement:")
    for phrase in papers_phrases():
        print(f"  {phrase!r}")
    print("\ndocs/planning.md, ## Worked plans, whole plans:")
    for flags, phrases, _ in WHOLE:
        print(f"  plan.py {flags}:")
        for phrase in whole_phrases(flags, phrases):
            print(f"      {phrase!r}")
    print("\ndocs/planning.md, ## Worked plans, ratios and boundaries:")
    for phrase in derived_phrases():
        print(f"  {phrase!r}")
    with tempfile.TemporaryDirectory() as data:
        print("\ndocs/planning.md, ## plan.py against published large runs, **Memory.**:")
        for phrase in memory_phrases(data):
            print(f"  {phrase!r}")
    print("\ndocs/strategies.md, the ZeRO row:")
    for phrase in strategies_phrases():
        print(f"  {phrase!r}")
    print("\ndocs/strategies.md, the sends column:")
    for script, phrases in SENDS.items():
        for phrase in phrases():
            print(f"  {script}: {phrase!r}")
    for script, phrase in more_holds():
        print(f"  {script} (holds): {phrase!r}")
    print("\ndocs/strategies.md, holds, defaults, constants, bubbles:")
    for phrase in [*held_rows(), *strategies_figures()]:
        print(f"  {phrase!r}")
