"""06_tensor_parallel.py: the parallel layers and the vocab-parallel loss against their
single-device definitions; full-model losses equal 01's at tp = 2, 3 and 4, with and without
sequence parallelism; the ledger; resume (a rank's own dropout stream saved on another device
type starts afresh); refusals."""

import json
import shutil
import zlib

import pytest
import torch

from harness import TINY, assert_losses_match, launch

BASE = TINY + ["--global_batch_size", "8", "--max_iters", "5", "--grad_clip", "0.05"]
SIX_HEADS = ["--n_head", "6", "--n_embd", "48", "--block_size", "48"]  # for tp = 3


@pytest.mark.parametrize("ranks", [2, 3])
def test_parallel_layers_and_loss_equal_their_definitions(ranks):
    run = launch("tests/tp_units.py", nprocs=ranks, metrics=False, out_dir=False, timeout=120).ok()
    assert run.stdout.count("TP-UNITS OK") == ranks


def test_layers_and_norms_work_unchanged_on_a_sub_group(tmp_path):
    """06's model, sequence-parallel gradient all-reduce and clipping norm, handed the TP
    groups {0, 1} and {2, 3} of a 4-rank world (two replicas fed other data), compute exactly
    what they compute on a 2-rank world of their own: no collective falls back to the world."""
    alone, mesh = tmp_path / "alone", tmp_path / "mesh"
    alone.mkdir(), mesh.mkdir()
    for ranks, out in ((2, alone), (4, mesh)):
        run = launch("tests/tp_mesh_units.py", [out], nprocs=ranks, metrics=False, out_dir=False, timeout=120).ok()
        assert run.stdout.count("TP-MESH-UNITS OK") == ranks
    for replica in (0, 1):
        for t in (0, 1):
            want = torch.load(alone / f"rank{t}_seed{replica}.pt")
            got = torch.load(mesh / f"rank{2 * replica + t}_seed{replica}.pt")
            assert want.keys() == got.keys() and len(want) > 4
            for key in want:
                assert torch.equal(want[key], got[key]), (replica, t, key)
    norms = [torch.load(alone / f"rank0_seed{s}.pt")["norm/sp0"] for s in (0, 1)]
    assert not torch.equal(*norms)  # the replicas' data differ: a norm summed over both would show


@pytest.fixture(scope="module")
def reference():
    return {name: launch("01_single_gpu.py", BASE + extra + ["--sample_tokens", "0"]).ok()
            for name, extra in (("tiny", []), ("six", SIX_HEADS))}


CASES = [  # (tp, model, sequence parallel, micro-batch)
    (2, "tiny", False, 4), (4, "tiny", True, 4),  # tp 4 without SP, tp 2 with: test_real_conditions.py
    (3, "six", False, None), (3, "six", True, 4),
]


@pytest.mark.parametrize("ranks, model, sp, micro", CASES)
def test_losses_and_ledger(reference, ranks, model, sp, micro):
    extra = SIX_HEADS if model == "six" else []
    flags = BASE + extra + (["--sequence_parallel"] if sp else []) + (["--micro_batch_size", micro] if micro else [])
    run = launch("06_tensor_parallel.py", flags + ["--tp", ranks], nprocs=ranks).ok()
    assert_losses_match(reference[model], run, what=f"tp={ranks} sp={sp} micro={micro}")
    # memory: 16 bytes per local parameter, Ψ_sharded/T + Ψ_replicated
    h = 48 if extra else 64
    V, T, L = -(-65 // ranks) * ranks, (48 if extra else 64), 4
    replicated = T * h + L * (4 * h + 2 * h) + 2 * h  # wpe, LayerNorms, row-parallel biases, ln_f
    sharded = (V * h + L * (12 * h * h + 3 * h + 4 * h)) // ranks
    single = reference[model].steps[0]["state_bytes"]["params"] // 4
    assert single == 65 * h + T * h + L * (12 * h * h + 13 * h) + 2 * h  # the check of the check
    for step in run.steps:
        assert step["state_bytes"] == {"params": 4 * (sharded + replicated), "grads": 4 * (sharded + replicated),
                                       "optim": 8 * (sharded + replicated)}
    # communication: 4 per layer + embedding + head, and 3 b·s for the loss, per micro-batch;
    # with sequence parallelism the two column-parallel Linears of a layer and the head
    # all-gather their input a second time in backward (they kept only its sequence shard)
    accum = 8 // (micro or 8)
    bsh, bs = (micro or 8) * T * h * 4, (micro or 8) * T * 4
    if sp:
        expected = {"all_gather_into_tensor": accum * (6 * L + 3) * bsh,
                    "reduce_scatter_tensor": accum * (4 * L + 2) * bsh,
                    "all_reduce": accum * 3 * bs + 4 * replicated + 4}
    else:
        expected = {"all_reduce": accum * ((4 * L + 2) * bsh + 3 * bs) + 4}
    for step in run.steps:
        assert step["comm_bytes"] == expected


def test_resume_is_bit_exact(tmp_path):
    flags = BASE + ["--max_iters", "4", "--lr_decay_iters", "4", "--dropout", "0.1", "--sequence_parallel"]
    whole = launch("06_tensor_parallel.py", flags + ["--out_dir", tmp_path / "w"], nprocs=2).ok()
    first = launch("06_tensor_parallel.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2",
                                                     "--ckpt_interval", "2"], nprocs=2).ok()
    second = launch("06_tensor_parallel.py", flags + ["--out_dir", tmp_path / "a", "--resume"], nprocs=2).ok()
    assert first.losses + second.losses == whole.losses  # both dropout streams resume too
    # (resuming at another layout, resharded, with the losses checked: test_checkpoints.py)


def test_own_stream_saved_on_another_device_type_starts_afresh(tmp_path):
    """The same layout resumed on another device type: the rank's own dropout stream's saved
    state (faked: a CUDA generator's 16 bytes in place of this CPU generator's 5056) does not
    fit, so it starts afresh from its seed, as at a layout change, said once; not an error at
    the first forward. The oracle: the same set with that stream's fresh state saved in it."""
    flags = BASE + ["--max_iters", "4", "--lr_decay_iters", "4", "--dropout", "0.1"]
    launch("06_tensor_parallel.py", flags + ["--out_dir", tmp_path / "a", "--max_iters", "2",
                                             "--ckpt_interval", "2"], nprocs=2).ok()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for out, fresh in (("a", False), ("b", True)):
        step = tmp_path / out / "ckpt" / "step_2"
        meta = json.loads((step / "metadata.json").read_text())
        for rank in range(2):
            data = torch.load(step / f"rank{rank}.pt")
            assert data["extra_rng/tp"].numel() == torch.get_rng_state().numel()  # CPU's: 5056 bytes
            seeded = torch.Generator().manual_seed(meta["run"]["seed"] + 2718 + rank)  # the stream's start
            data["extra_rng/tp"] = seeded.get_state() if fresh else torch.zeros(16, dtype=torch.uint8)
            torch.save(data, step / f"rank{rank}.pt")
            meta["checksums"][rank]["extra_rng/tp"] = zlib.crc32(data["extra_rng/tp"].numpy())
        (step / "metadata.json").write_text(json.dumps(meta))
    moved, oracle = (launch("06_tensor_parallel.py", flags + ["--out_dir", tmp_path / out, "--resume"],
                            nprocs=2).ok() for out in ("a", "b"))
    said = "the tensor-parallel dropout stream was saved on another device type"
    assert moved.stdout.count(said) == 1 and said not in oracle.stdout
    assert [s["step"] for s in moved.steps] == [2, 3] and moved.losses == oracle.losses


@pytest.mark.parametrize("ranks, flags, message", [
    (3, [], "n_head 4 is not divisible by the tensor-parallel size 3"),
    (2, ["--tp", "4"], "--tp 4 must equal the world size 2"),
    (3, SIX_HEADS[:-2] + ["--block_size", "64", "--sequence_parallel"], "block_size 64 divisible by the tensor-parallel size 3"),
])
def test_bad_input_gives_one_line(ranks, flags, message):
    run = launch("06_tensor_parallel.py", BASE + flags, nprocs=ranks, timeout=60)
    assert run.returncode != 0 and len(run.error_lines) == 1 and message in run.error_lines[0], run.stderr
