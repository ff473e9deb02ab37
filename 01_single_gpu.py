"""01_single_gpu.py: the whole model on one device, the baseline every strategy must match.

This is nanoGPT's training loop, kept short: warm-up + cosine learning rate, gradient
accumulation, gradient clipping, bf16 autocast on GPUs (fp32 on CPU), periodic train/val
evaluation, checkpoints with bit-exact resume, a text sample at the end, optional
torch.compile. Every other numbered script is this file plus one strategy: read it first,
then `diff 01_single_gpu.py 03_ddp.py`.

Who holds what (one device holds everything):

    device 0:  [ parameters | gradients | AdamW exp_avg, exp_avg_sq ]   <- the whole global
                                                                           batch, one micro-
                                                                           batch at a time
Run:

    python 01_single_gpu.py                        # nanoGPT's shakespeare_char recipe, for a GPU
    python 01_single_gpu.py --model shakespeare --n_layer 4 --n_head 4 --n_embd 128 \\
        --block_size 64 --global_batch_size 32 --max_iters 2000 --lr_decay_iters 2000 \\
        --dropout 0 --eval_interval 500 --device cpu   # ~4 minutes on 2 CPU cores, val ~1.76

Cost per device, Ψ = number of parameters (bytes; AdamW keeps two fp32 moments):

    parameters 4Ψ + gradients 4Ψ + optimizer 8Ψ = 16Ψ      (fp32, and also with bf16
                                                            autocast: weights stay fp32)
    communication: none
    activations (one micro-batch of b x s tokens, width h, common.activation_terms counts
    them op by op): per block 64bsh + 16bs + 4·b·heads·s in fp32, 36bsh + ... under bf16
    autocast, plus the head's 4bsV log-softmax; --recompute keeps only each block's input
"""

import time

import torch

from common import (activation_device_type, activation_terms, ActivationMeter,
                    activations_of_layers, autocast, build_model, check, check_batch, count_params,
                    Data, decay_groups, dry_run, flops_per_token, Guard, launch_for, LEDGER,
                    load_model_file, log, lr_at, make_adamw, make_parser, Metrics, model_block_size,
                    model_config, param_pieces, parse_args, planned_dtype, print_ledger, progress,
                    resume_checkpoint, run_config, save_checkpoint, setup, state_bytes, synchronize,
                    teardown, to_device)


def add_flags(parser):
    g = parser.add_argument_group("01_single_gpu")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--sample_tokens", type=int, default=300, help="tokens to sample at the end (0: none)")
    g.add_argument("--init_from", default=None,
                   help="start from the weights of a one-file model (--export's, or nanoGPT's ckpt.pt)")
    g.add_argument("--eval_only", action="store_true", help="evaluate (and sample), do not train")
    return parser


def costs(args, config, world_size, dtype):
    """What the one device holds, in bytes (Ψ parameters): the weights, their gradients and
    AdamW's two moments, all fp32 also under bf16 autocast (autocast casts inside each op;
    the stored tensors stay fp32). Nothing is sent. Activations: one micro-batch's, all
    layers (common.activation_terms counts them op by op; --recompute keeps block inputs)."""
    psi, _ = count_params(config)
    b = args.micro_batch_size or args.global_batch_size
    terms = activation_terms(config, b, config.block_size, dtype, activation_device_type(args))
    return {"layout": "one device",
            "held": {"params": ("4Ψ", 4 * psi), "grads": ("4Ψ", 4 * psi), "optim": ("8Ψ", 8 * psi)},
            "sent": {},
            "activations": activations_of_layers(terms, config.n_layer, args.recompute)}


@torch.no_grad()
def evaluate(model, data, args, env, accum_steps):
    """Mean loss of each split over eval_iters fixed global batches."""
    model.eval()
    losses = {}
    for split in ("train", "val"):
        total = torch.zeros((), device=env.device)
        for k in range(args.eval_iters):
            x, y = data.batch(split, k, args.global_batch_size, eval_split=True)
            x, y = to_device(x, env), to_device(y, env)
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    _, loss = model(x[rows], y[rows])
                total += loss.float()
        losses[split] = (total / (args.eval_iters * accum_steps)).item()
    model.train()
    return losses


def main():
    args = parse_args(add_flags(make_parser(__doc__)))
    launch = launch_for(args)
    check(launch.world_size == 1, f"01_single_gpu.py runs as one process, not {launch.world_size}: "
          "use plain `python 01_single_gpu.py` (the other scripts are the parallel ones)")
    check(args.sample_tokens >= 0, f"--sample_tokens must not be negative, got {args.sample_tokens}")
    accum_steps = check_batch(args, dp_size=1)
    if args.dry_run:
        config = model_config(args, Data.vocab_size_of(args.data))
        dry_run(args, "01_single_gpu.py", config, costs(args, config, 1, planned_dtype(args)),
                [f"layout: one device, {accum_steps} micro-batch(es) of {args.micro_batch_size}"])
    env = setup(args, launch, distributed=False)
    guard = Guard(args, env)  # every step: non-finite values, SIGTERM/SIGUSR1, --time_limit
    torch.manual_seed(args.seed)  # dropout's random stream (weights are seeded by name)

    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    model = build_model(config, args.seed, env.device)
    for block in model.transformer.h:
        block.recompute = args.recompute
    optimizer = make_adamw(*decay_groups(model.parameters()), args, env.device.type)
    run = run_config(args, config, {"world_size": 1})

    def checkpoint_pieces():
        """Every parameter and its AdamW moments, whole, under nanoGPT's names (the tied head
        is transformer.wte.weight): common.py's format, which any script resumes."""
        return [piece for name, p in model.named_parameters() for piece in param_pieces(name, p.shape, p, optimizer)]

    start_step = 0
    if args.resume:  # a checkpoint of any script, at any layout
        start_step, _ = resume_checkpoint(args.out_dir, env, checkpoint_pieces(), run, optimizer)
    elif args.init_from:
        model.load_state_dict(load_model_file(args.init_from, config))
    train_model = torch.compile(model) if args.compile else model

    log(env, f"model: {model.num_params() / 1e6:.2f}M parameters (nanoGPT's count), "
             f"device {env.device}, {str(env.dtype).replace('torch.', '')}, "
             f"{accum_steps} micro-batch(es) of {args.micro_batch_size} per step")
    cost = costs(args, config, 1, env.dtype)
    metrics = Metrics(args, env, flops_per_token(config, model.num_params()), cost)
    meter = ActivationMeter()  # the bytes autograd holds for backward, next to cost["activations"]

    def save(step):
        save_checkpoint(args, step, env, checkpoint_pieces(), run, optimizer)

    if args.eval_only:
        losses = evaluate(train_model, data, args, env, accum_steps)
        log(env, f"eval: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        metrics.write({"step": start_step, "val_loss": losses["val"], "train_loss": losses["train"]})
        args.max_iters = start_step  # nothing to train: fall through to the sample
    for step in progress(env, start_step, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            losses = evaluate(train_model, data, args, env, accum_steps)
            log(env, f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            metrics.write({"step": step, "val_loss": losses["val"], "train_loss": losses["train"]})
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()

        x, y = data.batch("train", step, args.global_batch_size)
        x, y = to_device(x, env), to_device(y, env)
        loss_sum = torch.zeros((), device=env.device)
        meter.start()
        for micro in range(accum_steps):
            rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
            with autocast(env):
                _, loss = train_model(x[rows], y[rows])
            (loss / accum_steps).backward()  # accumulate the mean over the global batch
            loss_sum += loss.detach().float()
        activations = meter.stop()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        # all ranks agree: a non-finite loss or gradient ends the run here, before the update;
        # a stop signal or --time_limit ends it after this step's checkpoint
        stop = guard.check(step, loss_sum, (p.grad for p in model.parameters()))
        optimizer.step()

        comm = LEDGER.take()
        if step == start_step:
            print_ledger(env, state_bytes(model.parameters(), optimizer), comm, cost, activations)
        if step % args.log_interval == 0 or step == args.max_iters - 1:
            loss_value = (loss_sum / accum_steps).item()
            synchronize(env)
            metrics.step(step, loss_value, lr, time.perf_counter() - t0,
                         state_bytes(model.parameters(), optimizer), comm, activations=activations)
        optimizer.zero_grad(set_to_none=True)
        if stop or args.ckpt_interval and ((step + 1) % args.ckpt_interval == 0 or step + 1 == args.max_iters):
            save(step + 1)
        if stop:
            guard.stop(step + 1)  # say how to resume, exit 0 on every rank

    if args.eval_interval and args.max_iters > start_step:
        losses = evaluate(train_model, data, args, env, accum_steps)
        log(env, f"step {args.max_iters}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        metrics.write({"step": args.max_iters, "val_loss": losses["val"], "train_loss": losses["train"]})
    if args.sample_tokens:
        start = torch.zeros((1, 1), dtype=torch.long, device=env.device)
        generator = torch.Generator(device=env.device).manual_seed(args.seed)
        with autocast(env):
            sample = model.eval().generate(start, args.sample_tokens, top_k=200, generator=generator)
        log(env, "sample:\n" + data.decode(sample[0].tolist()))
    teardown(env)


if __name__ == "__main__":
    main()
