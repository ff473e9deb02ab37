"""Hostile cases, tried as users on a cluster would (the Reliability III round), one test per
kind of failure, so that each kind stays fixed: damaged checkpoints that would load, runs that
would silently do something else, writes that fail, locks left by failed or dying jobs.
Launches are one process of 01 (every script shares these paths through infra.run.Run) unless
the case needs ranks; each ends with one line naming the cause, or with the right result."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import common
import infra.checkpoint
import infra.checkpoint_format
import infra.cli
import infra.data_check
import infra.fit
import infra.start
from harness import LAUNCHER_ENV, ROOT, TINY, dry, launch
from test_failures import committed, refused
from test_reliability import wait_for_rows

ONE = TINY + ["--sample_tokens", "0", "--ckpt_interval", "2", "--max_iters", "4", "--lr_decay_iters", "8"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A committed checkpoint of 01 at step 4 (and its metadata), copied fresh per test."""
    out = tmp_path_factory.mktemp("saved") / "out"
    launch("01_single_gpu.py", ONE + ["--out_dir", out]).ok()
    return out


def copy_of(saved, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    return out


def test_a_flipped_bit_in_a_rank_file_is_refused_naming_the_file_and_tensor(saved, tmp_path):
    out = copy_of(saved, tmp_path)
    (directory,) = [os.path.dirname(m) for m in committed(out)]
    rank0 = os.path.join(directory, "rank0.pt")
    weight = torch.load(rank0, weights_only=True)["model/transformer.h.0.mlp.c_fc.weight#0"]
    data = bytearray(open(rank0, "rb").read())
    at = data.find(weight.reshape(-1)[:16].numpy().tobytes())  # the tensor's bytes in the zip
    assert at > 0
    data[at + 8 * 4 + 2] ^= 0x10  # one bit of the 9th element
    open(rank0, "wb").write(bytes(data))
    run = launch("01_single_gpu.py", ONE + ["--out_dir", out, "--resume", "--max_iters", "6"])
    refused(run, f"checkpoint file {rank0}: model/transformer.h.0.mlp.c_fc.weight fails its checksum")
    meta = json.load(open(os.path.join(directory, "metadata.json")))
    assert len(meta["checksums"]) == 1 and "rng/cpu" in meta["checksums"][0]


def test_a_new_run_does_not_replace_another_runs_checkpoint(saved, tmp_path):
    out = copy_of(saved, tmp_path)
    message = f"--out_dir {out} holds the checkpoint of another run"
    refused(launch("01_single_gpu.py", ONE + ["--out_dir", out]), message)
    p = dry("01_single_gpu.py", "--world_size", 1, *ONE, "--out_dir", out)  # the dry run says the same
    assert p.returncode == 2 and message in p.stderr
    assert len(committed(out)) == 1
    launch("01_single_gpu.py", ONE + ["--out_dir", out, "--overwrite", "--max_iters", "2"]).ok()
    assert [os.path.basename(os.path.dirname(m)) for m in committed(out)] == ["step_2"]


def test_an_unfinished_set_is_named_and_an_older_committed_set_is_kept(saved, tmp_path):
    out = copy_of(saved, tmp_path)
    root = out / "ckpt"
    shutil.copytree(root / "step_4", root / "step_2")  # a user rolling back keeps an older set
    meta = json.load(open(root / "step_2" / "metadata.json"))
    (root / "step_2" / "metadata.json").write_text(json.dumps({**meta, "time": meta["time"] - 100}))
    (root / "step_6").mkdir()  # a write that did not finish: no metadata.json
    (root / "step_6" / "rank0.pt").write_bytes(b"half")
    run = launch("01_single_gpu.py", ONE + ["--out_dir", out, "--resume"]).ok()  # at step 4 of 4
    assert f"note: removing {root / 'step_6'}, the leftover of a checkpoint write" in run.stderr
    assert "nothing to train" in run.stdout
    assert sorted(os.listdir(root)) == ["step_2", "step_4"]
    shutil.rmtree(root / "step_2")
    shutil.rmtree(root / "step_4")
    (root / "step_6").mkdir()
    refused(launch("01_single_gpu.py", ONE + ["--out_dir", out, "--resume"]),
            f"--resume: {root / 'step_6'} has no metadata.json: its write did not finish")


def test_resume_export_of_a_finished_run_exports(saved, tmp_path):
    out = copy_of(saved, tmp_path)
    export = tmp_path / "model.pt"
    run = launch("01_single_gpu.py", ONE + ["--out_dir", out, "--resume", "--export", export]).ok()
    assert export.exists() and "exported step 4" in run.stdout
    assert torch.load(export, weights_only=True)["iter_num"] == 4


def test_a_metrics_file_that_cannot_be_written_stops_the_run_in_one_line(tmp_path):
    """/dev/full: every write fails with ENOSPC, as on a full disk."""
    run = launch("03_ddp.py", TINY + ["--metrics", "/dev/full", "--out_dir", tmp_path / "out"], nprocs=2)
    refused(run, "cannot write --metrics /dev/full: No space left on device; stopped before step 2's update")


def test_a_failed_torch_save_is_an_io_error_and_leaves_nothing(tmp_path, monkeypatch):
    def full(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="the write failed .* free on that file system; torch: .enforce fail"):
        infra.checkpoint_format.atomic_save({"x": torch.ones(2)}, str(tmp_path / "rank0.pt"))
    assert os.listdir(tmp_path) == []


def test_locks_of_failed_starts_and_of_zombies_are_stale(tmp_path):
    lock = tmp_path / "LOCK"
    lock.write_text("")  # a start that could not write its lock (disk full)
    assert not infra.start._lock_is_stale(str(lock), {})  # it may be being written right now
    old = time.time() - infra.start.LOCK_WRITE_S - 1
    os.utime(lock, (old, old))
    assert infra.start._lock_is_stale(str(lock), {})
    child = subprocess.Popen(["true"])  # exits; not reaped yet: a zombie answers kill(pid, 0)
    deadline = time.time() + 10
    while not infra.start._is_zombie(child.pid) and time.time() < deadline:
        time.sleep(0.05)
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": child.pid}))
    holder = json.loads(lock.read_text())
    try:
        assert infra.start._is_zombie(child.pid) and infra.start._lock_is_stale(str(lock), holder)
    finally:
        child.wait()
    assert infra.start.lock_out_dir(str(tmp_path), wait_s=1) is None  # taken over
    infra.start.release_out_dir()


@pytest.mark.skipif(not shutil.which("mpiexec"), reason="needs mpiexec")
def test_a_taken_master_port_is_one_line_and_ends_the_job_quickly(tmp_path):
    listener = socket.socket()  # a stray listener (or another job) on the port
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        run = launch("03_ddp.py", TINY + ["--timeout", "20"], nprocs=2, launcher="mpiexec",
                     env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    finally:
        listener.close()
    assert run.returncode != 0 and run.seconds < 20, run.stderr[-2000:]
    assert [line for line in run.error_lines] == [
        f"error: rank 0 could not join the process group at 127.0.0.1:{port}: port {port} on 127.0.0.1 is "
        "already taken (another job on this node, or a stray listener): set MASTER_PORT to a free port"]
    assert "Traceback" not in run.stderr


def test_rank_and_world_size_without_master_addr_is_one_line(tmp_path):
    run = launch("03_ddp.py", TINY, nprocs=1, env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29999"})
    refused(run, "RANK and WORLD_SIZE are set (a torchrun-style launch) but MASTER_ADDR is not")


def test_meta_pkl_top_level_vocab_size_only_and_numpy_integers(tmp_path):
    import pickle
    import numpy as np
    meta = tmp_path / "meta.pkl"
    for protocol in (2, 4):
        meta.write_bytes(pickle.dumps({"stoi": {"vocab_size": 7}, "vocab_size": 65}, protocol=protocol))
        assert common.read_vocab_size(str(meta)) == 65  # not the nested one
        meta.write_bytes(pickle.dumps({"vocab_size": np.int64(50304)}, protocol=protocol))
        assert common.read_vocab_size(str(meta)) == 50304  # numpy's integer, decoded, not unpickled
    meta.write_bytes(pickle.dumps({"itos": {"vocab_size": 7}}))
    with pytest.raises(ValueError, match="has no top-level vocab_size"):
        common.read_vocab_size(str(meta))
    meta.write_bytes(pickle.dumps({"vocab_size": 65.0}))
    with pytest.raises(ValueError, match="vocab_size is a float, not an integer"):
        common.read_vocab_size(str(meta))


def test_token_files_that_are_directories_or_shrink_under_the_job(tmp_path):
    from test_failures import dataset
    d = dataset(tmp_path / "data")
    (d / "train.bin").unlink()
    (d / "train.bin").mkdir()
    assert infra.data_check.data_problem(str(d), 64) == \
        f"--data {d}: {d / 'train.bin'} is a directory, not a token file"
    d = dataset(tmp_path / "data2")
    data = common.Data(str(d), 0, 64)
    x, _ = data.batch("train", 0, 4)
    assert x.shape == (4, 64)
    os.truncate(d / "train.bin", 200)  # a file rewritten under a running job: no SIGBUS, one line
    with pytest.raises(SystemExit) as stop:
        data.batch("train", 1, 4)
    assert stop.value.code == 2


# ---- every entry point keeps the contract: one line, status 2 ------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--gpus_per_node", "-4"], "--gpus_per_node must be a positive number, got -4"),
    (["--gpu_mem_gb", "-1"], "--gpu_mem_gb must be a positive number, got -1.0"),
    (["--link_gbps", "nan"], "--link_gbps must be a positive number, got nan"),
    (["--top", "-3"], "--top must not be negative, got -3"),
    (["--global_batch_size", str(10**12)], "--global_batch_size must be in 1..10,000,000"),
    (["--gpus", str(10**9)], "--gpus must be in 1..10,000,000"),
])
def test_plan_refuses_absurd_flags(capsys, flags, message):
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan", os.path.join(common.HERE, "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    argv = ["--model", "gpt2", "--gpus", "8", "--machine", "polaris"] + flags
    with pytest.raises(SystemExit) as stop:
        plan.parse(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert plan.divisors(10**9)[-3:] == [250000000, 500000000, 1000000000]  # without walking 10^9 integers


def test_plan_refuses_a_bench_file_that_is_not_02s(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan", os.path.join(common.HERE, "plan.py"))
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"op": "all_reduce", "world_size": "two"}\n')
    with pytest.raises(SystemExit) as stop:
        plan.parse(["--model", "gpt2", "--gpus", "8", "--machine", "polaris", "--bench", str(bench)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "not 02_collectives.py --bench output?" in err


@pytest.mark.parametrize("flags, message", [
    (["--timeout", "nan"], "--timeout must be a positive number of seconds"),
    (["--timeout", "-1"], "--timeout must be a positive number of seconds"),
    (["--metrics", "/nonexistent-gptpar/m.jsonl"], "--metrics /nonexistent-gptpar/m.jsonl: the directory"),
    (["--max_bytes", str(10**14)], "need 0 < --min_bytes <= --max_bytes <= 17179869184"),
])
def test_collectives_refuse_bad_flags(flags, message):
    run = launch("02_collectives.py", ["--device", "cpu"] + flags, metrics=False, out_dir=False)
    refused(run, message)


def test_scripts_refuse_an_absurd_batch_and_local_sh_bad_counts():
    p = dry("03_ddp.py", "--world_size", 2, "--global_batch_size", 10**12)
    assert p.returncode == 2 and "is more than 16,777,216 sequences per step" in p.stderr
    for args, message in ((["0", "03_ddp.py"], "the rank count must be a positive whole number, got '0'"),
                          (["2", "06_tensor_parallel.py", "--tp", "abc"], "--tp and --pp must be positive whole")):
        p = subprocess.run(["bash", os.path.join(common.HERE, "jobs", "local.sh"), *args], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and p.stderr.startswith(f"error: {message}"), p.stderr
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_dry_run_resume_needs_every_rank_file_and_data_spelling_does_not_matter(saved, tmp_path):
    out = copy_of(saved, tmp_path)
    (directory,) = [os.path.dirname(m) for m in committed(out)]
    meta = json.load(open(os.path.join(directory, "metadata.json")))
    assert meta["run"]["data"] == "shakespeare_char"
    os.remove(os.path.join(directory, "rank0.pt"))
    p = dry("01_single_gpu.py", "--world_size", 1, *ONE, "--out_dir", out, "--resume")
    assert p.returncode == 2 and f"checkpoint file {directory}/rank0.pt is missing" in p.stderr
    args = infra.cli.parse_args(common.make_parser(""), ["--data", str(tmp_path) + "/"])
    config = common.GPTConfig(vocab_size=65, **common.PRESETS["tiny"])
    assert infra.checkpoint.run_config(args, config, None)["data"] == str(tmp_path)


# ---- fits before it runs: costs() against the memory a rank can have ----------------------

def test_a_micro_batch_that_cannot_fit_is_refused_with_the_cheapest_fix(tmp_path):
    run = launch("01_single_gpu.py", ["--device", "cpu", "--global_batch_size", "2048", "--micro_batch_size", "256",
                                      "--max_iters", "1"])
    refused(run, "rank 0 needs 113.7 GiB (costs()'s peak + 50% + 768 MiB for transients) x 1 rank(s) on this node")
    fixes = run.error_lines[0].split("available: ")[1]
    assert fixes.startswith("--micro_batch_size ") and "--recompute fits" in fixes and run.seconds < 30


def test_a_model_state_that_cannot_fit_is_refused_before_it_is_built():
    run = launch("03_ddp.py", ["--model", "gpt2-xl", "--device", "cpu", "--max_iters", "1"], nprocs=2)
    refused(run, "x 2 rank(s) on this node")
    assert "the model state alone does not fit: shard it (04_zero.py --stage 3, 05_fsdp.py)" in run.error_lines[0]


def test_fit_problem_suggests_exactly_what_costs_says_fits(monkeypatch):
    """The suggestion is costs() evaluated at the changed flags: the largest divisor of the
    micro-batch whose need is within the room, and --recompute only if it fits."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("single", os.path.join(common.HERE, "01_single_gpu.py"))
    single = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(single)
    args = infra.cli.parse_args(common.make_parser(""), ["--device", "cpu", "--global_batch_size", "8"])
    args.micro_batch_size = 8
    env = common.Env(common.Launch("single"), torch.device("cpu"), "gloo", torch.float32)
    config = common.model_config(args, 65)

    def need(**changes):
        return infra.fit.fit_need(single.costs(common.argparse.Namespace(**{**vars(args), **changes}), config, 1,
                                            torch.float32), "cpu")
    monkeypatch.setattr(infra.fit, "memory_room", lambda env: need(micro_batch_size=4))  # 4 fits exactly
    problem = infra.fit.fit_problem(args, env, single.costs)
    assert "--micro_batch_size 4 fits (2x the accumulation steps)" in problem
    assert ("--recompute fits" in problem) == (need(recompute=True) <= need(micro_batch_size=4))
    monkeypatch.setattr(infra.fit, "memory_room", lambda env: need())
    assert infra.fit.fit_problem(args, env, single.costs) is None


def test_auto_chooses_the_largest_micro_batch_that_fits():
    """--micro_batch_size auto in a dry run for a GPU of a given size: the micro-batch chosen
    fits and the next larger divisor of the replica's 24 sequences does not."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("ddp", os.path.join(common.HERE, "03_ddp.py"))
    ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp)
    flags = ["--model", "gpt2", "--world_size", "2"]
    args = infra.cli.parse_args(ddp.add_flags(common.make_parser("")), flags + ["--dry_run"])

    def need(b):
        return infra.fit.rank_need(args, ddp.costs, 2, torch.bfloat16, "cuda", micro_batch_size=b)
    gpu_mem_gb = (need(4) + need(6)) / 2 / infra.fit.GPU_USABLE / 1e9  # room between the needs of 4 and 6
    out = dry("03_ddp.py", *flags, "--gpu_mem_gb", gpu_mem_gb).stdout
    assert "--micro_batch_size auto: 4 (of the 24 sequences per replica" in out and "fit: fits" in out, out
    assert "layout: 2 replicas, each 6 micro-batch(es) of 4 per step" in out
    out = dry("03_ddp.py", *flags, "--gpu_mem_gb", need(1) / 2 / 1e9).stdout  # nothing fits: the smallest, refused
    assert "--micro_batch_size auto: 1 " in out and "fit: does not fit: the model state alone does not fit" in out


def test_auto_in_a_launch_is_logged_agreed_and_in_the_metrics():
    """Every rank chooses, the smallest wins, the choice is logged and in every metrics row; a
    pipeline aims at m >= 2p micro-batches (8 sequences on 2 stages: micro-batches of 2)."""
    run = launch("07_pipeline.py", TINY + ["--global_batch_size", "8", "--max_iters", "2"], nprocs=2).ok()
    assert "--micro_batch_size auto: 2 (of the 8 sequences per replica, the largest that fits every rank, " \
           "at least 4 micro-batches)" in run.stdout
    assert run.steps and all(row["micro_batch_size"] == 2 for row in run.steps)


def test_a_checkpoint_written_before_the_moe_fields_still_resumes(saved, tmp_path):
    """metadata.json's model of a set written before --n_expert existed lacks its fields: they
    take their defaults (a dense model), so the set resumes instead of being 'another model'."""
    out = copy_of(saved, tmp_path)
    (directory,) = [os.path.dirname(m) for m in committed(out)]
    path = os.path.join(directory, "metadata.json")
    meta = json.load(open(path))
    for field in ("n_expert", "top_k", "aux_loss_coef"):
        meta["run"]["model"].pop(field, None)
    open(path, "w").write(json.dumps(meta))
    run = launch("01_single_gpu.py", ONE + ["--out_dir", out, "--resume", "--max_iters", "5"]).ok()
    assert [row["step"] for row in run.steps] == [4]


@pytest.mark.parametrize("stream", ["stdout", "stdout and stderr"])
def test_a_run_whose_output_reader_went_away_still_checkpoints_at_a_sigterm(tmp_path, stream):
    """`python 01_single_gpu.py ... | head`: the reader of the run's output exits mid-run.
    Python ignores SIGPIPE, so the next line printed raises BrokenPipeError; common.say then
    sends that stream to /dev/null and the run trains on: a SIGTERM still ends it with a
    committed checkpoint and exit 0 (the lines of the step log and of the stop go nowhere)."""
    out, metrics = tmp_path / "out", tmp_path / "m.jsonl"
    flags = TINY + ["--max_iters", "100000", "--lr_decay_iters", "100000", "--metrics", metrics, "--out_dir", out]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    run = subprocess.Popen([sys.executable, os.path.join(ROOT, "01_single_gpu.py"), *map(str, flags)],
                           env=dict(env, OMP_NUM_THREADS="1"), cwd=str(tmp_path), text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT if stream == "stdout and stderr" else subprocess.DEVNULL)
    try:
        for line in run.stdout:  # until training is under way
            if line.startswith("step 2:"):
                break
        run.stdout.close()
        rows = len(metrics.read_text().splitlines())
        wait_for_rows(metrics, rows + 4, seconds=20)  # several step lines printed into the closed pipe
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0 and committed(out) and "LOCK" not in os.listdir(out)
    assert len(metrics.read_text().splitlines()) > rows + 4


@pytest.mark.parametrize("flags,line", [
    (["--wandb", ""], "--wandb needs a project name, got an empty one (an unset variable in a job script?): "
                      "name the project, or leave --wandb out"),
    (["--out_dir", ""], "--out_dir is empty (an unset variable in a job script?): name a directory"),
])
def test_an_empty_variable_in_a_job_script_is_named(flags, line):
    """`--wandb "$PROJECT"` or `--out_dir "$OUT"` with the variable unset: one line saying so,
    not a run with wandb silently off or a directory named ''."""
    p = dry("03_ddp.py", "--world_size", 2, *flags)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"error: {line}"], p.stderr


def test_a_default_top_k_above_the_experts_says_it_is_the_default():
    p = dry("10_expert_parallel.py", "--world_size", 1, "--n_expert", 1)
    assert p.returncode == 2 and p.stderr.strip() == \
        "error: --top_k must be in [1, n_expert = 1], got 2 (the default: pass --top_k)", p.stderr
    p = dry("10_expert_parallel.py", "--world_size", 1, "--n_expert", 1, "--top_k", 3)
    assert p.returncode == 2 and p.stderr.strip() == "error: --top_k must be in [1, n_expert = 1], got 3", p.stderr


def fake_cgroup(tmp_path, monkeypatch, version, limit, usage):
    """Point infra at a made-up memory cgroup of this process: v2 (one hierarchy) or v1."""
    if version == 2:
        proc, folder, files = "0::/job.slice\n", tmp_path / "job.slice", ("memory.max", "memory.current")
    else:
        proc, folder = "12:cpu,cpuacct:/slurm/job\n5:memory:/slurm/job\n", tmp_path / "memory" / "slurm" / "job"
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    folder.mkdir(parents=True)
    (folder / files[0]).write_text(f"{limit}\n")
    (folder / files[1]).write_text(f"{usage}\n")
    (tmp_path / "cgroup").write_text(proc)
    monkeypatch.setattr(infra.fit, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(infra.fit, "PROC_SELF_CGROUP", str(tmp_path / "cgroup"))


@pytest.mark.parametrize("version", [1, 2])
def test_the_room_on_cpu_honours_the_jobs_memory_cgroup(tmp_path, monkeypatch, version):
    """Slurm's --mem, PBS's mem= or a shared node put the job in a memory cgroup whose limit
    the OOM killer enforces long before MemAvailable runs out (a bare 01 under a 3 GiB limit
    chose micro-batch 48 from MemAvailable and was killed): the room is the least of the two."""
    host = infra.fit.host_available()
    fake_cgroup(tmp_path, monkeypatch, version, limit=3 * 2**30, usage=2**30)
    assert infra.fit.cgroup_room() == 2 * 2**30
    assert infra.fit.host_available() == min(host, 2 * 2**30)
    unlimited = "max" if version == 2 else str(2**63 - 4096)
    (tmp_path / ("job.slice/memory.max" if version == 2 else "memory/slurm/job/memory.limit_in_bytes")).write_text(
        unlimited + "\n")
    assert infra.fit.cgroup_room() is None


def test_a_dry_run_on_cpu_chooses_for_the_cgroups_room(tmp_path, monkeypatch):
    """The same command, the same host: a small cgroup makes --micro_batch_size auto choose a
    smaller micro-batch, and the verdict name the room it was made for."""
    flags = ["--world_size", 1, "--device", "cpu", "--model", "shakespeare", "--global_batch_size", 64]
    roomy = dry("01_single_gpu.py", *flags)
    fake_cgroup(tmp_path, monkeypatch, 2, limit=1200 * 2**20, usage=0)
    tight = dry("01_single_gpu.py", *flags)
    chosen = [int(re.search(r"--micro_batch_size auto: (\d+)", p.stdout).group(1)) for p in (roomy, tight)]
    assert roomy.returncode == tight.returncode == 0 and chosen[1] < chosen[0], (chosen, tight.stdout)
    assert "room 1.2 GiB" in tight.stdout or "room 1.1 GiB" in tight.stdout, tight.stdout


def test_the_room_honours_the_address_space_limit():
    """ulimit -v (RLIMIT_AS): what this process may still map, within the host's share."""
    code = ("import resource, infra.fit; resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.RLIM_INFINITY)); "
            "room = infra.fit.address_space_room(); share = infra.fit.host_room(1); "
            "assert 0 < room < 8 * 2**30 and share <= room, (room, share); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.stdout.strip() == "ok", done.stderr
