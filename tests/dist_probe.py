"""A minimal program on infra.launch.setup (common.setup hardened), for the launcher tests: every rank reports what it
detected, all-reduces its rank, and (with --raise_on_rank R) rank R raises while the others
wait in a collective, to show that the job ends instead of hanging; (with --stall_on_rank R)
rank R stalls past --timeout, to show that the others name the collective they were in."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from common import make_parser, teardown
from infra.cli import parse_args
from infra.launch import setup
from infra.ledger import LEDGER


def main():
    parser = make_parser(__doc__)
    parser.add_argument("--raise_on_rank", type=int, default=-1)
    parser.add_argument("--stall_on_rank", type=int, default=-1,
                        help="this rank sleeps past --timeout before the second all-reduce (a hang)")
    args = parse_args(parser)
    env = setup(args)
    LEDGER.install()  # count what this probe sends (a training script's Run.start does this)
    value = torch.tensor([float(env.rank)])
    dist.all_reduce(value)  # the sum of all ranks
    report = dict(kind=env.launch.kind, rank=env.rank, world_size=env.world_size,
                  local_rank=env.launch.local_rank, local_world_size=env.launch.local_world_size,
                  sum=value.item(), comm=LEDGER.take(), threads=torch.get_num_threads())
    print("PROBE " + json.dumps(report), flush=True)
    if env.rank == args.raise_on_rank:
        time.sleep(0.5)
        raise RuntimeError(f"deliberate failure on rank {env.rank}")
    if args.stall_on_rank >= 0:
        LEDGER.step, LEDGER.phase = 7, "step"  # as Run sets them: step 7, in the forward
        if env.rank == args.stall_on_rank:
            time.sleep(args.timeout + 3)
        dist.all_reduce(value)  # the others time out here after --timeout
    dist.barrier()  # the others wait here for the failed rank, which never comes
    teardown(env)


if __name__ == "__main__":
    main()
