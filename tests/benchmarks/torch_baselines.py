"""PyTorch's own implementations, for the benchmarks: the same loop, model, batch and metrics
as the numbered scripts, with --impl choosing the wrapper. Not a teaching script: it exists
to be timed against ours.

    ddp     torch.nn.parallel.DistributedDataParallel (no_sync on accumulation micro-steps)
    zero1   DDP + torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO stage 1)
    fsdp2   torch.distributed.fsdp.fully_shard on every block and the root (ZeRO stage 3)
    tp      torch.distributed.tensor.parallel: ColwiseParallel c_attn/c_fc, RowwiseParallel
            c_proj on every block (the world is the TP group; embeddings replicated)
    gpipe, 1f1b, interleaved
            torch.distributed.pipelining: the same stage split as 07_pipeline.py, run by
            ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B
"""

import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common import (ADAM_BETAS, Data, decay_groups, autocast, build_model, check_batch,  # noqa: E402
                    detect_launcher, lr_at, make_adamw, make_parser, model_config, model_block_size, setup,
                    synchronize, teardown, to_device)
from infra.cli import parse_args  # noqa: E402
from infra.formulas import flops_per_token  # noqa: E402
from infra.ledger import LEDGER, state_bytes  # noqa: E402
from infra.metrics import Metrics  # noqa: E402


NO_THEORY = {"held": {}, "sent": {}}  # torch's implementations: no costs() formulas to compare


def begin_step(optimizer, data, args, env, step, dp_rank, dp_size):
    """The learning rate of `step`, the start time, and this data-parallel rank's batch."""
    lr = lr_at(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    t0 = time.perf_counter()
    x, y = data.batch("train", step, args.global_batch_size, dp_rank, dp_size)
    return lr, t0, to_device(x, env), to_device(y, env)


def main():
    parser = make_parser(__doc__)
    parser.add_argument("--bucket_mb", type=float, default=25.0)
    parser.add_argument("--impl", default="ddp", choices=["ddp", "zero1", "fsdp2", "tp", "gpipe", "1f1b", "interleaved"])
    parser.add_argument("--virtual_stages", type=int, default=2)
    args = parse_args(parser)
    if args.impl in ("tp", "gpipe", "1f1b", "interleaved"):
        return model_parallel(args)
    launch = detect_launcher(os.environ)
    accum_steps = check_batch(args, dp_size=launch.world_size)
    env = setup(args, launch)
    LEDGER.install(env.device)  # (a training script's Run.start does this)
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
        decay, no_decay = decay_groups(model.parameters())
        optimizer = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, lr=args.lr,
                                            betas=ADAM_BETAS, weight_decay=args.weight_decay)
        optimizer.add_param_group({"params": no_decay, "weight_decay": 0.0})
    else:
        optimizer = make_adamw(model.parameters(), args, env.device.type)
    metrics = Metrics(args, env, flops_per_token(config, model.num_params()), NO_THEORY)
    for step in range(args.max_iters):
        lr, t0, x, y = begin_step(optimizer, data, args, env, step, env.rank, env.world_size)
        loss_sum = torch.zeros((), device=env.device)
        for micro in range(accum_steps):
            rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            sync = contextlib.nullcontext() if micro == accum_steps - 1 else no_sync()
            with sync:  # no gradient communication on non-final micro-steps
                with autocast(env):
                    _, loss = ddp_model(x[rows], y[rows])
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
    # DDP's reducer (held by the model's gradient hooks) and ZeroRedundancyOptimizer let go
    # while the process group is alive: freed after it, with main's locals, they have hung
    # the process in their destructors
    del ddp_model, optimizer, model
    gc.collect()
    teardown(env)


def tp_model(model, config, env):
    """Megatron's layout with torch's TP plans. ColwiseParallel cuts c_attn's rows into
    contiguous chunks, so permute them first: chunk t = [Q; K; V] of rank t's heads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    T, h = env.world_size, config.n_embd
    rows = torch.cat([torch.arange(j * h + t * h // T, j * h + (t + 1) * h // T) for t in range(T) for j in range(3)])
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.copy_(block.attn.c_attn.weight[rows])
            if block.attn.c_attn.bias is not None:
                block.attn.c_attn.bias.copy_(block.attn.c_attn.bias[rows])
    mesh = init_device_mesh(env.device.type, (T,))
    for block in model.transformer.h:
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
        attn = block.attn

        def forward(x, attn=attn):  # the local heads: n_head / T of them
            B, S, _ = x.shape
            q, k, v = attn.c_attn(x).chunk(3, dim=-1)
            heads = attn.n_head // T
            q, k, v = (t.reshape(B, S, heads, -1).transpose(1, 2) for t in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return attn.resid_dropout(attn.c_proj(y.transpose(1, 2).reshape(B, S, -1)))
        attn.forward = forward
    return model


def clip_grad_norm(params, max_norm, world_size, plain_replicated, skip=()):
    """clip_grad_norm_ over the whole model for the TP and PP baselines (torch's own sees one
    rank's tensors, or DTensors of one mesh): the squares of a sharded gradient summed over
    the ranks, a replicated one's counted once; the names in `skip` (a tied copy) not at all."""
    from torch.distributed.tensor import DTensor
    squares = torch.zeros((), device=params[0][1].device)
    for name, p in params:
        if name in skip:
            continue
        if isinstance(p.grad, DTensor):
            local, replicated = p.grad.to_local(), not any(pl.is_shard() for pl in p.grad.placements)
        else:
            local, replicated = p.grad, plain_replicated
        squares += local.float().pow(2).sum() / (world_size if replicated else 1)
    dist.all_reduce(squares)
    coef = min(1.0, max_norm / (squares.sqrt().item() + 1e-6))
    for _, p in params:
        p.grad.mul_(coef)


class PipeStage(torch.nn.Module):
    """Layers [first, first + n) of the GPT; the embedding on the first stage, the final norm
    and the head (an untied copy, gradients summed with the first stage's) on the last."""

    def __init__(self, model, first, n, is_first, is_last):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.wte, self.wpe = (model.transformer.wte, model.transformer.wpe) if is_first else (None, None)
        self.h = torch.nn.ModuleList(model.transformer.h[first:first + n])
        if is_last:
            self.ln_f = model.transformer.ln_f
            self.head = torch.nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(model.lm_head.weight)

    def forward(self, x):
        if self.is_first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x)) if self.is_last else x


def model_parallel(args):
    """The TP and PP baselines: the world is one TP group or one pipeline (no data parallelism)."""
    launch = detect_launcher(os.environ)
    accum_steps = check_batch(args, dp_size=1)
    env = setup(args, launch)
    LEDGER.install(env.device)  # (a training script's Run.start does this)
    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    model = build_model(config, args.seed, env.device)
    P, rank = env.world_size, env.rank
    loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    if args.impl == "tp":
        module = tp_model(model, config, env)
        params = list(module.named_parameters())
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
        v = args.virtual_stages if args.impl == "interleaved" else 1
        per = config.n_layer // (P * v)
        stages, modules = [], []
        for c in range(v):
            g = c * P + rank
            part = PipeStage(model, g * per, per, g == 0, g == P * v - 1)
            modules.append(part)
            stages.append(PipelineStage(part, g, P * v, env.device))
        if args.impl == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=accum_steps, loss_fn=loss_fn)
        else:
            schedule = (ScheduleGPipe if args.impl == "gpipe" else Schedule1F1B)(
                stages[0], n_microbatches=accum_steps, loss_fn=loss_fn)
        params = [(f"{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters()]
        first = modules[0].is_first
        last = modules[-1].is_last
        tied = ([modules[0].wte.weight] if first else []) + ([modules[-1].head.weight] if last else [])
        ends = dist.new_group([0, P - 1])
    optimizer = make_adamw((p for _, p in params), args, env.device.type)
    metrics = Metrics(args, env, flops_per_token(config, model.num_params()), NO_THEORY)
    for step in range(args.max_iters):
        lr, t0, x, y = begin_step(optimizer, data, args, env, step, 0, 1)
        loss_sum = torch.zeros((), device=env.device)
        if args.impl == "tp":
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    _, loss = module(x[rows], y[rows])
                (loss / accum_steps).backward()
                loss_sum += loss.detach().float()
        else:
            losses = []
            kwargs = {}
            if first:
                kwargs["x"] = x
            if last:
                kwargs.update(target=y, losses=losses)
            schedule.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
            if last:
                loss_sum += torch.stack([l.detach().float() for l in losses]).sum()
            dist.broadcast(loss_sum, src=P - 1)
            if P > 1 and tied:
                for w in tied:
                    dist.all_reduce(w.grad, group=ends)
        if args.grad_clip > 0:  # as ours: the global norm, the tied head's copy counted once
            pipeline_copy = args.impl != "tp" and P > 1 and not first  # the last stage's head
            skip = {name for name, _ in params if name.endswith(".head.weight")} if pipeline_copy else set()
            clip_grad_norm(params, args.grad_clip, P, plain_replicated=args.impl == "tp", skip=skip)
        optimizer.step()
        if step % args.log_interval == 0 or step == args.max_iters - 1:
            loss_value = (loss_sum / accum_steps).item()
            synchronize(env)
            metrics.step(step, loss_value, lr, time.perf_counter() - t0,
                         state_bytes([p for _, p in params], optimizer), LEDGER.take())
        optimizer.zero_grad(set_to_none=True)
    teardown(env)


if __name__ == "__main__":
    main()
