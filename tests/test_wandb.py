"""--wandb PROJECT: rank 0 logs every metrics row (the same keys, nested ones flattened, the
ledger's theory next to the measurement) and the run's configuration to Weights & Biases, in
offline mode as on compute nodes without internet; the run's offline directory is read back
(the transaction log, .wandb, wandb's LevelDB-style record file). Without the optional wandb
package, --wandb is one line and exit 2."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from harness import ROOT, TINY, launch

BASE = TINY + ["--global_batch_size", "8", "--max_iters", "3", "--log_interval", "1",
               "--eval_interval", "2", "--eval_iters", "1"]


def wandb_records(run_dir):
    """The protobuf records of an offline run's .wandb file: a 7-byte header (':W&B', magic,
    version), then LevelDB log records in 32 KiB blocks (crc32, length, type: full, first,
    middle, last), each a wandb_internal Record."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    block, pos, pieces, records = 32768, 7, [], []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += block - pos % block
            continue
        pieces.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # full, or the last piece of a record split over blocks
            record = pb.Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
            pieces = []
    return records


def flat(row, prefix=""):
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}/"))
        elif value is not None:
            out[prefix + key] = value
    return out


def test_wandb_offline_run_holds_the_metrics_rows_and_the_config(tmp_path):
    pytest.importorskip("wandb", reason="wandb is optional (pip install wandb); .ci/run installs it")
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    run = launch("03_ddp.py", BASE + ["--wandb", "gptpar-test"], nprocs=2,
                 env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}).ok()
    assert "wandb: run" in run.stdout and "wandb sync" in run.stdout  # where the offline run is
    runs = glob.glob(str(wandb_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1, f"rank 0 alone opens a run, found {runs}"
    records = wandb_records(runs[0])

    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started.project == "gptpar-test"
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["script"] == "03_ddp.py" and config["world_size"] == 2
    assert config["global_batch_size"] == 8 and config["preset"] == "tiny"
    assert config["model"]["n_layer"] >= 1  # the resolved model configuration

    history = {}  # wandb step -> the keys logged at it (an evaluation and a step share one)
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
    expected = {}
    for row in run.metrics:
        expected.setdefault(row["step"], {}).update(flat(row))
    assert sorted(history) == sorted(expected) == [0, 1, 2, 3]
    for step, row in expected.items():
        # (the guard's flags: checked and taken out of run.metrics by the harness, logged here)
        logged = {k: v for k, v in history[step].items() if not k.startswith("_") and "[guard]" not in k}
        row = {k: v for k, v in row.items() if "[guard]" not in k}  # (its calls, which the harness keeps)
        assert logged.keys() == row.keys(), f"step {step}: {sorted(logged.keys() ^ row.keys())}"
        for key, value in row.items():
            assert logged[key] == pytest.approx(value) if isinstance(value, float) else logged[key] == value, key
    # the ledger's theory next to its measurement, per operation
    step0 = history[0]
    assert step0["comm_bytes/all_reduce"] == step0["comm_bytes_theory/all_reduce"] > 0
    assert step0["state_bytes/params"] == step0["state_bytes_theory/params"] > 0
    assert step0["dt_ms_max_rank"] in (0, 1) and step0["micro_batch_size"] == 4


def test_wandb_not_installed_is_one_line():
    """As where wandb is not installed: an import of it fails (sys.modules entry None)."""
    code = ("import runpy, sys; sys.modules['wandb'] = None; "
            "sys.argv = ['01_single_gpu.py'] + sys.argv[1:]; "
            "runpy.run_path('01_single_gpu.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, *TINY, "--max_iters", "1", "--wandb", "proj"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == ["error: --wandb proj: the wandb package is not installed "
                                              "(it is optional: pip install wandb)"]


def test_wandb_that_cannot_start_is_one_agreed_line(tmp_path):
    """Online without an API key (a compute node without WANDB_MODE=offline): rank 0's failure
    to start the run is one line, and both ranks exit 2 before training."""
    pytest.importorskip("wandb", reason="wandb is optional (pip install wandb); .ci/run installs it")
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(tmp_path), "WANDB_DIR": str(tmp_path),
           "WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_BASE_URL": "http://127.0.0.1:9",
           "WANDB_INIT_TIMEOUT": "20", "WANDB_SILENT": "true"}
    run = launch("03_ddp.py", BASE + ["--wandb", "gptpar-test"], nprocs=2, env=env)
    assert run.returncode == 2, run.stderr
    assert len(run.error_lines) == 1 and run.error_lines[0].startswith(
        "error: --wandb gptpar-test: wandb could not start a run: "), run.stderr
    assert "Traceback" not in run.stderr and not run.steps
