"""What a GPU run would wait for: the host syncs of every training step, counted on CPU.

A device-wide synchronize, or reading a device tensor's value on the host (.item(),
.tolist(), .cpu(), bool(), ...), makes the host wait until the GPU has run everything queued,
so the next kernels cannot be queued behind the running ones. On CPU these cost nothing, which
is why a CPU run can count them: with GPTPAR_COUNT_SYNCS=1 infra.stop.HostSyncs counts them inside
each step (forwards, backwards, the guard, the optimizer step; the logging after the step is
not counted) and writes the count into the metrics row as `host_syncs`. torch's fused AdamW,
which the scripts use on GPUs, reads nothing back; its CPU path is exempt (infra.stop.HostSyncs).

The table is the contract: the guard reads its flags once per step (1), and a strategy may
add only what it states here."""

import argparse
import importlib.util
import json
import os
import runpy

import pytest

from harness import ROOT, TINY, launch

GUARD = 1  # infra.stop.Guard: one read of the agreed flags, before the update

# script, ranks, flags, host syncs per step and why
CASES = [
    ("01_single_gpu.py", 1, [], GUARD, "the guard"),
    ("03_ddp.py", 2, [], GUARD, "the guard"),
    ("04_zero.py", 2, ["--stage", "2"], GUARD, "the guard"),
    ("04_zero.py", 2, ["--stage", "3"], GUARD, "the guard"),
    ("05_fsdp.py", 2, [], GUARD, "the guard"),
    ("06_tensor_parallel.py", 2, ["--sequence_parallel"], GUARD, "the guard"),
    ("09_context_parallel.py", 2, [], GUARD, "the guard"),
    ("09_context_parallel.py", 2, ["--cp_impl", "ulysses"], GUARD, "the guard"),
    ("07_pipeline.py", 2, [], GUARD, "the guard"),
    ("07_pipeline.py", 2, ["--schedule", "zb"], GUARD, "the guard"),
    ("07_pipeline.py", 2, ["--schedule", "interleaved", "--virtual_stages", "2"], GUARD, "the guard"),
    # device events around each forward and backward, read after the step (GPU semantics II)
    ("07_pipeline.py", 2, ["--measure_bubble"], GUARD, "the guard: --measure_bubble waits for nothing in the step"),
    ("07_pipeline.py", 2, ["--measure_bubble", "--schedule", "zb"], GUARD, "the guard: zb's W timed by events too"),
    ("08_3d.py", 4, ["--tp", "2", "--pp", "2"], GUARD, "the guard"),
    ("08_3d.py", 4, ["--pp", "2", "--cp", "2"], GUARD, "the guard"),
    # L = 4 MoE layers, m = 2 micro-batches per rank: the dispatch's split sizes, read on the host
    # once per layer (torch's all_to_all_single takes them as lists, and the receiver allocates
    # its rows by them); the tokens per expert stay on the device (GPU semantics II: was 3)
    ("10_expert_parallel.py", 2, ["--n_expert", "4", "--ep", "2"], GUARD + 1 * 4 * 2, "the dispatch's split sizes"),
]


@pytest.mark.parametrize("script,ranks,flags,expected,why", CASES,
                         ids=[f"{c[0]}{''.join(c[2])}" for c in CASES])
def test_host_syncs_per_step(script, ranks, flags, expected, why):
    run = launch(script, TINY + ["--max_iters", "3", "--micro_batch_size", "2"] + flags, nprocs=ranks,
                 env={"GPTPAR_COUNT_SYNCS": "1"}).ok()
    counts = [row["host_syncs"] for row in run.steps]
    assert counts == [expected] * 3, f"{script} {flags}: {counts} host syncs per step, expected {expected} ({why})"
    if script == "07_pipeline.py":  # the busy time is measured only when asked: the flag works
        busy = [row["busy_fraction"] for row in run.steps]
        if "--measure_bubble" in flags:
            assert all(0 < b <= 1 for b in busy), busy
            check_timelines(run, flags, ranks)
        else:
            assert busy == [None] * 3, busy


def check_timelines(run, flags, p, m=4):
    """--measure_bubble's timeline (issue 61): every rank wrote the last logged step's ops beside
    the metrics, every op of its schedule once, in the order it runs them (its rounds, a round's
    W after its F and B), each span inside the step and after the one before; plot.py draws
    them under plan.py's simulated step of the same layout (zb: the last case, F, B, I and W)."""
    pipeline = importlib.import_module("07_pipeline")
    schedule = flags[flags.index("--schedule") + 1] if "--schedule" in flags else "1f1b"
    every, v, _, _ = pipeline.run_schedule(argparse.Namespace(schedule=schedule, schedule_csv=None,
                                                              virtual_stages=1), p, m)
    metrics = run.cmd[run.cmd.index("--metrics") + 1]
    assert run.steps[-1]["timeline"] == pipeline.timeline_path(metrics, 0)
    for rank in range(p):
        timeline = json.load(open(pipeline.timeline_path(metrics, rank)))
        assert [timeline[key] for key in ("rank", "world_size", "step", "micro_batches")] == [rank, p, 2, m]
        ops = [(op["op"], op["micro_batch"], op["chunk"]) for op in timeline["ops"]]
        assert sorted(ops) == sorted(a for actions in every[rank] for a in actions), ops  # the schedule's, each once
        for kinds in ("F", "BI"):  # a forward and a backward of every micro-batch, W where I was split from it
            assert sorted(i for k, i, _ in ops if k in kinds) == list(range(m)), ops
        assert sorted(i for k, i, _ in ops if k == "W") == sorted(i for k, i, _ in ops if k == "I"), ops
        assert ops == pipeline.timed_order(every[rank]), ops  # in the order run, a round's W last
        ends = [0.0] + [op["end"] for op in timeline["ops"]]
        assert all(end <= op["start"] <= op["end"] for end, op in zip(ends, timeline["ops"])), timeline["ops"]
        assert ends[-1] <= timeline["step_s"], (ends[-1], timeline["step_s"])
    if schedule != "zb" or importlib.util.find_spec("matplotlib") is None:
        return
    plan = "--model tiny --gpus 2 --gpus_per_node 2 --gpu_mem_gb 8 --peak_tflops 10 --link_gbps 100 --inter_gbps 5"
    layout = f"07_pipeline.py --schedule zb --global_batch_size 8 --micro_batch_size {8 // m}"
    plot = runpy.run_path(os.path.join(ROOT, "plot.py"))
    out = os.path.join(os.path.dirname(metrics), "measured.png")
    assert plot["main"](["--plan", plan, "--layout", layout, "--measured", metrics, "-o", out]) == 0
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    other = layout.replace("zb", "1f1b")  # another layout than the one measured: refused in one line
    assert plot["main"](["--plan", plan, "--layout", other, "--measured", metrics, "-o", out]) == 2
