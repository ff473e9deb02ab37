"""Run under N ranks by test_context_parallel.py: 09's ring attention (zigzag layout, C = N),
with the fused CPU kernel's blocks and with the explicit fp32 fallback's (whole, and a few
queries at a time), and Ulysses attention equal F.scaled_dot_product_attention(is_causal=True)
on the whole sequence, in the output and in dq, dk and dv, on every rank's tokens. Exits non-zero on any mismatch (an
assertion ends the job)."""

import argparse
import importlib

import torch
import torch.distributed as dist
from torch.nn import functional as F

from common import setup, teardown

cp_module = importlib.import_module("09_context_parallel")


def close(name, a, b):
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{name}: max abs difference {(a - b).abs().max()}"


def main():
    env = setup(argparse.Namespace(device="cpu", dtype="float32", timeout=60.0))
    C, r = env.world_size, env.rank
    ranks = list(range(C))
    group = dist.new_group(ranks)
    torch.manual_seed(0)  # the same full tensors on every rank
    b, H, s, d = 2, 2 * C, 8 * C, 16  # 2C chunks of 4 tokens; H divisible by C for Ulysses
    q, k, v, dout = (torch.randn(b, H, s, d) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*full, is_causal=True).backward(dout)
    expected_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

    fused, whole = cp_module.fused_kernel, cp_module.EXPLICIT_SCORES
    explicit = lambda device_type, dtype, head_dim: "explicit"  # the fallback, where no fused kernel applies
    for impl, kernel, label, scores in (("ring", fused, "fused", whole), ("ring", explicit, "explicit", whole),
                                        ("ring", explicit, "explicit in chunks", b * H * (s // C) * 3),
                                        ("ulysses", fused, "fused", whole)):
        cp_module.fused_kernel = kernel  # the ring's blocks
        cp_module.EXPLICIT_SCORES = scores  # in chunks: 3 queries at a time on a rank's own block
        cp = cp_module.ContextParallel(group, ranks, r, impl)
        pos = cp_module.token_positions(s, C, r, impl)
        mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        out = cp.attention(*mine)
        out.backward(dout[:, :, pos])
        close(f"{impl} {label} out", out, expected_out[:, :, pos])
        for name, local, reference in zip(("dq", "dk", "dv"), mine, full):
            close(f"{impl} {label} {name}", local.grad, reference.grad[:, :, pos])
    cp_module.fused_kernel, cp_module.EXPLICIT_SCORES = fused, whole
    if r == 0:
        print(f"ring (fused and explicit blocks, whole and in chunks) and ulysses attention match SDPA at C = {C}: "
              "out, dq, dk, dv")
    teardown(env)


if __name__ == "__main__":
    main()
