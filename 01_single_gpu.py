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

    python 01_single_gpu.py                        # the default baby GPT (21.3M), for a GPU
    python 01_single_gpu.py --model shakespeare --n_layer 4 --n_head 4 --n_embd 128 \\
        --block_size 64 --global_batch_size 32 --max_iters 2000 --lr_decay_iters 2000 \\
        --dropout 0 --eval_interval 500 --device cpu   # the README's quick start, on a CPU

Cost per device, Ψ = number of parameters (bytes; AdamW keeps two fp32 moments):

    parameters 4Ψ + gradients 4Ψ + optimizer 8Ψ = 16Ψ      (fp32, and also with bf16
                                                            autocast: weights stay fp32)
    communication: none
    activations (one micro-batch of b x s tokens, width h, infra.formulas.activation_terms counts
    them op by op): per block 64bsh + 16bs + 4·b·heads·s in fp32, 36bsh + ... under bf16
    autocast, plus the head's 4bsV log-softmax; --recompute keeps only each block's input
"""

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch

from common import (autocast, build_model, check, count_params, Data, expert_rows, expert_step, lr_at,
                    make_optimizer, make_parser, model_block_size, model_config, to_device, TreeGrads)


def add_flags(parser):
    g = parser.add_argument_group("01_single_gpu")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--sample_tokens", type=int, default=300, help="tokens to sample at the end (0: none)")
    g.add_argument("--init_from", default=None,
                   help="start from the weights of a one-file model (--export's, or nanoGPT's ckpt.pt), or of "
                        "hf:DIR, a transformers GPT-2 directory (save_pretrained's, or --export_hf's)")
    g.add_argument("--eval_only", action="store_true", help="evaluate (and sample), do not train")
    return parser


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
    run = Run(add_flags(make_parser(__doc__, experts=True)), __file__)  # --n_expert: 10's reference
    args = run.args
    check_args(args, run.world_size)  # one process; --sample_tokens; --resume or --init_from, not both
    env, accum_steps = run.start(costs, dp_size=1)  # the process up; --micro_batch_size auto: what fits
    run.dry_run(costs, lambda config: [f"layout: one device, {accum_steps} micro-batch(es) of "
                                       f"{args.micro_batch_size}"])  # --dry_run: the plan, then exit
    torch.manual_seed(args.seed)  # dropout's random stream (weights are seeded by name)

    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    if args.init_from:  # a one-file model, or hf:DIR (a transformers GPT-2, whose vocabulary the model takes)
        from infra.checkpoint import load_model_file  # the checkpoint reader, which refuses pickled code
        config, weights = load_model_file(args.init_from, config)
    model = build_model(config, args.seed, env.device, recompute=args.recompute)
    if args.init_from:
        model.load_state_dict(weights)
    train_model = torch.compile(model) if args.compile else model
    optimizer = make_optimizer(model.named_parameters(), args, env)  # AdamW, or Muon + AdamW
    tree = TreeGrads(lambda: [p.grad for p in model.parameters()], accum_steps) if args.bitwise else None
    run.begin(config, optimizer, costs, layout={"world_size": 1},
              pieces=lambda: checkpoint_pieces(model, optimizer),
              evaluate=lambda: evaluate(train_model, data, args, env, accum_steps),
              describe=f"{accum_steps} micro-batch(es) of {args.micro_batch_size} per step")
    if args.eval_only:
        run.evaluate(run.start_step)
        args.max_iters = run.start_step  # nothing to train: go on to the sample

    for step in run.steps():
        lr = lr_at(step, args)  # linear warm-up, then cosine decay (nanoGPT's get_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = data.batch("train", step, args.global_batch_size)
        x, y = to_device(x, env), to_device(y, env)
        loss_sum = torch.zeros((), device=env.device)
        with run.meter:
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    _, loss = train_model(x[rows], y[rows])
                (loss if tree else loss / accum_steps).backward()  # accumulate the mean over the global batch
                loss_sum += loss.detach().float()
                if tree: tree.take(micro, loss)  # --bitwise: this micro-batch's gradients kept apart for one fixed tree
        loss_sum = bitwise_total(model, tree, accum_steps) if tree else loss_sum  # --bitwise: the tree's sums
        norm = None  # the global gradient norm, where clipping takes it (the guard reads it too)
        if args.grad_clip > 0:  # (--bitwise: each parameter's norm in turn, as a sharded layout takes it)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip,
                                                  foreach=False if tree else None)
        run.check(loss_sum, (p.grad for p in model.parameters()), norm)  # non-finite? asked to stop?
        optimizer.step()
        routing = expert_step(model) if config.n_expert else None  # --balance bias: the routers' biases move
        run.end_step(loss_sum / accum_steps, extra=routing, **expert_rows(model))  # ledger, metrics, checkpoint, stop
        optimizer.zero_grad(set_to_none=True)

    if args.sample_tokens:
        run.log("sample:\n" + sample(model, data, args, env))  # a few tokens of text from the trained model
    run.finish()


# ---- Beyond the lesson ----

def sample(model, data, args, env):
    """--sample_tokens of text from the trained model, from the seed's generator (top-k 200)."""
    start = torch.zeros((1, 1), dtype=torch.long, device=env.device)
    generator = torch.Generator(device=env.device).manual_seed(args.seed)
    with autocast(env):
        tokens = model.eval().generate(start, args.sample_tokens, top_k=200, generator=generator)
    return data.decode(tokens[0].tolist())


def check_args(args, world_size):
    """The refusals of 01's own flags, each one line (common.check: exit 2)."""
    check(world_size == 1, f"01_single_gpu.py runs as one process, not {world_size}: "
          "use plain `python 01_single_gpu.py` (the other scripts are the parallel ones)")
    check(args.sample_tokens >= 0, f"--sample_tokens must not be negative, got {args.sample_tokens}")
    check(not (getattr(args, "resume", False) and args.init_from), "--resume and --init_from both say where the "
          "weights come from: pass one (--resume continues a run; --init_from starts a new one from saved weights)")


# Not the training loop: what the device holds and sends (costs(), the ledger's theory), checkpoint pieces.

def costs(args, config, world_size, dtype, rows=None):
    """What the one device holds, in bytes (Ψ parameters): the weights, their gradients and
    AdamW's two moments, all fp32 also under bf16 autocast (autocast casts inside each op;
    the stored tensors stay fp32). Nothing is sent. Activations: one micro-batch's, all
    layers (infra.formulas.activation_terms counts them op by op; --recompute keeps block inputs);
    `rows` (--capacity_factor): the rows each layer's experts ran, per micro-batch, this step."""
    from infra.formulas import (activation_device_type, activation_terms, activations_of_layers, formula,
                                hidden_matrix_params, hidden_matrix_shapes, newton_schulz_flops, phase_peaks,
                                transient_terms)
    psi, _ = count_params(config)
    b = args.micro_batch_size or args.global_batch_size
    terms = activation_terms(config, b, config.block_size, dtype, activation_device_type(args))
    cost = {"layout": "one device",
            "held": {"params": formula("4*Ψ", Ψ=psi), "grads": formula("4*Ψ", Ψ=psi),
                     # AdamW's two moments; Muon keeps one (its momentum) for the Ψ_m matrix entries
                     "optim": formula("8*Ψ", Ψ=psi) if args.optimizer == "adamw" else
                     formula("4*Ψ_m + 8*(Ψ - Ψ_m)", Ψ=psi, Ψ_m=hidden_matrix_params(config))},
            "sent": {}, "calls": {},
            # Muon: Newton-Schulz on every matrix (infra.formulas.newton_schulz_flops)
            "muon_flops": newton_schulz_flops(hidden_matrix_shapes(config) if args.optimizer == "muon" else []),
            "activations": activations_of_layers(terms, config.n_layer, args.recompute) if rows is None else
            max((routed_activations(args, config, b, dtype, r) for r in zip(*rows)), key=lambda a: a[1])}
    # every live tensor at its most, by phase (infra.formulas.phase_peaks: the state, the saved
    # activations, the model's transients), and at start-up: the weights and param_init's
    # scratch (AdamW's moments are made at the first step, Muon's momentum at once)
    t = transient_terms(config, b, config.block_size, dtype, activation_device_type(args), args.optimizer)
    muon = args.optimizer == "muon"
    cost["peak"] = phase_peaks(cost, t, **bitwise_peaks(args, psi, b, t))
    cost["startup"] = formula("params + init" + " + 4*Ψ_m" * muon, show="init", params=cost["held"]["params"],
                              init=t["init"], Ψ_m=hidden_matrix_params(config) * muon)
    return cost


def routed_activations(args, config, b, dtype, rows):
    """--capacity_factor: what one micro-batch holds for backward when layer l's experts ran
    rows[l] rows (the drops differ by layer), as 10_expert_parallel.py's activations()."""
    from infra.formulas import activation_device_type, activation_terms, activations_of_layers, formula
    def terms(n):
        return activation_terms(config, b, config.block_size, dtype, activation_device_type(args), expert_rows=n)
    if args.recompute:  # layer l as the top of l + 1 layers: its backward holds l inputs and itself
        return max((activations_of_layers(terms(n), l + 1, True) for l, n in enumerate(rows)), key=lambda a: a[1])
    layers = {f"layer_{l}": terms(n)["layer"] for l, n in enumerate(rows)}
    ends = terms(rows[0])
    return formula(" + ".join(layers) + " + embedding + head", **layers, embedding=ends["embedding"],
                   head=ends["head"])


def bitwise_peaks(args, psi, b, t):
    """--bitwise's tensors in costs()'s peak: through the step the tree's partial sums (common.TreeSum),
    one gradient copy per 1-bit of the micro-batches taken so far, floor(log2 n) at most; after it,
    bitwise_total's sum beside .grad, where the optimizer's update would otherwise be the most."""
    from infra.formulas import formula
    n = args.global_batch_size // b
    if not getattr(args, "bitwise", False) or n < 2:
        return {}
    sums = {"tree": formula("k*4*Ψ", show="k", k=n.bit_length() - 1, Ψ=psi)}
    return {"forward": sums, "backward": sums,
            "optimizer": {"update": formula("max(update, 4*Ψ)", update=t["update"], Ψ=psi)}}


def bitwise_total(model, tree, n):
    """--bitwise: the micro-batches' gradients, summed in common.TreeSum's order, divided once by
    their count n into .grad, as every layout divides its tree's sum; the loss's sum, for the log."""
    *grads, loss = tree.total()
    for p, g in zip(model.parameters(), grads):
        p.grad.copy_(g.div_(n))
    return loss[0]


def checkpoint_pieces(model, optimizer):
    """Every parameter and its AdamW moments, whole, under nanoGPT's names (the tied head
    is transformer.wte.weight), and the routers' biases (--balance bias): infra's format,
    which any script resumes."""
    from infra.checkpoint_format import param_pieces
    return [piece for name, p in model.named_parameters() for piece in param_pieces(name, p.shape, p, optimizer)] + \
        [piece for name, b in model.named_buffers() for piece in param_pieces(name, b.shape, b)]  # routers' biases


if __name__ == "__main__":
    main()
