"""09_context_parallel.py: context (sequence) parallelism, the fourth dimension that long
sequences need: ring attention and DeepSpeed-Ulysses, by hand.

The C ranks of a context-parallel (CP) group split every sequence: each holds s/C of the
tokens of every sequence, and so 1/C of every activation. Everything in a transformer but
attention is position-wise, so each rank runs it on its own tokens, at their real positions,
with the full, replicated weights; attention is the one place where a token needs the others.
Data parallelism runs over the rest: D = world / C replicas of the CP group, each on its slice
of the global batch. Every rank's loss is its tokens' share of the global mean, so summing the
gradients over the whole world gives the full gradient.

    world = D x C, rank = d·C + c:   CP groups are consecutive ranks (inside a node)

--cp_impl ring (ring attention, Liu et al. 2023, in the zigzag layout of Megatron-core and
torchtitan). The sequence is cut into 2C chunks; rank r holds chunks r and 2C-1-r, one early
and one late, so that the causal work is the same on every rank:

    sequence, C = 4:  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
    rank 0 holds          0 and 7        rank 2 holds   2 and 5
    rank 1 holds          1 and 6        rank 3 holds   3 and 4

  K and V travel around the ring: in step k = 0..C-1 rank r holds the K/V of rank (r - k) mod C
  and posts their send to r+1 (and the receive of r-1's) before computing with them, so the
  transfer overlaps the block's compute. Of each step's (query chunk, key chunk) pairs, the
  causal mask empties those whose keys come after the queries; they are skipped (ring_block).
  Each block gives its softmax-normalised output O_b and the log-sum-exp of its scores L_b,
  and two results over disjoint keys merge exactly, in fp32 (FlashAttention's online softmax):

      L = log(exp(L_1) + exp(L_2)),    O = exp(L_1 - L)·O_1 + exp(L_2 - L)·O_2

  The backward is FlashAttention-2's, by hand: each block's gradients from the final O and L
  and dO; K and V go around again, each with an fp32 dK/dV accumulator that every rank adds
  its share to and whose last hop brings it home.

--cp_impl ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023). Rank r holds the contiguous tokens
[r·s/C, (r+1)·s/C). One all-to-all per q, k, v turns some tokens of all heads into all tokens
of some heads, attention runs as usual on whole sequences, one all-to-all turns it back
(C must divide the number of heads):

    rank 0: tokens 0..s/C,  heads 0..H     --all-to-all-->   rank 0: tokens 0..s,  heads 0..H/C
    rank 1: tokens s/C..2s/C, heads 0..H                     rank 1: tokens 0..s,  heads H/C..2H/C

Attention dropout is not applied, at any C (the ring never materialises the probabilities
whole; C = 1 keeps the same model); with --dropout > 0 this is said once at start.

Run:

    mpiexec -n 4 python 09_context_parallel.py --model tiny --block_size 1024 --cp 4
    mpiexec -n 8 python 09_context_parallel.py --cp 4 --cp_impl ulysses ...   # 2 replicas of 4
    qsub jobs/polaris_cp.sh          # GPT-2 at a 16k context: cp 4 x dp 2 on 2 Polaris nodes

One rank holds: the whole model state, 16Ψ bytes, and the activations of s/C tokens per sequence.
One rank sends, per layer per micro-batch (A = b·(s/C)·h·e, its K or V): ring, K and V C-1 hops
forward and again backward, 4(C-1)·A, + fp32 dK/dV C hops; Ulysses, 8 all-to-alls of A; and
per step the all-reduce of every gradient over the world, 4Ψ. The derivations, the block table
and the activation terms: docs/strategies.md, section "09_context_parallel.py".
"""

import math
from functools import partial

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist
from torch.nn import functional as F

from common import (autocast, build_model, check, count_params, Data, lr_at, make_optimizer, make_parser,
                    model_config, Muon, muon_apply, muon_momentum, orthogonalize, recomputed, to_device)


# ----------------------------------------------------------------------------------------
# The layout: C ranks split every sequence, D = world / C replicas; which tokens a rank holds
# ----------------------------------------------------------------------------------------

def splits(C, config, impl):
    """Whether C context-parallel ranks can split this model's sequence (and heads)."""
    if C == 1:  # nothing to split: plain attention
        return True
    if impl == "ring":
        return config.block_size % (2 * C) == 0
    return config.block_size % C == 0 and config.n_head % C == 0


def check_layout(args, config, world_size):
    """--cp divides the world (the rest is data parallel) and the sequence; Ulysses: the heads.
    Without --cp, the largest C that does (12 ranks of the 256-token default: cp 4 x dp 3)."""
    C = args.cp
    if C is None:
        C = max(c for c in range(1, world_size + 1) if world_size % c == 0 and splits(c, config, args.cp_impl))
    check(C >= 1, f"--cp must be positive, got {C}")
    check(not getattr(args, "bitwise", False), "--bitwise cannot hold in 09_context_parallel.py: context parallelism splits "
          "attention over the sequence (ring steps, or heads by all-to-all), which changes one micro-batch's arithmetic")
    check(world_size % C == 0, f"--cp {C} does not divide the world size {world_size}")
    s = config.block_size
    if C == 1:
        pass
    elif args.cp_impl == "ring":
        check(s % (2 * C) == 0, f"block_size {s} is not divisible by 2 x cp = {2 * C} "
              "(ring attention cuts every sequence into 2·cp chunks)")
    else:
        check(s % C == 0, f"block_size {s} is not divisible by --cp {C}")
        check(config.n_head % C == 0, f"--cp_impl ulysses needs --cp {C} to divide n_head {config.n_head}")
    return C, world_size // C


def zigzag_chunks(rank, C):
    """The two chunks (of 2C) that ring rank `rank` holds: one early, one late."""
    return rank, 2 * C - 1 - rank


def token_positions(s, C, cp_rank, impl):
    """Positions (into the sequence of length s) of the tokens this CP rank holds, in the
    order it holds them: ring, chunks r and 2C-1-r of length s/2C; Ulysses, a contiguous s/C."""
    if impl == "ulysses" or C == 1:
        return torch.arange(cp_rank * s // C, (cp_rank + 1) * s // C)
    c = s // (2 * C)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in zigzag_chunks(cp_rank, C)])


# ----------------------------------------------------------------------------------------
# Ring attention
# ----------------------------------------------------------------------------------------

class Ring:
    """This rank's place in its CP group's ring: it sends to `next`, receives from `prev`."""

    def __init__(self, group, ranks, rank):
        self.group, self.size, self.rank = group, len(ranks), ranks.index(rank)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def pass_on(self, tensors, tag):
        """Post, without waiting: send `tensors` to the next rank, receive the previous
        rank's tensors of the same shapes. Returns (requests, received)."""
        sent = [t.contiguous() for t in tensors]  # k, v: views of c_attn's output, copied to send
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag) for r in received]
        return dist.batch_isend_irecv(ops), received  # our blocks to r+1, r-1's blocks to us

    @staticmethod
    def wait(pending):
        requests, received = pending
        for request in requests:
            request.wait()
        return received


def ring_block(q_rank, kv_rank, C):
    """(q halves, kv halves, causal): the part of one ring step's scores, between the tokens of
    ring ranks q_rank and kv_rank, that the causal mask does not empty, as one block. Half 0 / 1
    of a rank's tokens is its chunk r / 2C-1-r. Its own tokens: all of them, causal (a rank holds
    its tokens in sequence order, so the local triangle is the global one). Key chunks j and
    2C-1-j of an earlier rank (j < r): both query chunks see chunk j whole, chunk 2C-1-j is after
    both. Of a later rank: only query chunk 2C-1-r sees them, both whole."""
    if kv_rank == q_rank:
        return (0, 1), (0, 1), True
    if kv_rank < q_rank:
        return (0, 1), (0,), False
    return (1,), (0, 1), False


def part(t, halves):
    """The halves (0, 1 or both) of a [b, heads, tokens, ...] tensor's tokens, as a view."""
    c = t.size(2) // 2
    return t[:, :, halves[0] * c:(halves[-1] + 1) * c]


def scores(q, k, causal, first=0):
    """S = q kᵀ/√d for one block in fp32, the upper triangle -inf on a causal block (`first`:
    the block's index of q's first query, where q is a chunk of the block's queries)."""
    s = (q.float() / math.sqrt(q.size(-1))) @ k.float().transpose(-2, -1)
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + first), float("-inf"))
    return s


def explicit_block_forward(q, k, v, causal, first=0):
    """The readable reference (and the fallback where no fused kernel applies), in fp32:
    L_b = logsumexp(S), O_b = exp(S - L_b) V."""
    s = scores(q, k, causal, first)
    lse = torch.logsumexp(s, dim=-1)
    return s.sub_(lse.unsqueeze(-1)).exp_() @ v.float(), lse  # softmax(S) V, S overwritten by P


def explicit_block_backward(dout, q, k, v, out, lse, causal, first=0):
    """FlashAttention-2's backward of one block in fp32, with the final O and L:
    P = exp(S - L), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)),
    dQ = dS K/√d, dK = dSᵀ Q/√d."""
    q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    p = scores(q, k, causal, first).sub_(lse.unsqueeze(-1)).exp_()
    delta = (dout * out.float()).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
    ds = (dout @ v.transpose(-2, -1)).sub_(delta).mul_(p)
    scale = 1.0 / math.sqrt(q.size(-1))
    return (ds @ k).mul_(scale), (ds.transpose(-2, -1) @ q).mul_(scale), p.transpose(-2, -1) @ dout


def merge(out, lse, block_out, block_lse):
    """Exact merge of two softmax-attention results over disjoint keys, in place in the fp32
    out and lse: L = log(e^L1 + e^L2), O = e^(L1-L)·O1 + e^(L2-L)·O2."""
    new_lse = torch.logaddexp(lse, block_lse)
    w_old, w_new = torch.exp(lse - new_lse).unsqueeze(-1), torch.exp(block_lse - new_lse).unsqueeze(-1)
    out.copy_(w_old * out + w_new * block_out)
    lse.copy_(new_lse)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys. q, k, v:
    [b, heads, s/C, d], this rank's zigzag tokens; returns the same shape, in q's dtype.
    A block runs in q's dtype on the device's fused kernel (block_forward and block_backward,
    beyond the lesson), or in fp32 as explicit_block_forward above; the blocks merge in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        ctx.ring = ring
        b, heads, t, d = q.shape
        with torch.autocast(q.device.type, enabled=False):
            # fp32 O in [b, t, heads, d] memory order, so that the transpose back is a view
            out = torch.empty(b, t, heads, d, device=q.device).transpose(1, 2)
            lse = torch.empty(b, heads, t, device=q.device)  # fp32 L
            kv = (k, v)  # in ring step k (`step`): the K/V of rank (r - k) mod C
            ctx.forwards = []  # each kernel call's state for its backward (RNG, lengths)
            for step in range(ring.size):
                if step < ring.size - 1:  # post: our K/V block to r+1, r-1's to us, during compute
                    pending = ring.pass_on(kv, tag=0)
                for qh, kh, causal in kernel_blocks(*ring_block(ring.rank, (ring.rank - step) % ring.size, ring.size)):
                    o, l, kernel_state = block_forward(part(q, qh), part(kv[0], kh), part(kv[1], kh), causal)
                    ctx.forwards.append(kernel_state)
                    if step == 0 and kh == (0,):  # a query chunk's first block (all see our chunk 0): O and L
                        part(out, qh).copy_(o)  # are its own (merging into 0 and -inf gives the same numbers,
                        part(lse, qh).copy_(l)  # at the price of a pass over O)
                    else:
                        merge(part(out, qh), part(lse, qh), o, l)
                if step < ring.size - 1:
                    kv = ring.wait(pending)
            out = out.to(q.dtype)  # fp32: out itself; bf16: its cast, c_proj's input either way
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype)
            kv, arriving, forwards = (k, v), None, iter(ctx.forwards)
            dq, dk, dv = (torch.empty(t.shape, device=t.device) for t in (q, k, v))  # fp32, filled by step 0
            for step in range(ring.size):
                if step < ring.size - 1:  # K/V go around again, as in forward
                    pending = ring.pass_on(kv, tag=0)
                if step > 0:  # our share for kv_rank's K/V
                    dk, dv = torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)
                for qh, kh, causal in kernel_blocks(*ring_block(ring.rank, (ring.rank - step) % ring.size, ring.size)):
                    dq_b, dk_b, dv_b = block_backward(part(dout, qh), part(q, qh), part(kv[0], kh),
                                                      part(kv[1], kh), part(out, qh), part(lse, qh).contiguous(),
                                                      causal, next(forwards))
                    # our own blocks start the fp32 accumulators: a query chunk's first block is the one
                    # over our chunk 0, a key chunk's its triangle; every other block adds to them
                    for grad, halves, block, first in ((dq, qh, dq_b, step == 0 and kh == (0,)),
                                                       (dk, kh, dk_b, step == 0 and causal),
                                                       (dv, kh, dv_b, step == 0 and causal)):
                        if first:
                            part(grad, halves).copy_(block)
                        else:
                            part(grad, halves).add_(block)
                if arriving is not None:  # the shares of the ranks this K/V block visited before us
                    dk_in, dv_in = ring.wait(arriving)
                    dk += dk_in
                    dv += dv_in
                if ring.size > 1:  # dK/dV travel with their K/V; the last hop brings them home
                    arriving = ring.pass_on((dk, dv), tag=1)
                if step < ring.size - 1:
                    kv = ring.wait(pending)
            if ring.size > 1:
                dk, dv = ring.wait(arriving)  # every rank's share of our own K and V
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ----------------------------------------------------------------------------------------
# Ulysses
# ----------------------------------------------------------------------------------------

def seq_to_heads(x, group, C):
    """[b, H, s/C, d] (our tokens, every head) -> [b, H/C, s, d] (every token, our heads)."""
    b, H, t, d = x.shape
    send = x.reshape(b, C, H // C, t, d).transpose(0, 1).contiguous()  # [C = head group, ...]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # head group j to rank j; its tokens to us
    return received.permute(1, 2, 0, 3, 4).reshape(b, H // C, C * t, d)  # [C = token chunk, ...]


def heads_to_seq(x, group, C):
    """The inverse: [b, H/C, s, d] -> [b, H, s/C, d]."""
    b, h, s, d = x.shape
    send = x.reshape(b, h, C, s // C, d).permute(2, 0, 1, 3, 4).contiguous()  # [C = token chunk, ...]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # token chunk j to rank j; its heads to us
    return received.transpose(0, 1).reshape(b, C * h, s // C, d)  # [C = head group, ...]


class SeqToHeads(torch.autograd.Function):
    """All-to-all forward, the inverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, group, C):
        ctx.group, ctx.C = group, C
        return seq_to_heads(x, group, C)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group, ctx.C), None, None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, C):
        ctx.group, ctx.C = group, C
        return heads_to_seq(x, group, C)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group, ctx.C), None, None


def ulysses_attention(q, k, v, group, C):
    """Four all-to-alls: q, k, v to [b, H/C, s, d], causal attention, the output back."""
    q, k, v = (SeqToHeads.apply(t, group, C) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return HeadsToSeq.apply(y, group, C)


# ----------------------------------------------------------------------------------------
# The GPT's forward on this rank's tokens
# ----------------------------------------------------------------------------------------

class ContextParallel:
    """This rank's CP group and the attention it runs over it."""

    recompute = False  # --recompute: keep each block's input only (its ring / all-to-alls run again in backward)

    def __init__(self, group, ranks, rank, impl):
        self.group, self.C, self.impl = group, len(ranks), impl
        self.ring = Ring(group, ranks, rank)
        self.cp_rank = ranks.index(rank)

    def attention(self, q, k, v):
        if self.C == 1:  # nothing to share: ordinary causal attention
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.impl == "ring":
            return RingAttention.apply(q, k, v, self.ring)
        return ulysses_attention(q, k, v, self.group, self.C)


def self_attention(attn, x, cp):
    """common.CausalSelfAttention's forward with its attention replaced by the CP one (same
    modules, same parameter names)."""
    B, T, h = x.size()  # T = s/C: this rank's tokens
    q, k, v = attn.c_attn(x).split(h, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, h // attn.n_head).transpose(1, 2) for t in (q, k, v))
    y = cp.attention(q, k, v)
    y = y.transpose(1, 2).contiguous().view(B, T, h)
    return attn.resid_dropout(attn.c_proj(y))


def transformer_block(block, cp, x):
    """common.Block's body with the CP attention: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    x = x + self_attention(block.attn, block.ln_1(x), cp)
    return x + block.mlp(block.ln_2(x))


def loss_sum(model, idx, targets, positions, cp):
    """GPT.forward on this rank's tokens at their real positions; returns the *sum* of their
    cross-entropies (the caller divides by the global token count)."""
    tr = model.transformer
    x = tr.drop(tr.wte(idx) + tr.wpe(positions))
    for block in tr.h:
        if cp.recompute and torch.is_grad_enabled():  # only x is kept; backward runs the block
            x = recomputed(partial(transformer_block, block, cp), x)  # again, collectives included
        else:
            x = transformer_block(block, cp, x)
    logits = model.lm_head(tr.ln_f(x))
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="sum")


def make_groups(world_size, C, rank):
    """CP groups of C consecutive ranks; returns this rank's (group, ranks, dp index)."""
    mine = None
    for d in range(world_size // C):
        ranks = list(range(d * C, (d + 1) * C))
        group = dist.new_group(ranks, group_desc="cp")  # every rank creates every group, in the same order
        if rank in ranks:
            mine = (group, ranks, d)
    return mine


def all_reduce_grads(params, group):
    """Every rank's gradient is its tokens' share of the global mean: summing over `group`,
    here the whole world (CP peers hold other tokens, DP peers other sequences), gives the
    full gradient. One all-reduce of them all, flattened: one per parameter pays a collective's
    fixed cost some 12·L times (at cp 2, 66 ms of a 1.8 s step: docs/measured.md)."""
    if dist.get_world_size(group) == 1:  # one rank holds every token: its gradients are the mean already
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # sum over every rank holding these weights
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def add_flags(parser):
    g = parser.add_argument_group("09_context_parallel")
    g.add_argument("--cp", type=int, default=None,
                   help="context-parallel ranks that split every sequence (default: the largest divisor of "
                        "the world size that splits the sequence, and for Ulysses the heads; the rest is data parallel)")
    g.add_argument("--cp_impl", default="ring", choices=["ring", "ulysses"],
                   help="ring attention (zigzag, K/V around the ring) or Ulysses (all-to-all over heads)")
    return parser


@torch.no_grad()
def evaluate(model, data, args, env, accum_steps, dp_rank, D, positions, cp, group):
    """Mean loss of each split over eval_iters fixed global batches: every rank sums its
    tokens' losses, the sums are added over the world and divided by the token count."""
    model.eval()
    losses = {}
    for split in ("train", "val"):
        total = torch.zeros((), device=env.device)
        for k in range(args.eval_iters):
            x, y = data.batch(split, k, args.global_batch_size, dp_rank, D, eval_split=True)
            x, y = to_device(x[:, positions], env), to_device(y[:, positions], env)
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    total += loss_sum(model, x[rows], y[rows], positions.to(env.device), cp).float()
        total /= args.eval_iters * args.global_batch_size * model.config.block_size
        if dist.get_world_size(group) > 1:  # one rank alone posts nothing
            dist.all_reduce(total, group=group)  # every rank's share of the global mean
        losses[split] = total.item()
    model.train()
    return losses


def main():
    run = Run(add_flags(make_parser(__doc__)), __file__)
    args = run.args
    config = model_config(args, Data.vocab_size_of(args.data))
    C, D = check_layout(args, config, run.world_size)  # C and D: the sequence (and Ulysses' heads) decide
    env, accum_steps = run.start(costs, dp_size=D,  # the processes and the CP groups up; auto: the largest that fits
                                 groups=lambda env: make_groups(env.world_size, C, env.rank))
    run.dry_run(costs, lambda config: layout_lines(args, config, C, D, accum_steps))
    data = Data(args.data, args.seed, config.block_size)
    torch.manual_seed(args.seed + env.rank)  # dropout: a stream per rank (each holds other tokens)

    cp_group, cp_ranks, dp_rank = run.groups
    world = dist.group.WORLD  # every rank holds the same weights: the gradients' and the loss's group
    cp = ContextParallel(cp_group, cp_ranks, env.rank, args.cp_impl)
    cp.recompute = args.recompute
    positions = token_positions(config.block_size, C, cp.cp_rank, args.cp_impl)  # our tokens: columns of x
    model = build_model(config, args.seed, env.device)
    # AdamW, or Muon + AdamW with each matrix's Newton-Schulz run by one rank (03's ReplicatedMuon)
    optimizer = make_optimizer(model.named_parameters(), args, env, muon=partial(ReplicatedMuon, group=world))
    run.begin(config, optimizer, costs, layout={"strategy": "context parallel", "cp": C, "cp_impl": args.cp_impl},
              pieces=lambda: checkpoint_pieces(model, optimizer, env),
              evaluate=lambda: evaluate(model, data, args, env, accum_steps, dp_rank, D, positions, cp, world),
              describe=f"{D} data-parallel x {C} context-parallel ({args.cp_impl}), "
                       f"{config.block_size // C} of {config.block_size} tokens per sequence per rank, "
                       f"{accum_steps} micro-batch(es) of {args.micro_batch_size} per replica per step")
    if config.dropout > 0:
        run.log(f"dropout {config.dropout}: on embeddings, residuals and MLP; not on the attention "
                "probabilities (not applied in 09_context_parallel.py)")
    tokens = args.global_batch_size * config.block_size  # the global mean's denominator
    device_positions = positions.to(env.device)

    for step in run.steps():
        lr = lr_at(step, args)  # linear warm-up, then cosine decay (nanoGPT's get_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = data.batch("train", step, args.global_batch_size, dp_rank, D)
        x, y = to_device(x[:, positions], env), to_device(y[:, positions], env)  # our tokens only
        loss_total = torch.zeros((), device=env.device)
        with run.meter:
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):  # attention over the CP group: the ring, or Ulysses' all-to-alls
                    loss = loss_sum(model, x[rows], y[rows], device_positions, cp) / tokens
                loss.backward()  # this rank's tokens' share of the global mean
                loss_total += loss.detach().float()
        all_reduce_grads(model.parameters(), world)  # gradients are now the global mean, on every rank
        if env.world_size > 1:  # one rank alone posts nothing
            dist.all_reduce(loss_total, group=world)  # the global batch's mean loss, for logging
        norm = None  # the global gradient norm, where clipping takes it (the guard reads it too)
        if args.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        run.check(loss_total, (p.grad for p in model.parameters()), norm)  # non-finite? asked to stop?
        optimizer.step()
        run.end_step(loss_total)  # ledger, metrics, checkpoint, stop
        optimizer.zero_grad(set_to_none=True)
    run.finish()


# ---- Beyond the lesson ----
# Muon divided among the ranks (03's), the fused attention kernels a ring block runs; costs() (the
# ledger's theory, the dry run, the fit check and plan.py), the checkpoint pieces and the dry run's
# layout lines.

aten = torch.ops.aten


def fused_kernel(device_type, dtype, head_dim):
    """The fused attention kernel a ring block runs, by the rules torch's SDPA checks before it
    picks one (which calling the kernels directly skips): on CPU, flash attention for CPU; on
    CUDA, flash (fp16/bf16, a head dim that is a multiple of 8 and at most 256) or else the
    memory-efficient kernel (a multiple of 8; unverified on a GPU); any other head dim
    (`--n_embd 100 --n_head 4`: 25) or device (XPU), the explicit fp32 block, exact, at the
    price of its fp32 scores, a chunk of queries at a time (query_chunk), while it runs."""
    if device_type == "cpu":
        return "flash_cpu"
    if device_type == "cuda" and head_dim % 8 == 0:
        return "flash" if dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 else "efficient"
    return "explicit"


def sdpa_accepts(kernel, q, k, v, causal):
    """Whether SDPA's own checks of this device and these tensors accept the CUDA kernel
    fused_kernel() picked by its rules (the GPU's architecture, ROCm's HSA_XNACK, strides,
    sizes), which calling the kernel directly would skip; where they do not, the block runs
    explicitly instead of failing in the kernel."""
    if kernel not in ("flash", "efficient"):
        return True
    can_use = getattr(torch.backends.cuda, f"can_use_{kernel}_attention")
    return can_use(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, False))


def kernel_blocks(q_halves, kv_halves, causal):
    """The kernel calls that compute one ring step's block: a rank's own, causal block as its two
    chunks' triangles and the square between them (the late chunk's queries over the early
    chunk's keys), any other block whole. A kernel skips the mask's empty part only in whole
    tiles (CPU's flash attention: splits of 512 keys, so a causal block of up to 512 tokens costs
    its full square); the triangles leave out the quarter above the diagonal. The late chunk's
    two blocks merge as two ring steps' do."""
    if not causal:
        return [(q_halves, kv_halves, False)]
    return [((0,), (0,), True), ((1,), (0,), False), ((1,), (1,), True)]


def block_forward(q, k, v, causal):
    """One block's attention: its output O_b (normalised over the block's keys), the
    log-sum-exp of its scores L_b = log Σ_keys exp(q·k/√d), fp32 [b, heads, t], and what the
    kernel's backward needs of its forward besides (its RNG state: dropout's Philox seed and
    offset, which the backward must replay; the sequence lengths; first, the kernel's name),
    from the kernel fused_kernel() picks where SDPA's checks accept it (the CUDA kernels as
    torchtitan's ring calls them; unverified: 09 has not run on a GPU)."""
    kernel = fused_kernel(q.device.type, q.dtype, q.size(-1))
    kernel = kernel if sdpa_accepts(kernel, q, k, v, causal) else "explicit"
    if kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse, (kernel,)
    if kernel == "flash":  # (rng_state, unused) are the backward's (philox_seed, philox_offset)
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        return out, lse, (kernel, cum_q, cum_k, max_q, max_k, rng_state, unused)
    if kernel == "efficient":  # CUDA's kernel pads its log-sum-exp to a multiple of 32 queries,
        # ROCm's (AOTriton) does not: the backward gets L at the length this forward returned
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        return out, lse[..., :q.size(2)], (kernel, seed, offset, lse.size(-1))
    return (*explicit_in_chunks(q, k, v, causal), (kernel,))


def block_backward(dout, q, k, v, out, lse, causal, forward):
    """One block's dq, dk, dv from the *final* (merged) O and L (FlashAttention-2's backward
    needs only those and dO, not the block's own) and `forward`, what block_forward returned
    for the kernel's backward: the same kernel's backward, else the explicit fp32 reference."""
    kernel, *state = forward
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    if kernel == "flash":  # unverified
        cum_q, cum_k, max_q, max_k, rng_state, unused = state
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused)
    if kernel == "efficient":  # unverified; the kernel reads L at its forward's length (padded on CUDA)
        seed, offset, length = state
        lse = F.pad(lse, (0, length - q.size(2)))
        return aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal)[:3]
    return explicit_backward_in_chunks(dout, q, k, v, out, lse, causal)


EXPLICIT_SCORES = 2**26  # fp32 scores an explicit block holds at a time, at most: 256 MiB (512 in backward)


def query_chunk(b, heads, keys):
    """How many of a block's queries the explicit block takes at a time: as many as keep their
    fp32 scores, b·heads·chunk·keys, within EXPLICIT_SCORES (at least one query)."""
    return max(1, EXPLICIT_SCORES // (b * heads * keys))


def explicit_in_chunks(q, k, v, causal):
    """explicit_block_forward over chunks of the queries (query_chunk), so that the fp32 scores
    held at a time are bounded, not the whole block's b·heads·M·N (GBs at a long context, cp 2);
    each query's row is its own softmax, so the result is the whole block's."""
    k, v = k.float(), v.float()  # once for every chunk (fp32 already: themselves)
    chunk = query_chunk(*k.shape[:3])
    if chunk >= q.size(2):
        return explicit_block_forward(q, k, v, causal)
    out, lse = torch.empty(q.shape, device=q.device), torch.empty(q.shape[:3], device=q.device)  # fp32
    for first in range(0, q.size(2), chunk):
        rows = slice(first, first + chunk)
        out[:, :, rows], lse[:, :, rows] = explicit_block_forward(q[:, :, rows], k, v, causal, first)
    return out, lse


def explicit_backward_in_chunks(dout, q, k, v, out, lse, causal):
    """explicit_block_backward over the same chunks of the queries: each chunk's dQ rows are
    its own, its shares of dK and dV are summed over the chunks (fp32)."""
    k, v = k.float(), v.float()
    chunk = query_chunk(*k.shape[:3])
    if chunk >= q.size(2):
        return explicit_block_backward(dout, q, k, v, out, lse, causal)
    dq, dk, dv = torch.empty(q.shape, device=q.device), torch.zeros(k.shape, device=k.device), torch.zeros_like(v)
    for first in range(0, q.size(2), chunk):
        rows = slice(first, first + chunk)
        dq[:, :, rows], dk_c, dv_c = explicit_block_backward(dout[:, :, rows], q[:, :, rows], k, v, out[:, :, rows],
                                                             lse[:, :, rows], causal, first)
        dk += dk_c
        dv += dv_c
        del dk_c, dv_c  # before the next chunk's scores
    return dq, dk, dv


def explicit_block_terms(heads, width, chunked, e):
    """What the explicit block holds while it runs, at its largest (a rank's own block: s queries
    over s keys; the others have half of either), as (forward, backward) expressions in b, s and
    c, the queries of a chunk (query_chunk), for `heads` heads of `width` in all ("a", "h"; a TP
    rank's "(a/T)", "(h/T)"). Forward: a chunk's fp32 scores and the larger of the causal mask
    (one byte a score, per query and key) or the chunk's output rows and L; with several chunks
    the block's fp32 output and L they fill. Backward: a chunk's P and dS, its dQ rows and L's,
    the block's fp32 dQ, dK and dV (and with several chunks each chunk's shares of dK and dV
    before they are added). bf16: the fp32 K and V, and in backward q's and dO's rows."""
    a, h = heads, width
    if chunked:
        forward = f"4*b*s*{h} + 4*b*{a}*s + 4*b*{a}*c*s + max(2*c*s, 4*b*c*{h} + 4*b*{a}*c)"
        backward = f"8*b*{a}*c*s + 4*b*c*{h} + 4*b*{a}*c + 20*b*s*{h}"
    else:
        forward = f"4*b*{a}*s*s + max(2*s*s, 4*b*s*{h} + 4*b*{a}*s)"
        backward = f"8*b*{a}*s*s + 12*b*s*{h} + 4*b*{a}*s"
    if e == 2:
        forward += f" + 8*b*s*{h}"
        backward += f" + 8*b*s*{h} + 8*b*{'c' if chunked else 's'}*{h}"
    return forward, backward


def costs(args, config, world_size, dtype, rank=0):
    """The formulas of docs/strategies.md's 09 section for one rank: layout, bytes held, bytes
    sent per step, activations (the layout is validated first, so --dry_run refuses what a
    launch would refuse). In every formula s is this rank's block_size/C tokens of a sequence
    (the section's T). Activations: infra.formulas.activation_terms on them, with the attention term
    replaced by what this script's attention saves."""
    from infra.formulas import (activation_device_type, activation_terms, activations_of_layers, formula,
                                hidden_matrix_params, hidden_matrix_shapes, newton_schulz_flops, phase_peaks,
                                sdpa_logsumexp, transient_terms)
    C, D = check_layout(args, config, world_size)
    n_params, _ = count_params(config)  # from the shapes alone: nothing allocated
    psi_m = hidden_matrix_params(config) if args.optimizer == "muon" else 0  # Muon's matrices
    shapes = hidden_matrix_shapes(config) if args.optimizer == "muon" else []  # their shapes, whole
    micro = args.micro_batch_size or args.global_batch_size // D
    m = args.global_batch_size // (micro * D)
    e = torch.tensor([], dtype=dtype).element_size()
    L, s, h, a = config.n_layer, config.block_size // C, config.n_embd, config.n_head  # s: this rank's tokens
    device_type = activation_device_type(args)

    def f(expr):
        return formula(expr, show="m e", Ψ=n_params, Ψ_m=psi_m, L=L, m=m, C=C, b=micro, s=s, h=h, a=a, e=e, loss=1)
    sent = {"all_reduce": f("4*Ψ + 4*loss")} if world_size > 1 else {}  # one rank alone posts nothing
    if psi_m and world_size > 1:  # ReplicatedMuon: each owner's orthogonalised updates to every rank
        sent["broadcast"] = f("e*Ψ_m")
    # the recomputed forward sends its K/V (ring) or its 4 all-to-alls again
    if C > 1 and args.cp_impl == "ring":  # K, V (e) C-1 hops forward and in backward; dK, dV (fp32) C hops
        sent["send"] = sent["recv"] = f(f"m*L*({6 if args.recompute else 4}*(C - 1)*e*b*s*h + 8*C*b*s*h)")
    elif C > 1:  # q, k, v to heads and the output back, forward and backward
        sent["all_to_all_single[cp]"] = f(f"m*L*{12 if args.recompute else 8}*e*b*s*h")
    # the calls a step posts, each paying the network's latency once: the flattened gradients' all-reduce
    # and the loss's; per layer and micro-batch the ring's K and V sends each hop (forward, and in
    # backward with dK, dV's C hops), or Ulysses' four all-to-alls each pass; Muon's per matrix
    passes = 3 if args.recompute else 2
    calls = {"all_reduce": formula("grads + loss", grads=1, loss=1)} if "all_reduce" in sent else {}
    if "broadcast" in sent:
        calls["broadcast"] = formula("matrices", matrices=len(shapes))
    if "send" in sent:
        calls["send"] = calls["recv"] = formula("m*L*(p*2*(C - 1) + 2*C)", show="m p", m=m, L=L, p=passes, C=C)
    if "all_to_all_single[cp]" in sent:
        calls["all_to_all_single[cp]"] = formula("m*L*p*4", show="m p", m=m, L=L, p=passes)
    # activations of one micro-batch of b sequences of s = block_size/C tokens, a = H heads
    if C == 1:  # plain SDPA without dropout: q, k, v (c_attn's output), its output = c_proj's input, logsumexp
        attention = f(f"4*e*b*s*h + {sdpa_logsumexp('a', 's', dtype, device_type)}")
    elif args.cp_impl == "ring":  # RingAttention saves q, k, v (views of c_attn's whole q|k|v
        # output), its output O (allocated in [b, s, heads, d] order: the transpose back to
        # [b, s, h] is a view, so c_proj's input is O itself) and the fp32 log-sum-exp L
        attention = f("3*e*b*s*h + e*b*s*h + 4*b*a*s")
    else:  # SDPA saves the all-to-all'd q, k, v (3 storages of b·(H/C)·Cs·d = b·s·h), its output
        # and logsumexp (b·(H/C)·Cs); c_proj saves the output back in [b, s, h] (another storage)
        attention = f(f"3*e*b*s*h + e*b*s*h + {sdpa_logsumexp('(a/C)', '(C*s)', dtype, device_type)} + e*b*s*h")
    terms = activation_terms(config, micro, s, dtype, device_type, attention=attention)
    cost = {"layout": f"context parallel ({args.cp_impl}) over {C} ranks x {D} data-parallel, {m} micro-batch(es)",
            "held": {"params": f("4*Ψ"), "grads": f("4*Ψ"), "optim": f("8*Ψ" if args.optimizer == "adamw" else "4*Ψ_m + 8*(Ψ - Ψ_m)")},
            # Muon: Newton-Schulz on the matrices this rank owns among all the CP and DP ranks
            # (infra.formulas.newton_schulz_flops)
            "muon_flops": newton_schulz_flops([shape for shape, owner in zip(shapes, muon_owners(shapes, world_size))
                                               if owner == rank]),
            "sent": sent, "calls": calls, "activations": activations_of_layers(terms, L, args.recompute)}
    # every live tensor at its most, by phase (infra.formulas.phase_peaks: 01's on s tokens), with the
    # ring's working set: in forward the fp32 O being merged, a block's output and the next
    # K/V arriving; in backward the fp32 dQ, this hop's dK, dV and the pair arriving with
    # them, and the next K/V. Start-up: the weights and param_init's scratch
    t = transient_terms(config, micro, s, dtype, device_type, args.optimizer)
    ring = C > 1 and args.cp_impl == "ring"
    forward, backward = ({"ring": f("8*b*s*h + 2*e*b*s*h")}, {"ring": f("20*b*s*h + 2*e*b*s*h")}) if ring else ({}, {})
    if ring and fused_kernel(device_type, dtype, h // a) == "explicit":  # block_forward's choice, by its rules:
        # the explicit block's fp32 scores, a chunk of c queries at a time (explicit_block_terms)
        c = min(s, query_chunk(micro, a, s))
        for phase, expr in zip((forward, backward), explicit_block_terms("a", "h", c < s, e)):
            phase["scores"] = formula(expr, show="m e", b=micro, s=s, h=h, a=a, c=c)
    cost["peak"] = phase_peaks(cost, t, forward=forward, backward=backward,
                               # the gradients flattened for their all-reduce, before the optimizer's own
                               optimizer={"update": formula("max(4*Ψ, update)", show="update", Ψ=n_params,
                                                            update=t["update"])} if world_size > 1 else None)
    momentum = " + 4*Ψ_m" if args.optimizer == "muon" else ""  # Muon's, made with the optimizer
    cost["startup"] = formula("params + init" + momentum, show="init", params=cost["held"]["params"],
                              init=t["init"], Ψ_m=psi_m)
    return cost


def checkpoint_pieces(model, optimizer, env):
    """Every parameter and its AdamW moments, whole: the replicas are equal, so rank 0
    writes them; every rank reads them (common.py's format, any script resumes it)."""
    from infra.checkpoint_format import param_pieces
    return [piece for name, p in model.named_parameters()
            for piece in param_pieces(name, p.shape, p, optimizer, write=env.master)]


def layout_lines(args, config, C, D, accum_steps):
    """The dry run's layout: the D x C mesh, the tokens per rank, the micro-batches."""
    return [f"layout: {D} data-parallel x {C} context-parallel ({args.cp_impl}; groups of {C} consecutive "
            f"ranks), {config.block_size // C} of {config.block_size} tokens per sequence per rank, "
            f"{accum_steps} micro-batch(es) of {args.micro_batch_size} per replica per step"]


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
