"""plot.py: every kind of picture is rendered headless (Agg) to a valid PNG of a reasonable
size, from real runs: a training run's metrics (one file, and two compared), 02_collectives.py
--bench with the link's peak, and 07_pipeline.py's schedules; bad input is one line
`error: ...` and exit 2, matplotlib missing included."""

import os
import runpy
import struct
import subprocess
import sys

import pytest

from harness import ROOT, TINY, launch

PLOT = os.path.join(ROOT, "plot.py")
plot = runpy.run_path(PLOT)  # its functions, main() not run


def assert_png(path, min_bytes=10_000, max_bytes=2_000_000):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert 300 <= width <= 3000 and 100 <= height <= 3000, (width, height)
    assert min_bytes <= len(data) <= max_bytes, len(data)
    assert data.rstrip(b"\0")[-8:-4] == b"IEND", f"{path} is truncated"


def run_plot(args, capsys):
    """plot.py's main() in this process (matplotlib imported once): (status, stdout, stderr)."""
    status = plot["main"]([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module")
def metrics_files(tmp_path_factory):
    """A real 2-rank 03_ddp.py run's metrics and a 01_single_gpu.py run's, with evaluations."""
    needs_matplotlib()
    tmp = tmp_path_factory.mktemp("metrics")
    flags = TINY + ["--max_iters", "6", "--eval_interval", "3", "--eval_iters", "1", "--log_interval", "1"]
    ddp, single = tmp / "ddp.jsonl", tmp / "single.jsonl"
    launch("03_ddp.py", flags + ["--metrics", ddp], nprocs=2).ok()
    launch("01_single_gpu.py", flags + ["--metrics", single, "--sample_tokens", "0"]).ok()
    return ddp, single


def needs_matplotlib():
    pytest.importorskip("matplotlib", reason="matplotlib is optional (pip install matplotlib); .ci/run installs it")


def test_metrics_png(metrics_files, tmp_path, capsys):
    needs_matplotlib()
    ddp, _ = metrics_files
    out = tmp_path / "ddp.png"
    status, stdout, stderr = run_plot([ddp, "-o", out], capsys)
    assert status == 0 and not stderr, stderr
    assert stdout.strip() == f"wrote {out}"
    assert_png(out, min_bytes=40_000)


def test_metrics_compared_png_and_default_name(metrics_files, capsys):
    needs_matplotlib()
    ddp, single = metrics_files
    status, stdout, stderr = run_plot([ddp, single], capsys)
    assert status == 0, stderr
    assert_png(str(ddp)[:-len(".jsonl")] + ".png", min_bytes=40_000)  # next to the first file


def test_bench_png(tmp_path, capsys):
    needs_matplotlib()
    bench = tmp_path / "bench.jsonl"
    launch("02_collectives.py", ["--device", "cpu", "--bench", "--max_bytes", "65536", "--iters", "2",
                                 "--metrics", bench], nprocs=2, metrics=False, out_dir=False).ok()
    out = tmp_path / "bench.png"
    status, _, stderr = run_plot([bench, "--peak_gbps", "25", "-o", out], capsys)
    assert status == 0, stderr
    assert_png(out, min_bytes=20_000)


@pytest.mark.parametrize("schedule, flags", [("gpipe", []), ("1f1b", []),
                                             ("interleaved", ["--virtual_stages", "3"]), ("zbv", []), ("dualpipev", [])])
def test_schedule_png(tmp_path, capsys, schedule, flags):
    needs_matplotlib()
    out = tmp_path / f"{schedule}.png"
    status, _, stderr = run_plot(["--schedule", schedule, "--pp", "4", "--micro_batches", "8", *flags,
                                  "-o", out], capsys)
    assert status == 0, stderr
    assert_png(out)


PLAN = "--model tiny --n_layer 4 --gpus 4 --gpus_per_node 2 --gpu_mem_gb 8 --peak_tflops 10 --link_gbps 100 --inter_gbps 5"


@pytest.mark.parametrize("layout", ["07_pipeline.py --schedule zb --global_batch_size 8", "03_ddp.py"])
def test_plan_png(tmp_path, capsys, layout):
    """plan.py's simulated step of a layout, one row per role: a pipeline across two nodes (its
    messages drawn), and DDP's buckets under its backward."""
    needs_matplotlib()
    out = tmp_path / "plan.png"
    status, _, stderr = run_plot(["--plan", PLAN, "--layout", layout, "-o", out], capsys)
    assert status == 0, stderr
    assert_png(out)


def bad(tmp_path):
    not_json = tmp_path / "notes.txt"
    not_json.write_text("step 1: loss 4.2\n")
    other_json = tmp_path / "other.jsonl"
    other_json.write_text('{"name": "x", "value": 1}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    binary = tmp_path / "ckpt.pt"
    binary.write_bytes(b"\x80\x04\x95\xff\xfe\x00")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 4.2}\n')
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"op": "all_reduce", "bytes": 1024, "busbw_GBps": 1.5}\n')
    return [
        ([tmp_path / "missing.jsonl"], "no such file"),
        ([tmp_path], "is a directory"),
        ([not_json], "line 1 is not JSON"),
        ([other_json], "neither a training script's --metrics JSONL"),
        ([empty], "neither"),
        ([binary], "not"),
        ([metrics, bench], "different kinds"),
        ([metrics, "--schedule", "1f1b"], "one of the three"),
        ([], "one of the three"),
        (["--schedule", "interleaved", "--pp", "4", "--micro_batches", "6"], "multiple of --pp 4"),
        (["--schedule", "1f1b", "--pp", "0"], "--pp must be positive"),
        (["--schedule", "dualpipev", "--pp", "4", "--micro_batches", "4"], "dualpipev needs at least 2·pp = 8"),
        (["--schedule", "1f1b", "--pp", "1000", "--micro_batches", "1000"], "too many"),
        (["--schedule", "pipedream"], "invalid choice"),
        ([bench, "--peak_gbps", "nan"], "--peak_gbps must be a positive number"),
        ([metrics, "-o", tmp_path / "nowhere" / "x.png"], "does not exist"),
        ([metrics, "-o", tmp_path / "x.xyz"], "name a .png, .svg, .pdf file"),
        (["/dev/zero"], "not a regular file"),
        (["--layout", "03_ddp.py"], "give --plan too"),
        (["--plan", PLAN, "--schedule", "1f1b"], "one of the three"),
        (["--plan", PLAN.replace("--gpus 4", "--gpus 0")], "--gpus must be in"),
        (["--plan", PLAN, "--layout", "02_collectives.py"], "name a training script"),
        (["--plan", PLAN, "--layout", "07_pipeline.py --schedule interleaved --virtual_stages 3"], "07_pipeline.py: "),
    ]


def test_bad_input_is_one_line(tmp_path, capsys):
    for args, message in bad(tmp_path):
        status, stdout, stderr = run_plot(args, capsys)
        assert status == 2, (args, stdout, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, stderr)


def test_command_line_contract(tmp_path):
    """The real command: a missing file and matplotlib not installed (an import of it fails)."""
    p = subprocess.run([sys.executable, PLOT, str(tmp_path / "missing.jsonl")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr == f"error: {tmp_path / 'missing.jsonl'}: no such file\n", p.stderr
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 0, "loss": 4.2}\n')
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = [sys.argv[1]] + sys.argv[2:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, PLOT, str(metrics)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr == "error: plot.py needs matplotlib, an optional package: pip install matplotlib\n"


def test_odd_values_are_drawn_or_refused_in_one_line(tmp_path, capsys):
    """Rows that are metrics but whose values no real run writes (strings, lists, a number where
    a dict belongs, 1e308): what can be drawn is, the rest left out, never a traceback."""
    needs_matplotlib()
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"step": 0, "loss": 2.0, "state_bytes_theory": -1, "dt_ms_max": {"a": "b"}, "tokens_per_s": "x",'
                   ' "dt_ms_min": 1e308, "comm_bytes": {"send": "x", "recv": 4}, "activation_bytes": []}\n'
                   '{"step": -1, "loss": 1.0}\n{"step": 2.5, "val_loss": 1.9}\n{"step": 3, "loss": null}\n')
    status, _, stderr = run_plot([odd, "-o", tmp_path / "odd.png"], capsys)
    assert status == 0, stderr
    assert_png(tmp_path / "odd.png")
    only_bad_steps = tmp_path / "bad_steps.jsonl"
    only_bad_steps.write_text('{"step": -1, "loss": 1.0}\n{"step": "s", "loss": 1.0}\n')
    status, _, stderr = run_plot([only_bad_steps], capsys)
    assert status == 2 and stderr.startswith("error: ") and len(stderr.splitlines()) == 1, stderr
