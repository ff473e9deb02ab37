"""The model and the pieces of common.py that every strategy relies on."""

import math
import pickle

import pytest
import torch

from common import GPT, GPTConfig, PRESETS, build_model, lr_at, param_init, read_vocab_size


def count(preset, vocab_size):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab_size, **PRESETS[preset]))
    return sum(p.numel() for p in model.parameters()), model.num_params()


@pytest.mark.parametrize("preset, total", [
    # the published GPT-2 checkpoints' parameter counts (vocabulary 50257, tied head)
    ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_parameter_count_matches_gpt2(preset, total):
    assert count(preset, 50257)[0] == total


def test_parameter_count_matches_nanogpt_shakespeare_char():
    # nanoGPT prints "number of parameters: 10.65M" for config/train_shakespeare_char.py
    _, reported = count("shakespeare", 65)
    assert reported == 10_646_784 and f"{reported / 1e6:.2f}M" == "10.65M"


def test_initialisation_is_a_pure_function_of_seed_and_name():
    config = GPTConfig(vocab_size=65, **PRESETS["tiny"])
    a, b, c = build_model(config, 7, "cpu"), build_model(config, 7, "cpu"), build_model(config, 8, "cpu")
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, param_init(name, pa.shape, config, 7)), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    # GPT-2 init: residual projections scaled by 1/sqrt(2 n_layer); LayerNorm ones; bias zeros
    proj = a.transformer.h[0].attn.c_proj.weight.std().item()
    fc = a.transformer.h[0].mlp.c_fc.weight.std().item()
    assert abs(fc - 0.02) < 0.002 and abs(proj - 0.02 / math.sqrt(2 * config.n_layer)) < 0.001
    assert torch.all(a.transformer.ln_f.weight == 1) and torch.all(a.transformer.h[1].mlp.c_fc.bias == 0)


def test_weights_are_tied_and_generate_extends():
    config = GPTConfig(vocab_size=65, **PRESETS["tiny"])
    model = build_model(config, 1, "cpu")
    assert model.lm_head.weight is model.transformer.wte.weight
    out = model.eval().generate(torch.zeros((2, 1), dtype=torch.long), 5, top_k=10)
    assert out.shape == (2, 6) and int(out.max()) < 65
    logits, loss = model(torch.zeros((2, 8), dtype=torch.long), torch.zeros((2, 8), dtype=torch.long))
    assert logits.shape == (2, 8, 65) and loss.item() > 0


def test_lr_schedule_warmup_then_cosine():
    class A:
        lr, min_lr, warmup_iters, lr_decay_iters = 1.0, 0.1, 10, 110
    assert lr_at(0, A) == pytest.approx(1 / 11) and lr_at(9, A) == pytest.approx(10 / 11)
    assert lr_at(10, A) == pytest.approx(1.0) and lr_at(60, A) == pytest.approx(0.55)
    assert lr_at(110, A) == pytest.approx(0.1) and lr_at(500, A) == pytest.approx(0.1)


class Exploit:
    def __reduce__(self):
        return (eval, ("__import__('os').system('touch /tmp/gptpar-pwned')",))


def test_vocab_size_is_read_without_unpickling(tmp_path):
    meta = tmp_path / "meta.pkl"
    # nanoGPT's meta.pkl layout, plus an object that would run code if it were unpickled
    meta.write_bytes(pickle.dumps({"vocab_size": 1234, "itos": {0: "a"}, "stoi": {"a": 0},
                                   "x": Exploit()}))
    assert read_vocab_size(str(meta)) == 1234
    meta.write_bytes(pickle.dumps({"vocab_size": 70000}))
    assert read_vocab_size(str(meta)) == 70000
    meta.write_bytes(pickle.dumps({"itos": {}}))
    with pytest.raises(ValueError):
        read_vocab_size(str(meta))
