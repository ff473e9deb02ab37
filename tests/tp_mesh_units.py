"""Run by test_tensor_parallel.py at 2 ranks and at 4: 06's tensor-parallel GPT, its
sequence-parallel gradient all-reduce and its gradient-norm clipping, unchanged, on the TP
groups it is handed. At 2 ranks the TP group is the world; at 4 the world is two replicas of
two, TP groups {0, 1} and {2, 3}, each fed other data (replica d: seed d), as a DP x TP program
would. Every rank saves what it computed, for each seed its replica runs, to
OUT/rank<r>_seed<d>.pt: the test checks that rank 2d + t of the 4-rank world saved exactly
what rank t of the 2-rank world saved for seed d. A collective that forgot its group would
sum over both replicas at 4 ranks, and the norms and gradients would differ.

    python tests/tp_mesh_units.py OUT"""

import argparse
import importlib
import os
import sys

import torch
import torch.distributed as dist

from common import GPTConfig, setup, teardown

tp_module = importlib.import_module("06_tensor_parallel")
TP = 2  # the tensor-parallel group's size, at 2 ranks and at 4


def train_step(group, tp_rank, seed, sp):
    """One forward and backward of 06's TPGPT on `group`, then 06's sequence-parallel
    gradient all-reduce (with sp) and clipping: the loss, the norm and every gradient."""
    config = GPTConfig(block_size=8, vocab_size=37, n_layer=2, n_head=4, n_embd=16, dropout=0.0, bias=True)
    rng = tp_module.ShardedRNG(seed, tp_rank, torch.device("cpu"))
    model = tp_module.init_from_full(tp_module.TPGPT(config, TP, tp_rank, sp, rng, group), seed)
    data = torch.Generator().manual_seed(100 + seed)  # this replica's batch
    x = torch.randint(0, config.vocab_size, (3, config.block_size), generator=data)
    y = torch.randint(0, config.vocab_size, (3, config.block_size), generator=data)
    loss = model(x, y)
    loss.backward()
    if sp:
        tp_module.all_reduce_sequence_parallel_grads(model, group)
    norm = tp_module.clip_grad_norm(model, 1e-3, group)  # small: every gradient is scaled
    return {"loss": loss.detach(), "norm": norm.detach(),
            **{name: p.grad.clone() for name, p in model.named_parameters()}}


def main():
    out = sys.argv[1]
    env = setup(argparse.Namespace(device="cpu", dtype="float32", timeout=60.0))
    world, rank = env.world_size, env.rank
    assert world in (TP, 2 * TP), world
    groups = [dist.new_group(list(range(d * TP, (d + 1) * TP))) for d in range(world // TP)]  # every rank: every group
    replica, tp_rank = rank // TP, rank % TP
    group = groups[replica] if world > TP else dist.group.WORLD
    seeds = [replica] if world > TP else [0, 1]  # at 2 ranks: both replicas' seeds, in turn
    for seed in seeds:
        result = {f"{name}/sp{int(sp)}": value for sp in (False, True)
                  for name, value in train_step(group, tp_rank, seed, sp).items()}
        torch.save(result, os.path.join(out, f"rank{rank}_seed{seed}.pt"))
    print("TP-MESH-UNITS OK", flush=True)
    teardown(env)


if __name__ == "__main__":
    main()
