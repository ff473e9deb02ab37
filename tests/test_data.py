"""The data: the embedded corpus, nanoGPT .bin directories, synthetic data, and batches that
do not depend on the world size."""

import pickle

import numpy as np
import pytest
import torch

from common import Data, SYNTHETIC_VOCAB
from infra.data_check import data_problem


@pytest.fixture(scope="module")
def shakespeare():
    return Data("shakespeare_char", seed=5, block_size=16)


def test_embedded_corpus_split_and_vocabulary(shakespeare):
    assert shakespeare.vocab_size == 65
    assert (len(shakespeare.splits["train"]), len(shakespeare.splits["val"])) == (1_003_854, 111_540)
    assert shakespeare.decode(shakespeare.splits["train"][:13].tolist()) == "First Citizen"


@pytest.mark.parametrize("dp_size", [2, 3, 4, 6])
def test_batch_is_independent_of_world_size(shakespeare, dp_size):
    for step in (0, 1, 17):
        x, y = shakespeare.batch("train", step, 12)
        slices = [shakespeare.batch("train", step, 12, r, dp_size) for r in range(dp_size)]
        assert torch.equal(torch.cat([s[0] for s in slices]), x)
        assert torch.equal(torch.cat([s[1] for s in slices]), y)
        assert x.shape == (12, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_batches_differ_by_step_split_and_purpose(shakespeare):
    x0, _ = shakespeare.batch("train", 0, 8)
    assert torch.equal(x0, Data("shakespeare_char", 5, 16).batch("train", 0, 8)[0])
    assert not torch.equal(x0, shakespeare.batch("train", 1, 8)[0])
    assert not torch.equal(x0, shakespeare.batch("val", 0, 8)[0])
    assert not torch.equal(x0, shakespeare.batch("train", 0, 8, eval_split=True)[0])
    assert not torch.equal(x0, Data("shakespeare_char", 6, 16).batch("train", 0, 8)[0])


def write_bin_dataset(path, n_train=5000, n_val=500, vocab=100, meta=True):
    path.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, n_train, dtype=np.uint16).tofile(path / "train.bin")
    rng.integers(0, vocab, n_val, dtype=np.uint16).tofile(path / "val.bin")
    if meta:
        (path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab, "itos": {}, "stoi": {}}))
    return path


def test_nanogpt_bin_directory(tmp_path):
    d = write_bin_dataset(tmp_path / "ds")
    data = Data(str(d), 0, 32)
    assert data.vocab_size == 100 and data_problem(str(d), 32) is None
    x, y = data.batch("val", 3, 4)
    assert x.dtype == torch.int64 and int(x.max()) < 100 and torch.equal(x[:, 1:], y[:, :-1])
    (d / "meta.pkl").unlink()
    assert Data(str(d), 0, 32).vocab_size == 50304  # GPT-2's padded vocabulary, as nanoGPT


def test_data_errors_are_named(tmp_path):
    assert "no such directory" in data_problem(str(tmp_path / "nope"), 32)
    d = write_bin_dataset(tmp_path / "short", n_val=20)
    assert "fewer than block_size+2" in data_problem(str(d), 32)
    (d / "val.bin").unlink()
    assert "val.bin is missing" in data_problem(str(d), 32)
    d = write_bin_dataset(tmp_path / "big", meta=False)
    (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 100_000}))
    assert "must be in 1..65536" in data_problem(str(d), 32)


def test_synthetic_corpus_is_learnable():
    data = Data("synthetic", 0, 32)
    stream = np.asarray(data.splits["train"][:200_000], dtype=np.int64)
    assert data.vocab_size == SYNTHETIC_VOCAB and int(stream.max()) < SYNTHETIC_VOCAB
    successors = {}
    for a, b in zip(stream[:-1], stream[1:]):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4  # next-token entropy <= log 4


def test_data_problems_found_before_training(tmp_path):
    """Odd byte length, exactly block_size+1 tokens, ids outside the vocabulary (found by the
    rank whose slice holds them), vocab_size 0, embedded corpora shorter than the block."""
    d = write_bin_dataset(tmp_path / "odd")
    with open(d / "train.bin", "ab") as f:
        f.write(b"\0")
    assert "not a whole number of uint16 tokens" in data_problem(str(d), 32)
    d = write_bin_dataset(tmp_path / "exact", n_val=33)
    assert "fewer than block_size+2 = 34" in data_problem(str(d), 32)
    d = write_bin_dataset(tmp_path / "ids")
    tokens = np.fromfile(d / "val.bin", dtype=np.uint16)
    tokens[-1] = 199
    tokens.tofile(d / "val.bin")
    assert data_problem(str(d), 32, rank=0, world_size=2) is None  # rank 0's half is clean
    problem = data_problem(str(d), 32, rank=1, world_size=2)
    assert f"token id 199 at position {len(tokens) - 1}" in problem and "below 100" in problem
    (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 0}))
    assert "vocab_size 0" in data_problem(str(d), 32)
    assert "block_size+2" in data_problem("synthetic", 1 << 17)
    assert data_problem("synthetic", (1 << 17) - 2) is None
    assert "block_size+2" in data_problem("shakespeare_char", 200_000)
