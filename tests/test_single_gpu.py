"""01_single_gpu.py end to end on CPU: the loss falls, the metrics follow the schema,
resume is bit-exact, bad input gets one line, and every script flag works."""

import shutil

import pytest

from harness import TINY, launch

SCRIPT = "01_single_gpu.py"
KEYS = {"step", "loss", "lr", "dt_ms", "tokens_per_s", "mfu", "mem_peak_bytes", "mem_host_bytes",  # docs/design.md
        "state_bytes", "comm_bytes", "state_bytes_theory", "comm_bytes_theory", "activation_bytes",
        "activation_bytes_theory", "micro_batch_size", "dt_ms_min", "dt_ms_max", "dt_ms_mean", "dt_ms_max_rank",
        "dt_ms_max_host", "grad_norm", "comm_calls", "comm_calls_theory"}
# (mem_peak_bytes_min/max/mean/max_rank/max_host join them on a GPU, where mem_peak_bytes is known)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    export = tmp_path_factory.mktemp("export") / "weights.pt"
    run = launch(SCRIPT, TINY + ["--max_iters", "40", "--eval_interval", "20", "--eval_iters", "2",
                                 "--sample_tokens", "40", "--ckpt_interval", "40", "--export", export]).ok()
    run.export = export
    return run


def test_loss_falls_and_metrics_follow_the_schema(long_run):
    losses = long_run.losses
    assert len(losses) == 40 and losses[-1] < losses[0] - 0.8, losses
    step = long_run.steps[-1]
    assert set(step) == KEYS and step["mfu"] is None and step["mem_peak_bytes"] is None
    assert step["mem_host_bytes"] is None  # nothing offloaded (--offload: tests/test_memory.py)
    n_bytes = step["state_bytes"]["params"]  # 4 bytes per parameter: 16Ψ in all
    assert step["state_bytes"] == {"params": n_bytes, "grads": n_bytes, "optim": 2 * n_bytes}
    assert step["comm_bytes"] == {}
    assert [e["step"] for e in long_run.evals] == [0, 20, 40]
    assert long_run.evals[-1]["val_loss"] < long_run.evals[0]["val_loss"] - 0.8
    assert "sample:" in long_run.stdout and "ledger (rank 0)" in long_run.stdout


def test_accumulation_gives_the_same_losses():
    whole = launch(SCRIPT, TINY + ["--sample_tokens", "0"]).ok()
    micro = launch(SCRIPT, TINY + ["--sample_tokens", "0", "--micro_batch_size", "2"]).ok()
    assert micro.losses == pytest.approx(whole.losses, rel=2e-5)


def test_resume_is_bit_exact(tmp_path):
    common = TINY + ["--max_iters", "8", "--lr_decay_iters", "8", "--sample_tokens", "0",
                     "--dropout", "0.1", "--out_dir", str(tmp_path)]  # dropout: RNG state resumes too
    whole = launch(SCRIPT, common).ok()
    first = launch(SCRIPT, common[:-2] + ["--out_dir", str(tmp_path), "--max_iters", "4",
                                          "--ckpt_interval", "4"]).ok()
    second = launch(SCRIPT, common + ["--resume"]).ok()
    assert first.losses == whole.losses[:4]
    assert second.losses == whole.losses[4:]  # exactly, not approximately


# (refusals of another run's and of damaged checkpoints: test_checkpoints.py)


def test_init_from_and_eval_only_reproduce_the_final_evaluation(long_run, tmp_path):
    shutil.copy(long_run.export, tmp_path / "weights.pt")  # --export: the final checkpoint in one file
    ev = launch(SCRIPT, TINY + ["--eval_only", "--eval_iters", "2", "--eval_interval", "20",
                                "--sample_tokens", "40", "--init_from", str(tmp_path / "weights.pt")]).ok()
    assert ev.evals[0]["val_loss"] == pytest.approx(long_run.evals[-1]["val_loss"], rel=1e-6)
    assert ev.losses == []
    # the same sample as at the end of training: the same weights and generator seed
    assert ev.stdout.split("sample:")[1] == long_run.stdout.split("sample:")[1]
    other = launch(SCRIPT, TINY + ["--eval_only", "--n_layer", "2", "--init_from", str(tmp_path / "weights.pt")])
    assert other.returncode == 2 and "another model" in other.error_lines[0]


def test_compile_gives_the_same_losses():
    eager = launch(SCRIPT, TINY + ["--max_iters", "3", "--sample_tokens", "0"]).ok()
    compiled = launch(SCRIPT, TINY + ["--max_iters", "3", "--sample_tokens", "0", "--compile"],
                      timeout=600).ok()
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--model", "gpt5"], "invalid choice: 'gpt5'"),
    (["--micro_batch_size", "3"], "not divisible by micro_batch_size 3"),
    (["--n_embd", "30"], "n_embd 30 is not divisible by n_head 4"),
    (["--data", "/nonexistent/corpus"], "no such directory"),
    (["--max_iters", "0"], "--max_iters must be positive"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--sample_tokens", "-1"], "--sample_tokens must not be negative"),
    (["--device", "cuda"], "--device cuda is not available"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_input_gives_one_line(flags, message):
    run = launch(SCRIPT, TINY + flags, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.error_lines == [line for line in run.stderr.splitlines() if line.strip()], run.stderr
    assert len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr


def test_refuses_more_than_one_process():
    # two ranks with torchrun's variables (the fork server's, as torchrun sets them; the real
    # launchers' own variables: test_launch.py)
    run = launch(SCRIPT, TINY, nprocs=2, timeout=120)
    assert run.returncode != 0
    assert sum("runs as one process, not 2" in line for line in run.error_lines) == 1
