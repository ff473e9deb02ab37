"""plot.py: pictures of what the scripts measured, one PNG per command (matplotlib, optional).

    python plot.py run.jsonl                       # a training script's --metrics file
    python plot.py ddp.jsonl fsdp.jsonl -o cmp.png # several, compared (labelled by file name)
    python plot.py bench.jsonl --peak_gbps 200     # 02_collectives.py --bench: bus bandwidth
    python plot.py --schedule 1f1b --pp 4 --micro_batches 8          # 07_pipeline.py's timeline
    python plot.py --schedule interleaved --pp 4 --micro_batches 8 --virtual_stages 2
    python plot.py --hangs logs/fr-JOBID           # a stalled job's Flight Recorder dumps, as text
    python plot.py --plan "--model gpt2 --gpus 8 --machine polaris" --layout "07_pipeline.py --schedule 1f1b"
    python plot.py --plan "--model tiny --gpus 2 ..." --layout "07_pipeline.py ..." --measured run.jsonl

A metrics file (docs/design.md's JSONL, any training script) gives six panels: loss and val
loss against step; tokens/s; the step time over ranks (min, mean, max: a straggler shows as a
gap); GPU peak memory over ranks (on GPUs); rank 0's memory (params, grads, optimizer state,
activations) as bars with its theory, the script's costs(), as a black tick on each; and the
bytes rank 0 sent per step by operation, measured against theory the same way.

A 02_collectives.py --bench file gives the bus bandwidth (nccl-tests' busbw) against the
message size, one line per operation, with the link's peak (--peak_gbps) as a dashed line.

--schedule draws the order every stage of 07_pipeline.py runs (its own rounds, replayed
with unit costs by its timeline(), as its log draws in text): forwards, backwards (zero
bubble's input- and weight-gradient passes, I and W, where a schedule has them) coloured, each box labelled with its
micro-batch (and chunk), the bubble drawn and in theory in the title. DualPipeV's overlapped
pairs share a slot as two half-height bars (the forward on top), max(F, B) long; the title
adds the bubble with each pair run in order, F + B, as 07 runs it.

--plan draws plan.py's simulated step of one layout (--layout: a script and its strategy flags;
without it, the plan's recommendation), one row per distinct rank (every stage of a pipeline):
compute boxes (F, B, I, W as above; outside a pipeline, a micro-batch's forward and backward),
and under them the collectives that rank waits for or overlaps (the gradient buckets, what
follows the backward) and a pipeline's messages between stages, each as long as plan.py
prices it. For a pipeline the title gives the share idle beside 07's unit-cost bubble, the
picture --schedule draws of the same schedule. --measured METRICS adds, under the simulated
rows, what each rank of a 07_pipeline.py --measure_bubble --metrics METRICS run of the same
layout measured (its METRICS.timeline.rankR.json: every F, B, I and W of the last logged step,
from the step's first mark): scaled so that the measured schedule ends with the simulated
one's last pass (the title gives the factor, the measured schedule in ms and its idle share),
so the shapes compare across machines.

--hangs reads the Flight Recorder dumps a stalled job left (jobs/*.sh set them up) and prints
one line per rank: the operation it waits in, its group, and the step and phase it was posted
at (docs/failures.md, "Hangs on GPUs").

The kind is read from the files (every file must be of one kind). Without -o the picture is
written next to the (first) file, with .png for its extension, or to schedule_<...>.png or plan.png
(-o may name a .svg or .pdf instead).
Bad input (a missing file, one that is neither metrics nor --bench JSONL, flags out of
range, matplotlib not installed) is one line `error: ...` and exit status 2. docs/observability.md
shows what each panel says."""

import argparse
import importlib.util
import json
import math
import os
import pickle
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_OPS = 20000  # operations in a drawn schedule (pp x micro_batches x virtual_stages x 2): a typo beyond
FORMATS = (".png", ".svg", ".pdf")  # -o's extension says which
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#8172b3"}


class Refused(Exception):
    """Bad input: one line, exit 2."""


def load_rows(path):
    """The JSON objects of a JSONL file, one per non-empty line."""
    if not os.path.exists(path):
        raise Refused(f"{path}: no such file")
    if os.path.isdir(path):
        raise Refused(f"{path} is a directory, not a metrics file")
    if not os.path.isfile(path):  # a device or a pipe (/dev/zero would be read for ever)
        raise Refused(f"{path} is not a regular file, not a metrics file")
    too_big = refusal(path, "metrics file")
    if too_big:
        raise Refused(too_big)
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        raise Refused(f"{path}: line {number} is not JSON: not a metrics JSONL file") from None
                    except RecursionError:  # [[[[...]]]]: deeper than the parser's recursion
                        raise Refused(f"{path}: line {number} nests JSON thousands of levels deep: "
                                      "not a metrics JSONL file") from None
                    if not isinstance(row, dict):
                        raise Refused(f"{path}: line {number} is not a JSON object: not a metrics JSONL file")
                    rows.append(row)
    except UnicodeDecodeError:
        raise Refused(f"{path} is not text: not a metrics JSONL file") from None
    except OSError as e:
        raise Refused(f"{path} cannot be read: {e.strerror or e}") from None
    return rows


def number(value):
    """A plottable number: finite, and below 1e18 (bytes, steps and rates of any real run)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and abs(value) < 1e18


def clean(rows):
    """The metrics rows that can be drawn, with only what can be: a row needs a step (a whole
    number >= 0) and a loss or a val_loss; a value is kept if it is a number, or a dict of
    numbers (state_bytes, comm_bytes and their theory) with the numbers only."""
    kept = []
    for row in rows:
        step = row.get("step")
        if not (number(step) and step >= 0 and step == int(step)) or not (number(row.get("loss"))
                                                                          or number(row.get("val_loss"))):
            continue
        out = {}
        for key, value in row.items():
            if isinstance(value, dict):
                out[key] = {k: v for k, v in value.items() if number(v)}
            elif number(value) or isinstance(value, str):
                out[key] = value
        kept.append(out)
    return kept


def kind_of(path, rows):
    """'metrics' (rows with step and loss or val_loss: a training script's --metrics, even of
    a run stopped after its step-0 evaluation), 'bench' (rows of 02_collectives.py --bench),
    or a refusal."""
    if clean(rows):
        return "metrics"
    if rows and all(isinstance(r.get("op"), str) and number(r.get("bytes")) and r["bytes"] > 0
                    and number(r.get("busbw_GBps")) for r in rows):
        return "bench"
    raise Refused(f"{path}: neither a training script's --metrics JSONL (rows with step and loss or val_loss) "
                  "nor 02_collectives.py --bench output (rows with op, bytes, busbw_GBps)")


def byte_unit(largest):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return unit, size
    return "B", 1


def label_of(path, paths):
    """A file's legend label: its name, with its folder when two files share a name."""
    name = os.path.basename(path)
    same = [p for p in paths if os.path.basename(p) == name]
    return os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), name) if len(same) > 1 else name


# ----------------------------------------------------------------------------------------
# A training run's metrics
# ----------------------------------------------------------------------------------------

def series(rows, key):
    points = [(r["step"], r[key]) for r in rows if number(r.get("step")) and number(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def last_ledger(rows):
    """The last training row that carries the ledger (state, comm, activations and their theory)."""
    steps = [r for r in rows if number(r.get("loss")) and isinstance(r.get("state_bytes"), dict)]
    return steps[-1] if steps else None


def ledger_bars(ax, runs, measured, theory, title):
    """Grouped bars: one group per key, one bar per run (measured), a black tick at its theory."""
    keys = []
    for _, row in runs:
        for key in list(measured(row)) + list(theory(row)):
            if key not in keys:
                keys.append(key)
    if not keys:
        ax.axis("off")
        ax.text(0.5, 0.5, f"{title}:\nnone in these rows", ha="center", va="center", transform=ax.transAxes,
                color="grey")
        return
    largest = max([v for _, row in runs for v in list(measured(row).values()) + list(theory(row).values())
                   if number(v)] + [1])
    unit, size = byte_unit(largest)
    width = 0.8 / len(runs)
    for j, (label, row) in enumerate(runs):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(keys))]
        got, want = measured(row), theory(row)
        ax.bar(xs, [got.get(k, 0) / size if number(got.get(k)) else 0 for k in keys], width * 0.9,
               label=f"{label}: measured" if len(runs) > 1 else "measured", color=f"C{j}")
        ticks = [(x, want[k] / size) for x, k in zip(xs, keys) if number(want.get(k))]
        if ticks:
            ax.hlines([y for _, y in ticks], [x - width * 0.45 for x, _ in ticks], [x + width * 0.45 for x, _ in ticks],
                      colors="black", linewidth=2.5, zorder=3, label="theory (costs())" if j == 0 else None)
    values = [v / size for _, row in runs for v in measured(row).values() if number(v) and v > 0]
    log = values and max(values) > 30 * min(values)
    if log:  # params next to activations: a log scale shows both
        ax.set_yscale("log")
    pad = max(0.0, (3 - len(keys)) / 2)  # one or two groups: bars of a readable width
    ax.set_xlim(-0.5 - pad, len(keys) - 0.5 + pad)
    ax.set_ylim(top=ax.get_ylim()[1] * (3 if log else 1.2))  # room for the legend above the bars
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys, rotation=20 if len(keys) > 3 else 0, ha="right" if len(keys) > 3 else "center",
                       fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(fontsize=7)


def mapping(row, key):
    """A copy of row[key] when it is a dict ({kind: bytes}), else {}."""
    value = row.get(key)
    return dict(value) if isinstance(value, dict) else {}


def memory_of(row):
    out = mapping(row, "state_bytes")
    if number(row.get("activation_bytes")):
        out["activations"] = row["activation_bytes"]
    return out


def memory_theory_of(row):
    out = mapping(row, "state_bytes_theory")
    if number(row.get("activation_bytes_theory")):
        out["activations"] = row["activation_bytes_theory"]
    return out


def summary(label, rows):
    """A run in a few lines: steps, final losses, median throughput and step time, the spread
    over ranks, and whether the ledger's measurement met its theory in every logged row."""
    train = [r for r in rows if number(r.get("loss"))]
    evals = [r for r in rows if number(r.get("val_loss"))]
    if not train:  # a run stopped after its first evaluation, before a step was logged
        return "\n".join([label, "  no training step logged"] + [f"  val loss {r['val_loss']:.4f} (step {r['step']})"
                                                                   for r in evals[-1:]])
    lines = [label, f"  steps {train[0]['step']}..{train[-1]['step']} logged: {len(train)} rows"]
    lines.append(f"  last loss {train[-1]['loss']:.4f}" + (f", val loss {evals[-1]['val_loss']:.4f}"
                                                           f" (step {evals[-1]['step']})" if evals else ""))
    later = train[1:] or train  # the first step warms up
    for key, unit, fmt in (("tokens_per_s", "tokens/s", ",.0f"), ("dt_ms", "ms per step", ".1f")):
        values = sorted(r[key] for r in later if number(r.get(key)))
        if values:
            lines.append(f"  median {values[len(values) // 2]:{fmt}} {unit}")
    spread = [r["dt_ms_max"] / r["dt_ms_min"] for r in later
              if number(r.get("dt_ms_max")) and number(r.get("dt_ms_min")) and r["dt_ms_min"] > 0]
    if spread and max(spread) > 1:  # (one rank: always 1)
        lines.append(f"  slowest / fastest rank: {sorted(spread)[len(spread) // 2]:.2f} (median)")
    pairs = [("state_bytes", "state_bytes_theory"), ("comm_bytes", "comm_bytes_theory"),
             ("activation_bytes", "activation_bytes_theory")]
    checked = [r for r in train if isinstance(r.get("state_bytes"), dict)]
    if checked:
        off = sum(1 for r in checked for got, want in pairs if r.get(want) is not None and r.get(got) != r.get(want))
        lines.append("  ledger: measured = theory in every row" if not off else
                     f"  ledger: {off} measurement(s) differ from theory")
    return "\n".join(lines)


def plot_metrics(plt, paths, all_rows):
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (loss_ax, tok_ax, dt_ax), (mem_ax, comm_ax, peak_ax) = axes
    runs = []
    for j, (path, rows) in enumerate(zip(paths, all_rows)):
        label = label_of(path, paths)
        colour = f"C{j}"
        train = [r for r in rows if number(r.get("loss"))]
        loss_ax.plot(*series(train, "loss"), color=colour, label=f"{label}: loss")
        vs, vl = series(rows, "val_loss")
        if vs:
            loss_ax.plot(vs, vl, "o--", color=colour, markersize=4, label=f"{label}: val loss")
        tok_ax.plot(*series(train, "tokens_per_s"), color=colour, label=label)
        spread = [r for r in train if all(number(r.get(k)) for k in ("dt_ms_min", "dt_ms_max", "dt_ms_mean"))]
        steps, mean = series(spread, "dt_ms_mean")
        if steps:
            _, low = series(spread, "dt_ms_min")
            _, high = series(spread, "dt_ms_max")
            dt_ax.fill_between(steps, low, high, color=colour, alpha=0.25, label=f"{label}: min-max over ranks")
            dt_ax.plot(steps, mean, color=colour, label=f"{label}: mean")
        else:
            dt_ax.plot(*series(train, "dt_ms"), color=colour, label=f"{label}: rank 0")
        spread = [r for r in train if number(r.get("mem_peak_bytes_max")) and number(r.get("mem_peak_bytes_min"))]
        steps, peak = series(spread, "mem_peak_bytes_max")
        if steps:
            _, low = series(spread, "mem_peak_bytes_min")
            peak_ax.fill_between(steps, [v / 2**30 for v in low], [v / 2**30 for v in peak], color=colour,
                                 alpha=0.3, label=f"{label}: min-max over ranks")
        ledger = last_ledger(rows)
        if ledger is not None:
            runs.append((label, ledger))
    loss_ax.set(title="loss", xlabel="step")
    tok_ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    dt_ax.set(title="step time over ranks", xlabel="step", ylabel="ms")
    for ax in (loss_ax, tok_ax, dt_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if peak_ax.has_data():
        peak_ax.set(title="device peak memory over ranks", xlabel="step", ylabel="GiB")
        peak_ax.grid(alpha=0.3)
        peak_ax.legend(fontsize=7)
    else:  # on CPUs (mem_peak_bytes null): the runs in numbers instead
        peak_ax.axis("off")
        peak_ax.text(0.0, 1.0, "\n\n".join(summary(label_of(p, paths), rows) for p, rows in zip(paths, all_rows)),
                     ha="left", va="top", transform=peak_ax.transAxes, fontsize=9, family="monospace")
    when = f"step {runs[0][1]['step']}" if len(runs) == 1 else "last logged step"
    ledger_bars(mem_ax, runs, memory_of, memory_theory_of, f"memory held by rank 0 ({when})")
    ledger_bars(comm_ax, runs, lambda r: mapping(r, "comm_bytes"), lambda r: mapping(r, "comm_bytes_theory"),
                f"bytes sent by rank 0 per step ({when})")
    fig.suptitle(", ".join(label_of(p, paths) for p in paths))
    return fig


# ----------------------------------------------------------------------------------------
# 02_collectives.py --bench
# ----------------------------------------------------------------------------------------

def plot_bench(plt, paths, all_rows, peak_gbps=None):
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for path, rows in zip(paths, all_rows):
        prefix = f"{label_of(path, paths)}: " if len(paths) > 1 else ""
        for op in dict.fromkeys(r["op"] for r in rows):
            points = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["op"] == op)
            ax.plot([b for b, _ in points], [g for _, g in points], "o-", markersize=3, label=prefix + op)
    if peak_gbps:
        ax.axhline(peak_gbps, color="black", linestyle="--", label=f"link peak {peak_gbps:g} GB/s")
    ax.set_xscale("log", base=2)
    runs = sorted({f"{r.get('backend', '?')}, {r.get('world_size', '?')} ranks" for rows in all_rows for r in rows})
    ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title=f"02_collectives.py --bench: bus bandwidth against message size ({'; '.join(runs)})")
    sizes = sorted({r["bytes"] for rows in all_rows for r in rows})
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(s) for s in sizes], rotation=30, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def size_label(n):
    unit, size = byte_unit(n)
    return f"{n / size:g} {unit}"


# ----------------------------------------------------------------------------------------
# 07_pipeline.py's schedule as a timeline
# ----------------------------------------------------------------------------------------

def pipeline_module():
    """07_pipeline.py as a module (its name starts with a digit: importlib, as plan.py does)."""
    spec = importlib.util.spec_from_file_location("pipeline_07", os.path.join(HERE, "07_pipeline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plot_schedule(plt, kind, p, m, v):
    """07's timeline (its timeline(): every rank's rounds replayed at unit cost), one box per
    F, B, I or W. DualPipeV's overlapped pair shares one slot, max(F, B) long: its forward a half-height
    bar on top, the backward it overlaps (and its W) below; the title gives the bubble drawn
    so and with each pair run in order, F + B, as 07 runs it (one stream)."""
    pp = pipeline_module()  # the schedule's rounds, as 07 runs and draws them (run_schedule, timeline_text)
    flags = type("Flags", (), dict(schedule=kind, schedule_csv=None, virtual_stages=v))
    every, v, vee, split = pp.run_schedule(flags, p, m)
    _, bubble, starts, overlap = pp.timeline(every, p, v, vee, split)
    pairs = any(overlap)
    in_order = pp.timeline(every, p, v, vee, split, overlapped=False)[1] if pairs else None
    width = 1.0 / v
    end = max(s for row in starts for s, _ in row) + width
    fig, ax = plt.subplots(figsize=(min(18, 4 + end * 0.55), 1.3 + 0.5 * min(p, 32)))
    for r, row in enumerate(starts):
        below = {op for ops in overlap[r].values() for op in ops}  # a pair's backward (and its W)
        for start, (op, i, c) in row:
            shade = 1.0 - 0.45 * c / max(1, v - 1) if v > 1 else 1.0
            top, height = ((r - 0.4, 0.4) if (op, i, c) in overlap[r] else (r, 0.4) if (op, i, c) in below
                           else (r - 0.4, 0.8))
            ax.broken_barh([(start, width)], (top, height), facecolors=COLOURS.get(op, "grey"),
                           edgecolor="white", alpha=shade)
            text = f"{i}" + ("" if v == 1 else "abcdefghijklmnop"[c])
            if end < 80:  # labels only while they can be read
                ax.text(start + width / 2, top + height / 2, text, ha="center", va="center",
                        fontsize=6 if height < 0.8 else 7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time (one stage's forward or backward = 1" + (f"; a chunk's = 1/{v}" if v > 1 else "")
                  + ("; a half-height pair: a forward overlapped with a backward, max(F, B)" if pairs else "") + ")")
    ops = sorted({op for row in starts for _, (op, _, _) in row}, key="FBIW".index)
    names = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[o]) for o in ops]
    ax.legend(handles, [names[o] for o in ops], loc="upper left", fontsize=8, bbox_to_anchor=(1.005, 1))
    theory = pp.bubble_theory(kind, p, m, v)
    ax.set_title(f"07_pipeline.py --schedule {kind}: {p} stages, {m} micro-batches"
                 + (f", {v} chunks per stage" if v > 1 else "")
                 + f"\nbubble {bubble:.3f} drawn, {theory:.3f} in theory"
                 + (f"; {in_order:.3f} with each pair in order (F + B, as 07 runs it)" if pairs else ""),
                 loc="left", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# plan.py's simulated step of a layout, one row per role
# ----------------------------------------------------------------------------------------

LANE_COLOURS = {"p2p": "#55a868", "collective": "#937860"}


def planned_step(plan_flags, layout):
    """plan.py's candidate for `layout` ("SCRIPT FLAGS"; None: the plan's recommendation) under
    `plan_flags`, and its roles' boxes (plan.simulate_step): (candidate, lanes, pipeline shape
    or None). plan.py's own refusals are one line here too."""
    import contextlib
    import io
    import shlex
    sys.path.insert(0, HERE)
    import plan
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, machine = plan.parse(shlex.split(plan_flags))
            if layout:
                name, *flags = shlex.split(layout)
                if not re.fullmatch(r"(0[13-9]|10)_\w+\.py", name) or not os.path.isfile(os.path.join(HERE, name)):
                    raise Refused(f"--layout {layout[:80]!r}: name a training script first (01, 03 ... 10)")
            else:
                choice = plan.plan(args, machine)[3]
                if choice is None:
                    raise Refused("--plan: nothing fits, so there is no recommendation to draw (--layout names one)")
                name, flags = choice["script"], choice["flags"][len(args.model_flags):]
            candidate, reason = plan.score(name, flags, name, args, machine)
            if candidate is None:
                raise Refused(f"--layout {name}: {reason}")
            dry = plan.dry_run(name, [*args.model_flags, *flags], args.gpus, machine["gpus_per_node"],
                               machine.get("gpu_mem_gb"))
            shape = plan.pipeline_shape(name, dry[0], args.gpus) if plan.is_pipeline(name, dry[0]) else None
            boxes = (shape[2] * shape[3] * shape[1] * 3) if shape else 0
            if boxes > MAX_OPS:
                raise Refused(f"{shape[2]} stages x {shape[3]} micro-batches is too many boxes to draw "
                              f"(at most {MAX_OPS:,})")
            lanes = {}
            plan.score(name, flags, name, args, machine, lanes)
    except SystemExit:
        raise Refused(err.getvalue().strip().splitlines()[-1].removeprefix("error: ") if err.getvalue().strip()
                      else "--plan: plan.py refused these flags") from None
    return candidate, lanes, shape, " ".join([name, *candidate["flags"][len(args.model_flags):]])


MAX_TIMELINE_BYTES = 2**28  # one rank's ops of one step: MAX_OPS of them is a few MB


def load_timelines(metrics):
    """07_pipeline.py --measure_bubble's timelines beside the --metrics file `metrics`, one per
    rank (07's timeline_path), rank 0 first, until a rank has none: [{rank, step_s, ops...}]."""
    path_of, found = pipeline_module().timeline_path, []
    while os.path.isfile(path_of(metrics, len(found))):
        path = path_of(metrics, len(found))
        why = refusal(path, "a timeline", MAX_TIMELINE_BYTES)
        if why:
            raise Refused(why)
        try:
            with open(path, encoding="utf-8") as f:
                row = json.load(f)
        except (ValueError, RecursionError, OSError) as e:
            raise Refused(f"--measured: {path} cannot be read as 07's timeline ({e})") from None
        ops = row.get("ops") if isinstance(row, dict) else None
        if not (isinstance(ops, list) and ops and number(row.get("step_s")) and row["step_s"] > 0 and all(
                isinstance(op, dict) and op.get("op") in COLOURS and number(op.get("start")) and number(op.get("end"))
                and 0 <= op["start"] <= op["end"] for op in ops) and len(ops) <= MAX_OPS):
            raise Refused(f"--measured: {path} is not 07_pipeline.py's timeline (rank, step_s, ops with start <= end)")
        found.append(row)
    if not found:
        raise Refused(f"--measured {metrics}: no timeline beside it ({path_of(metrics, 0)}): run 07_pipeline.py "
                      "with --measure_bubble and --metrics")
    return found


def measured_lanes(timelines, shape, scale):
    """The measured rows: rank r's ops, each box its measured span times `scale` (the simulated
    schedule over the measured one, so both end together). Refused unless the run is the
    layout drawn: the same schedule, stages, micro-batches and chunks."""
    schedule, v, p, m, _ = shape
    ran = timelines[0]
    want = {"schedule": schedule, "world_size": p, "micro_batches": m, "virtual_stages": v}
    got = {key: ran.get(key) for key in want}
    if got != want or len(timelines) != p:
        raise Refused(f"--measured: the run is {got} over {len(timelines)} rank timeline(s), the plan's layout "
                      f"{want}: measure the layout drawn")
    return {f"rank {t['rank']} measured": [(op["start"] * scale, (op["end"] - op["start"]) * scale, "compute",
                                            f"{op['op']}{op.get('micro_batch', '')}") for op in t["ops"]]
            for t in timelines}


def plot_plan(plt, plan_flags, layout, measured=None):
    """One row per role of plan.py's simulated step: compute on top, the messages and
    collectives under it, every box as long as the simulation priced it. `measured` (a
    --metrics file of 07 --measure_bubble): each rank's measured ops in rows under them, scaled
    so that the measured schedule ends with the simulated one's last pass (the step's
    reductions after it are not in Pipeline.run's marks)."""
    c, lanes, shape, strategy = planned_step(plan_flags, layout)
    timelines = load_timelines(measured) if measured else None
    if timelines and not shape:
        raise Refused(f"--measured: {strategy} is not a pipeline; 07_pipeline.py's timelines compare with one")
    simulated = list(lanes)
    if timelines:  # the measured schedule (Pipeline.run's marks) against the simulated one, to its last pass
        measured_s = max(t["step_s"] for t in timelines)
        passes_s = max(start + length for boxes in lanes.values() for start, length, kind, _ in boxes
                       if kind == "compute")
        lanes = {**lanes, **measured_lanes(timelines, shape, passes_s / measured_s)}
    rows = list(lanes)
    end = max(start + length for boxes in lanes.values() for start, length, _, _ in boxes)
    fig, ax = plt.subplots(figsize=(14, 1.5 + 0.45 * min(len(rows), 40)))
    busy = 0.0
    for r, role in enumerate(rows):
        for start, length, kind, what in lanes[role]:
            if kind == "compute":
                busy += length if role in simulated else 0
                ax.broken_barh([(start, length)], (r - 0.4, 0.5), facecolors=COLOURS.get(what[0], "grey"),
                               edgecolor="white", linewidth=0.3)
            else:
                ax.broken_barh([(start, length)], (r + 0.15, 0.25), facecolors=LANE_COLOURS[kind],
                               edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("seconds (plan.py's simulated step: each box as long as it prices it"
                  + ("; the measured rows scaled to end with the simulated passes)" if timelines else ")"))
    names = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    kinds = sorted({what[0] for boxes in lanes.values() for _, _, kind, what in boxes if kind == "compute"},
                   key="FBIW".index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in kinds]
    labels = [names[k] for k in kinds]
    for kind, text in (("p2p", "message between stages"), ("collective", "collective")):
        if any(k == kind for boxes in lanes.values() for _, _, k, _ in boxes):
            handles.append(plt.Rectangle((0, 0), 1, 1, color=LANE_COLOURS[kind]))
            labels.append(text)
    ax.legend(handles, labels, loc="upper left", fontsize=8, bbox_to_anchor=(1.005, 1))
    title = f"plan.py {plan_flags}: {strategy}\nstep {c['step_time_s'] * 1e3:.4g} ms simulated"
    if shape:
        schedule, v, p, m, _ = shape
        unit = pipeline_module().bubble_theory(schedule, p, m, v)
        title += (f"; idle {1 - busy / (len(simulated) * c['step_time_s']):.3f} of the stages' time, against 07's "
                  f"unit-cost {unit:.3f} (plot.py --schedule {schedule} --pp {p} --micro_batches {m})")
    if timelines:
        idle = 1 - sum(op["end"] - op["start"] for t in timelines for op in t["ops"]) / (p * measured_s)
        title += (f"\nmeasured ({measured}, step {timelines[0].get('step')}, on {timelines[0].get('device')}): "
                  f"schedule {measured_s * 1e3:.4g} ms, idle {idle:.3f}; its rows scaled by "
                  f"{passes_s / measured_s:.3g}, to end with the simulated schedule's last pass")
        ax.axhline(len(simulated) - 0.5, color="black", linewidth=0.8)
    ax.set_title(title, loc="left", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------
# --hangs: where every rank of a stalled job waits, from torch's Flight Recorder dumps
# ----------------------------------------------------------------------------------------

TRAIL = "ledger.{rank}.jsonl"  # infra.ledger.trail_path's name: the step/phase trail beside the dumps
MAX_DUMP_BYTES = 4 * 2**30  # a Flight Recorder dump or a trail beyond this is no real run's (20,000 entries: ~10 MB)


def refusal(path, what, limit=MAX_DUMP_BYTES):
    """Why `path` is not read, before a byte of it is (a FIFO nobody writes, /dev/zero, a file of
    terabytes would be read for ever), or None."""
    try:
        stat = os.stat(path)
    except OSError as e:
        return f"{path} cannot be read: {e.strerror or e}"
    import stat as kinds
    if kinds.S_ISDIR(stat.st_mode):
        return f"{path} is a directory, not {what}"
    if not kinds.S_ISREG(stat.st_mode):
        kind = "a FIFO" if kinds.S_ISFIFO(stat.st_mode) else "a device" if kinds.S_ISCHR(stat.st_mode) or \
            kinds.S_ISBLK(stat.st_mode) else "a socket" if kinds.S_ISSOCK(stat.st_mode) else "not a regular file"
        return f"{path} is {kind}, not {what}: not read"
    if stat.st_size > limit:
        return f"{path} holds {stat.st_size:,} bytes, more than any {what} ({limit:,}): not read"
    return None


class _PlainUnpickler(pickle.Unpickler):
    """A Flight Recorder dump is a pickle of dicts, lists, strings and numbers: refuse any
    other object, so reading a dump never runs code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: not a Flight Recorder dump")


def read_trail(path):
    """A ledger trail's JSON objects, and notes on the lines it could not read: a line cut by
    a disk that filled (or anything else that is not a JSON object) loses only that line."""
    why = refusal(path, "a ledger trail")
    if why:
        return [], [why]
    rows, bad = [], []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError):
                    row = None
                if isinstance(row, dict):
                    rows.append(row)
                else:
                    bad.append(number)
    except OSError as e:
        return rows, [f"{path} cannot be read: {e.strerror or e}"]
    notes = [f"{path}: line{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:5]))}"
             f"{', ...' if len(bad) > 5 else ''} not a trail line (cut, or not JSON): skipped"] if bad else []
    return rows, notes


def _int(value):
    """A whole number from a dump or a trail (older torch, a string), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    if isinstance(value, (str, bytes)) and len(value) < 40:
        try:
            return int(value)
        except ValueError:
            return None
    return None


def entry_of(raw):
    """One Flight Recorder entry as the reader needs it, from any torch since 2.3 (seq_id before
    collective_seq_id), or None when it lacks what places it (a dict with a process group
    and a number): dict(key, desc, seq, p2p, op, backend, state, t_ns, record)."""
    if not isinstance(raw, dict):
        return None
    group = raw.get("process_group")
    if not (isinstance(group, (list, tuple)) and group and isinstance(group[0], (str, int))):
        return None
    p2p = raw.get("is_p2p") is True
    seq = _int(raw.get("p2p_seq_id") if p2p else raw.get("collective_seq_id", raw.get("seq_id")))
    if seq is None:
        return None
    name = raw.get("profiling_name")
    name = name if isinstance(name, str) else "?"
    state = raw.get("state")
    return dict(key=str(group[0]), desc=str(group[1]) if len(group) > 1 else "", seq=seq, p2p=p2p,
                op=name.split(":", 1)[-1][:60] or "?", backend=name.split(":", 1)[0] if ":" in name else "",
                state=state if isinstance(state, str) else None, t_ns=_int(raw.get("time_created_ns")),
                record=_int(raw.get("record_id")))


def group_ranks(config):
    """A pg_config entry's ranks, a list of whole numbers, or None (nested, cut or odd: unread)."""
    ranks = config.get("ranks") if isinstance(config, dict) else None
    if isinstance(ranks, str):
        if len(ranks) > 10**7:
            return None
        try:
            ranks = json.loads(ranks)
        except (ValueError, RecursionError):
            return None
    if isinstance(ranks, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return ranks
    return None


def read_dumps(folder):
    """{rank: dump} of the Flight Recorder dumps in `folder` (files named <prefix><rank>, all
    with one prefix, as TORCH_FR_DUMP_TEMP_FILE writes them), {rank: trail rows}, notes on what
    was not read, and {rank: path} of the dumps older than this run (not read as its)."""
    if not os.path.isdir(folder):
        raise Refused(f"--hangs {folder}: " + ("no such directory" if not os.path.exists(folder) else
                      "not a directory (the folder of the Flight Recorder dumps, logs/fr-<job id>)"))
    dumps, trails, prefixes, notes, written = {}, {}, set(), [], {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        trail = re.fullmatch(TRAIL.replace(".", r"\.").replace("{rank}", r"(\d+)"), name)
        if trail:
            trails[int(trail.group(1))], more = read_trail(path)
            notes += more
            continue
        found = re.fullmatch(r"(.*?)(\d+)", name)
        if not found or name.startswith(".") or os.path.isdir(path):
            continue
        why = refusal(path, "a Flight Recorder dump")
        if why:
            notes.append(why)
            continue
        try:
            with open(path, "rb") as f:
                dump = _PlainUnpickler(f).load()
            written[int(found.group(2))] = os.stat(path).st_mtime_ns
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, OSError, RecursionError, MemoryError,
                AttributeError, IndexError, KeyError) as e:
            raise Refused(f"{path} is not a Flight Recorder dump ({str(e)[:200]})") from None
        if not (isinstance(dump, dict) and isinstance(dump.get("entries"), list)):
            raise Refused(f"{path} is not a Flight Recorder dump (no entries)")
        prefixes.add(found.group(1))
        dumps[int(found.group(2))] = (dump, path)
    if not dumps:
        raise Refused(f"--hangs {folder}: no Flight Recorder dumps (files <prefix><rank>) in it"
                      + (f" that can be read ({notes[0]})" if notes else ""))
    if len(prefixes) > 1:
        raise Refused(f"--hangs {folder}: dumps of several prefixes ({', '.join(sorted(prefixes))}): one job's only")
    # this run began at its trails' first line (each trail is rewritten when a run starts), or at
    # the first entry of its newest dump: a dump written before that is an earlier run's
    firsts = [row["t_ns"] for rows in trails.values() for row in rows[:2] if _int(row.get("t_ns")) is not None]
    newest = max(dumps, key=lambda r: written[r])
    times = [e["t_ns"] for e in map(entry_of, dumps[newest][0]["entries"]) if e and e["t_ns"] is not None]
    began = min([_int(t) for t in firsts] + ([min(times)] if times else []), default=None)
    stale = {r: path for r, (dump, path) in dumps.items() if began is not None and written[r] < began}
    return {r: d for r, (d, p) in dumps.items() if r not in stale}, trails, notes, stale


def hang_lines(folder):
    """One line per rank of a stalled job: the operation it waits in (Flight Recorder's own
    number on its group: the SeqNum NCCL's watchdog prints), its group, and the step and phase
    it was posted at (the ledger's trail), or that it waits in none and which operation the
    others wait for it to post; then the first operation that not every rank of its group
    posted. An operation is done when its state says so (NCCL, XCCL); gloo does not update
    the state, so there an operation is done once every member of its group posted it,
    unless it is the last operation every one of them posted. Entries and trail lines it
    cannot read (an older or newer torch's, cut ones) are counted in a note, never a
    traceback; the work is linear in the entries.

        rank 0 waits in operation #3 (all_reduce) on group world, posted at step 7, phase forward
        rank 2 waits in no operation: it has not posted #3 on group world, which ranks 0, 1 wait in;
               its last was #2 (all_reduce) on group world, posted at step 6, phase optimizer
    """
    raw_dumps, trails, notes, stale = read_dumps(folder)
    groups = {}  # group name -> {"name", "ranks"}
    dumps = {}  # rank -> its readable entries, in the order they were recorded
    for rank, dump in raw_dumps.items():
        configs = dump.get("pg_config")
        for key, config in (configs.items() if isinstance(configs, dict) else ()):
            ranks = group_ranks(config)
            if key and ranks:
                groups.setdefault(str(key), {})["ranks"] = ranks
        entries = [entry_of(raw) for raw in dump["entries"]]
        unread = sum(e is None for e in entries)
        if unread:
            notes.append(f"rank {rank}: {unread} of {len(entries)} Flight Recorder entries not read (no process "
                         "group or sequence number: another torch's format)")
        entries = [e for e in entries if e is not None]
        if all(e["record"] is not None for e in entries):
            entries.sort(key=lambda e: e["record"])
        dumps[rank] = entries
    for rows in trails.values():
        for row in rows:
            if "group" in row and isinstance(row.get("group"), (str, int)):
                ranks = row.get("ranks")
                groups.setdefault(str(row["group"]), {}).update(
                    name=row["name"] if isinstance(row.get("name"), str) else None,
                    ranks=ranks if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks) else None)
    steps = {rank: [(_int(r["t_ns"]), r.get("step"), r.get("phase")) for r in rows
                    if "t_ns" in r and _int(r["t_ns"]) is not None] for rank, rows in trails.items()}

    def label(entry):
        known = groups.get(entry["key"], {})
        if known.get("name"):
            return known["name"]
        if entry["desc"] == "default_pg":
            return "world"
        if entry["desc"] and entry["desc"] != "undefined":
            return entry["desc"][:60]
        return "ranks " + ",".join(map(str, known.get("ranks") or [])) if known.get("ranks") else f"group {entry['key']}"

    def posted(rank, entry):
        before = [row for row in steps.get(rank, []) if entry["t_ns"] is not None and row[0] <= entry["t_ns"]]
        if not before:
            return "at an unknown step and phase (no ledger trail)" if rank not in trails else \
                "at an unknown step and phase (no time in the entry)" if entry["t_ns"] is None else \
                "before the first step"
        return f"at step {before[-1][1]}, phase {before[-1][2]}"

    # the highest collective number each rank posted on each group; each rank's last
    # collective; the last p2p entry of each rank on each group (one pass over the entries)
    last, final, last_p2p = {}, {}, {}
    for rank, entries in dumps.items():
        for e in entries:
            if e["p2p"]:
                last_p2p[rank, e["key"]] = e
            else:
                last[rank, e["key"]] = max(last.get((rank, e["key"]), 0), e["seq"])
        if entries and not entries[-1]["p2p"]:
            final[rank] = (entries[-1]["key"], entries[-1]["seq"])
    posted_on = {}
    for rank, key in last:
        posted_on.setdefault(key, set()).add(rank)
    memo = {}

    # a dump without entries says nothing of where its rank is (a recorder that saw none of the
    # run's collectives: TORCH_FR_BUFFER_SIZE=0, or not its backend's): never read as "waits in none"
    empty = {rank for rank, dump in raw_dumps.items() if not dump["entries"]}

    def members(key):
        if key not in memo:
            ranks = groups.get(key, {}).get("ranks") or sorted(posted_on.get(key, ()))
            memo[key] = [r for r in ranks if r in dumps and r not in empty]
        return memo[key]

    def pending(rank, entry):
        if entry["backend"] != "gloo":
            return entry["state"] != "completed"
        key = entry["key"]
        if entry["p2p"]:  # not numbered alike on both sides: pending while the last on its group
            return entry is last_p2p.get((rank, key))
        seq = entry["seq"]
        if not all(last.get((r, key), 0) >= seq for r in members(key)):
            return True  # a member has not posted it: it cannot have completed
        # every member posted it: done, unless it is the last thing every member posted (they
        # all wait in it together: a link, not a disagreement)
        return all(final.get(r) == (key, seq) for r in members(key))

    waits, lines = {}, []
    for rank in sorted(dumps):
        waits[rank] = next((e for e in dumps[rank] if pending(rank, e)), None)
    missing = {}  # (group, number) -> ranks that did not post it
    for rank, entry in waits.items():
        if entry is not None and not entry["p2p"]:
            key, seq = entry["key"], entry["seq"]
            late = [r for r in members(key) if last.get((r, key), 0) < seq]
            if late:
                missing.setdefault((key, seq, label(entry)), set()).update(late)
    for rank in sorted(dumps):
        entry = waits[rank]
        if entry is not None:
            lines.append(f"rank {rank} waits in operation #{entry['seq']} ({entry['op']}) on group "
                         f"{label(entry)}, posted {posted(rank, entry)}")
            continue
        if rank in empty:
            lines.append(f"rank {rank}: its dump holds no entries (its recorder saw none of this run's collectives: "
                         "TORCH_FR_BUFFER_SIZE=0, or a recorder other than its backend's): where it waits is unknown")
            continue
        line = f"rank {rank} waits in no operation"
        for (key, seq, name), late in sorted(missing.items()):
            if rank in late:
                waiting = sorted(r for r, e in waits.items() if e is not None and e["key"] == key
                                 and not e["p2p"] and e["seq"] == seq)
                line += f": it has not posted #{seq} on group {name}, which rank(s) {', '.join(map(str, waiting))} wait in"
                break
        if dumps[rank]:
            e = dumps[rank][-1]
            line += f"; its last was #{e['seq']} ({e['op']}) on group {label(e)}, posted {posted(rank, e)}"
        lines.append(line)
    world = max((len(g.get("ranks") or []) for g in groups.values()), default=0)
    absent = [rank for rank in range(max(world, max(stale, default=-1) + 1)) if rank not in dumps]
    lines += [f"rank {rank}: no dump of this run (its dump {stale[rank]} was written before this run began: an "
              "earlier run's, not read)" if rank in stale else
              f"rank {rank}: no dump (its process ended before it could write one)" for rank in absent]
    if missing:
        (key, seq, name), late = min(missing.items(), key=lambda item: item[0][1])
        lines.append(f"the hang: rank(s) {', '.join(map(str, sorted(late)))} never posted #{seq} on group {name}")
    elif absent and any(e is not None for e in waits.values()):
        lines.append(f"the hang: every rank with a dump posted what the others wait in; rank(s) "
                     f"{', '.join(map(str, absent))} left none: look at its log first")
    elif any(e is not None for e in waits.values()):
        lines.append("the hang: every rank posted the operations the others wait in: a slow or failed link, "
                     "not ranks that disagree on what comes next")
    return lines + [f"note: {note}" for note in notes]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Refused(message)


def parse(argv):
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("files", nargs="*", help="--metrics JSONL of a training script, or of 02_collectives.py --bench")
    p.add_argument("-o", "--out", default=None, help="the PNG to write (default: next to the first file)")
    p.add_argument("--peak_gbps", type=float, default=None, help="--bench: the link's peak, drawn as a line")
    p.add_argument("--dpi", type=int, default=100)
    g = p.add_argument_group("07_pipeline.py's schedule (instead of files)")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"], default=None,
                   help="zb: zero bubble (ZB-H1), its weight-gradient passes W drawn apart; zbv, dualpipev: "
                        "V-shaped, two chunks per stage (a, b)")
    g.add_argument("--pp", type=int, default=4, help="pipeline stages")
    g.add_argument("--micro_batches", type=int, default=8)
    g.add_argument("--virtual_stages", type=int, default=2, help="chunks per stage (interleaved)")
    g = p.add_argument_group("plan.py's simulated step of a layout (instead of files)")
    g.add_argument("--plan", metavar="PLAN_FLAGS", default=None,
                   help='plan.py\'s flags, quoted: "--model gpt2 --gpus 8 --machine polaris"')
    g.add_argument("--measured", metavar="METRICS", default=None,
                   help="with --plan: the --metrics file of a 07_pipeline.py --measure_bubble run of the same "
                        "layout; its ranks' measured ops drawn under the simulated ones, scaled to the same step")
    g.add_argument("--layout", metavar="SCRIPT_FLAGS", default=None,
                   help='the layout to draw, quoted: "07_pipeline.py --schedule 1f1b" (default: the recommendation)')
    p.add_argument("--hangs", metavar="DIR", default=None,
                   help="a stalled job's Flight Recorder dumps (TORCH_FR_DUMP_TEMP_FILE's folder): one line per rank")
    args = p.parse_args(argv)
    if args.hangs is not None:
        if args.files or args.schedule or args.plan:
            raise Refused("--hangs reads a folder of dumps: give it alone")
        return args
    if args.layout is not None and args.plan is None:
        raise Refused("--layout names a layout of a plan: give --plan too")
    if args.measured is not None and args.plan is None:
        raise Refused("--measured is drawn under a plan's simulated step: give --plan (and --layout) too")
    if bool(args.files) + bool(args.schedule) + (args.plan is not None) != 1:
        raise Refused("give metrics files, --schedule (07_pipeline.py's timeline) or --plan (plan.py's "
                      "simulated step), one of the three")
    if args.peak_gbps is not None and not (math.isfinite(args.peak_gbps) and args.peak_gbps > 0):
        raise Refused(f"--peak_gbps must be a positive number, got {args.peak_gbps}")
    if not 10 <= args.dpi <= 1000:
        raise Refused(f"--dpi must be in 10..1000, got {args.dpi}")
    if args.schedule:
        v = args.virtual_stages if args.schedule == "interleaved" else 1
        for flag, value in (("pp", args.pp), ("micro_batches", args.micro_batches), ("virtual_stages", v)):
            if value < 1:
                raise Refused(f"--{flag} must be positive, got {value}")
        if args.schedule == "interleaved" and args.micro_batches % args.pp:
            raise Refused(f"the interleaved schedule needs --micro_batches ({args.micro_batches}) to be a "
                          f"multiple of --pp {args.pp}")
        if args.schedule == "dualpipev" and args.micro_batches < 2 * args.pp:
            raise Refused(f"dualpipev needs at least 2·pp = {2 * args.pp} micro-batches (its two chunks per "
                          f"rank), got {args.micro_batches}")
        v = 2 if args.schedule in ("zbv", "dualpipev") else v  # two chunks per stage, in a V
        passes = 3 if args.schedule in ("zb", "zbv", "dualpipev") else 2  # F and B, and ZB's W
        if passes * args.pp * args.micro_batches * v > MAX_OPS:
            raise Refused(f"{args.pp} stages x {args.micro_batches} micro-batches x {v} chunks is too many "
                          f"boxes to draw (at most {MAX_OPS // passes:,} per pass)")
        args.virtual_stages = v
    if args.out is None:
        args.out = (os.path.splitext(args.files[0])[0] + ".png" if args.files else "plan.png" if args.plan else
                    f"schedule_{args.schedule}_p{args.pp}_m{args.micro_batches}"
                    + (f"_v{args.virtual_stages}" if args.virtual_stages > 1 else "") + ".png")
    if os.path.splitext(args.out)[1].lower() not in FORMATS:
        raise Refused(f"-o {args.out}: name a {', '.join(FORMATS)} file")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        raise Refused(f"-o {args.out}: the directory {folder} does not exist")
    if os.path.isdir(args.out):
        raise Refused(f"-o {args.out} is a directory")
    return args


def main(argv=None):
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        if args.hangs is not None:
            print("\n".join(hang_lines(args.hangs)))
            return 0
        all_rows = [load_rows(path) for path in args.files]
        kinds = {kind_of(path, rows) for path, rows in zip(args.files, all_rows)}
        if len(kinds) > 1:
            raise Refused("these files are of different kinds (training metrics and --bench): plot them apart")
        try:
            import matplotlib
        except ImportError:
            raise Refused("plot.py needs matplotlib, an optional package: pip install matplotlib") from None
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
        try:
            if args.plan is not None:
                fig = plot_plan(plt, args.plan, args.layout, args.measured)
            elif args.schedule:
                fig = plot_schedule(plt, args.schedule, args.pp, args.micro_batches, args.virtual_stages)
            elif kinds == {"bench"}:
                fig = plot_bench(plt, args.files, all_rows, args.peak_gbps)
            else:
                fig = plot_metrics(plt, args.files, [clean(rows) for rows in all_rows])
            if not (args.schedule or args.plan):
                fig.tight_layout()
        except (ArithmeticError, TypeError, ValueError) as e:  # values no real run writes
            raise Refused(f"{', '.join(args.files)}: cannot draw these rows ({e})") from None
        try:
            fig.savefig(args.out, dpi=args.dpi)
        except OSError as e:
            raise Refused(f"-o {args.out} cannot be written: {e.strerror or e}") from None
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
