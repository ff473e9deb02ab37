"""prepare.py: a user's corpus (a directory of text, JSONL) through a tokenizer.json trained here
with `tokenizers` (no network; installed for the tests only) into train.bin / val.bin / meta.pkl
that 03 trains on at 2 ranks; the split the same on every run and at any --workers; a killed
prepare resumed without redoing its finished shards; uint32 tokens above 65,536 read by --data;
every bad input one line. prepare.py runs in this process (main(argv)): no launch but 03's."""

import json
import pickle

import numpy as np
import pytest

import prepare
from common import Data, token_dtype
from harness import TINY, launch
from infra.data_check import data_problem

WORDS = "the a of to and in is it that was for on are with as his they be at one have this from".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A directory of 6 text files and a JSONL of 40 records (field "body"), and a BPE
    tokenizer.json trained on them, with <|endoftext|> as its end-of-text token."""
    tokenizers = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    text = lambda n: " ".join(rng.choice(WORDS, n)) + ".\n"  # noqa: E731
    (root / "docs").mkdir()
    for i in range(6):
        (root / "docs" / f"{i}.txt").write_text(text(400))
    with open(root / "records.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": i, "body": text(60)}) + "\n")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train([str(p) for p in (root / "docs").iterdir()], trainer)
    tok.save(str(root / "tokenizer.json"))
    return root


def prepare_(corpus, out, *flags):
    prepare.main([str(corpus / "docs"), str(corpus / "records.jsonl"), "--field", "body", "--tokenizer",
                  str(corpus / "tokenizer.json"), "--out_dir", str(out), *map(str, flags)])
    return {split: np.fromfile(out / f"{split}.bin", dtype=np.uint16) for split in ("train", "val")}


def test_a_corpus_prepared_with_a_tokenizer_json_trains_with_03(corpus, tmp_path):
    tokens = prepare_(corpus, tmp_path / "data", "--shard_docs", "8")
    meta = pickle.load(open(tmp_path / "data" / "meta.pkl", "rb"))
    assert meta["dtype"] == "uint16" and meta["eot"] == 1 and meta["vocab_size"] <= 120
    assert (tokens["train"] == 1).sum() + (tokens["val"] == 1).sum() == 46  # one end-of-text per document
    assert 0 < len(tokens["val"]) < len(tokens["train"]) and not (tmp_path / "data" / ".shards").exists()
    again = prepare_(corpus, tmp_path / "parallel", "--shard_docs", "8", "--workers", "2")  # the same split
    assert all(np.array_equal(tokens[s], again[s]) for s in tokens)
    run = launch("03_ddp.py", TINY + ["--data", tmp_path / "data", "--block_size", "32", "--max_iters", "4"],
                 nprocs=2).ok()
    assert len(run.losses) == 4 and run.losses[-1] < run.losses[0]


def test_a_killed_prepare_resumes_its_unfinished_shards(corpus, tmp_path, monkeypatch, capsys):
    clean = prepare_(corpus, tmp_path / "clean", "--shard_docs", "8")
    encode = prepare.encode_shard

    def killed_at_shard_3(job):
        if job[0] == 3:
            raise KeyboardInterrupt  # the kill, after shards 0-2 were written
        return encode(job)
    monkeypatch.setattr(prepare, "encode_shard", killed_at_shard_3)
    with pytest.raises(KeyboardInterrupt):
        prepare_(corpus, tmp_path / "data", "--shard_docs", "8")
    assert not (tmp_path / "data" / "train.bin").exists()  # nothing under a final name
    done = []
    monkeypatch.setattr(prepare, "encode_shard", lambda job: done.append(job[0]) or encode(job))
    resumed = prepare_(corpus, tmp_path / "data", "--shard_docs", "8")
    assert done == [3, 4, 5] and "resuming: 3 shard(s)" in capsys.readouterr().out
    assert all(np.array_equal(clean[s], resumed[s]) for s in clean)


def test_uint32_tokens_above_65536_are_written_and_read(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(70_000)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "input.txt").write_text(" ".join(f"w{i}" for i in range(69_000, 69_999)))
    prepare.main([str(tmp_path / "input.txt"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                  "--out_dir", str(tmp_path / "data")])
    assert token_dtype(str(tmp_path / "data")) == np.uint32 and data_problem(str(tmp_path / "data"), 32) is None
    data = Data(str(tmp_path / "data"), 0, 32)
    assert data.vocab_size == 70_001 and int(data.batch("train", 0, 4)[0].max()) >= 69_000


@pytest.mark.parametrize("case", ["empty", "field", "parquet", "gpt2", "missing"])
def test_bad_input_is_one_line(corpus, tmp_path, capsys, case):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    argv, said = {
        "empty": ([tmp_path / "empty.txt", "--tokenizer", "char"], "the corpus is empty"),
        "field": ([corpus / "records.jsonl", "--tokenizer", "char"], "records.jsonl:1 has no field 'text'"),
        "parquet": ([tmp_path / "t.parquet", "--tokenizer", "char"], "reading parquet needs pyarrow"),
        "gpt2": ([tmp_path / "empty.txt", "--tokenizer", "gpt2"], "--tokenizer gpt2 needs tiktoken"),
        "missing": ([tmp_path / "nothing.txt", "--tokenizer", "char"], "nothing.txt: no such file"),
    }[case]
    if case in ("parquet", "gpt2"):
        try:
            __import__("pyarrow" if case == "parquet" else "tiktoken")
            pytest.skip("installed here: its refusal cannot be seen")
        except ImportError:
            pass
    with pytest.raises(SystemExit) as exit:
        prepare.main([*map(str, argv), "--out_dir", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and said in lines[0], lines
