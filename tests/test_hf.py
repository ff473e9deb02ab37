"""Hugging Face GPT-2 in and out, proven with the real client (transformers, installed for the
tests only: requirements-test.txt): a random GPT2LMHeadModel saved by save_pretrained and read
by 01 --init_from hf:DIR gives its logits and its loss; 03's checkpoint exported by --export_hf
and read by GPT2LMHeadModel.from_pretrained gives ours and the same greedy continuation; a
model without biases and GPT-2's padded vocabulary survive the trip; a foreign directory is one
line. One module, its fixtures module-scoped: transformers takes seconds to import."""

import json

import pytest
import torch

from harness import TINY, launch
from common import GPT, GPTConfig, Data
from infra.checkpoint import consolidated_model, load_model_file
from infra.hf import export_hf, read_safetensors, write_safetensors

SMALL = dict(n_layer=2, n_head=2, n_embd=32)
SEED = 1337
FLAGS = TINY + ["--seed", str(SEED), "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "32"]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def gpt2(transformers, vocab_size=65, activation="gelu", seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**SMALL, n_positions=64, vocab_size=vocab_size, activation_function=activation,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                     eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


def ours(config, state):
    model = GPT(config)
    model.load_state_dict(state)
    return model.eval()


def logits(model, x):
    with torch.no_grad():
        out = model(x)
        return out.logits if hasattr(out, "logits") else model(x, x.contiguous())[0]  # ours: all positions with targets


def test_a_transformers_gpt2_read_by_01_gives_its_logits_and_its_loss(transformers, tmp_path):
    hf = gpt2(transformers)
    hf.save_pretrained(tmp_path / "hf")
    config, state = load_model_file(f"hf:{tmp_path / 'hf'}", GPTConfig(vocab_size=65, block_size=32, bias=True, **SMALL))
    x = torch.randint(0, 65, (4, 32), generator=torch.Generator().manual_seed(1))
    assert (logits(hf, x) - logits(ours(config, state), x)).abs().max() <= 1e-5
    # the script itself: 01's evaluation of the imported model is transformers' loss on the same batch
    run = launch("01_single_gpu.py", FLAGS + ["--init_from", f"hf:{tmp_path / 'hf'}", "--eval_only",
                                              "--eval_iters", "1", "--eval_interval", "1", "--sample_tokens", "0"]).ok()
    x, y = Data("shakespeare_char", SEED, 32).batch("val", 0, 8, eval_split=True)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf(x).logits.view(-1, 65), y.view(-1)).item()
    assert abs(run.evals[0]["val_loss"] - expected) <= 1e-5, (run.evals, expected)
    assert "transformers' GPT-2 read" in run.stdout


def test_03s_export_read_by_transformers_gives_our_logits_and_samples(transformers, tmp_path):
    out = tmp_path / "out"
    launch("03_ddp.py", FLAGS + ["--max_iters", "3", "--ckpt_interval", "3", "--out_dir", out,
                                 "--export_hf", tmp_path / "hf"], nprocs=2).ok()
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert {k: config[k] for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")} == \
        {**SMALL, "n_positions": 32, "vocab_size": 65}
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    state, meta = consolidated_model(str(out))
    model = ours(GPTConfig(**meta["run"]["model"]), state)
    x = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(2))
    assert (logits(hf, x) - logits(model, x)).abs().max() <= 1e-5
    start = x[:, :4]
    theirs = hf.generate(start, max_new_tokens=12, do_sample=False, pad_token_id=0)
    mine = start
    for _ in range(12):  # greedy: the most probable next token, ours
        mine = torch.cat([mine, logits(model, mine)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(theirs, mine)


def test_no_biases_and_gpt2s_padded_vocabulary_survive_the_trip(transformers, tmp_path):
    for bias, vocab in ((False, 65), (True, 50304)):
        config = GPTConfig(vocab_size=vocab, block_size=32, bias=bias, **SMALL)
        torch.manual_seed(3)
        model = GPT(config).eval()
        notes = export_hf(model.state_dict(), vars(config), tmp_path / f"hf{vocab}")
        hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / f"hf{vocab}").eval()
        x = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(4))
        assert hf.config.vocab_size == min(vocab, 50257)  # the padding's 47 rows are never a token: dropped
        assert (logits(hf, x) - logits(model, x)[..., :50257]).abs().max() <= 1e-5, notes
        back, state = load_model_file(f"hf:{tmp_path / f'hf{vocab}'}", config)  # and read back
        assert back.vocab_size == min(vocab, 50257) and back.bias == bias
        assert (logits(ours(back, state), x) - logits(model, x)[..., :50257]).abs().max() <= 1e-6


def test_safetensors_by_hand_match_the_library(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16()}
    write_safetensors(tensors, tmp_path / "ours.safetensors")
    theirs = safetensors.load_file(tmp_path / "ours.safetensors")
    safetensors.save_file(tensors, tmp_path / "theirs.safetensors")
    for read in (theirs, read_safetensors(tmp_path / "theirs.safetensors")):
        assert read.keys() == tensors.keys() and all(torch.equal(read[k], tensors[k]) for k in tensors)


def test_a_foreign_or_other_directory_is_one_line(transformers, tmp_path, capsys):
    hf = gpt2(transformers)
    hf.save_pretrained(tmp_path / "hf")
    cases = [(GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=2, n_embd=32), "holds another model"),
             (GPTConfig(vocab_size=100, block_size=32, **SMALL), "has 65 tokens, --data's vocabulary 100"),
             (GPTConfig(vocab_size=65, block_size=128, **SMALL), "has 64 positions; --block_size 128")]
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\xff" * 16)
    capsys.readouterr()  # save_pretrained's progress bar
    cases.append((GPTConfig(vocab_size=65, block_size=32, **SMALL), "is not a safetensors file"))
    for config, said in cases:
        with pytest.raises(SystemExit) as exit:
            load_model_file(f"hf:{tmp_path / 'hf'}", config)
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit.value.code == 2 and len(lines) == 1 and said in lines[0], lines
