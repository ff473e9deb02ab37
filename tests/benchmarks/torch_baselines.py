"""PyTorch's own implementations, for the benchmarks: the same loop, model, batch and metrics
as the numbered scripts, with --impl choosing the wrapper. Not a teaching script: it exists
to be timed against ours.

    ddp     torch.nn.parallel.DistributedDataParallel (no_sync on accumulation micro-steps)
    zero1   DDP + torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1)
    fsdp2   torch.distributed.fsdp.fully_shard on every block and the root (ZeRO stage 3)
"""

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common import (ADAM_BETAS, LEDGER, Data, autocast, build_model, check_batch,  # noqa: E402
                    detect_launcher, flops_per_token, is_decayed, lr_at, make_adamw, make_parser, Metrics, model_config,
                    model_block_size, parse_args, setup, state_bytes, synchronize, teardown, to_device)


def main():
    parser = make_parser(__doc__)
    parser.add_argument("--bucket_mb", type=float, default=25.0)
    parser.add_argument("--impl", default="ddp", choices=["ddp", "zero1", "fsdp2"])
    args = parse_args(parser)
    launch = detect_launcher(os.environ)
    accum_steps = check_batch(args, dp_size=launch.world_size)
    env = setup(args, launch)
    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    model = build_model(config, args.seed, env.device)
    if args.impl == "fsdp2":
        for block in model.transformer.h:
            fully_shard(block)
        ddp_model = fully_shard(model)
        no_sync = lambda: contextlib.nullcontext()  # noqa: E731 (FSDP2 reduces every micro-batch)
    else:
        ddp_model = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb,
                                            device_ids=[env.device.index] if env.device.type == "cuda" else None)
        no_sync = ddp_model.no_sync
    if args.impl == "zero1":
        decay = [p for p in model.parameters() if is_decayed(p)]
        optimizer = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, lr=args.lr,
                                            betas=ADAM_BETAS, weight_decay=args.weight_decay)
        optimizer.add_param_group({"params": [p for p in model.parameters() if not is_decayed(p)],
                                   "weight_decay": 0.0})
    else:
        optimizer = make_adamw(model.named_parameters(), args, env.device.type)
    metrics = Metrics(args, env, flops_per_token(config, model.num_params()))
    for step in range(args.max_iters):
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        x, y = data.batch("train", step, args.global_batch_size, env.rank, env.world_size)
        x, y = to_device(x, env), to_device(y, env)
        loss_sum = torch.zeros((), device=env.device)
        for micro in range(accum_steps):
            rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            sync = contextlib.nullcontext() if micro == accum_steps - 1 else no_sync()
            with sync, autocast(env):
                _, loss = ddp_model(x[rows], y[rows])
            with sync:
                (loss / accum_steps).backward()
            loss_sum += loss.detach().float()
        loss_sum /= accum_steps * env.world_size
        dist.all_reduce(loss_sum)
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        if step % args.log_interval == 0 or step == args.max_iters - 1:
            loss_value = loss_sum.item()
            synchronize(env)
            metrics.step(step, loss_value, lr, time.perf_counter() - t0,
                         state_bytes(model.parameters(), optimizer), LEDGER.take())
        optimizer.zero_grad(set_to_none=True)
    teardown(env)


if __name__ == "__main__":
    main()
