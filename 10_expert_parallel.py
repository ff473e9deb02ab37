"""10_expert_parallel.py: a mixture of experts with expert parallelism by hand (GShard,
Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2022; Megatron-LM's token dispatcher).

Every block's MLP is common.py's MoE: E expert MLPs and a router; each token goes to its top-k
experts, their outputs weighted by the renormalised router probabilities (Mixtral's routing),
dropless unless --capacity_factor (common.route has the routing options, --balance and
--shared_experts too: docs/strategies.md). The experts of a block are divided among the N
ranks of an expert-parallel (EP) group: rank r holds experts [r·E/N, (r+1)·E/N). Everything
else (attention, embeddings, LayerNorms, routers, shared experts) is replicated, and every
rank trains on its own slice of the global batch, as in 03's data parallelism. Per MoE
layer, on every rank:

    route locally     x ─ router ─ top-k ─> (token, expert) entries, k per token
    permute           sort the entries by expert: experts of rank 0 first, then rank 1, ...
    exchange counts   all_to_all of E counts: how many rows each rank will receive
    dispatch          all_to_all of the rows, variable sizes (all_to_all_single with splits)

        rank 0 [to e0 e1 | to e2 e3]          rank 0 [from 0: e0 e1 | from 1: e0 e1]
        rank 1 [to e0 e1 | to e2 e3]   ──>    rank 1 [from 0: e2 e3 | from 1: e2 e3]

    compute           regroup by local expert, run experts e_j on their rows
    combine           all_to_all back (the same splits, swapped), un-permute, and sum each
                      token's k outputs weighted by the router: y = Σ_j w_j · expert_j(x)

The backward is autograd's through the two all-to-alls: AllToAll's backward sends every
gradient row back to the rank its row came from (the splits swapped), as 06's f/g operators
carry their own collective for backward.

With more ranks than --ep (world W = ep x dp), the world is dp EP groups of --ep consecutive
ranks (inside a node, where the all-to-alls are cheap); the ranks with the same place in their
group hold the same experts. Gradients after backward: the replicated parameters' are
all-reduced over the world; an expert's gradient already holds the contributions of its EP
group's tokens (they came back through the all-to-all), so it is all-reduced over the dp
ranks that hold the same experts; both divided by W, the mean over the global batch.

The load-balancing loss (common.route: Switch's E·Σ f_e·P_e, per sequence) depends only on
the rank's own sequences, so the objective is 01's however the batch is split: the losses
equal `01_single_gpu.py --n_expert E --top_k K` at every --ep and data-parallel size.

Run:

    mpiexec -n 8 python 10_expert_parallel.py                    # baby-moe: 8 experts, 1 per rank
    mpiexec -n 12 python 10_expert_parallel.py                   # --ep 4 (divides 8 and 12) x dp 3
    torchrun --standalone --nproc_per_node 4 10_expert_parallel.py --model gpt2 --n_expert 8 --top_k 2 --ep 4

One rank holds: 16 bytes x (Ψ_d + L·Ψ_e·E/N), the replicated parameters Ψ_d whole and E/N of
each layer's experts (Ψ_e one expert's parameters), N = --ep.
One rank sends, per MoE layer per micro-batch: its k·b·s routed rows of h out and the experts'
outputs back, forward and again backward (4·k·b·s·h·e·(N-1)/N on the wire when the routing is
balanced), + E counts; per step the all-reduce of the replicated gradients over the world and of
its experts' over the ranks holding the same experts. The busiest rank sets the pace (dropless:
no cap; --capacity_factor bounds it). The derivations, the imbalance and the activation terms:
docs/strategies.md, section "10_expert_parallel.py".
"""

import math
from functools import partial

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist
import torch.nn as nn

from common import (autocast, check, combine, Data, expert_load, expert_step, GPT, grad_norm, is_hidden_matrix,
                    lr_at, make_optimizer, make_parser, model_block_size, model_config, Muon, muon_apply,
                    muon_momentum, orthogonalize, param_shapes, shared_plus, to_device, TreeGrads, tree_all_reduce)


def add_flags(parser):
    g = parser.add_argument_group("10_expert_parallel")
    g.add_argument("--ep", type=int, default=None,
                   help="expert-parallel size: ranks sharing one copy of the experts (default: the largest "
                        "that divides both --n_expert and the world size)")
    parser.set_defaults(model="baby-moe")  # the default preset's mixture-of-experts variant
    return parser


def check_layout(args, config, world_size):
    """--ep: divides the world and the experts; returns it."""
    E = config.n_expert
    check(E > 0, "10_expert_parallel.py needs a mixture of experts: --n_expert E > 0 (or --model baby-moe)")
    check(args.ep is None or args.ep > 0, f"--ep must be positive, got {args.ep}")
    ep = args.ep or math.gcd(E, world_size)
    check(world_size % ep == 0, f"--ep {ep} does not divide the world size {world_size}")
    check(E % ep == 0, f"--n_expert {E} is not divisible by --ep {ep}: every rank holds E/ep whole experts")
    # --bitwise: at ep 1 every rank is a replica computing its micro-batches as 01 does; at ep N an
    # expert's matmuls take the rows of N ranks' micro-batches at once, summing their gradients inside
    check(not getattr(args, "bitwise", False) or ep == 1, f"--bitwise holds in 10_expert_parallel.py at --ep 1 only "
          f"(every rank all the experts, a data-parallel replica): at --ep {ep} an expert's matmul takes the rows of "
          f"{ep} ranks' micro-batches at once, where 01 takes one micro-batch's")
    return ep


def expert_groups(world_size, ep):
    """(ep_group, expert_dp_group) of this rank: its EP group (ep consecutive ranks, which
    together hold every expert once) and the ranks holding the same experts (stride ep),
    named "ep" and "expert_dp": the ledger counts their collectives as all_to_all_single[ep],
    all_reduce[expert_dp]. Every rank creates every group, in the same order (torch.distributed
    requires it)."""
    rank, mine = dist.get_rank(), {}
    for d in range(world_size // ep):
        group = dist.new_group(list(range(d * ep, (d + 1) * ep)), group_desc="ep")
        if rank // ep == d:
            mine["ep"] = group
    for j in range(ep):
        group = dist.new_group(list(range(j, world_size, ep)), group_desc="expert_dp")
        if rank % ep == j:
            mine["expert_dp"] = group
    return mine["ep"], mine["expert_dp"]


class AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes, differentiable: forward sends in_splits[r] rows to
    rank r of the group and receives out_splits[r] from it; backward sends every gradient
    row back to where its row came from (the same exchange, splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), x.size(1))
        # rows to the ranks that own their experts (dispatch), or back to their tokens (combine)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), grad.size(1))
        # the gradient of every row back to the rank that sent it
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelMoE(nn.Module):
    """common.MoE with only this rank's experts (a ModuleDict under their global numbers, so
    that their parameters keep 01's names: transformer.h.0.mlp.experts.3.c_fc.weight) and the
    dispatch / combine all-to-alls over the EP group; its router (which counts the tokens per
    expert) and shared experts are replicated. Records, for the ledger, the rows it sent and
    received (training forwards only)."""

    def __init__(self, moe, local, group):
        super().__init__()
        self.router, self.top_k, self.n_expert, self.group = moe.router, moe.top_k, len(moe.experts), group
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in local})
        self.shared = moe.shared  # --shared_experts: every token's, replicated like the dense MLP
        self.received, self.sent = [], []

    def forward(self, x):
        B, T, C = x.shape
        N, local = dist.get_world_size(self.group), len(self.experts)
        weights, order, counts, aux = self.router(x)  # 01's routing (common.Router), this rank's rows
        rows = x.reshape(B * T, C)[order // self.top_k]  # permuted: grouped by expert, so by rank
        if torch.is_autocast_enabled(x.device.type):  # the experts' Linears would cast them anyway
            rows = rows.to(torch.get_autocast_dtype(x.device.type))
        # exchange counts: rank r gets, from every rank of the group, its counts for r's experts
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # E int64 counts
        # the one host read of the layer: all_to_all_single takes its split sizes as lists, and
        # the receiver must know them to allocate its inbox (Megatron's dispatcher reads them
        # too); what this rank sends comes back with it, in the same read
        received, send = torch.stack([received.view(N, local), counts.view(N, local)]).tolist()
        send, recv = [sum(row) for row in send], [sum(row) for row in received]  # [source][local expert]
        inbox = AllToAll.apply(rows[:sum(send)], recv, send, self.group)  # dispatch (dropped rows: last, stay)
        # The dispatch delivers the rows source-major: from each source rank s, its rows for
        # each of this rank's experts j in turn. Each expert runs once on all of its rows, so
        # the [s][j] grid of pieces is transposed to [j][s], the experts run, and their outputs
        # are transposed back, source-major, for the combine (2 sources, experts e0 e1 here):
        #
        #   inbox, by source   [ s0>e0 | s0>e1 | s1>e0 | s1>e1 ]
        #   by expert          e0: [ s0>e0 | s1>e0 ]   e1: [ s0>e1 | s1>e1 ]    -> e0(...), e1(...)
        #   back, by source    [ e0(s0) | e1(s0) | e0(s1) | e1(s1) ]    -> combine: to s0, to s1
        by_source = [chunk.split(sizes) for chunk, sizes in zip(inbox.split(recv), received)]  # [s][j]
        by_expert = list(zip(*by_source))  # [j][s]: the transpose
        outs = [expert(torch.cat(pieces)) for expert, pieces in zip(self.experts.values(), by_expert)]
        outs_by_expert = [out.split([len(p) for p in pieces]) for out, pieces in zip(outs, by_expert)]  # [j][s]
        back = torch.cat([piece for row in zip(*outs_by_expert) for piece in row])  # [s][j] again, flat
        out = AllToAll.apply(back, send, recv, self.group)  # combine: to the tokens' ranks
        if torch.is_grad_enabled():  # a training forward (with --recompute: the one in backward)
            self.received.append(sum(recv))  # one entry per micro-batch
            self.sent.append(sum(send))
        return shared_plus(self.shared, combine(out, order, weights).view(B, T, C), x), aux


def build_model(config, seed, device, ep_rank, ep, group, recompute):
    """01's MoE GPT with this rank's E/ep experts per block: built on the meta device (no
    memory), the other experts dropped, then allocated and initialised by param_init, by name:
    the same values as 01's model."""
    with torch.device("meta"):
        model = GPT(config)
    per = config.n_expert // ep
    for block in model.transformer.h:
        block.mlp = ExpertParallelMoE(block.mlp, range(ep_rank * per, (ep_rank + 1) * per), group)
        block.recompute = recompute
    model.to_empty(device=device)
    model.transformer.wte.weight = model.lm_head.weight  # weight tying, again after allocation
    return model.init_weights(seed)


def is_expert(name):
    return ".experts." in name


def take_routing(model):
    """This step's routing, and reset: (the rows this rank received and sent, per layer per
    micro-batch; the routers' (L, E) tokens per expert and (L,) dropped of this rank's tokens,
    on the device: common.expert_load)."""
    layers = [block.mlp for block in model.transformer.h]
    received, sent = [m.received for m in layers], [m.sent for m in layers]
    for m in layers:
        m.received, m.sent = [], []
    return received, sent, *expert_load(model)


def reduce_gradients(model, world_size, data_group, expert_dp_group, dp_size):
    """The mean gradient over the global batch: the replicated parameters' summed over
    `data_group` (every rank with a slice of the batch: the world), the experts' over the ranks
    holding the same experts (their EP groups' tokens are already in them), each divided by W."""
    for expert, group in ((False, data_group), (True, expert_dp_group)):
        grads = [p.grad for name, p in model.named_parameters() if is_expert(name) == expert]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(world_size)
        if not expert or dp_size > 1:
            dist.all_reduce(flat, group=group)  # the sum of every rank's g/W
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm(model, max_norm, ep_group, tree=None):
    """Global norm: the replicated gradients counted once, the experts' summed over the EP
    group (which holds every expert once)."""
    if tree:  # --bitwise (ep 1: every gradient here, whole): 01's, each parameter's norm, then theirs
        return clip_with(model, max_norm, grad_norm([p.grad for p in model.parameters()]))
    device = next(model.parameters()).device
    squares = {True: torch.zeros((), device=device), False: torch.zeros((), device=device)}
    for name, p in model.named_parameters():
        squares[is_expert(name)] += p.grad.float().pow(2).sum()
    dist.all_reduce(squares[True], group=ep_group)  # every expert's squares, once
    return clip_with(model, max_norm, (squares[True] + squares[False]).sqrt())


def clip_with(model, max_norm, total):
    """Scale every gradient so that their norm, `total`, is at most max_norm."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)
    return total


@torch.no_grad()
def evaluate(model, data, args, env, accum_steps, data_group):
    """Mean loss of each split over eval_iters fixed global batches: each rank evaluates its
    slice (through the all-to-alls), then the means are averaged across ranks."""
    model.eval()
    losses = {}
    for split in ("train", "val"):
        total = torch.zeros((), device=env.device)
        for k in range(args.eval_iters):
            x, y = data.batch(split, k, args.global_batch_size, env.rank, env.world_size, eval_split=True)
            x, y = to_device(x, env), to_device(y, env)
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    _, loss = model(x[rows], y[rows])
                total += loss.float()
        total /= args.eval_iters * accum_steps * env.world_size
        dist.all_reduce(total, group=data_group)  # the sum of every rank's mean/W: the global mean
        losses[split] = total.item()
    model.train()
    return losses


def main():
    run = Run(add_flags(make_parser(__doc__, experts=True)), __file__)
    args = run.args
    config = model_config(args, Data.vocab_size_of(args.data))
    ep = check_layout(args, config, run.world_size)
    # every rank its own slice; the expert groups up before auto reads the room for what fits
    env, accum_steps = run.start(costs, dp_size=run.world_size, groups=lambda env: expert_groups(env.world_size, ep))
    run.dry_run(costs, lambda config: layout_lines(args, config, run.world_size, accum_steps))  # checked first
    torch.manual_seed(args.seed + env.rank)  # dropout: a different stream on every rank
    data = Data(args.data, args.seed, model_block_size(args))
    dp = env.world_size // ep
    ep_group, expert_dp_group = run.groups  # the all-to-alls; the ranks that hold the same experts
    data_group = dist.group.WORLD  # every rank trains on its own slice of the batch: ep x dp ranks
    model = build_model(config, args.seed, env.device, env.rank % ep, ep, ep_group, args.recompute)
    optimizer = replicated_optimizer(model, args, env, data_group, expert_dp_group)  # AdamW, or Muon + AdamW
    tree = TreeGrads(lambda: [p.grad for p in model.parameters()], accum_steps) if args.bitwise else None
    run.begin(config, optimizer, costs, layout={"strategy": "expert parallel", "ep": ep},
              pieces=lambda: checkpoint_pieces(model, optimizer, env.rank // ep == 0, env),
              evaluate=lambda: evaluate(model, data, args, env, accum_steps, data_group),
              describe=f"expert parallel over {ep} ranks x {dp} data-parallel, {config.n_expert // ep} of "
                       f"{config.n_expert} experts per rank, top-{config.top_k}, {accum_steps} micro-batch(es) "
                       f"of {args.micro_batch_size} per rank per step")

    for step in run.steps():
        lr = lr_at(step, args)  # linear warm-up, then cosine decay (nanoGPT's get_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = data.batch("train", step, args.global_batch_size, env.rank, env.world_size)
        x, y = to_device(x, env), to_device(y, env)
        loss_sum = torch.zeros((), device=env.device)
        with run.meter:
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    _, loss = model(x[rows], y[rows])  # dispatch and combine all-to-alls in every block
                (loss if tree else loss / accum_steps).backward()  # backward all-to-alls: the gradients' rows home
                loss_sum += loss.detach().float()
                if tree: tree.take(micro, loss)  # --bitwise: this micro-batch's gradients kept apart for one fixed tree
        if tree:  # --bitwise (ep 1): every replica's tree, then one fixed tree over the world (below)
            loss_sum = bitwise_reduce(model, tree, data_group, accum_steps)
        else:
            reduce_gradients(model, env.world_size, data_group, expert_dp_group, dp)  # the experts' over expert_dp
        received, sent, load, dropped = take_routing(model)
        stats = torch.cat([(loss_sum / (accum_steps * env.world_size)).view(1), load.float().view(-1),
                           dropped.float().sum().view(1)])
        # the global batch's mean loss, tokens per expert (--balance bias steps on them) and tokens dropped
        dist.all_reduce(stats, group=data_group)
        norm = None  # the global gradient norm, where clipping takes it (the guard reads it too)
        if args.grad_clip > 0:
            norm = clip_grad_norm(model, args.grad_clip, ep_group, tree)  # the norm over every expert once
        run.check(stats[0], (p.grad for p in model.parameters()), norm)  # non-finite? asked to stop?
        optimizer.step()
        routing = expert_step(model, stats[1:-1].view(config.n_layer, -1), stats[-1])  # --balance bias: the biases
        run.end_step(stats[0], extra=lambda: {**expert_metrics(run.cost), **routing()},
                     received=received, sent=sent)  # this step's routing: what its costs() depend on
        optimizer.zero_grad(set_to_none=True)
    run.finish()


# ---- Beyond the lesson ----
# Muon divided among the replicas (03's ReplicatedMuon), costs() (the ledger's theory, the dry run,
# the fit check and plan.py) and its activations, the metrics' expert keys, the checkpoint pieces
# and the dry run's layout lines.

def bitwise_reduce(model, tree, group, n):
    """--bitwise (ep 1): this replica's tree of its n micro-batches (every gradient, then the loss)
    summed over the replicas by common.tree_all_reduce, the tree's upper levels in one fixed order,
    and divided once by the global batch's micro-batch count, as 01 --bitwise divides (03's
    bitwise_reduce). Returns the losses' sum on the group's rank 0 and 0 elsewhere, so that the
    statistics' all-reduce adds it to zeros only (x + 0 = x) after the loop divides it."""
    p = dist.get_world_size(group)
    flat = torch.cat([t.reshape(-1) for t in tree.total()])  # the gradients' sums, then the loss's
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % p))  # a multiple of p elements
    tree_all_reduce(flat, group)
    offset = 0
    for param in model.parameters():
        param.grad.copy_(flat[offset:offset + param.numel()].view_as(param)).div_(n * p)
        offset += param.numel()
    return flat[offset].clone() if dist.get_rank(group) == 0 else torch.zeros((), device=flat.device)


def replicated_optimizer(model, args, env, data_group, expert_dp_group):
    """common.make_optimizer's AdamW, or its Muon as 03's ReplicatedMuon twice: each replicated
    matrix's owner among every rank (`data_group`), each expert matrix's among the ranks that
    hold the same experts (`expert_dp_group`); the one steps the other, as Muon steps its AdamW."""
    named = list(model.named_parameters())
    if args.optimizer == "adamw":
        return make_optimizer(named, args, env)
    experts = [is_expert(name) and is_hidden_matrix(name, p.shape) for name, p in named]
    rest = make_optimizer([x for x, expert in zip(named, experts) if not expert], args, env,
                          muon=partial(ReplicatedMuon, group=data_group))
    return ReplicatedMuon([p for (_, p), expert in zip(named, experts) if expert], rest, args, env.dtype,
                          expert_dp_group)


def costs(args, config, world_size, dtype, received=None, rank=0, sent=None):
    """The formulas of docs/strategies.md's 10 section in bytes per rank. `received`, `sent`: the
    rows this rank received and sent in this step's all-to-alls, per layer per micro-batch (from
    its routing counts); without them, balanced routing: k·b·s each, and with --capacity_factor
    the most the capacity lets in: b·E·ceil(C·k·s/E) received (at most N·k·b·s)."""
    from infra.formulas import (activation_device_type, formula, matmul_weights, newton_schulz_flops, phase_peaks,
                                transient_terms)
    ep = check_layout(args, config, world_size)  # first: the formulas divide by E and by ep
    L, E, k, h, e = config.n_layer, config.n_expert, config.top_k, config.n_embd, dtype.itemsize
    shapes = param_shapes(config)  # the model's, without making one (a meta GPT of 64 experts: 2 s)
    psi_e = sum(math.prod(shape) for name, shape in shapes.items() if is_expert(name))  # all L·E experts
    psi_d = sum(math.prod(shape) for name, shape in shapes.items() if not is_expert(name))
    muon = {expert: sum(math.prod(shape) for name, shape in shapes.items()  # Muon's matrices, if it runs
                        if args.optimizer == "muon" and is_hidden_matrix(name, shape) and is_expert(name) == expert)
            for expert in (False, True)}
    b = args.micro_batch_size or args.global_batch_size // world_size
    m, s = args.global_batch_size // (b * world_size), config.block_size
    if received is None:  # [layer][micro-batch]
        capacity = math.ceil(config.capacity_factor * k * s / E)  # per sequence (common.route)
        received = [[min(b * E * capacity, ep * k * b * s) if capacity else k * b * s] * m] * L
    rows_sent = [[k * b * s] * m] * L if sent is None else sent  # fewer where --capacity_factor drops
    passes = 3 if args.recompute else 2  # forward, backward (and the forward again)

    def f(expr):  # Ψ_d: the dense parameters, Ψ_e: one expert's; R, S: the rows received, sent over the step
        return formula(expr, show="e m p R S", Ψ_d=psi_d, Ψ_e=psi_e // (L * E), Ψ_dm=muon[False],
                       Ψ_em=muon[True] // (L * E), L=L, E=E, N=ep, k=k, h=h, e=e,
                       b=b, s=s, m=m, p=passes, R=sum(map(sum, received)), S=sum(map(sum, rows_sent)), norm=1)
    held = {"params": f("4*(Ψ_d + L*Ψ_e*E/N)"), "grads": f("4*(Ψ_d + L*Ψ_e*E/N)"), "optim": f("8*(Ψ_d + L*Ψ_e*E/N)" if args.optimizer == "adamw" else  # Muon: one moment of its matrices
                   "4*(Ψ_dm + L*Ψ_em*E/N) + 8*(Ψ_d - Ψ_dm + L*(Ψ_e - Ψ_em)*E/N)")}
    # all-to-all inputs: the S routed rows out (L·m·k·b·s less those dropped) and the experts'
    # outputs back (R of them), in forward and again in backward (and the forward once more
    # with --recompute), + the counts (8E per layer and micro-batch, forward and recompute)
    all_to_all = f("p*e*h*(S + R) + (p - 1)*8*E*L*m")
    # the dense gradients, the loss, the expert counts and the dropped tokens (2 + L·E), over all
    # ranks; the experts' gradients over the dp ranks that hold the same experts; the experts'
    # share of the norm over the EP group
    sent = {"all_to_all_single[ep]": all_to_all, "all_reduce": f("4*Ψ_d + 4*(2 + L*E)"),
            "all_reduce[expert_dp]": f("4*L*Ψ_e*E/N" if world_size > ep else "0"),
            "all_reduce[ep]": f("4*norm" if args.grad_clip > 0 else "0")}
    if getattr(args, "bitwise", False):  # (ep 1) every gradient and the loss, padded to the world, to their
        # owners and back (bitwise_reduce: a ring all-reduce's bytes); the statistics' all-reduce as ever; no norm's
        tree = formula("4*(Ψ_d + L*Ψ_e*E + loss + pad)", Ψ_d=psi_d, Ψ_e=psi_e // (L * E), L=L, E=E, loss=1,
                       pad=-(psi_d + psi_e + 1) % world_size)
        sent.update({"all_reduce": f("4*(2 + L*E)"), "all_reduce[expert_dp]": f("0"), "all_reduce[ep]": f("0"),
                     "all_to_all_single": tree, "all_gather_into_tensor": tree})
    # Muon's matrices on this rank: the dense ones, and those of its E/N experts of every layer (alike)
    dense, experts = ([shape for name, shape in shapes.items() if args.optimizer == "muon"
                       and is_hidden_matrix(name, shape) and is_expert(name) == expert] for expert in (False, True))
    experts, dp = experts[:len(experts) // ep], world_size // ep  # this rank's, replicated over dp ranks
    if dense and world_size > 1:  # ReplicatedMuon: each owner's orthogonalised updates to every replica
        sent["broadcast"] = f("e*Ψ_dm")
    if experts and dp > 1:  # and the experts' among the ranks that hold the same experts
        sent["broadcast[expert_dp]"] = f("e*L*Ψ_em*E/N")
    # the calls a step posts, each paying the network's latency once: per layer and micro-batch the
    # rows out and back in each pass and the counts in each forward; the dense gradients' flat
    # all-reduce and the logged statistics'; the experts' flat all-reduce; the norm; Muon's per matrix
    bitwise = getattr(args, "bitwise", False)  # (then the statistics' all-reduce only: bitwise_reduce's tree)
    calls = {"all_to_all_single[ep]": f("L*m*(2*p + p - 1)"), "all_reduce": f("1" if bitwise else "2"),
             "all_reduce[expert_dp]": f("1"), "all_reduce[ep]": f("1"), "all_to_all_single": f("1"),
             "all_gather_into_tensor": f("1"),
             "broadcast": formula("matrices", matrices=len(dense)),
             "broadcast[expert_dp]": formula("matrices", matrices=len(experts))}
    owned = [shape for shape, owner in zip(dense, muon_owners(dense, world_size)) if owner == rank] + \
        [shape for shape, owner in zip(experts, muon_owners(experts, dp)) if owner == rank // ep]
    cost = {"layout": f"expert parallel over {ep} ranks x {world_size // ep} data-parallel",
            "held": held, "sent": {op: value for op, value in sent.items() if value[1]},
            "calls": {op: value for op, value in calls.items() if sent.get(op, (0, 0))[1]},
            # Muon: Newton-Schulz on the matrices this rank owns, dense and of its experts
            # (infra.formulas.newton_schulz_flops)
            "muon_flops": newton_schulz_flops(owned),
            "activations": max((activations(args, config, b, dtype, rows) for rows in zip(*received)),
                               key=lambda a: a[1])}
    # every live tensor at its most, by phase (infra.formulas.phase_peaks; autocast casts the dense
    # weights and this rank's experts), with the dispatch's packed rows in forward, and
    # reduce_gradients' flat copy of the dense
    # gradients, still named while the experts' is made, before AdamW's temporaries; at
    # start-up the weights (materialised from the meta device) and param_init's scratch
    casts = matmul_weights({k: v for k, v in shapes.items() if not is_expert(k)}) + \
        matmul_weights({k: v for k, v in shapes.items() if is_expert(k)}) // ep
    t = transient_terms(config, b, s, dtype, activation_device_type(args), args.optimizer, casts=casts)
    dispatch = f("e*k*b*s*h")  # a layer's routed rows, packed for the dispatch all-to-all
    cost["peak"] = phase_peaks(cost, t, forward={"dispatch": dispatch}, optimizer={"update": formula(
        "max(4*Ψ_d + 4*L*Ψ_e*E/N, update)", show="update", Ψ_d=psi_d, Ψ_e=psi_e // (L * E), L=L, E=E, N=ep,
        update=t["update"])})
    momentum = " + 4*(Ψ_dm + L*Ψ_em*E/N)" if args.optimizer == "muon" else ""  # Muon's, made at once
    cost["startup"] = formula("params + init" + momentum, show="init", params=held["params"], init=t["init"],
                              Ψ_dm=muon[False], Ψ_em=muon[True] // (L * E), L=L, E=E, N=ep)
    return cost


def activations(args, config, b, dtype, rows):
    """The formula of what one micro-batch holds for backward when layer l's experts
    received rows[l] rows (infra.formulas.activation_terms): every layer's until backward; with
    --recompute the block inputs, and while layer l's backward runs, the inputs below it and
    its internals."""
    from infra.formulas import activation_device_type, activation_terms, activations_of_layers, formula
    def terms(n):
        return activation_terms(config, b, config.block_size, dtype, activation_device_type(args), expert_rows=n)
    if args.recompute:  # layer l as the top of l + 1 layers: its backward holds l inputs and itself
        return max((activations_of_layers(terms(n), l + 1, True) for l, n in enumerate(rows)), key=lambda a: a[1])
    layers = {f"layer_{l}": terms(n)["layer"] for l, n in enumerate(rows)}  # layer l on its R_l rows
    ends = terms(rows[0])
    return formula(" + ".join(layers) + " + embedding + head", **layers, embedding=ends["embedding"],
                   head=ends["head"])


def expert_metrics(cost):
    """The metrics' extra keys besides common.routing_metrics': this step's comm_bytes_theory and
    activation_bytes_theory (the formulas on its routing counts)."""
    return {"comm_bytes_theory": {op: value for op, (_, value) in cost["sent"].items()},
            "activation_bytes_theory": cost["activations"][1]}


def checkpoint_pieces(model, optimizer, writes_experts, env):
    """Every parameter and its AdamW moments under 01's names, and the routers' biases (--balance
    bias): the replicated ones written by rank 0, each expert by the rank of the first EP group that holds it (common.py's format:
    01 with --n_expert, or 10 at another --ep, resumes it)."""
    from infra.checkpoint_format import param_pieces
    return [piece for name, p in model.named_parameters()
            for piece in param_pieces(name, p.shape, p, optimizer,
                                      write=env.master or (writes_experts and is_expert(name)))] + \
        [piece for name, b in model.named_buffers() for piece in param_pieces(name, b.shape, b, write=env.master)]


def layout_lines(args, config, world_size, accum_steps):
    """The dry run's layout: EP groups, experts per rank, micro-batches; and a warning when an
    EP group spans nodes (its all-to-alls, four per layer, want a node's fast links)."""
    ep = check_layout(args, config, world_size)
    lines = [f"layout: {world_size // ep} expert-parallel group(s) of {ep} ranks, {config.n_expert // ep} of "
             f"{config.n_expert} experts per rank (top-{config.top_k}); {accum_steps} micro-batch(es) of "
             f"{args.micro_batch_size} per rank per step"]
    if ep > args.ranks_per_node:
        lines.append(f"  warning: an expert-parallel group spans nodes of {args.ranks_per_node} ranks: its "
                     "all-to-alls cross the network (a smaller --ep keeps them inside a node)")
    return lines


# ---- restated from 03_ddp.py: ReplicatedMuon, muon_owners (word for word; tests/test_restated.py checks it) ----
class ReplicatedMuon(Muon):
    """Muon on replicas. After the all-reduce every replica of `group` holds the same mean
    gradient, so Newton-Schulz, Muon's costly part, need run only once per matrix: each matrix
    has one owner among the replicas (muon_owners, 04's balanced assignment), which
    orthogonalises the matrix's update and broadcasts it to the others; every replica then
    applies it. The work per replica falls as 1/N instead of staying whole on each.

    The momentum stays replicated: element-wise and cheap, every replica keeps all of it, so
    the replicas stay equal and any one of them checkpoints it whole, as AdamW's moments.

    One broadcast per matrix from its owner, not one all-gather: the owners' shares are whole
    matrices of unequal sizes, and an all-gather pads every replica's part to the busiest's
    (N·max ≥ Ψ_m elements, and N times the largest matrix once replicas outnumber matrices),
    while the broadcasts move Ψ_m exactly. They are posted asynchronously, so an owner's
    update travels while the replicas go on to their next matrix. The update lands in the
    matrix's gradient, spent by then, read in the Newton-Schulz dtype: no buffer is added."""

    def __init__(self, matrices, adamw, args, ns_dtype, group):
        super().__init__(matrices, adamw, args, ns_dtype)
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)
        self.owners = muon_owners([p.shape for p in self.param_groups[0]["params"]], self.size)

    @torch.no_grad()
    def step(self):
        group, handles, received = self.param_groups[0], [], []
        for p, owner in zip(group["params"], self.owners):
            update = muon_momentum(p.grad, self.state[p]["momentum_buffer"])  # every replica: the momentum
            orthogonal = p.grad.view(-1).view(self.ns_dtype)[:p.numel()].view(p.shape)  # the gradient's memory
            if owner == self.rank:
                orthogonal.copy_(orthogonalize(update, self.ns_dtype))
            if self.size > 1:  # a replica alone posts nothing
                # the owner's orthogonalised update (the matrix, in the NS dtype) to every replica
                handles.append(dist.broadcast(orthogonal, group=self.group, group_src=owner, async_op=True))
            received.append(orthogonal)
        for handle in handles:
            handle.wait()
        for p, orthogonal in zip(group["params"], received):
            muon_apply(p, orthogonal, group["lr"], group["weight_decay"], p.shape)
        self.adamw.step()


def muon_owners(shapes, group_size):
    """The rank that orthogonalises each hidden matrix (given their full shapes): largest
    first to the least-loaded rank (LPT), so the group's Newton-Schulz work is spread as
    evenly as whole matrices allow. The same on every rank: no communication."""
    owners, load = [None] * len(shapes), [0] * group_size
    for i in sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i])):
        owners[i] = min(range(group_size), key=lambda t: load[t])
        load[owners[i]] += math.prod(shapes[i])
    return owners
# ---- end restated ----


if __name__ == "__main__":
    main()
