"""06_tensor_parallel.py: Megatron-style tensor parallelism by hand, with a vocab-parallel
loss and sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022).

Every layer's weight matrices are split across the T ranks of the tensor-parallel group, so
each rank holds and computes 1/T of every layer; the ranks exchange activations twice per
layer forward and twice backward. Here the world is the TP group (world size = --tp).

The MLP, A = c_fc (h -> 4h) split by columns, B = c_proj (4h -> h) split by rows:

           X ──f──┬── X A_1 ── GeLU ── (.) B_1 ──┬──g── Y      f: forward identity,
                  ├── X A_2 ── GeLU ── (.) B_2 ──┤             backward all-reduce
                  └── ...   (rank t: A_t, B_t) ──┘          g: forward all-reduce,
                                                               backward identity
GeLU is elementwise, so each rank applies it to its own columns: no communication between A
and B. Attention is the same with heads: c_attn (Q, K, V) split by columns so that rank t owns
heads [t·n_head/T, (t+1)·n_head/T), c_proj split by rows. The token embedding, which is also
the output head, is split by vocabulary rows, and the cross-entropy never gathers the logits.
Which parameter is split along which dimension is said once, in the table TP_PLAN, and the
layers are built from it.

--sequence_parallel splits the regions between the layers (LayerNorm, dropout) along the sequence:
f an all-gather, g a reduce-scatter, the activations between the layers 1/T as large; backward
gathers each column-parallel input again, and sums the replicated parameters' gradients once a step.

    X_t ──all-gather──> X ── X A_t ── ... ── (.) B_t ──reduce-scatter──> Y_t
    [b, s/T, h]        [b, s, h]                                     [b, s/T, h]: chunk t of the sum

Run:

    mpiexec -n 4 python 06_tensor_parallel.py --model gpt2
    torchrun --standalone --nproc_per_node 8 06_tensor_parallel.py --model gpt2-xl --sequence_parallel

One rank, of T, with L layers of width h, b sequences of s tokens a micro-batch (costs() below):

    holds: 16 bytes x (Ψ_sharded/T + Ψ_replicated), and the attention's and MLP's activations /T
    sends: 4 all-reduces of b·s·h per layer per micro-batch (SP: 4 reduce-scatters, 6 all-gathers)

docs/strategies.md, section "06_tensor_parallel.py: tensor parallelism", derives these and
details the vocabulary-parallel loss, sequence parallelism's backward and the dropout streams.
"""

import math
from contextlib import contextmanager

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

from common import (autocast, check, Data, device_rng_state, is_hidden_matrix, lr_at, make_adamw, make_parser,
                    model_block_size, model_config, Muon, muon_apply, muon_momentum, orthogonalize, param_init,
                    recomputed, set_device_rng_state, to_device)


# ---------------------------------------------------------------------------------------
# The layout: which parameter the group splits, along which dimension (one table)
# ---------------------------------------------------------------------------------------

# parameter-name suffix -> (how, dim, parts): the group splits dimension `dim` T ways; with parts = 3
# that dimension is three blocks stacked (c_attn's rows [Q; K; V]), each split, so that rank t holds
# its heads of Q, K and V. The vocabulary is padded to a multiple of T. Every parameter not named is
# replicated: LayerNorms, the position embedding, the row-parallel biases (added once, after g).
TP_PLAN = {
    "wte.weight":         ("vocab", 0, 1),   # rows [t·V/T, (t+1)·V/T): the embedding and the tied head
    "attn.c_attn.weight": ("column", 0, 3),  # column-parallel: output rows, this rank's heads of Q, K, V
    "attn.c_attn.bias":   ("column", 0, 3),
    "attn.c_proj.weight": ("row", 1, 1),     # row-parallel: input columns (this rank's heads' outputs)
    "mlp.c_fc.weight":    ("column", 0, 1),  # column-parallel: output rows
    "mlp.c_fc.bias":      ("column", 0, 1),
    "mlp.c_proj.weight":  ("row", 1, 1),     # row-parallel: input columns
}


def tp_split(name):
    """TP_PLAN's (how, dim, parts) for parameter `name`, or None: replicated."""
    return next((split for suffix, split in TP_PLAN.items() if name.endswith(suffix)), None)


def shard_shape(name, shape, tp_size):
    """Parameter `name`'s shape on one rank: the whole `shape` with TP_PLAN's dimension divided among
    the T ranks (the vocabulary's rounded up: padded to a multiple of T), or `shape` where replicated."""
    shape, split = list(shape), tp_split(name)
    if split is not None:
        shape[split[1]] = math.ceil(shape[split[1]] / tp_size)  # exact, but for the vocabulary's padding
    return shape


# ---------------------------------------------------------------------------------------
# Megatron's conjugate operators f and g, and the parallel layers built on them
# ---------------------------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward all-reduce over the TP group, since every rank's
    branch contributed a part of the gradient of the shared input."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_world_size(ctx.group) > 1:  # a one-rank group posts nothing
            dist.all_reduce(grad, group=ctx.group)  # sum the input-gradient parts of every rank's weight shard
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce of the partial sums over the TP group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        if dist.get_world_size(group) > 1:  # a one-rank group posts nothing
            dist.all_reduce(x, group=group)  # sum the partial outputs of the row-parallel shards
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """Y_t = f(X) A_t: this rank's block of output columns (rows of nn.Linear's weight)."""

    def __init__(self, in_features, out_local, bias, group, sequence_parallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:  # f as an all-gather; keeps only the sequence shard of x for backward
            return AllGatherSequenceLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(X_t B_t) + bias: this rank's rows of B (columns of nn.Linear's weight); the bias once, after g."""

    def __init__(self, in_local, out_features, bias, group, sequence_parallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        alone = dist.get_world_size(self.group) == 1  # g is then nothing: the bias inside, as nn.Linear adds it
        partial = F.linear(x, self.weight, self.bias if alone else None)  # (so under autocast, 01's bits)
        y = (ReduceScatterSequence if self.sequence_parallel else ReduceFromTP).apply(partial, self.group)  # g
        return y + self.bias if self.bias is not None and not alone else y


def parallel_linear(name, in_features, out_features, bias, tp_size, group, sequence_parallel):
    """nanoGPT's nn.Linear(in_features, out_features) named `name`, split as TP_PLAN says:
    column-parallel (this rank's rows of the weight) or row-parallel (its columns)."""
    out_local, in_local = shard_shape(name + ".weight", (out_features, in_features), tp_size)
    layer = {"column": ColumnParallelLinear, "row": RowParallelLinear}[tp_split(name + ".weight")[0]]
    return layer(in_local, out_local, bias, group, sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """Rank t holds rows [start, start + V/T) of the (padded) token embedding."""

    def __init__(self, vocab_local, n_embd, start, group, sequence_parallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, n_embd))
        self.start, self.group, self.sequence_parallel = start, group, sequence_parallel

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # other ranks' tokens contribute zeros
        reduce = ReduceScatterSequence if self.sequence_parallel else ReduceFromTP  # g
        return reduce.apply(x, self.group)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from this rank's slice of the logits, never gathering them:
    loss_i = log Σ_v exp(z_iv - m_i) - (z_i,target - m_i), with m_i the global max. The
    backward needs no communication: d loss / d z = softmax - onehot, computed locally."""

    @staticmethod
    def forward(ctx, logits, targets, start, vocab_size, group):
        logits, n_local = logits.float(), logits.shape[-1]
        ids = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))  # padding never counts
        logits_max = logits.max(dim=-1).values
        many = dist.get_world_size(group) > 1  # a one-rank group posts nothing
        if many:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # the global max per token
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = targets - start
        mine = (local_target >= 0) & (local_target < n_local)
        target_logit = shifted.gather(-1, local_target.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~mine, 0.0)
        if many:
            dist.all_reduce(target_logit, group=group)  # only the owning rank contributes the target's logit
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if many:
            dist.all_reduce(sum_exp, group=group)  # the softmax denominator over the whole vocabulary
        loss = sum_exp.log() - target_logit
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_target.clamp(0, n_local - 1), mine)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * (grad / softmax[..., 0].numel()), None, None, None, None


# ---------------------------------------------------------------------------------------
# Sequence parallelism: f and g along the sequence; dropout streams
# ---------------------------------------------------------------------------------------

def all_gather_sequence(x, group):
    """[b, s/T, h] on each rank -> [b, s, h], the shards in rank order."""
    tp_size, (b, s_local, h) = dist.get_world_size(group), x.shape
    parts = torch.empty((tp_size * b, s_local, h), dtype=x.dtype, device=x.device)  # rank-major
    dist.all_gather_into_tensor(parts, x.contiguous(), group=group)  # every rank's sequence shard
    return parts.view(tp_size, b, s_local, h).permute(1, 0, 2, 3).reshape(b, tp_size * s_local, h)


def reduce_scatter_sequence(x, group):
    """[b, s, h] partial sums on each rank -> [b, s/T, h]: this rank's sequence shard of the sum."""
    tp_size, (b, s, h) = dist.get_world_size(group), x.shape
    chunks = x.reshape(b, tp_size, s // tp_size, h).permute(1, 0, 2, 3).reshape(tp_size * b, s // tp_size, h)
    out = torch.empty((b, s // tp_size, h), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, chunks, group=group)  # sum over ranks; rank t keeps sequence chunk t
    return out


class AllGatherSequenceLinear(torch.autograd.Function):
    """f as an all-gather, and a column-parallel Linear: Y_t = all-gather(X) A_t + b_t, keeping
    only this rank's sequence shard of X for backward (Korthikanti et al. 2022, Sec. 4.2.2), not
    the gathered X, T times as large: backward all-gathers it again for the weight gradient and
    reduce-scatters the input gradient. Under autocast the shard is cast first, and kept cast."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        shard = x.to(dtype)
        out = F.linear(all_gather_sequence(shard, group), weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(shard, weight)  # [b, s/T, h], not the gathered [b, s, h]
        ctx.has_bias, ctx.x_dtype, ctx.group = bias is not None, x.dtype, group
        return out

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        total = all_gather_sequence(shard, ctx.group)  # the whole sequence again, for the weight gradient
        grad_x = grad.matmul(weight.to(grad.dtype))  # [b, s, h]: this rank's part of dL/dX
        # sum every rank's part, keep this rank's sequence shard (in the input's dtype, as autocast would)
        grad_x = reduce_scatter_sequence(grad_x.to(ctx.x_dtype), ctx.group)
        grad_weight = grad.flatten(0, 1).t().matmul(total.flatten(0, 1))  # dL/dA_tᵀ = dY_tᵀ X (the weight's)
        grad_bias = grad.sum(dim=(0, 1)).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None


class ReduceScatterSequence(torch.autograd.Function):
    """g as a reduce-scatter: forward reduce-scatter to sequence shards, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class ShardedRNG:
    """Megatron's model-parallel RNG tracker, reduced to one stream: `with rng.sharded():` swaps
    the device's default generator (the stream the TP group shares) for this rank's own, and back."""

    def __init__(self, seed, rank, device):
        self.device = device  # a fresh generator's state, made without reseeding the default one
        self.state = torch.Generator(device=device).manual_seed(seed + 2718 + rank).get_state()

    @contextmanager
    def sharded(self):
        shared = device_rng_state(self.device)
        set_device_rng_state(self.device, self.state)
        try:
            yield
        finally:
            self.state = device_rng_state(self.device)
            set_device_rng_state(self.device, shared)


# ---------------------------------------------------------------------------------------
# The tensor-parallel GPT (nanoGPT's module names, so param_init names match 01's)
# ---------------------------------------------------------------------------------------

class TPAttention(nn.Module):
    """Causal self-attention on this rank's n_head/T heads: c_attn and c_proj as TP_PLAN
    splits them (column-parallel: the heads' Q, K and V; row-parallel: their outputs)."""

    def __init__(self, config, tp_size, sp, rng, group):
        super().__init__()
        h = config.n_embd
        self.c_attn = parallel_linear("attn.c_attn", h, 3 * h, config.bias, tp_size, group, sp)
        self.c_proj = parallel_linear("attn.c_proj", h, h, config.bias, tp_size, group, sp)
        self.n_head_local, self.dropout, self.rng, self.sp = config.n_head // tp_size, config.dropout, rng, sp
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)  # this rank's heads of Q, K and V
        b, s, width = q.shape  # the whole sequence (with SP too: c_attn gathered it)
        q, k, v = (z.view(b, s, self.n_head_local, width // self.n_head_local).transpose(1, 2) for z in (q, k, v))
        y = self.c_proj(self.attend(q, k, v).transpose(1, 2).contiguous().view(b, s, width))
        if self.sp:  # with sequence parallelism the residual stream is sharded too
            with self.rng.sharded():
                return self.resid_dropout(y)
        return self.resid_dropout(y)

    def attend(self, q, k, v):
        """Causal attention within this rank's heads, [b, heads, s, head size]."""
        with self.rng.sharded():  # attention dropout acts inside this rank's heads
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)


class TPMLP(nn.Module):
    """The docstring's picture: c_fc column-parallel (A_t), GeLU on this rank's columns,
    c_proj row-parallel (B_t), as TP_PLAN splits them."""

    def __init__(self, config, tp_size, sp, rng, group):
        super().__init__()
        h = config.n_embd
        self.c_fc = parallel_linear("mlp.c_fc", h, 4 * h, config.bias, tp_size, group, sp)
        self.gelu = nn.GELU()
        self.c_proj = parallel_linear("mlp.c_proj", 4 * h, h, config.bias, tp_size, group, sp)
        self.dropout, self.rng, self.sp = nn.Dropout(config.dropout), rng, sp

    def forward(self, x):
        y = self.c_proj(self.gelu(self.c_fc(x)))
        if self.sp:
            with self.rng.sharded():
                return self.dropout(y)
        return self.dropout(y)


class TPBlock(nn.Module):
    def __init__(self, config, tp_size, sp, rng, group):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = TPAttention(config, tp_size, sp, rng, group)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = TPMLP(config, tp_size, sp, rng, group)

    recompute = False  # --recompute: keep the block's input only (its f/g run again in backward)

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            return recomputed(self.body, x, trackers=[self.attn.rng])  # the rank's own stream too
        return self.body(x)

    def body(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TPGPT(nn.Module):
    def __init__(self, config, tp_size, tp_rank, sp, rng, group, recompute=False):
        super().__init__()
        self.config, self.tp_size, self.tp_rank, self.sp, self.rng = config, tp_size, tp_rank, sp, rng
        self.group = group  # the tensor-parallel group (in this script: every rank)
        self.vocab_local = shard_shape("wte.weight", (config.vocab_size, config.n_embd), tp_size)[0]
        self.padded_vocab = self.vocab_local * tp_size  # a multiple of T: padding rows, never a target
        self.transformer = nn.ModuleDict(dict(
            wte=VocabParallelEmbedding(self.vocab_local, config.n_embd, tp_rank * self.vocab_local, group, sp),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([TPBlock(config, tp_size, sp, rng, group) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        for block in self.transformer.h:
            block.recompute = recompute

    def forward(self, idx, targets):
        s = idx.shape[1]
        x = self.transformer.wte(idx)  # [b, s, h], or [b, s/T, h] with sequence parallelism
        if self.sp:  # this rank's positions, and dropout on a sequence shard: this rank's own stream
            positions = self.tp_rank * s // self.tp_size + torch.arange(s // self.tp_size, device=idx.device)
            with self.rng.sharded():
                x = self.transformer.drop(x + self.transformer.wpe(positions))
        else:
            x = self.transformer.drop(x + self.transformer.wpe(torch.arange(s, device=idx.device)))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if self.sp:  # the tied head, a column-parallel Linear too: this rank's vocabulary
            logits = AllGatherSequenceLinear.apply(x, self.transformer.wte.weight, None, self.group)
        else:
            logits = F.linear(CopyToTP.apply(x, self.group), self.transformer.wte.weight)  # the tied head
        return VocabParallelCrossEntropy.apply(logits.view(-1, logits.size(-1)), targets.view(-1),
                                               self.tp_rank * self.vocab_local, self.config.vocab_size, self.group)


def clip_grad_norm(model, max_norm, group):
    """Global norm: the squares of what TP_PLAN splits summed over the TP `group`, the replicated ones once."""
    device = next(model.parameters()).device
    sharded, replicated = torch.zeros((), device=device), torch.zeros((), device=device)
    for name, p in model.named_parameters():
        square = p.grad.float().pow(2).sum()
        if tp_split(name):
            sharded += square
        else:
            replicated += square
    if dist.get_world_size(group) > 1:  # a one-rank group posts nothing
        dist.all_reduce(sharded, group=group)  # the sum over the group's shards (not over replicas)
    total_norm = (sharded + replicated).sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in model.parameters():
        p.grad.mul_(coef)
    return total_norm


def all_reduce_sequence_parallel_grads(model, group):
    """With sequence parallelism each rank saw only its sequence shard in the replicated regions,
    so the replicated parameters' gradients are partial: sum them over the TP `group`."""
    grads = [p.grad for name, p in model.named_parameters() if tp_split(name) is None]
    flat = torch.cat([g.view(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # sum of the TP ranks' partial gradients of the replicated parameters
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def add_flags(parser):
    g = parser.add_argument_group("06_tensor_parallel")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel size (= world size)")
    g.add_argument("--sequence_parallel", action="store_true",
                   help="shard LayerNorm/dropout regions along the sequence")
    return parser


def main():
    run = Run(add_flags(make_parser(__doc__)), __file__)
    args = run.args
    tp_size = run.world_size  # one tensor-parallel group: every rank
    check(args.tp in (None, tp_size), f"--tp {args.tp} must equal the world size {tp_size} in "
          "06_tensor_parallel.py (08_3d.py combines TP with data and pipeline parallelism)")
    env, accum_steps = run.start(costs, dp_size=1)  # the processes up; auto: the largest that fits
    run.dry_run(costs, lambda config: layout_lines(args, config, tp_size, accum_steps))  # the layout checked first
    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    check_layout(args, config, tp_size)
    torch.manual_seed(args.seed)  # the shared stream: identical on every rank of the group
    rng = ShardedRNG(args.seed, env.rank, env.device)  # this rank's own stream, for the sharded regions
    tp_group = dist.group.WORLD  # the tensor-parallel group: here every rank
    model = TPGPT(config, tp_size, env.rank, args.sequence_parallel, rng, tp_group, recompute=args.recompute)
    model = init_from_full(model, args.seed).to(env.device)  # every shard cut from 01's initial values
    optimizer = make_adamw(model.parameters(), args, env.device.type) if args.optimizer == "adamw" else \
        ShardedMuon(model, args, env, tp_group)  # Muon: each matrix orthogonalised whole by its owner
    sp = " with sequence parallelism" if args.sequence_parallel else ""
    saved = run.begin(config, optimizer, costs, layout={"strategy": "tensor parallel",
                                                       "sequence_parallel": args.sequence_parallel},
                      pieces=lambda: checkpoint_pieces(model, optimizer, env),
                      evaluate=lambda: evaluate(model, data, args, env, accum_steps),
                      describe=f"tensor parallel over {tp_size} ranks{sp}, vocabulary {config.vocab_size} "
                               f"padded to {model.padded_vocab}, {accum_steps} micro-batch(es) of "
                               f"{args.micro_batch_size} per step",
                      extra_rng=lambda: {"tp": rng.state})  # this rank's own stream is checkpointed too
    resume_sharded_rng(rng, saved, run.log)  # the same layout: this rank's own dropout stream continues too

    for step in run.steps():
        lr = lr_at(step, args)  # linear warm-up, then cosine decay (nanoGPT's get_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = data.batch("train", step, args.global_batch_size)  # every TP rank: the whole batch
        x, y = to_device(x, env), to_device(y, env)
        loss_sum = torch.zeros((), device=env.device)
        with run.meter:
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    loss = model(x[rows], y[rows])  # f and g in every block; the loss never gathers logits
                (loss / accum_steps).backward()  # accumulate the mean over the global batch
                loss_sum += loss.detach().float()
        if args.sequence_parallel:  # the replicated parameters saw only this rank's sequence shard
            all_reduce_sequence_parallel_grads(model, tp_group)
        norm = None  # the global gradient norm, where clipping takes it (the guard reads it too)
        if args.grad_clip > 0:
            norm = clip_grad_norm(model, args.grad_clip, tp_group)  # the norm over every rank's shards
        run.check(loss_sum, (p.grad for p in model.parameters()), norm)  # non-finite? asked to stop?
        optimizer.step()
        run.end_step(loss_sum / accum_steps)  # ledger, metrics, checkpoint, stop
        optimizer.zero_grad(set_to_none=True)
    run.finish()


# ---- Beyond the lesson ----
# What the lesson does not need to be read: where a shard lies in the full parameter (the
# initialisation, the checkpoint pieces and Muon place shards by it), the evaluation, the
# layout's checks and the dry run's lines, resuming this rank's dropout stream, the formulas
# of what a rank holds and sends (costs()), the checkpoint pieces and Muon on shards.

def shard_boxes(name, shape, vocab_size, tp_size, tp_rank):
    """Where the shard of parameter `name` (local `shape`) that rank `tp_rank` holds lies in
    the full parameter, from TP_PLAN: (the full shape, [(box, index), ...]) where `box` is
    the region of the full parameter ([start, stop) per dimension) that shard[index] holds.
    One box per block of the split dimension (three for c_attn); the vocabulary's full shape
    is the unpadded V, its padding rows in no box; a replicated parameter: one box, whole."""
    full, whole = list(shape), [[0, s] for s in shape]
    split = tp_split(name)
    if split is None:
        return tuple(full), [(whole, ...)]
    how, dim, parts = split
    n = shape[dim] // parts  # this rank's part of each block
    full[dim] = vocab_size if how == "vocab" else shape[dim] * tp_size
    boxes = []
    for j in range(parts):
        lo = j * n * tp_size + tp_rank * n  # block j of the full dimension starts at j·n·T
        hi = min(lo + n, full[dim])  # shorter (or empty) only where the vocabulary's padding is
        if lo < hi:
            boxes.append((whole[:dim] + [[lo, hi]] + whole[dim + 1:],
                          (slice(None),) * dim + (slice(j * n, j * n + hi - lo),)))
    return tuple(full), boxes


@torch.no_grad()
def init_from_full(model, seed):
    """A TPGPT's shards, each cut by TP_PLAN (shard_boxes) from the full parameter as 01
    initialises it (one full parameter at a time: the whole model never exists on a rank);
    the vocabulary's padding rows are zeros."""
    for name, p in model.named_parameters():
        full, boxes = shard_boxes(name, p.shape, model.config.vocab_size, model.tp_size, model.tp_rank)
        value = param_init(name, full, model.config, seed)
        p.zero_()
        for box, index in boxes:
            p[index] = value[tuple(slice(lo, hi) for lo, hi in box)]
    return model


@torch.no_grad()
def evaluate(model, data, args, env, accum_steps):
    """Mean loss of each split over eval_iters fixed global batches (every TP rank reads the
    whole batch and computes the same loss)."""
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
                    loss = model(x[rows], y[rows])
                total += loss.float()
        losses[split] = (total / (args.eval_iters * accum_steps)).item()
    model.train()
    return losses


def check_layout(args, config, tp_size):
    check(not getattr(args, "bitwise", False), "--bitwise cannot hold in 06_tensor_parallel.py: tensor parallelism splits each "
          "matmul's inner dimension over the ranks, which changes one micro-batch's arithmetic")
    check(config.n_head % tp_size == 0,
          f"n_head {config.n_head} is not divisible by the tensor-parallel size {tp_size}: "
          f"each rank must own whole attention heads")
    check(not args.sequence_parallel or config.block_size % tp_size == 0,
          f"--sequence_parallel needs block_size {config.block_size} divisible by the tensor-parallel size {tp_size}")


def resume_sharded_rng(rng, saved, log):
    """Continue this rank's own dropout stream (`rng`, a ShardedRNG) from a checkpoint's state
    (`saved`: the same layout's extra streams, else None). A state written on another device
    type does not fit this device's generator (a CPU generator's state is 5056 bytes, a CUDA
    one's 16): the stream then starts afresh, as at a layout change, and `log` says so once."""
    if saved is None:
        return
    if saved["tp"].shape == rng.state.shape:
        rng.state = saved["tp"]
    else:
        log(f"the tensor-parallel dropout stream was saved on another device type (a "
            f"{saved['tp'].numel()}-byte state; this {rng.device.type} generator's is "
            f"{rng.state.numel()} bytes): it starts afresh, as at a layout change")


# ---------------------------------------------------------------------------------------
# Accounting: what a rank holds and sends (the ledger's theory), checkpoint pieces
# ---------------------------------------------------------------------------------------

def costs(args, config, world_size, dtype, rank=0):
    """docs/strategies.md's formulas in bytes per rank, T = world_size, m micro-batches of b
    sequences. Parameters: the sharded ones (1/T each; the vocabulary padded to a multiple
    of T) and the replicated ones, all fp32. Activations: b·s·h elements each; under
    autocast the row-parallel outputs (g's forward) are in the compute dtype (e bytes) while
    LayerNorm outputs, the embedding and the gradients flowing into f are fp32, so f's
    backward and the embedding/head all-reduces move 4 bytes an element. With
    --sequence_parallel f's all-gathers (in forward, and again in backward) move the
    LayerNorm output cast to the compute dtype: e bytes."""
    from infra.formulas import (activation_device_type, activation_terms, activations_of_layers, formula,
                                largest_matrix, matmul_weights, newton_schulz_flops, phase_peaks, plus, transient_terms)
    T, L, sp = world_size, config.n_layer, args.sequence_parallel
    check_layout(args, config, T)  # first: the formulas divide by T exactly
    with torch.device("meta"):
        model = TPGPT(config, T, 0, sp, None, None)  # shapes only
    n_sharded = sum(p.numel() for name, p in model.named_parameters() if tp_split(name))  # 1/T of each
    n_replicated = sum(p.numel() for name, p in model.named_parameters() if tp_split(name) is None)
    m, b = args.global_batch_size // args.micro_batch_size, args.micro_batch_size
    s, h, e = config.block_size, config.n_embd, dtype.itemsize
    matrices = [shard_boxes(name, p.shape, 0, T, 0)[0] for name, p in model.named_parameters()
                if args.optimizer == "muon" and is_hidden_matrix(name, p.shape)]  # Muon's, whole
    owners = muon_owners(matrices, T)

    def f(expr):  # Ψ_s: the parameters TP_PLAN splits (the vocabulary padded), Ψ_r the rest;
        # Muon: Ψ_m its matrices' parameters (all split), Ψ_o those of the matrices this rank owns
        return formula(expr, show="m e", Ψ_s=n_sharded * T, Ψ_r=n_replicated, T=T, L=L, m=m, b=b, s=s, h=h, e=e,
                       V=model.vocab_local * T, norm=int(args.grad_clip > 0), Ψ_m=sum(map(math.prod, matrices)),
                       Ψ_o=sum(math.prod(shape) for shape, owner in zip(matrices, owners) if owner == rank))
    held = {"params": f("4*(Ψ_s/T + Ψ_r)"), "grads": f("4*(Ψ_s/T + Ψ_r)"),
            "optim": f("8*(Ψ_s/T + Ψ_r)" if args.optimizer == "adamw" else "4*Ψ_m/T + 8*((Ψ_s - Ψ_m)/T + Ψ_r)")}
    if sp:
        # all-gather: f of c_attn, c_fc and the head, of the LayerNorm output cast to e,
        # twice each (forward, and again in backward: only the shard was kept); the backward
        # of g (an e gradient) and of the embedding's reduce-scatter (fp32).
        # reduce-scatter: g (forward, e; the embedding's fp32), the backward of f (fp32).
        # all-reduce: the loss statistics (3·4bs), the replicated parameters' gradients, the norm
        sent = {"all_gather_into_tensor": f("m*(L*(2*2*e + 2*e) + 2*e + 4)*b*s*h"),
                "reduce_scatter_tensor": f("m*(L*(2*e + 2*4) + 2*4)*b*s*h"),
                "all_reduce": f("m*3*4*b*s + 4*Ψ_r + 4*norm" if T > 1 else "4*Ψ_r")}  # alone: the loss's none
    else:  # per layer g's forward (e) and f's backward (fp32), twice; the embedding, the head (none alone)
        sent = {"all_reduce": f("m*((L*(2*e + 2*4) + 2*4)*b*s*h + 3*4*b*s) + 4*norm")} if T > 1 else {}
    if matrices and T > 1:  # Muon: this rank's update shards to their owners, its own matrices' shards back
        sent["all_to_all_single"] = f("e*(Ψ_m/T + Ψ_o)")
    if args.recompute and (sp or T > 1):  # backward runs each block's forward again, its g (e) twice too
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor") if sp else ("all_reduce",):
            sent[op] = plus(sent[op], f("m*L*2*e*b*s*h"))
    # the calls a step posts, each paying the network's latency once: per micro-batch and layer
    # f and g twice each (SP: the all-gathers again in backward), the ends' and the loss's
    # statistics (3); once per step the norm, SP's replicated gradients, Muon's two all-to-alls
    if sp:
        calls = {"all_gather_into_tensor": f("m*(6*L + 3)"), "reduce_scatter_tensor": f("m*(4*L + 2)"),
                 "all_reduce": f("m*3 + 1 + norm")}
    else:
        calls = {"all_reduce": f("m*(4*L + 5) + norm" if T > 1 else "norm")}
    if args.recompute and (sp or T > 1):  # g again in each block's second forward
        for op in ("all_gather_into_tensor", "reduce_scatter_tensor") if sp else ("all_reduce",):
            calls[op] = plus(calls[op], f("m*2*L"))
    if "all_to_all_single" in sent:
        calls["all_to_all_single"] = f("2")
    calls = {op: value for op, value in calls.items() if op in sent and value[1]}
    # activations: Megatron's split (infra.formulas.activation_terms with tp, sp), plus the
    # vocabulary-parallel ends: the embedding's out-of-slice mask (bool, b·s) and a head
    # that keeps its input (the whole sequence, its shard with SP), this rank's fp32 softmax
    # (b·s·V/T) and the target-ownership mask (bool, b·s) instead of the log-softmax of all V;
    # LayerNorm inputs and statistics are fp32 (the parameters are)
    sp_T = "/T" if sp else ""
    terms = activation_terms(config, b, s, dtype, activation_device_type(args), tp=T, sp=sp)
    terms["embedding"] = plus(terms["embedding"], f("b*s"))
    if config.dropout > 0 and config.bias and activation_device_type(args) not in ("cuda", "xpu") and T > 1:
        # the row-parallel bias is added after g, promoting the output to fp32: CPU's
        # dropout masks (in their input's dtype) are then fp32 (one rank adds it inside F.linear)
        terms["layer"] = plus(terms["layer"], f(f"2*(4 - e)*b*s*h{sp_T}"))
    terms["head"] = f(f"(4*b*s*h + 2*4*b*s + e*b*s*h){sp_T} + 4*b*s*V/T + b*s")
    cost = {"layout": f"tensor parallel over {T} ranks" + (" with sequence parallelism" if sp else ""),
            "held": held, "sent": sent, "calls": calls, "params_per_rank": (n_sharded, n_replicated), "muon": matrices,
            # Muon: Newton-Schulz on the matrices this rank owns, put together whole (infra.formulas.newton_schulz_flops)
            "muon_flops": newton_schulz_flops([shape for shape, owner in zip(matrices, owners) if owner == rank]),
            "activations": activations_of_layers(terms, L, args.recompute)}
    # every live tensor at its most, by phase (infra.formulas.phase_peaks on this rank's shards: the
    # vocabulary-parallel logits V/T, the MLP's 4h/T; the all-reduces work in place), and at
    # start-up the shards, each parameter drawn whole by param_init before its slice is kept
    t = transient_terms(config, b, s, dtype, activation_device_type(args), args.optimizer, tp=T,
                        update=max(p.numel() for p in model.parameters()), matrix=largest_matrix(matrices),
                        casts=matmul_weights({name: p.shape for name, p in model.named_parameters()}))
    cost["peak"] = phase_peaks(cost, t)
    cost["startup"] = formula("params + init" + " + 4*Ψ_m/T" * bool(matrices), show="init", params=held["params"],
                              init=t["init"], Ψ_m=sum(map(math.prod, matrices)), T=T)
    return cost


def checkpoint_pieces(model, optimizer, env):
    """This rank's shard of every parameter and its AdamW moments, as pieces of common.py's
    format placed in the full parameter by TP_PLAN (shard_boxes): the vocab-parallel rows
    (the global shape is the unpadded vocabulary), the column-parallel rows ([Q_t; K_t; V_t]
    of c_attn are three pieces), the row-parallel columns; the replicated parameters are
    written by rank 0 only. Any layout of any script reads these pieces back."""
    from infra.checkpoint_format import param_pieces
    pieces = []
    for name, p in model.named_parameters():
        full, boxes = shard_boxes(name, p.shape, model.config.vocab_size, model.tp_size, model.tp_rank)
        write = env.master or tp_split(name) is not None
        pieces += [piece for box, index in boxes
                   for piece in param_pieces(name, full, p, optimizer, box=box, index=index, write=write)]
    return pieces



# ---------------------------------------------------------------------------------------
# Muon on tensor-parallel shards: each matrix orthogonalised whole, by one owner rank
# ---------------------------------------------------------------------------------------

# ---- restated from 04_zero.py: muon_owners, muon_balance (word for word; tests/test_restated.py checks it) ----
def muon_owners(shapes, group_size):
    """The rank that orthogonalises each hidden matrix (given their full shapes): largest
    first to the least-loaded rank (LPT), so the group's Newton-Schulz work is spread as
    evenly as whole matrices allow. The same on every rank: no communication."""
    owners, load = [None] * len(shapes), [0] * group_size
    for i in sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i])):
        owners[i] = min(range(group_size), key=lambda t: load[t])
        load[owners[i]] += math.prod(shapes[i])
    return owners


def muon_balance(shapes, group_size):
    """The dry run's line on Muon: how evenly the owners' Newton-Schulz work (their matrices'
    elements; an iteration costs about 5·(4m²n + 2m³) FLOPs for an m x n matrix, m <= n) spreads."""
    owners = muon_owners(shapes, group_size)
    load = [sum(math.prod(shape) for shape, owner in zip(shapes, owners) if owner == t) for t in range(group_size)]
    return (f"  Muon: {len(shapes)} matrices, each orthogonalised whole by its owner: {min(load):,} to "
            f"{max(load):,} elements per rank (the busiest {max(load) * group_size / sum(load):.2f}x the mean)")
# ---- end restated ----


class ShardedMuon(Muon):
    """Muon where every rank holds 1/T of each matrix (TP_PLAN's rows or columns). Momentum is
    element-wise, so each rank keeps its shard's. Newton-Schulz is not: it needs the whole
    matrix. Two all-to-alls per step move whole matrices, by hand:

        rank t: its shards U_t of every matrix's update (the momentum, in the NS dtype)
          ── all-to-all ──>  owner o: all T shards of each matrix it owns, placed by shard_boxes,
                             O = orthogonalize(U), cut back into its T shards
          <── all-to-all ──  rank t: O_t of every matrix, applied to its shard

    Each rank sends its Ψ_m/T update elements once and receives as many back. (The iteration
    on the shards themselves would need an all-reduce of a Gram matrix in each of its 5
    steps, for every matrix, and every rank would repeat the small products.) `replicas`
    (08): the ranks holding the same shards in other replicas, which assemble the same whole
    matrices; each is orthogonalised by one of them (muon_owners again) and broadcast to the
    others (03's ReplicatedMuon, in the same words). A group of one rank posts nothing."""

    def __init__(self, model, args, env, group, rest=None, replicas=None):
        named = [(name, p) for name, p in model.named_parameters() if is_hidden_matrix(name, p.shape)]
        if rest is None:  # AdamW for the other parameters (08's ZeRO1 passes its own, on its flat shard)
            rest = make_adamw([p for name, p in model.named_parameters() if not is_hidden_matrix(name, p.shape)],
                              args, env.device.type)
        super().__init__([p for _, p in named], rest, args, env.dtype)
        self.group, self.tp_size, self.tp_rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.replicas, self.replica_size = replicas, dist.get_world_size(replicas) if replicas else 1
        self.replica_rank = dist.get_rank(replicas) if replicas else 0
        self.boxes = [[shard_boxes(name, p.shape, 0, self.tp_size, t) for t in range(self.tp_size)]
                      for name, p in named]  # [matrix][rank]: (full shape, [(box, index), ...])
        self.owners = muon_owners([boxes[0][0] for boxes in self.boxes], self.tp_size)

    @torch.no_grad()
    def step(self):
        group, T, me = self.param_groups[0], self.tp_size, self.tp_rank
        params = group["params"]
        updates = [muon_momentum(p.grad, self.state[p]["momentum_buffer"]).to(self.ns_dtype) for p in params]
        owned = [[i for i, owner in enumerate(self.owners) if owner == t] for t in range(T)]  # by owner
        sizes = [sum(updates[i].numel() for i in owned[t]) for t in range(T)]
        # 1: to each owner (in rank order) this rank's shards of the matrices it owns
        send = torch.cat([updates[i].reshape(-1) for t in range(T) for i in owned[t]])
        shards = send.new_empty(T * sizes[me]) if T > 1 else send  # row t: rank t's shards of my matrices
        if T > 1:
            dist.all_to_all_single(shards, send, [sizes[me]] * T, sizes, group=self.group)
        shards = shards.view(T, sizes[me])
        offset = 0
        replica_owners = muon_owners([self.boxes[i][0][0] for i in owned[me]], self.replica_size)
        for i, replica in zip(owned[me], replica_owners):  # each of my matrices whole, orthogonalised, cut back
            full, n = self.boxes[i][0][0], updates[i].numel()
            whole = shards.new_empty(full)
            pieces = [(shards[t, offset:offset + n].view_as(updates[i]), box, index)
                      for t in range(T) for box, index in self.boxes[i][t][1]]
            if replica == self.replica_rank:
                for shard, box, index in pieces:
                    whole[tuple(slice(*b) for b in box)] = shard[index]
                whole.copy_(orthogonalize(whole, self.ns_dtype))  # in place: a broadcast needs it contiguous
            if self.replica_size > 1:  # the replica that orthogonalised it: the whole matrix to the others
                dist.broadcast(whole, group=self.replicas, group_src=replica)
            for shard, box, index in pieces:
                shard[index] = whole[tuple(slice(*b) for b in box)]
            offset += n
        # 2: the orthogonalised shards back to the ranks that hold them
        back = send.new_empty(send.numel()) if T > 1 else shards.reshape(-1)
        if T > 1:
            dist.all_to_all_single(back, shards.reshape(-1), sizes, [sizes[me]] * T, group=self.group)
        offset = 0
        for t in range(T):
            for i in owned[t]:
                n = updates[i].numel()
                muon_apply(params[i], back[offset:offset + n].view_as(updates[i]), group["lr"],
                           group["weight_decay"], self.boxes[i][0][0])
                offset += n
        self.adamw.step()



def layout_lines(args, config, tp_size, accum_steps):
    """The dry run's layout: the group, heads per rank, micro-batches; and a warning when the
    group spans nodes (TP's per-layer all-reduces want a node's fast links)."""
    check_layout(args, config, tp_size)  # the heads and the vocabulary divide among the ranks
    matrices = costs(args, config, tp_size, torch.float32)["muon"]  # Muon's, whole (none with AdamW)
    return ([f"layout: one tensor-parallel group of {tp_size} ranks"
             + (" with sequence parallelism" if args.sequence_parallel else "")
             + f", {config.n_head // tp_size} head(s) per rank; {accum_steps} micro-batch(es) of "
             f"{args.micro_batch_size} per step"]
            + ([f"  warning: the group spans nodes of {args.ranks_per_node} ranks: keep TP inside a node "
                "(08_3d.py adds data and pipeline parallelism across nodes)"]
               if tp_size > args.ranks_per_node else [])
            + ([muon_balance(matrices, tp_size)] if matrices else []))


if __name__ == "__main__":
    main()
