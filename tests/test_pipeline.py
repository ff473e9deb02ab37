"""07_pipeline.py: the schedules against textbook orders, the drawn timeline and its bubble,
then losses equal to 01's for every schedule at pp = 2 and 4 (zero bubble also at 3) with
several micro-batch counts, the ledger (every stage's activations), resume and refusals."""

import importlib

import pytest

from harness import TINY, assert_losses_match, launch

pp = importlib.import_module("07_pipeline")


def ops(text):
    """'F0 F1 B0' -> [("F", 0, 0), ...]; 'F0b' is chunk 1; I0 zero bubble's input gradient."""
    return [(t[0], int(t[1:].rstrip("ab")), 1 if t.endswith("b") else 0) for t in text.split()]


@pytest.mark.parametrize("kind, p, m, expected", [
    ("gpipe", 2, 3, ["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"]),
    ("1f1b", 2, 4, ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]),
    ("1f1b", 4, 4, ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 B0 F3 B1 B2 B3",
                    "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]),
    ("1f1b", 4, 2, ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]),
    # Narayanan et al. 2021, p = 2, v = 2, m = 4: chunks visited in groups of p micro-batches
    ("interleaved", 2, 4, ["F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a B2b B3b B2a B3a",
                           "F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a"]),
    # ZB-H1 (Qi et al. 2023, Fig. 3; the paper's B is our I), p = 4, m = 6: 1F1B's F/B order,
    # stage r defers its first r Ws, each later I takes the oldest W, the deferred ones fill the tail
    ("zb", 4, 6, ["F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5",
                  "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5",
                  "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 I5 W3 W4 W5",
                  "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5"]),
])
def test_orders_equal_the_textbook(kind, p, m, expected):
    for rank in range(p):
        assert pp.schedule(kind, p, rank, m, 2 if kind == "interleaved" else 1) == ops(expected[rank])


@pytest.mark.parametrize("kind, p, m, v", [
    ("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 4, 1), ("1f1b", 3, 7, 1), ("1f1b", 4, 16, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 3, 6, 3),
    ("zb", 2, 4, 1), ("zb", 3, 7, 1), ("zb", 4, 8, 1), ("zb", 4, 2, 1)])
def test_drawn_bubble_equals_theory_and_timeline_is_well_formed(kind, p, m, v):
    orders = [pp.schedule(kind, p, r, m, v) for r in range(p)]
    text, bubble = pp.draw(pp.simulate(orders, p, v), p, v)
    assert bubble == pytest.approx(pp.bubble_theory(kind, p, m, v))
    rows = text.splitlines()
    assert len(rows) == p and len({len(row) for row in rows}) == 1
    for r, row in enumerate(rows):
        cells = row.split()[2:]
        labels = [c for c in cells if c != "."]
        assert len(labels) == (3 if kind == "zb" else 2) * m * v == len(set(labels))  # every F, B (I, W) once
        assert (cells[0] == ".") == (r > 0)  # a later stage waits for the first activation


def test_1f1b_holds_fewer_activations_than_gpipe():
    """The peak number of micro-batches whose forward is done and backward is not."""
    def peak(order):
        live = top = 0
        for kind, _, _ in order:
            live += 1 if kind == "F" else -1
            top = max(top, live)
        return top
    p, m = 4, 8
    assert [peak(pp.schedule("gpipe", p, r, m)) for r in range(p)] == [8, 8, 8, 8]
    assert [peak(pp.schedule("1f1b", p, r, m)) for r in range(p)] == [4, 3, 2, 1]


def test_zero_bubble_is_a_third_of_1f1b_and_holds_p_micro_batches_per_stage():
    """ZB-H1: the bubble (p-1)/(3m+p-1) against 1F1B's (p-1)/(m+p-1), which tends to a
    third; a micro-batch is held from F to W (whole until B, its W tensors after), and every
    stage holds at most p: stage 0's 1F1B peak, now on every stage."""
    for p, m in ((4, 8), (4, 16), (8, 64)):
        zb, one = pp.bubble_theory("zb", p, m, 1), pp.bubble_theory("1f1b", p, m, 1)
        assert zb < one / 2 and zb == pytest.approx((p - 1) / (3 * m + p - 1))
    ratio = pp.bubble_theory("zb", 8, 1000, 1) / pp.bubble_theory("1f1b", 8, 1000, 1)
    assert ratio == pytest.approx(1 / 3, rel=0.01)

    def peak(order):
        live = top = 0
        for kind, _, _ in order:
            live += {"F": 1, "I": 0, "W": -1}[kind]
            top = max(top, live)
        return top
    for p, m in ((4, 8), (3, 3), (4, 2)):
        assert [peak(pp.schedule("zb", p, r, m)) for r in range(p)] == [min(p, m)] * p


BASE = TINY + ["--global_batch_size", "24", "--max_iters", "5", "--grad_clip", "0.05",
               "--eval_interval", "5", "--eval_iters", "1"]
EIGHT_LAYERS = ["--n_layer", "8"]


@pytest.fixture(scope="module")
def reference():
    return {name: launch("01_single_gpu.py", BASE + extra + ["--sample_tokens", "0"]).ok()
            for name, extra in (("tiny", []), ("eight", EIGHT_LAYERS))}


CASES = [  # (pp, schedule, virtual stages, micro-batch size -> m = 24 / micro, model)
    (2, "gpipe", 1, 6, "tiny"), (2, "1f1b", 1, 3, "tiny"),
    (4, "1f1b", 1, 3, "tiny"), (4, "1f1b", 1, 12, "tiny"),
    (2, "interleaved", 2, 6, "tiny"), (4, "interleaved", 2, 6, "eight"),
    (1, "interleaved", 4, 6, "tiny"),
    (2, "zb", 1, 6, "tiny"), (3, "zb", 1, 4, "tiny"), (4, "zb", 1, 3, "tiny"), (4, "zb", 1, 12, "tiny"),
    (1, "zb", 1, 6, "tiny"),
]


@pytest.mark.parametrize("ranks, kind, v, micro, model", CASES)
def test_losses_and_ledger(reference, ranks, kind, v, micro, model):
    flags = BASE + (EIGHT_LAYERS if model == "eight" else []) + [
        "--schedule", kind, "--virtual_stages", v, "--micro_batch_size", micro, "--pp", ranks]
    run = launch("07_pipeline.py", flags, nprocs=ranks).ok()
    what = f"pp={ranks} {kind} v={v} m={24 // micro}"
    assert_losses_match(reference[model], run, what=what)
    assert run.evals[-1]["val_loss"] == pytest.approx(reference[model].evals[-1]["val_loss"], rel=2e-5)
    m = 24 // micro
    order = pp.schedule(kind, ranks, 0, m, v if kind == "interleaved" else 1)
    step = run.steps[0]
    # rank 0 (the first stage): sends its forward outputs and the gradients of chunks > 0
    bsh = micro * 64 * 64 * 4
    sends = sum(1 for k, i, c in order if (k == "F" and c * ranks < ranks * v - 1) or (k in "BI" and c > 0))
    if ranks > 1:
        assert step["comm_bytes"]["send"] == sends * bsh == step["comm_bytes"]["recv"]
        assert step["comm_bytes"]["all_reduce[embedding]"] == 65 * 64 * 4  # tied wte gradient, its own group
        assert step["comm_bytes"]["all_reduce"] == 4  # the norm, over every stage
    assert step["comm_bytes"].get("broadcast", 0) == (4 if ranks > 1 else 0)  # the logged loss (none in one stage)
    live = top = 0
    for k, _, _ in order:  # held from F to B, or with zero bubble from F to W
        live += 1 if k == "F" else -1 if k == ("W" if kind == "zb" else "B") else 0
        top = max(top, live)
    assert step["activations_in_flight"] == top
    assert "ledger mismatch" not in run.stderr, run.stderr[-2000:]  # every stage's activations too
    assert step["bubble_drawn"] == pytest.approx(step["bubble_theory"])
    assert "schedule (unit-cost replay" in run.stdout and "stage 0" in run.stdout


def test_resume_is_bit_exact(tmp_path):
    flags = BASE + ["--schedule", "1f1b", "--micro_batch_size", "6", "--max_iters", "4", "--lr_decay_iters", "4",
                    "--dropout", "0.1", "--eval_interval", "0"]
    whole = launch("07_pipeline.py", flags + ["--out_dir", tmp_path / "w"], nprocs=2).ok()
    first = launch("07_pipeline.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2",
                                              "--ckpt_interval", "2"], nprocs=2).ok()
    second = launch("07_pipeline.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=2).ok()
    assert first.losses + second.losses == whole.losses


@pytest.mark.parametrize("ranks, flags, message", [
    (3, ["--n_layer", "2"], "n_layer 2 is fewer than pp 3"),  # stages may be uneven, not empty
    (2, ["--schedule", "interleaved", "--virtual_stages", "4", "--micro_batch_size", "6"],
     "n_layer 4 is fewer than pp 2 x virtual_stages 4"),
    (2, ["--schedule", "interleaved", "--micro_batch_size", "8"],
     "needs the number of micro-batches (3) to be a multiple of pp 2"),
    (2, ["--pp", "4"], "--pp 4 must equal the world size 2"),
])
def test_bad_input_gives_one_line(ranks, flags, message):
    run = launch("07_pipeline.py", BASE + flags, nprocs=ranks, timeout=60)
    assert run.returncode != 0 and len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr
