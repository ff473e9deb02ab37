"""Run by test_groups.py: 03's GradientBuckets and mean_over_replicas, unchanged, inside a
bigger mesh. With --mesh (4 ranks) the world is cut into the data-parallel groups {0, 1} and
{2, 3} (dist.new_group); group {0, 1} trains one step on batch A, group {2, 3} on batch B, and
rank r writes its averaged gradients and mean loss to OUT/mesh_rank<r>.pt. Without it (2
ranks) the world itself is the data-parallel group and runs batch A, then batch B, writing
OUT/alone_<batch>_rank<r>.pt. The test compares the two bit for bit.

Each step has two micro-batches (gradient accumulation: the buckets communicate on the last
only) and small buckets, so that several are in flight during backward."""

import argparse
import importlib
import os

import torch
import torch.distributed as dist

from common import GPTConfig, PRESETS, build_model, setup, teardown

ddp = importlib.import_module("03_ddp")

MICRO_BATCHES, ROWS, LENGTH, VOCAB = 2, 2, 16, 65


def batch(name, group_rank):
    """This replica's rows of batch `name`: the same on a rank of the mesh and on the rank
    with the same place in a world of its own."""
    g = torch.Generator().manual_seed(1000 * (name == "B") + group_rank)
    return torch.randint(0, VOCAB, (MICRO_BATCHES, ROWS, LENGTH + 1), generator=g)


def step(model, buckets, group, tokens):
    """03's step, as its main() runs it: accumulate, finish the buckets, average the loss."""
    loss_sum = torch.zeros(())
    for micro in range(MICRO_BATCHES):
        buckets.sync = micro == MICRO_BATCHES - 1
        x, y = tokens[micro, :, :-1].contiguous(), tokens[micro, :, 1:].contiguous()
        _, loss = model(x, y)
        (loss / MICRO_BATCHES).backward()
        loss_sum += loss.detach()
    buckets.finish()
    loss_sum /= MICRO_BATCHES
    ddp.mean_over_replicas(loss_sum, group)
    result = {name: p.grad.clone() for name, p in model.named_parameters()}
    result["loss"] = loss_sum.clone()
    buckets.zero_grad()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--no_overlap", action="store_true")
    args = parser.parse_args()
    env = setup(argparse.Namespace(device="cpu", dtype="float32", timeout=60.0))
    model = build_model(GPTConfig(vocab_size=VOCAB, **PRESETS["tiny"]), 0, "cpu")
    if args.mesh:
        assert env.world_size == 4
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in order
        group = groups[env.rank // 2]
        buckets = ddp.GradientBuckets(model.parameters(), 20_000, group, overlap=not args.no_overlap)
        assert len(buckets.buffers) > 2
        result = step(model, buckets, group, batch("AB"[env.rank // 2], dist.get_rank(group)))
        torch.save(result, os.path.join(args.out, f"mesh_rank{env.rank}.pt"))
    else:
        assert env.world_size == 2
        buckets = ddp.GradientBuckets(model.parameters(), 20_000, dist.group.WORLD, overlap=not args.no_overlap)
        for name in "AB":
            result = step(model, buckets, dist.group.WORLD, batch(name, env.rank))
            torch.save(result, os.path.join(args.out, f"alone_{name}_rank{env.rank}.pt"))
    teardown(env)


if __name__ == "__main__":
    main()
