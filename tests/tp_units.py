"""Run under N ranks by test_tensor_parallel.py: 06's column- and row-parallel layers equal
nn.Linear in outputs and gradients (the sequence-parallel column-parallel Linear in fp32 and
under bf16 autocast, keeping only its sequence shard), and its vocab-parallel cross-entropy equals
F.cross_entropy in value and gradient (padded vocabulary included). Exits non-zero on any
mismatch (an assertion ends the job)."""

import argparse
import importlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

from common import setup, teardown
from infra.activations import ActivationMeter

tp_module = importlib.import_module("06_tensor_parallel")


def close(a, b, rtol=1e-5, atol=1e-6):
    assert torch.allclose(a, b, rtol=rtol, atol=atol), (a - b).abs().max()


def main():
    env = setup(argparse.Namespace(device="cpu", dtype="float32", timeout=60.0))
    tp, r = env.world_size, env.rank
    torch.manual_seed(0)  # the same "full" tensors on every rank
    full = nn.Linear(8, 6 * tp)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.randn(3, 5, 6 * tp)
    (full(x) * w).sum().backward()

    # column-parallel: this rank's output columns
    col = tp_module.ColumnParallelLinear(8, 6, True, dist.group.WORLD, False)
    with torch.no_grad():
        col.weight.copy_(full.weight.chunk(tp)[r])
        col.bias.copy_(full.bias.chunk(tp)[r])
    x_col = x.detach().clone().requires_grad_()
    y = col(x_col)
    close(y, full(x).chunk(tp, dim=-1)[r])
    (y * w.chunk(tp, dim=-1)[r]).sum().backward()  # the total loss is the sum over ranks
    close(x_col.grad, x.grad)  # f's backward all-reduce gives the whole input gradient
    close(col.weight.grad, full.weight.grad.chunk(tp)[r])
    close(col.bias.grad, full.bias.grad.chunk(tp)[r])

    # column-parallel with sequence parallelism: the input is this rank's sequence shard, the
    # output this rank's columns of the whole sequence; only the shard is kept for backward
    # (in the compute dtype under autocast), and the gradients equal nn.Linear's
    for dtype, tol in ((torch.float32, {}), (torch.bfloat16, {"rtol": 1e-2, "atol": 1e-2})):
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
        x = torch.randn(3, 2 * tp, 8, requires_grad=True)
        w = torch.randn(3, 2 * tp, 6 * tp)
        full.zero_grad()
        with autocast:
            (full(x).float() * w).sum().backward()
        col = tp_module.ColumnParallelLinear(8, 6, True, dist.group.WORLD, True)
        with torch.no_grad():
            col.weight.copy_(full.weight.chunk(tp)[r])
            col.bias.copy_(full.bias.chunk(tp)[r])
        x_seq = x.detach().chunk(tp, dim=1)[r].clone().requires_grad_()
        with ActivationMeter() as meter, autocast:
            y = col(x_seq)
            assert meter.current == x_seq.numel() * dtype.itemsize, (meter.current, dtype)  # the shard only
            (y.float() * w.chunk(tp, dim=-1)[r]).sum().backward()
        assert y.dtype == dtype and col.weight.grad.dtype == torch.float32
        with torch.no_grad(), autocast:
            close(y.float(), full(x).float().chunk(tp, dim=-1)[r], **tol)
        close(x_seq.grad, x.grad.chunk(tp, dim=1)[r], **tol)  # all ranks' parts, this rank's shard
        close(col.weight.grad, full.weight.grad.chunk(tp)[r], **tol)
        close(col.bias.grad, full.bias.grad.chunk(tp)[r], **tol)

    # row-parallel: this rank's input rows; the output is the full product
    full_row = nn.Linear(4 * tp, 7)
    x = torch.randn(3, 5, 4 * tp, requires_grad=True)
    w = torch.randn(3, 5, 7)
    (full_row(x) * w).sum().backward()
    row = tp_module.RowParallelLinear(4, 7, True, dist.group.WORLD, False)
    with torch.no_grad():
        row.weight.copy_(full_row.weight.chunk(tp, dim=1)[r])
        row.bias.copy_(full_row.bias)
    x_row = x.detach().chunk(tp, dim=-1)[r].clone().requires_grad_()
    y = row(x_row)
    close(y, full_row(x))
    (y * w).sum().backward()
    close(x_row.grad, x.grad.chunk(tp, dim=-1)[r])
    close(row.weight.grad, full_row.weight.grad.chunk(tp, dim=1)[r])
    close(row.bias.grad, full_row.bias.grad)

    # vocab-parallel cross-entropy, vocabulary 7 padded up to a multiple of tp
    vocab = 7
    padded = -(-vocab // tp) * tp
    logits = torch.randn(10, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (10,))
    reference = F.cross_entropy(logits, targets)
    reference.backward()
    with torch.no_grad():  # padding filled with huge values: masking must ignore them
        padded_logits = torch.cat([logits, torch.full((10, padded - vocab), 1e4)], dim=-1)
    local = padded_logits.chunk(tp, dim=-1)[r].clone().requires_grad_()
    loss = tp_module.VocabParallelCrossEntropy.apply(local, targets, r * (padded // tp), vocab,
                                                     dist.group.WORLD)
    loss.backward()
    close(loss, reference)
    expected_grad = torch.cat([logits.grad, torch.zeros(10, padded - vocab)], dim=-1).chunk(tp, dim=-1)[r]
    close(local.grad, expected_grad)
    print(f"TP-UNITS OK rank {r}", flush=True)
    teardown(env)


if __name__ == "__main__":
    main()
