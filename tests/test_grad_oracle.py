"""The gradient oracle (--check_gradients, infra/numerics.py, docs/numerics.md): at step 0 every
script at a representative layout reassembles its whole gradient from its checkpoint pieces
and finds every tensor inside the bound derived from the arithmetic (exit 0), and every bug of
the zoo that changes the gradient (tests/bug_zoo.py, gradient=CAUGHT) puts a tensor outside it
(exit 4), with clipping off: the 2x scales AdamW hides from the losses included.

One step per launch (the run stops after step 0's backward), against 01's gradient written
once per model (dense, and the mixture of experts for 10)."""

import sys

import pytest

from bug_zoo import BUGS, CAUGHT, MOE, NOT_GRADIENT
from harness import ROOT, TINY, launch
from test_bug_zoo import apply

sys.path.insert(0, ROOT)
from infra.numerics import GRADIENT_BUG_EXIT, bound_factor, gamma, reduction_lengths  # noqa: E402

FLAGS = TINY + ["--max_iters", "1", "--micro_batch_size", "2"]


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """01's step-0 gradient and Σ_m|g_m|, dense and with experts: {moe?: path}."""
    out = {}
    for moe in (False, True):
        path = str(tmp_path_factory.mktemp("ref") / "ref.pt")
        run = launch("01_single_gpu.py", FLAGS + ["--sample_tokens", "0", "--check_gradients", path]
                     + (list(MOE) if moe else []), metrics=False).ok()
        assert f"wrote 01's gradient at step 0" in run.stdout
        out[moe] = path
    return out


def verdict(run):
    return [line for line in run.stdout.splitlines() if line.startswith("gradient oracle: ")][-1]


LAYOUTS = [  # (ranks, script, flags): every axis once, 08 at 8 ranks with each of its kinds
    (2, "03_ddp.py", ()),
    (2, "04_zero.py", ("--stage", "3", "--offload")),
    (4, "05_fsdp.py", ("--replicate", "2")),
    (2, "06_tensor_parallel.py", ("--sequence_parallel",)),
    (2, "07_pipeline.py", ("--schedule", "zbv")),
    (8, "08_3d.py", ("--tp", "2", "--pp", "2", "--cp", "2", "--cp_impl", "ulysses")),
    (8, "08_3d.py", ("--tp", "2", "--pp", "2", "--zero1", "--sequence_parallel")),
    (2, "09_context_parallel.py", ("--cp", "2", "--cp_impl", "ring")),
    (2, "10_expert_parallel.py", MOE + ("--ep", "2")),
]


@pytest.mark.parametrize("ranks,script,flags", LAYOUTS, ids=[f"{s[:2]}{''.join(f)}" for _, s, f in LAYOUTS])
def test_every_layout_is_inside_its_bound(refs, ranks, script, flags):
    run = launch(script, FLAGS + list(flags) + ["--check_gradients", refs["--n_expert" in flags]], nprocs=ranks,
                 metrics=False).ok()
    rows = [line for line in run.stdout.splitlines() if line.endswith(" OK")]
    assert len(rows) >= 52 and "BUG" not in run.stdout, run.stdout[-3000:]
    assert verdict(run).startswith("gradient oracle: OK"), verdict(run)


def test_bf16_autocast_is_inside_its_bound(tmp_path):
    """Under bf16 autocast (CPU's): the r term, 2(γ_n + γ_r(2^-8)), for TP + SP's split matmuls."""
    flags = [f if f != "float32" else "bfloat16" for f in FLAGS] + ["--check_gradients", str(tmp_path / "ref.pt")]
    launch("01_single_gpu.py", flags + ["--sample_tokens", "0"], metrics=False).ok()
    run = launch("06_tensor_parallel.py", flags + ["--sequence_parallel"], nprocs=2, metrics=False).ok()
    assert "r = 2LT = 16" in run.stdout and verdict(run).startswith("gradient oracle: OK"), run.stdout[-3000:]


GRADIENT_BUGS = [bug for bug in BUGS if bug.gradient == CAUGHT]


@pytest.mark.parametrize("bug", GRADIENT_BUGS, ids=[bug.name for bug in GRADIENT_BUGS])
def test_every_gradient_bug_is_outside(refs, bug, tmp_path):
    script = apply(bug, str(tmp_path))
    layout = list(bug.flags)
    for flag in ("--max_iters", "--ckpt_interval"):  # one step here, and no checkpoint
        if flag in layout:
            del layout[layout.index(flag):layout.index(flag) + 2]
    run = launch(script, FLAGS + layout + ["--check_gradients", refs["--n_expert" in layout]], nprocs=bug.ranks,
                 metrics=False)
    assert run.returncode == GRADIENT_BUG_EXIT, \
        f"{bug.name}: exit {run.returncode}\n{run.stdout[-3000:]}{run.stderr[-2000:]}"
    assert verdict(run).startswith("gradient oracle: BUG"), verdict(run)


def test_every_bug_has_a_gradient_verdict():
    """Each bug says whether the gradient oracle catches it, or why its gradient is right."""
    assert len(GRADIENT_BUGS) >= 12
    for bug in BUGS:
        assert bug.gradient == CAUGHT or bug.gradient in NOT_GRADIENT, bug.name


def test_the_zoo_table_says_the_same():
    """docs/bugs.md's table: the gradient oracle's column is the zoo's verdict, bug by bug."""
    import os
    rows = {line.split("|")[1].strip(" `"): line.split("|")[5].strip()
            for line in open(os.path.join(ROOT, "docs", "bugs.md")) if line.startswith("| `")}
    assert set(rows) == {bug.name for bug in BUGS}
    for bug in BUGS:
        assert (rows[bug.name] == "caught") == (bug.gradient == CAUGHT), (bug.name, rows[bug.name])


def test_a_missing_or_mismatched_reference_is_one_line(refs, tmp_path):
    """Only 01 writes a reference; a run with other micro-batches than the reference's is refused."""
    run = launch("03_ddp.py", FLAGS + ["--check_gradients", str(tmp_path / "none.pt")], nprocs=2, metrics=False)
    assert run.returncode == 2 and run.error_lines[0].startswith("error: --check_gradients") \
        and "write 01's gradient first" in run.error_lines[0], run.stderr[-2000:]
    run = launch("01_single_gpu.py", FLAGS + ["--micro_batch_size", "4", "--check_gradients", refs[False]],
                 metrics=False)
    assert run.returncode == 2 and "micro_batch_size (2 there, 4 here)" in run.error_lines[0], run.stderr[-2000:]


def test_the_bound_is_the_summation_bound():
    """2(γ_n(2^-24) + γ_r(2^-8)) with n, r from the layout, in costs()' letters."""
    from types import SimpleNamespace
    args = SimpleNamespace(micro_batch_size=2, global_batch_size=8, dtype="float32")
    config = SimpleNamespace(block_size=64, n_embd=64, n_layer=4, top_k=0)
    assert reduction_lengths(args, config, {"strategy": "data parallel"}, 2)[0] == ("M", 4)
    assert reduction_lengths(args, config, {"strategy": "tensor parallel", "sequence_parallel": True}, 2)[0] \
        == ("M + 4h + bs", 4 + 256 + 128)
    assert reduction_lengths(args, config, {"strategy": "3d", "pp": 2, "tp": 2, "cp": 2, "cp_impl": "ring"}, 8)[0][0] \
        == "2M + 4h + bs + s"
    args.dtype = "bfloat16"
    assert reduction_lengths(args, config, {"strategy": "3d", "tp": 2}, 2)[1] == ("2LT", 16)
    assert gamma(4, 2.0 ** -24) == pytest.approx(4 * 2.0 ** -24)
    assert bound_factor(4, 0) == pytest.approx(2 * gamma(4, 2.0 ** -24))
