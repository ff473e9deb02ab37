"""08_3d.py: data x tensor x pipeline parallelism in one standalone script (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), with
sequence parallelism and context parallelism as a fourth dimension (--sequence_parallel, --cp).

The world of N = D·P·T ranks is a 3D mesh. Tensor parallelism (T) splits every layer and
talks twice per layer forward and backward, so its groups are consecutive ranks, inside one
node's fast links; pipeline parallelism (P) splits the layers into stages and sends only a
micro-batch's activations across a boundary; data parallelism (D) replicates the whole
pipeline and averages gradients once per step, outermost, across nodes.

    global rank = dp·(P·T) + pp·T + tp                   N = 8, D = P = T = 2:

                     pipeline stage 0     stage 1           rank: (dp, pp, tp)
    replica dp = 0   [ 0 | 1 ]  ──acts──>  [ 2 | 3 ]        0:(0,0,0) 1:(0,0,1)
                       TP pair     <─grads─  TP pair        2:(0,1,0) 3:(0,1,1)
    replica dp = 1   [ 4 | 5 ]  ──acts──>  [ 6 | 7 ]        4:(1,0,0) ... 7:(1,1,1)
                     0-4, 1-5, 2-6, 3-7: data-parallel groups (gradient all-reduce)

Inside a stage: Megatron TP as in 06_tensor_parallel.py (column/row-parallel linears with the
f and g operators, vocab-parallel embedding and cross-entropy), which parameter is split along
which dimension written once, in the table TP_PLAN. Across stages: 1F1B as in 07_pipeline.py,
each TP rank exchanging with the same TP rank of the next stage. Across replicas: gradients
all-reduced in each DP group (DataParallel), or with --zero1 reduce-scattered, each DP rank
updating its 1/D of the optimizer state and all-gathering the parameters (ZeRO1: ZeRO stage 1,
as in 04_zero.py); the two have one interface, so the training step is the same for both.
Only what is needed is restated here: this file does not import the others.

--sequence_parallel (Korthikanti et al. 2022), as in 06, inside every TP group: LayerNorm and
dropout, replicated in plain TP, run on sequence shards instead; f becomes an all-gather of
the sequence and g a reduce-scatter back to shards, so the residual stream between layers,
and what crosses a stage boundary, is this TP rank's [b, s/T, h] (s must divide by T):

    stage pp, TP rank t                                              stage pp + 1, TP rank t
    X_t ─LN─all-gather─> X ─ X A_t ... (.) B_t ─reduce-scatter─> Y_t ──send──> X_t ─LN─ ...
    [b, s/T, h]         [b, s, h]                               [b, s/T, h]: 1/T of the bytes
    kept for backward: the shard X_t only, not X (GatherSequenceLinear gathers it again there)

The replicated parameters (LayerNorms, row-parallel biases, wpe) then see only this rank's
sequence shard: their gradients are partial and are all-reduced over the TP group each step.

--cp C --cp_impl ring|ulysses: context parallelism (as in 09_context_parallel.py) inside each
stage's attention, the fourth dimension. The mesh becomes, outermost first, DP x PP x CP x TP,

    global rank = ((dp·P + pp)·C + cp)·T + tp           N = 8, P = C = T = 2, D = 1:

                     stage 0                          stage 1          rank: (pp, cp, tp)
    CP rank 0        [ 0 | 1 ]  ─── acts (s/C) ───>  [ 4 | 5 ]         0:(0,0,0) 1:(0,0,1)
                        ↕ K/V ring or all-to-all         ↕             2:(0,1,0) 3:(0,1,1)
    CP rank 1        [ 2 | 3 ]  ─── acts (s/C) ───>  [ 6 | 7 ]         4:(1,0,0) ... 7:(1,1,1)
    TP pairs 0-1, 2-3, 4-5, 6-7; CP pairs 0-2, 1-3, 4-6, 5-7; gradients reduced over DP x CP

TP innermost on the fastest links (two collectives per layer on the critical path), then CP
(K/V or all-to-alls every layer, which the ring overlaps with its blocks' compute), then PP
(one activation per micro-batch per boundary), DP outermost (once per step). (Megatron-core
and torchtitan also keep CP next to TP; they put DP inside PP, this script keeps 08's DP
outermost.) Every rank of a CP group holds the same stage's same TP shard and sees s/C of
the tokens of every sequence of its replica: the ring's load-balanced zigzag (chunks c and
2C-1-c of 2C) or Ulysses' contiguous s/C, at their real positions (wpe). Everything but
attention is position-wise and runs on those tokens; the attention of this TP rank's H/T
heads meets the other CP ranks' keys by 09's ring (K/V around the CP group, each block on
the fused CPU flash kernel, the explicit fp32 block as fallback, merged by log-sum-exp) or by
Ulysses (all-to-alls to H/(T·C) heads of all s tokens and back: C must divide H/T). A stage
boundary sends the CP rank's [b, s/C, h] (with SP [b, s/(C·T), h]); with SP, the TP group
gathers and scatters the CP rank's s/C tokens (s/C must divide by T). Each CP rank's loss is
the mean over its tokens, so the gradients are averaged, and ZeRO-1 shards, over the D·C
ranks of DP x CP (09's one reduction over every rank holding the same weights), and the
logged loss is the mean over those D·C ranks. The batch is a replica's (D, not D·C): CP
ranks split its sequences, not its rows. Attention dropout is not applied with C > 1 (as in
09: the ring never materialises the probabilities whole).

The hard parts:
  * the tied embedding: the first stage's wte shard and the last stage's head shard (the
    same vocabulary rows, same TP rank) are two copies, kept equal by all-reducing their
    gradients between the two ranks before each update;
  * the clipping norm: TP-sharded parameters summed over the TP group, TP-replicated ones
    (LayerNorms, row biases, wpe) counted once, the tied copy counted once, summed over the
    stages (and over the DP shards with --zero1);
  * data: a DP replica reads its own slice of the global batch; in it, only the first stage
    needs the tokens and only the last stage the targets.

Run:

    mpiexec -n 8 python 08_3d.py --tp 2 --pp 2 --model gpt2          # D = 2
    sbatch jobs/frontier_3d.sh                                         # 2 nodes x 8 GCDs
    mpiexec -n 8 python 08_3d.py --tp 2 --pp 2 --cp 2 --sequence_parallel --model tiny

Cost per rank (Ψ parameters, b micro-batch, s sequence, h width, L layers, m micro-batches):

    memory:  16Ψ_rank bytes, Ψ_rank = Ψ_stage,sharded/T + Ψ_stage,replicated (fp32 weights,
             gradients, AdamW); --zero1: weights 4Ψ_rank and gradients 4Ψ_rank (both padded
             to a multiple of D) + the reduced gradient shard 4Ψ_rank/D + AdamW 8Ψ_rank/D
    TP:      all-reduce of b·s·h, 4 per layer per micro-batch: the two forward ones (g) in the
             compute dtype, the two backward ones (f) in fp32; + the embedding's and the
             head's (fp32) and 3·b·s loss statistics (fp32) on the last stage
    SP:      each TP all-reduce of b·s·h becomes an all-gather + a reduce-scatter of the
             same b·s·h, + 2 all-gathers (compute dtype) per layer in backward (the
             column-parallel inputs again; the head's on the last stage), + 4Ψ_replicated
             all-reduced over the TP group per step (the replicated gradients)
    PP:      send and receive of b·s·h (fp32, the residual stream; with SP b·s·h/T) per
             micro-batch per stage boundary; the wte shard's gradient between first and last
             stage
    DP:      all-reduce of this rank's 4·Ψ_rank gradient bytes per step (--zero1:
             reduce-scatter + all-gather of the padded 4Ψ_rank)
    logging: the loss all-reduced over the stages and the replicas (4 bytes each) and, with
             clipping, the squared norm over the replica (over the world with --zero1; 4
             bytes)
    activations: 1F1B's micro-batches in flight (P - pp at most) x this stage's layers,
             each the attention and MLP /T, the LayerNorms and residual stream whole; with
             SP every term of a block /T; --recompute keeps each block's input only (/T with
             SP). The exact terms are costs() below
    CP:      s is the s/C tokens of a CP rank in every formula above (TP, SP, PP, the
             activations); the DP all-reduce (--zero1: reduce-scatter + all-gather, padded to
             D·C) runs over the D·C ranks of DP x CP. Per micro-batch and layer, with
             A = b·s·(h/T)·b_c (this TP rank's heads' K, or V):
               ring     send = recv += 4(C-1)·A (K and V, C-1 hops, forward and again in
                        backward) + 8C·b·s·h/T (fp32 dK and dV, C hops); --recompute + 2(C-1)·A
               ulysses  all_to_all_single[cp] = 8·A (q, k, v and the output, forward and
                        backward); --recompute 12·A
             activations: the attention term is 09's on H/T heads: ring (3 + 1)·b_c·b·s·h/T
             (q|k|v, O) + 4b(H/T)s (L); Ulysses (3 + 1 + 1)·b_c·b·s·h/T + SDPA's log-sum-exp
             of H/(T·C) heads over C·s tokens
"""

import math
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.variable import Variable
from torch.nn import functional as F

from common import (activation_device_type, activation_terms, activations_of_layers, autocast, check,
                    Data, device_rng_state, format_bytes, formula, is_decayed, LEDGER, make_adamw,
                    make_parser, model_config, param_init, param_pieces, parse_args, planned_dtype,
                    plus, recomputed, Run, sdpa_logsumexp, set_device_rng_state, state_bytes,
                    to_device)


# ---------------------------------------------------------------------------------------
# The mesh
# ---------------------------------------------------------------------------------------

class Mesh:
    """Coordinates and process groups of the 4D mesh, outermost first DP x PP x CP x TP:
    rank = ((dp·P + pp)·C + cp)·T + tp. TP innermost (it talks most: every layer, on the
    critical path), then CP (K/V or all-to-alls every layer, overlappable), then PP (one
    activation per micro-batch per boundary), DP outermost (once per step)."""

    AXES = ("dp", "pp", "cp", "tp")  # outermost first

    def __init__(self, rank, world, tp_size, pp_size, cp_size=1):
        self.rank, self.tp_size, self.pp_size, self.cp_size = rank, tp_size, pp_size, cp_size
        self.dp_size = world // (tp_size * pp_size * cp_size)
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = self.coordinates(rank)
        # the gradient reduction runs over DP x CP: CP ranks hold the same weights and see
        # other tokens of the same sequences (09's "every rank's share of the global mean")
        self.reduce_size, self.reduce_rank = self.dp_size * cp_size, self.dp_rank * cp_size + self.cp_rank
        d, s, c, t = self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank
        self.next = self.rank_of(d, s + 1, t, c) if s < pp_size - 1 else None
        self.prev = self.rank_of(d, s - 1, t, c) if s > 0 else None
        self.tp_group = self.pp_group = self.dp_group = self.mp_group = None  # make_groups()
        self.embedding_group = self.cp_group = None
        self.cp_ranks = [self.rank_of(d, s, t, i) for i in range(cp_size)]  # this rank's CP group

    def rank_of(self, dp_rank, pp_rank, tp_rank, cp_rank=0):
        return ((dp_rank * self.pp_size + pp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def coordinates(self, rank):
        """(dp_rank, pp_rank, cp_rank, tp_rank) of a global rank."""
        T, C, P = self.tp_size, self.cp_size, self.pp_size
        return rank // (P * C * T), (rank // (C * T)) % P, (rank // T) % C, rank % T

    def groups_over(self, *axes):
        """Every group whose ranks differ only along `axes` (("tp",): the TP groups), each a
        list of ranks, in rank order."""
        groups = {}
        for r in range(self.dp_size * self.pp_size * self.cp_size * self.tp_size):
            fixed = tuple(v for a, v in zip(self.AXES, self.coordinates(r)) if a not in axes)
            groups.setdefault(fixed, []).append(r)
        return list(groups.values())

    def make_groups(self):
        """The process groups of this rank (a collective: every rank creates every group, in
        the same order)."""
        kinds = [("tp", ("tp",), "tp_group"),  # Megatron's f and g
                 ("model", ("pp", "tp"), "mp_group"),  # one replica (at one CP rank): the norm
                 ("dp", ("dp", "cp"), "dp_group"),  # the gradient reduction, DP x CP
                 ("pp", ("pp",), "pp_group")]  # a pipeline: the logged loss
        if self.cp_size > 1:
            kinds.append(("cp", ("cp",), "cp_group"))  # the ring, or Ulysses' all-to-alls
        for name, axes, attribute in kinds:
            for ranks in self.groups_over(*axes):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    setattr(self, attribute, LEDGER.name_group(group, name))
        for ranks in self.groups_over("pp"):  # the tied embedding: first and last stage
            group = dist.new_group(sorted({ranks[0], ranks[-1]}))
            if self.rank in ranks:
                self.embedding_group = LEDGER.name_group(group, "embedding")
        return self

    def describe(self, world, ranks_per_node=None):
        D, P, C, T = self.dp_size, self.pp_size, self.cp_size, self.tp_size
        if C == 1:
            lines = [f"mesh: {world} ranks = {D} data-parallel x {P} pipeline x {T} tensor-parallel "
                     f"(rank = dp·{P * T} + pp·{T} + tp)"]
        else:
            lines = [f"mesh: {world} ranks = {D} data-parallel x {P} pipeline x {C} context-parallel x "
                     f"{T} tensor-parallel (rank = dp·{P * C * T} + pp·{C * T} + cp·{T} + tp)"]
        shown = range(D) if D <= 4 else [0, 1, D - 1]
        for d in shown:
            if d == D - 1 and D > 4:
                lines.append(f"  ... ({D - 3} more replicas)")
            row = [f"{self.rank_of(d, s, t, c):>3}:(dp {d}, pp {s}" + (f", cp {c}" if C > 1 else "") + f", tp {t})"
                   for s in range(P) for c in range(C) for t in range(T)]
            lines.append("  " + "  ".join(row))
        if ranks_per_node:
            for name, axis, size in (("TP", "tp", T), ("CP", "cp", C)):
                if name == "CP" and C == 1:
                    continue
                spans = max(len({r // ranks_per_node for r in ranks}) for ranks in self.groups_over(axis))
                where = "inside one node" if spans == 1 else \
                    f"spans {spans} nodes (slow: keep {axis}{' x tp' if axis == 'cp' else ''} <= ranks per node)"
                lines.append(f"  {ranks_per_node} ranks per node: every {name} group {where}")
        return "\n".join(lines)


def check_layout(config, T, P, sp=False, C=1, impl="ring"):
    check(config.n_head % T == 0, f"n_head {config.n_head} is not divisible by tp {T}: "
          "each TP rank must own whole attention heads")
    check(not sp or config.block_size % T == 0, f"--sequence_parallel needs block_size "
          f"{config.block_size} divisible by tp {T}: each TP rank holds s/T of the sequence")
    check(config.n_layer >= P,
          f"n_layer {config.n_layer} is fewer than pp {P}: every stage needs a layer")
    s = config.block_size
    if C > 1 and impl == "ring":
        check(s % (2 * C) == 0, f"block_size {s} is not divisible by 2 x cp = {2 * C} "
              "(ring attention cuts every sequence into 2·cp chunks)")
    elif C > 1:
        check(s % C == 0, f"block_size {s} is not divisible by --cp {C}")
        check(config.n_head // T % C == 0, f"--cp_impl ulysses needs --cp {C} to divide the heads of "
              f"each TP rank, n_head / tp = {config.n_head // T}")
    check(not sp or C == 1 or s // C % T == 0, f"--sequence_parallel with --cp {C} needs the "
          f"{s // C} tokens of a CP rank divisible by tp {T}: each TP rank holds s/(C·T) of them")


# ---------------------------------------------------------------------------------------
# Tensor parallelism inside a stage (restated from 06_tensor_parallel.py, on the TP group)
# ---------------------------------------------------------------------------------------

# The tensor-parallel plan (as torchtitan's parallelize plan): how the TP group splits each
# parameter of a stage, by the end of its name; anything else is replicated (LayerNorms,
# wpe, c_proj.bias: added once, after g). Read by the initialisation (Stage.tp_layout), the
# checkpoint pieces, the gradient norm (counted_once) and costs(). T ranks, t this rank's.
TP_PLAN = {
    "wte.weight": "vocab",      # rows [t·V'/T, (t+1)·V'/T) of V' = V padded to a multiple of T
    "lm_head.weight": "vocab",  # the tied head: the same rows (on the last stage, a copy)
    "c_attn.weight": "qkv",     # column-parallel, dim 0, per head: this rank's of Q, of K, of V
    "c_attn.bias": "qkv",
    "c_fc.weight": "column",    # column-parallel, dim 0: rows [t·4h/T, (t+1)·4h/T)
    "c_fc.bias": "column",
    "c_proj.weight": "row",     # row-parallel, dim 1: columns [t·k/T, (t+1)·k/T), k = h or 4h
}


def tp_split(name):
    """How parameter `name` of a stage is split across the TP group: its TP_PLAN entry, or
    "replicated"."""
    return next((how for suffix, how in TP_PLAN.items() if name.endswith(suffix)), "replicated")


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
        dist.all_reduce(grad, group=ctx.group)  # sum the input-gradient parts of every weight shard
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g: forward all-reduce of the partial sums over the TP group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)  # sum the partial outputs of the row-parallel shards
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_seq(x, group):
    """[b, s/T, h] on each rank -> [b, s, h], the shards in rank order."""
    tp_size, (b, s_local, h) = dist.get_world_size(group), x.shape
    parts = torch.empty((tp_size * b, s_local, h), dtype=x.dtype, device=x.device)  # rank-major
    dist.all_gather_into_tensor(parts, x.contiguous(), group=group)  # every rank's sequence shard
    return parts.view(tp_size, b, s_local, h).permute(1, 0, 2, 3).reshape(b, tp_size * s_local, h)


def _reduce_scatter_seq(x, group):
    """[b, s, h] partial sums on each rank -> [b, s/T, h]: this rank's sequence shard of
    the sum."""
    tp_size, (b, s, h) = dist.get_world_size(group), x.shape
    chunks = x.reshape(b, tp_size, s // tp_size, h).permute(1, 0, 2, 3)
    chunks = chunks.reshape(tp_size * b, s // tp_size, h)
    out = torch.empty((b, s // tp_size, h), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, chunks, group=group)  # sum over ranks; rank t keeps chunk t
    return out


class GatherSequenceLinear(torch.autograd.Function):
    """f and a column-parallel Linear with sequence parallelism, Y_t = all-gather(X) A_t^T +
    b_t, keeping only this rank's sequence shard of X for backward (Korthikanti et al. 2022,
    Sec. 4.2.2): backward all-gathers the shard again for the weight gradient (one more
    all-gather of b·s·h, in the compute dtype) and reduce-scatters the input gradient.
    Under autocast the shard is cast before the gather (half the bytes in bf16), and that
    cast shard is what is kept, as autocast would keep its cast input."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
            else x.dtype
        shard = x.to(dtype)
        out = F.linear(_all_gather_seq(shard, group), weight.to(dtype),
                       None if bias is None else bias.to(dtype))
        ctx.save_for_backward(shard, weight)  # [b, s/T, h], not the gathered [b, s, h]
        ctx.has_bias, ctx.x_dtype, ctx.group = bias is not None, x.dtype, group
        return out

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        total = _all_gather_seq(shard, ctx.group)  # the whole sequence again, for dL/dA_t
        grad_x = grad.matmul(weight.to(grad.dtype))  # [b, s, h]: this rank's part of dL/dX
        # sum the parts of every rank's weight shard, keep this rank's sequence shard (in
        # the input's dtype, as autocast's cast back would hand it on)
        grad_x = _reduce_scatter_seq(grad_x.to(ctx.x_dtype), ctx.group)
        grad_weight = grad.flatten(0, 1).t().matmul(total.flatten(0, 1))  # dY_t^T X
        grad_bias = grad.sum(dim=(0, 1)).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None


class ScatterSequence(torch.autograd.Function):
    """g with sequence parallelism: reduce-scatter forward, all-gather back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None  # every rank's shard of dL/dY


class ColumnParallelLinear(nn.Module):
    """Y_t = f(X) A_t: this rank's block of output columns (rows of nn.Linear's weight)."""

    def __init__(self, in_features, out_local, bias, group, sequence_parallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if self.sequence_parallel:  # keeps only the sequence shard of x for backward
            return GatherSequenceLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(X_t B_t) + bias: this rank's block of input rows; the bias is added once,
    after the reduction (with sequence parallelism: to this rank's sequence shard)."""

    def __init__(self, in_local, out_features, bias, group, sequence_parallel):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        reduce = ScatterSequence if self.sequence_parallel else ReduceFromTP
        y = reduce.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


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
        reduce = ScatterSequence if self.sequence_parallel else ReduceFromTP
        return reduce.apply(x, self.group)  # the sum, or with SP this rank's sequence shard of it


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from this rank's slice of the logits, never gathering them:
    loss_i = log Σ_v exp(z_iv - m_i) - (z_i,target - m_i), with m_i the global max. The
    backward needs no communication: d loss / d z = softmax - onehot, computed locally."""

    @staticmethod
    def forward(ctx, logits, targets, start, vocab_size, group):
        logits = logits.float()
        n_local = logits.shape[-1]
        ids = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))  # padding never counts
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # the global max per token
        shifted = logits - logits_max.unsqueeze(-1)
        local_target = targets - start
        mine = (local_target >= 0) & (local_target < n_local)
        index = local_target.clamp(0, n_local - 1)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        dist.all_reduce(target_logit, group=group)  # the target's logit: only its owner's is not 0
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)  # the softmax denominator over the whole vocabulary
        loss = sum_exp.log() - target_logit
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, index, mine)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        onehot = mine.unsqueeze(-1).to(softmax.dtype)  # 1 at the target's column, on its owner
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        return grad_logits * (grad / softmax[..., 0].numel()), None, None, None, None


class TPBlock(nn.Module):
    def __init__(self, config, tp_size, group, sp):
        super().__init__()
        h = config.n_embd
        self.ln_1 = nn.LayerNorm(h, bias=config.bias)
        self.attn = nn.Module()
        self.attn.c_attn = ColumnParallelLinear(h, 3 * h // tp_size, config.bias, group, sp)
        self.attn.c_proj = RowParallelLinear(h // tp_size, h, config.bias, group, sp)
        self.ln_2 = nn.LayerNorm(h, bias=config.bias)
        self.mlp = nn.Module()
        self.mlp.c_fc = ColumnParallelLinear(h, 4 * h // tp_size, config.bias, group, sp)
        self.mlp.c_proj = RowParallelLinear(4 * h // tp_size, h, config.bias, group, sp)
        self.n_head_local, self.dropout = config.n_head // tp_size, nn.Dropout(config.dropout)
        self.p_attn, self.sp = config.dropout, sp

    recompute = False  # --recompute: keep the block's input only (its g all-reduces run again)
    cp = None  # --cp C > 1: a ContextParallel, the attention over this rank's CP group

    def forward(self, x, rng):
        if self.recompute and torch.is_grad_enabled():  # restoring the TP rank's stream too
            return recomputed(lambda t: self.body(t, rng), x, trackers=[rng])
        return self.body(x, rng)

    def body(self, x, rng):
        q, k, v = self.attn.c_attn(self.ln_1(x)).chunk(3, dim=-1)  # this rank's heads
        B, T, C = q.shape
        heads = self.n_head_local
        q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
        if self.cp is not None:  # this CP rank's queries meet every CP rank's keys (as in 09:
            y = self.cp.attention(q, k, v)  # no attention dropout), on this TP rank's heads
        else:
            with rng.sharded():  # attention dropout acts inside this rank's heads: its own stream
                p = self.p_attn if self.training else 0.0
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        y = self.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        with sharded_if(self.sp, rng):  # with SP the residual stream is a sequence shard
            x = x + self.dropout(y)
        y = self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))
        with sharded_if(self.sp, rng):
            return x + self.dropout(y)


class ShardedRNG:
    """Megatron's model-parallel RNG tracker, reduced to one stream: `with rng.sharded():`
    swaps the device's default generator (the stream the TP group shares) to this rank's
    own stream and back."""

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


def sharded_if(sp, rng):
    """Dropout on a sequence shard (SP's residual stream and embedding) draws this rank's
    own stream; on the replicated stream (no SP), the one the TP group shares."""
    return rng.sharded() if sp else nullcontext()


class Stage(nn.Module):
    """This rank's pipeline stage, tensor-parallel: layers [first_layer, first_layer + n),
    the vocab-parallel embedding on the first stage, the final norm and head on the last.
    With sequence parallelism (sp) the residual stream in and out is [b, s/T, h]: this TP
    rank's sequence shard. With context parallelism (cp, a ContextParallel) the stage sees
    only its CP rank's tokens, `positions` (s/C of every sequence; with SP, [b, s/(C·T), h])."""

    def __init__(self, config, mesh, first_layer, n_layers, rng, recompute=False, sp=False, cp=None):
        super().__init__()
        tp_size, h, group = mesh.tp_size, config.n_embd, mesh.tp_group
        self.config, self.mesh, self.first_layer, self.rng = config, mesh, first_layer, rng
        self.sp = sp
        self.positions = torch.arange(config.block_size) if cp is None else \
            token_positions(config.block_size, cp.C, cp.cp_rank, cp.impl)  # in the order held
        self.is_first, self.is_last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp_size - 1
        self.padded_vocab = math.ceil(config.vocab_size / tp_size) * tp_size
        self.vocab_local = self.padded_vocab // tp_size
        self.vocab_start = mesh.tp_rank * self.vocab_local
        if self.is_first:
            self.wte = VocabParallelEmbedding(self.vocab_local, h, self.vocab_start, group, sp)
            self.wpe = nn.Embedding(config.block_size, h)
            self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([TPBlock(config, tp_size, group, sp) for _ in range(n_layers)])
        for block in self.h:
            block.recompute, block.cp = recompute, cp
        if self.is_last:
            self.ln_f = nn.LayerNorm(h, bias=config.bias)
            # the tied head: the embedding itself, or (on another stage) a copy of its shard
            self.lm_head = self.wte if self.is_first else VocabParallelEmbedding(
                self.vocab_local, h, self.vocab_start, group, sp)

    def full_name(self, name):
        if name.startswith("h."):
            index, rest = name[2:].split(".", 1)
            return f"transformer.h.{self.first_layer + int(index)}.{rest}"
        return {"lm_head.weight": "transformer.wte.weight"}.get(name, "transformer." + name)

    def tp_layout(self, name, p):
        """Where this rank's `p`, its TP piece of parameter `name`, sits in 01's parameter, as
        TP_PLAN says: (01's shape, [(box of 01's tensor, the rows of p holding it, None for
        all of p)]). The vocabulary's padding rows are no part of 01's tensor."""
        T, t, shape = self.mesh.tp_size, self.mesh.tp_rank, list(p.shape)
        rest = [[0, s] for s in shape[1:]]
        how = tp_split(name)
        if how == "vocab":  # rows [lo, hi) of the vocabulary, those below V
            V, lo = self.config.vocab_size, self.vocab_start
            hi = min(lo + self.vocab_local, V)
            boxes = [([[lo, hi]] + rest, slice(0, hi - lo))] if lo < hi else []
            return [V] + shape[1:], boxes
        if how == "qkv":  # [Q_t; K_t; V_t]: 01's rows j·h + [t·n, (t+1)·n), n = h/T, j = Q, K, V
            n = shape[0] // 3
            return [3 * n * T] + shape[1:], [([[j * n * T + t * n, j * n * T + (t + 1) * n]] + rest,
                                              slice(j * n, (j + 1) * n)) for j in range(3)]
        if how == "column":  # rows [t·n, (t+1)·n)
            n = shape[0]
            return [n * T] + shape[1:], [([[t * n, (t + 1) * n]] + rest, None)]
        if how == "row":  # columns [t·n, (t+1)·n)
            n = shape[1]
            return [shape[0], n * T], [([[0, shape[0]], [t * n, (t + 1) * n]], None)]
        return shape, [(None, None)]  # replicated: all of it

    @torch.no_grad()
    def init_weights(self, seed):
        """01's initial values (common.param_init: by name and full shape), each rank taking
        its TP pieces of them (tp_layout); the vocabulary's padding rows zero."""
        for name, p in self.named_parameters():
            shape, boxes = self.tp_layout(name, p)
            full = param_init(self.full_name(name), tuple(shape), self.config, seed)
            p.zero_()
            for box, rows in boxes:
                p[rows or slice(None)] = full[tuple(slice(a, b) for a, b in box)] if box else full
        return self

    def forward(self, x, targets=None):
        T, t, group = self.mesh.tp_size, self.mesh.tp_rank, self.mesh.tp_group
        if self.is_first:
            pos, n = self.positions, len(self.positions)  # the real positions of the tokens
            if self.sp:  # held (a CP rank's, else all); with SP this TP rank's n/T of them
                pos = pos[t * n // T:(t + 1) * n // T]
            x = self.wte(x) + self.wpe(pos.to(x.device))
            with sharded_if(self.sp, self.rng):
                x = self.drop(x)
        for block in self.h:
            x = block(x, self.rng)
        if self.is_last:
            x = self.ln_f(x)  # the tied head: this rank's vocabulary, of the tokens held
            if self.sp:  # a column-parallel Linear too: keeps the sequence shard only
                logits = GatherSequenceLinear.apply(x, self.lm_head.weight, None, group)
            else:
                logits = F.linear(CopyToTP.apply(x, group), self.lm_head.weight)
            logits, targets = logits.view(-1, logits.size(-1)), targets.view(-1)
            return VocabParallelCrossEntropy.apply(logits, targets, self.vocab_start,
                                                   self.config.vocab_size, group)
        return x


def counted_once(stage, name):
    """Whether this rank's copy of parameter `name` is the one that counts, in the global
    gradient norm and in the checkpoint written: the tied head's copy on the first stage
    only, a TP-replicated parameter on TP rank 0 only (TP-split ones on every TP rank)."""
    tied_copy = name == "lm_head.weight" and not stage.is_first
    return not tied_copy and (tp_split(name) != "replicated" or stage.mesh.tp_rank == 0)


def reduce_replicated_grads(stage, group):
    """With sequence parallelism each TP rank ran the replicated parameters (LayerNorms,
    row-parallel biases, wpe) on its sequence shard only, so their gradients are partial:
    sum them over the TP group (one all-reduce per step, 4Ψ_replicated bytes)."""
    grads = [p.grad for name, p in stage.named_parameters() if tp_split(name) == "replicated"]
    flat = torch.cat([g.view(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # every TP rank's partial gradients, summed
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# ---------------------------------------------------------------------------------------
# Context parallelism inside a stage's attention (restated from 09_context_parallel.py, on
# the CP group, on this TP rank's heads)
# ---------------------------------------------------------------------------------------

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


aten = torch.ops.aten


def block_forward(q, k, v, causal):
    """One block's attention: its output O_b (normalised over the block's keys) and the
    log-sum-exp of its scores L_b = log Σ_keys exp(q·k/√d), fp32 [b, heads, t], from the fused
    attention kernel that returns it: on CPU torch's flash attention for CPU, on CUDA the
    flash (fp16/bf16) or memory-efficient (fp32) kernel (as torchtitan's ring does; unverified:
    neither 09 nor 08 has run on a GPU); elsewhere the explicit fp32 reference below."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse
    if q.device.type == "cuda":  # its log-sum-exp is padded to a multiple of 32 queries
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        return out, lse[..., :q.size(2)]
    return explicit_block_forward(q, k, v, causal)


def block_backward(dout, q, k, v, out, lse, causal):
    """One block's dq, dk, dv from the *final* (merged) O and L (FlashAttention-2's backward
    needs only those and dO, not the block's own): the fused kernel's backward, as in
    block_forward, else the explicit fp32 reference."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):  # unverified
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout 0: never read
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, no_rng, no_rng)
    if q.device.type == "cuda":  # unverified; the kernel reads L padded to 32 queries
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)
        lse = F.pad(lse, (0, -q.size(2) % 32))
        return aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, no_rng, no_rng, 0.0, [True, True, True, False], causal)[:3]
    return explicit_block_backward(dout, q, k, v, out, lse, causal)


def scores(q, k, causal):
    """S = q kᵀ/√d for one block in fp32, the upper triangle -inf on a causal block."""
    s = (q.float() / math.sqrt(q.size(-1))) @ k.float().transpose(-2, -1)
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def explicit_block_forward(q, k, v, causal):
    """The readable reference (and the fallback where no fused kernel applies), in fp32:
    L_b = logsumexp(S), O_b = exp(S - L_b) V."""
    s = scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    return s.sub_(lse.unsqueeze(-1)).exp_() @ v.float(), lse  # softmax(S) V, S overwritten by P


def explicit_block_backward(dout, q, k, v, out, lse, causal):
    """FlashAttention-2's backward of one block in fp32, with the final O and L:
    P = exp(S - L), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)),
    dQ = dS K/√d, dK = dSᵀ Q/√d."""
    q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    p = scores(q, k, causal).sub_(lse.unsqueeze(-1)).exp_()
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
    Blocks run in q's dtype (the fused kernel; fp32 in the explicit fallback), they merge in
    fp32."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        ctx.ring = ring
        b, heads, t, d = q.shape
        with torch.autocast(q.device.type, enabled=False):
            # fp32 O in [b, t, heads, d] memory order, so that the transpose back is a view
            out = torch.zeros(b, t, heads, d, device=q.device).transpose(1, 2)
            lse = torch.full((b, heads, t), float("-inf"), device=q.device)
            kv = (k, v)  # in ring step t: the K/V of rank (r - t) mod C
            for step in range(ring.size):
                if step < ring.size - 1:  # post: our K/V block to r+1, r-1's to us, during compute
                    pending = ring.pass_on(kv, tag=0)
                qh, kh, causal = ring_block(ring.rank, (ring.rank - step) % ring.size, ring.size)
                o, l = block_forward(part(q, qh), part(kv[0], kh), part(kv[1], kh), causal)
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
            dq = torch.zeros(q.shape, device=q.device)  # fp32 accumulators
            kv, arriving = (k, v), None
            for step in range(ring.size):
                if step < ring.size - 1:  # K/V go around again, as in forward
                    pending = ring.pass_on(kv, tag=0)
                qh, kh, causal = ring_block(ring.rank, (ring.rank - step) % ring.size, ring.size)
                dq_b, dk_b, dv_b = block_backward(part(dout, qh), part(q, qh), part(kv[0], kh),
                                                  part(kv[1], kh), part(out, qh), part(lse, qh).contiguous(),
                                                  causal)
                part(dq, qh).add_(dq_b)
                dk, dv = torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)
                part(dk, kh).add_(dk_b)  # our share for kv_rank's K/V
                part(dv, kh).add_(dv_b)
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


class ContextParallel:
    """This rank's CP group (global ranks `ranks`, in cp order) and the attention it runs
    over it: q, k, v are [b, H/T, s/C, d], this TP rank's heads of this CP rank's tokens."""

    def __init__(self, group, ranks, rank, impl):
        self.group, self.C, self.impl = group, len(ranks), impl
        self.ring = Ring(group, ranks, rank)
        self.cp_rank = ranks.index(rank)

    def attention(self, q, k, v):
        if self.impl == "ring":  # K/V around the ring, merged by their log-sum-exp
            return RingAttention.apply(q, k, v, self.ring)
        return ulysses_attention(q, k, v, self.group, self.C)  # heads H/(T·C), all s tokens


# ---------------------------------------------------------------------------------------
# Pipeline parallelism across stages (restated from 07_pipeline.py: 1F1B)
# ---------------------------------------------------------------------------------------

def stage_layers(n_layer, pp):
    """(first layer, layer count) of each stage: as even as it goes, the last n_layer % pp
    stages one layer more (under 1F1B the first stages hold the most activations)."""
    base, extra = divmod(n_layer, pp)
    sizes = [base + (s >= pp - extra) for s in range(pp)]
    return [(sum(sizes[:s]), sizes[s]) for s in range(pp)]


def one_f_one_b(p, stage, m):
    """1F1B: p-stage-1 warm-up forwards, then one forward one backward, then cool-down."""
    warmup = min(p - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def run_pipeline(stage, mesh, env, xs, ys, m, act_shape, train=True):
    """One step's 1F1B on this rank; every send is posted with the next receive (see 07).
    A sent output's data is freed once its send completes (Megatron's pseudo-free, as in
    07): only its autograd graph waits for the backward, so the memory in flight is what
    autograd saved. Returns the sum of the micro-batch losses (last stage; zero elsewhere)."""
    order = one_f_one_b(mesh.pp_size, mesh.pp_rank, m) if train else [("F", i) for i in range(m)]
    pending, posted, saved = [], [], {}  # to send; sent (request, output to free or None)
    loss_sum = torch.zeros((), device=env.device)

    def retire(wait=False):
        """Forget completed sends, freeing the data of sent outputs."""
        still = []
        for request, output in posted:
            if wait:
                request.wait()
            if wait or request.is_completed():
                if output is not None:
                    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
            else:
                still.append((request, output))
        posted[:] = still

    def exchange(recv_from=None, tag=None):
        ops = [dist.P2POp(dist.isend, t, peer, tag=tg) for peer, t, tg, _ in pending]
        buffer = None
        if recv_from is not None:
            buffer = torch.empty(act_shape, device=env.device)
            ops.append(dist.P2POp(dist.irecv, buffer, recv_from, tag=tag))
        requests = dist.batch_isend_irecv(ops) if ops else []  # activations / gradients, b·s·h
        posted.extend((request, t if free else None)
                      for request, (_, t, _, free) in zip(requests, pending))
        pending.clear()
        if buffer is not None:
            requests[-1].wait()  # wait for the receive only (a send completes when received)
        retire()
        return buffer

    for kind, i in order:
        if kind == "F":
            x = xs[i] if stage.is_first else exchange(mesh.prev, i).requires_grad_(train)
            if stage.is_first:
                exchange()
            with torch.set_grad_enabled(train), autocast(env):
                out = stage(x, ys[i] if stage.is_last else None)
            if stage.is_last:
                loss_sum += out.detach().float()
                out = out / m  # backward of the mean over the micro-batches
            else:
                pending.append((mesh.next, out if train else out.detach(), i, train))
            if train:
                saved[i] = (x, out)
        else:
            x, out = saved.pop(i)
            if stage.is_last:
                exchange()
                out.backward()
            else:
                grad = exchange(mesh.next, m + i)
                # the output's data may have been freed after its send: run the engine
                # directly, which (unlike tensor.backward) does not check the shapes
                Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)
            if not stage.is_first:
                pending.append((mesh.prev, x.grad, m + i, False))
    exchange()
    retire(wait=True)
    return loss_sum


# ---------------------------------------------------------------------------------------
# Data parallelism across replicas: plain all-reduce or ZeRO-1, behind one interface
# ---------------------------------------------------------------------------------------

class DataParallel:
    """Plain data parallelism over the DP group: every replica holds its stage's TP pieces
    whole, with their gradients and AdamW state, and averages the gradients with one
    all-reduce per step. ZeRO1 below has the same interface: `optimizer`,
    `reduce_gradients()`, `grad_tensors()` (for the guard and the norm), `squared_norm()`
    with its `norm_group`, `step()`, `zero_grad()`, `held_bytes()`, `checkpoint_pieces()`."""

    def __init__(self, stage, mesh, args, device):
        self.stage, self.mesh, self.params = stage, mesh, list(stage.parameters())
        self.optimizer = make_adamw(self.params, args, device.type)
        self.norm_group = mesh.mp_group  # one replica's stages and TP ranks: every gradient once

    def reduce_gradients(self):
        """The mean gradient on every replica: one all-reduce of this rank's flat gradients."""
        for p in self.params:  # CP ranks' gradients are their tokens' shares: /C too
            p.grad.div_(self.mesh.reduce_size)
        flat = torch.cat([p.grad.view(-1) for p in self.params])
        dist.all_reduce(flat, group=self.mesh.dp_group)  # sum over the DP x CP ranks of this (pp, tp)
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def grad_tensors(self):
        return [p.grad for p in self.params]

    def squared_norm(self):
        """Σ g² over this rank's gradients that count (counted_once), before norm_group's sum."""
        squares = torch.zeros((), device=self.params[0].device)
        for name, p in self.stage.named_parameters():
            if counted_once(self.stage, name):
                squares += p.grad.float().pow(2).sum()
        return squares

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def held_bytes(self):
        """The model-state bytes this rank holds, counted from the live tensors."""
        return state_bytes(self.params, self.optimizer)

    def checkpoint_pieces(self):
        """DP replica 0 (CP rank 0) writes the parameters (TP pieces of its stage) and their
        moments."""
        stage, write = self.stage, self.mesh.reduce_rank == 0
        return [piece for name, p in stage.named_parameters()
                for piece in tp_pieces(stage, name, p, self.optimizer, write=write)]


class ZeRO1:
    """ZeRO stage 1 over the DP group (restated from 04_zero.py; with CP the D·C ranks of
    DP x CP, Megatron's distributed optimizer's group), DataParallel's interface: this
    rank's parameters as one flat buffer padded to a multiple of D; DP rank d owns
    shard d of it, with its AdamW state (P_os); gradients are reduce-scattered, parameters
    all-gathered after the update."""

    def __init__(self, stage, mesh, args, device):
        self.stage, self.mesh, self.params = stage, mesh, list(stage.parameters())
        D = mesh.reduce_size  # the DP group: D x C ranks with CP, which hold the same weights
        numel = sum(p.numel() for p in self.params)
        self.shard = math.ceil(numel / D)
        self.flat = torch.zeros(self.shard * D, device=device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.lo, self.hi = lo, hi = mesh.reduce_rank * self.shard, (mesh.reduce_rank + 1) * self.shard
        self.grad_shard = torch.zeros(self.shard, device=device)
        self.segments = []  # (parameter, [a, b) of it flattened, the optimizer's tensor of them)
        self.counted = []  # [a, b) of the shard whose gradients count in the norm (counted_once)
        offset, pieces = 0, {True: [], False: []}
        for name, p in stage.named_parameters():
            n = p.numel()
            self.flat[offset:offset + n].copy_(p.data.view(-1))
            p.data = self.flat[offset:offset + n].view_as(p)
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            a, b = max(offset, lo), min(offset + n, hi)
            if a < b:
                piece = self.flat[a:b]
                piece.grad = self.grad_shard[a - lo:b - lo]
                pieces[is_decayed(p.shape)].append(piece)
                self.segments.append((p, a - offset, b - offset, piece))
                if counted_once(stage, name):
                    self.counted.append((a - lo, b - lo))
            offset += n
        if offset < hi:  # padding: no decay, stays zero
            piece = self.flat[max(offset, lo):hi]
            piece.grad = self.grad_shard[max(offset, lo) - lo:]
            pieces[False].append(piece)
        self.optimizer = make_adamw(pieces[True], args, device.type, not_decayed=pieces[False])
        self.norm_group = None  # the whole world: DP shards x stages x TP pieces

    def reduce_gradients(self):
        self.flat_grad.div_(self.mesh.reduce_size)
        # sum the replicas' gradients; DP rank d receives shard d
        dist.reduce_scatter_tensor(self.grad_shard, self.flat_grad, group=self.mesh.dp_group)

    def grad_tensors(self):
        return [self.grad_shard]

    def squared_norm(self):
        """Σ g² over this DP rank's shard of the gradients that count, before the world's sum."""
        weights = torch.zeros_like(self.grad_shard)
        for a, b in self.counted:
            weights[a:b] = 1.0
        return (self.grad_shard.pow(2) * weights).sum()

    def step(self):
        self.optimizer.step()
        # every DP rank's updated shard -> the whole parameter buffer on every DP rank
        mine = self.flat[self.lo:self.hi].clone()
        dist.all_gather_into_tensor(self.flat, mine, group=self.mesh.dp_group)

    def zero_grad(self):
        self.flat_grad.zero_()
        self.grad_shard.zero_()

    def held_bytes(self):
        """The model-state bytes this rank holds, counted from the live tensors: the flat
        buffers (through the parameters' views of them), the reduced shard, AdamW's state."""
        held = state_bytes(self.params, self.optimizer)
        held["grads"] += self.grad_shard.untyped_storage().nbytes()
        return held

    def checkpoint_pieces(self):
        """DP replica 0 writes the parameters (TP pieces of its stage); every DP rank writes
        the AdamW moments it owns: each optimizer tensor holds elements [a, b) of one
        parameter flattened; where that meets a TP piece of the parameter (elements [s, e) of
        it, a box of 01's tensor), it is the elements [x - s, y - s) of the box."""
        stage, named = self.stage, list(self.stage.named_parameters())
        pieces = [piece for name, p in named
                  for piece in tp_pieces(stage, name, p, None, write=self.mesh.reduce_rank == 0)]
        whole = {p: tp_pieces(stage, name, p, None, write=True) for name, p in named}
        for p, a, b, segment in self.segments:
            for piece in whole[p]:
                # where the piece starts in p: a dim-0 slice of p, or all of it
                s = piece.tensor.storage_offset() - p.data.storage_offset()
                x, y = max(a, s), min(b, s + piece.tensor.numel())
                if x < y:
                    name, mine = piece.name.removeprefix("model/"), slice(x - a, y - a)  # of segment
                    pieces += param_pieces(name, piece.shape, segment, self.optimizer, box=piece.box,
                                           flat=(x - s, y - s), index=mine, write=piece.write,
                                           model=False)
        return pieces


def clip_grad_norm(replicas, max_norm):
    """Scale the gradients so that their global norm, every parameter counted once over the
    whole model, is at most max_norm."""
    squares = replicas.squared_norm()
    dist.all_reduce(squares, group=replicas.norm_group)  # over the ranks of distinct gradients
    coef = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for g in replicas.grad_tensors():
        g.mul_(coef)


# ---------------------------------------------------------------------------------------
# One step's pieces: this replica's micro-batches, the loss
# ---------------------------------------------------------------------------------------

def micro_batches(data, split, step, stage, mesh, args, env, m, eval_split=False):
    """This replica's rows in m micro-batches; only the first stage needs tokens and the
    last targets; with CP only this CP rank's tokens of them (stage.positions)."""
    if not (stage.is_first or stage.is_last):
        return [None] * m, [None] * m
    x, y = data.batch(split, step, args.global_batch_size, mesh.dp_rank, mesh.dp_size,
                      eval_split=eval_split)
    x, y = to_device(x[:, stage.positions], env), to_device(y[:, stage.positions], env)
    b = args.micro_batch_size
    return [x[i * b:(i + 1) * b] for i in range(m)], [y[i * b:(i + 1) * b] for i in range(m)]


def global_mean(loss_sum, mesh, m):
    """The mean loss over every micro-batch of every replica, on every rank (with CP each
    CP rank's loss is the mean over its s/C tokens: their mean over the CP ranks is the
    sequences' mean)."""
    dist.all_reduce(loss_sum, group=mesh.pp_group)  # the last stage's loss, to every stage
    loss_sum /= m * mesh.reduce_size
    dist.all_reduce(loss_sum, group=mesh.dp_group)  # the mean over the replicas (and CP ranks)
    return loss_sum


def add_flags(parser):
    g = parser.add_argument_group("08_3d")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (innermost)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--zero1", action="store_true",
                   help="shard the optimizer state across each DP group")
    g.add_argument("--sequence_parallel", action="store_true",
                   help="shard LayerNorm/dropout regions along the sequence in each TP group")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks that split every sequence (between TP and PP in the mesh)")
    g.add_argument("--cp_impl", default="ring", choices=["ring", "ulysses"],
                   help="ring attention (zigzag, K/V around the ring) or Ulysses (all-to-all over heads)")
    return parser


@torch.no_grad()
def evaluate(stage, mesh, data, args, env, m, act_shape):
    stage.eval()
    losses = {}
    for split in ("train", "val"):
        total = 0.0
        for k in range(args.eval_iters):
            xs, ys = micro_batches(data, split, k, stage, mesh, args, env, m, eval_split=True)
            loss_sum = run_pipeline(stage, mesh, env, xs, ys, m, act_shape, train=False)
            total += global_mean(loss_sum, mesh, m).item()
        losses[split] = total / args.eval_iters
    stage.train()
    return losses


def main():
    args = parse_args(add_flags(make_parser(__doc__)))
    run = Run(args, __file__)
    world, T, P, C = run.world_size, args.tp, args.pp, args.cp
    check(T >= 1 and P >= 1 and C >= 1, f"--tp, --pp and --cp must be positive, got {T}, {P} and {C}")
    check(world % (T * P * C) == 0, f"world size {world} is not divisible by tp {T} x pp {P}"
          + (f" x cp {C}" if C > 1 else "") + f" = {T * P * C}")
    D = world // (T * P * C)  # CP ranks split the same sequences: the batch is shared by D
    # micro-batches per replica per step; --micro_batch_size auto: the largest that fits every
    # stage, with about 2·pp micro-batches to fill a pipeline (none needed without one)
    m = run.batch(costs, dp_size=D, aim=2 * P if P > 1 else 1, ranks=[s * C * T for s in range(P)])
    if args.dry_run:  # the mesh and every stage's bytes; then rank 0's costs
        run.dry_run(costs, plan(args, world, T, P, m))
    env = run.setup(costs)  # costs(): checked against this rank's memory first
    mesh = Mesh(env.rank, world, T, P, C).make_groups()
    config = model_config(args, Data.vocab_size_of(args.data))
    data = Data(args.data, args.seed, config.block_size)
    check_layout(config, T, P, args.sequence_parallel, C, args.cp_impl)
    run.log(mesh.describe(world))
    torch.manual_seed(args.seed + 1000 * mesh.reduce_rank + mesh.pp_rank)  # the stage's TP group's
    rng = ShardedRNG(args.seed, env.rank, env.device)  # and this TP rank's own (attention dropout)
    cp = ContextParallel(mesh.cp_group, mesh.cp_ranks, env.rank, args.cp_impl) if C > 1 else None

    first_layer, n_layers = stage_layers(config.n_layer, P)[mesh.pp_rank]
    stage = Stage(config, mesh, first_layer, n_layers, rng, args.recompute, args.sequence_parallel, cp)
    stage = stage.init_weights(args.seed).to(env.device)
    ends = P > 1 and (stage.is_first or stage.is_last)  # the tied embedding's copies: wte, head
    tied = (stage.wte if stage.is_first else stage.lm_head).weight if ends else None
    replicas = (ZeRO1 if args.zero1 else DataParallel)(stage, mesh, args, env.device)  # same calls
    act_shape = (args.micro_batch_size, config.block_size // C // (T if stage.sp else 1), config.n_embd)
    cost = costs(args, config, world, env.dtype, env.rank)
    extra_rng = run.begin(config, replicas.optimizer, cost, describe=describe(args, stage, m),
                          layout={"strategy": "3d", "dp": D, "pp": P, "tp": T, "zero1": args.zero1,
                                  "sequence_parallel": args.sequence_parallel,
                                  **({"cp": C, "cp_impl": args.cp_impl} if C > 1 else {})},
                          pieces=replicas.checkpoint_pieces, held=replicas.held_bytes,
                          evaluate=lambda: evaluate(stage, mesh, data, args, env, m, act_shape),
                          extra_rng=lambda: {"tp": rng.state})
    if extra_rng is not None:  # resumed at the same layout: this rank's own dropout stream too
        rng.state = extra_rng["tp"]

    for step in run.steps():
        xs, ys = micro_batches(data, "train", step, stage, mesh, args, env, m)  # first, last stage
        with run.meter:
            loss_sum = run_pipeline(stage, mesh, env, xs, ys, m, act_shape)  # 1F1B; TP in the stage
        loss = global_mean(loss_sum, mesh, m)
        if tied is not None:  # the two copies of the wte shard stay equal: sum their gradients
            dist.all_reduce(tied.grad, group=mesh.embedding_group)
        if stage.sp:  # the replicated parameters saw only this rank's sequence shard
            reduce_replicated_grads(stage, mesh.tp_group)
        replicas.reduce_gradients()  # the mean over the replicas (ZeRO-1: this DP rank's shard)
        if args.grad_clip > 0:
            clip_grad_norm(replicas, args.grad_clip)
        run.check(loss, replicas.grad_tensors())  # non-finite? asked to stop?
        replicas.step()  # AdamW (ZeRO-1: on this DP rank's shard, then the parameters all-gathered)
        run.end_step(loss)  # ledger, metrics, checkpoint, stop
        replicas.zero_grad()
    run.finish()


# ----------------------------------------------------------------------------------------
# Accounting: what a rank holds and sends (the ledger's theory), checkpoint pieces, the plan
# ----------------------------------------------------------------------------------------

def costs(args, config, world_size, dtype, rank=0):
    """The module docstring's cost per rank, for `rank`, axis by axis. In every formula L is
    the layers of this rank's stage, s the tokens of a sequence on this CP rank (s/C), e the
    bytes of the compute dtype, m the micro-batches per step, Ψ_rank this rank's parameters
    and Ψ_r the TP-replicated ones among them."""
    T, P, C = args.tp, args.pp, args.cp
    D = world_size // (T * P * C)
    mesh = Mesh(rank, world_size, T, P, C)  # coordinates only, no groups
    first_layer, n_layers = stage_layers(config.n_layer, P)[mesh.pp_rank]
    split, n_local, vocab_local = stage_sizes(config, T, P, mesh.pp_rank)  # Ψ_rank = split + the rest
    x = dict(T=T, P=P, C=C, D=D, L=n_layers, m=args.global_batch_size // (args.micro_batch_size * D),
             b=args.micro_batch_size, s=config.block_size // C, h=config.n_embd, a=config.n_head,
             V=vocab_local * T, e=dtype.itemsize, Ψ_rank=n_local, Ψ_r=n_local - split, loss=1, norm=1)
    ends = (mesh.pp_rank == 0, mesh.pp_rank == P - 1)  # first, last stage
    held, sent = dp_costs(args, x)
    sent.update(tp_costs(args, x, *ends))
    sent.update(pp_costs(args, x, *ends))
    for op, f in cp_costs(args, x).items():  # the ring's K/V share send/recv with the pipeline
        sent[op] = plus(sent.get(op), f)
    layout = (f"dp {mesh.dp_rank}, pp {mesh.pp_rank}{f', cp {mesh.cp_rank}' if C > 1 else ''}, tp {mesh.tp_rank}: "
              f"layers {first_layer}-{first_layer + n_layers - 1}, Ψ_rank {split:,} split + {n_local - split:,} "
              "replicated")
    return {"layout": layout, "held": held, "sent": {k: v for k, v in sent.items() if v[1]},
            "activations": activation_costs(args, config, dtype, x, min(P - mesh.pp_rank, x["m"]), *ends)}


def cost(expr, x, **more):
    """One of 08's formulas at this rank's symbols; m and e printed by value."""
    return formula(expr, show="m e n", **x, **more)


def dp_costs(args, x):
    """The docstring's memory and DP lines (its group: the D·C ranks of DP x CP)."""
    pad = "D*C*ceil(Ψ_rank/(D*C))"  # Ψ_rank padded to a multiple of D·C
    if args.zero1:
        held = {"params": cost(f"4*{pad}", x), "grads": cost(f"4*({pad} + ceil(Ψ_rank/(D*C)))", x),
                "optim": cost("8*ceil(Ψ_rank/(D*C))", x)}
        sent = {"all_reduce[dp]": cost("4*loss", x), "reduce_scatter_tensor[dp]": cost(f"4*{pad}", x),
                "all_gather_into_tensor[dp]": cost(f"4*{pad}", x)}
    else:
        held = {"params": cost("4*Ψ_rank", x), "grads": cost("4*Ψ_rank", x), "optim": cost("8*Ψ_rank", x)}
        sent = {"all_reduce[dp]": cost("4*loss + 4*Ψ_rank", x)}
    if args.grad_clip > 0:  # the squared norm, over the model group (--zero1: the world)
        sent["all_reduce" if args.zero1 else "all_reduce[model]"] = cost("4*norm", x)
    return held, sent


def tp_costs(args, x, first, last):
    """The docstring's TP and SP lines: the embedding's on the first stage only, the head's
    and the loss statistics (3·4bs) on the last only; --recompute repeats g (2e per layer)."""
    again = " + m*L*2*e*b*s*h" if args.recompute else ""
    if not args.sequence_parallel:
        return {"all_reduce[tp]": cost("m*(L*(2*e + 2*4)*b*s*h" + " + 4*b*s*h" * first
                                       + " + 4*b*s*h + 3*4*b*s" * last + ")" + again, x)}
    return {"all_gather_into_tensor[tp]": cost("m*(L*(2*2*e + 2*e)" + " + 4" * first + " + 2*e" * last
                                               + ")*b*s*h" + again, x),
            "reduce_scatter_tensor[tp]": cost("m*(L*(2*e + 2*4)" + " + 4" * first + " + 4" * last
                                              + ")*b*s*h" + again, x),
            "all_reduce[tp]": cost("m*3*4*b*s + 4*Ψ_r" if last else "4*Ψ_r", x)}


def pp_costs(args, x, first, last):
    """The docstring's PP line, n the stage boundaries this rank sits on; the logged loss."""
    sent = {"all_reduce[pp]": cost("4*loss", x)}
    if x["P"] > 1:
        sent["send"] = sent["recv"] = cost("m*n*4*b*s*h" + "/T" * args.sequence_parallel, x, n=2 - first - last)
        if first or last:
            sent["all_reduce[embedding]"] = cost("4*V/T*h", x)
    return sent


def cp_costs(args, x):
    """The docstring's CP line, on this TP rank's heads (h/T)."""
    if x["C"] == 1:
        return {}
    if args.cp_impl == "ring":
        ring = cost(f"m*L*({6 if args.recompute else 4}*(C - 1)*e*b*s*h/T + 8*C*b*s*h/T)", x)
        return {"send": ring, "recv": ring}
    return {"all_to_all_single[cp]": cost(f"m*L*{12 if args.recompute else 8}*e*b*s*h/T", x)}


def activation_costs(args, config, dtype, x, in_flight, first, last):
    """The docstring's activations line: common.activation_terms with 06's vocabulary-parallel
    ends (the embedding's out-of-slice mask, b·s bool; the head's input, this rank's fp32
    softmax of V/T and the target mask) and, with CP, 09's attention; `in_flight` of them."""
    T, C, sp, device_type = x["T"], x["C"], args.sequence_parallel, activation_device_type(args)
    sp_T, attention = "/T" if sp else "", None
    if C > 1 and args.cp_impl == "ring":
        attention = cost("(3*e*b*s*h + e*b*s*h)/T + 4*b*(a/T)*s", x)
    elif C > 1:
        lse = sdpa_logsumexp("(a/(T*C))", "(C*s)", dtype, device_type)
        attention = cost(f"(3*e*b*s*h + e*b*s*h + e*b*s*h)/T + {lse}", x)
    terms = activation_terms(config, x["b"], x["s"], dtype, device_type, tp=T, sp=sp, attention=attention)
    terms["embedding"] = plus(terms["embedding"], cost("b*s", x))
    if config.dropout > 0 and config.bias and device_type not in ("cuda", "xpu"):
        # the row-parallel bias is added after g, promoting the output to fp32: CPU's
        # dropout masks (in their input's dtype) are then fp32
        terms["layer"] = plus(terms["layer"], cost(f"2*(4 - e)*b*s*h{sp_T}", x))
    terms["head"] = cost(f"(4*b*s*h + 8*b*s + e*b*s*h){sp_T} + 4*b*s*V/T + b*s", x)
    return activations_of_layers(terms, x["L"], args.recompute, first, last, in_flight)


_STAGE_SIZES = {}


def stage_sizes(config, T, P, pp_rank):
    """(parameters TP_PLAN splits, all parameters, vocabulary rows) of a TP rank of stage
    pp_rank, counted on a Stage built on the meta device; remembered, since the fit check and
    plan.py price many micro-batches of one layout."""
    key = (repr(config), T, P, pp_rank)
    if key not in _STAGE_SIZES:
        mesh = Mesh(pp_rank * T, P * T, T, P)  # stage pp_rank's TP rank 0: coordinates only
        with torch.device("meta"):
            stage = Stage(config, mesh, *stage_layers(config.n_layer, P)[pp_rank], None)
        split = sum(p.numel() for name, p in stage.named_parameters() if tp_split(name) != "replicated")
        _STAGE_SIZES[key] = split, sum(p.numel() for p in stage.parameters()), stage.vocab_local
    return _STAGE_SIZES[key]


def tp_pieces(stage, name, p, optimizer, write):
    """Where this rank's TP piece `p` of parameter `name` sits in 01's full parameter
    (Stage.tp_layout, from TP_PLAN), as pieces of common.py's format: vocabulary rows without
    the padding, [Q_t; K_t; V_t] rows as three pieces, c_fc rows, c_proj columns, replicated
    parameters whole. Written where they count once (counted_once: a replicated parameter by
    TP rank 0 of each stage, the tied embedding by the first stage; the last stage's copy is
    read, never written). With the optimizer: the AdamW moments too."""
    shape, boxes = stage.tp_layout(name, p)
    write = write and counted_once(stage, name)
    return [piece for box, rows in boxes
            for piece in param_pieces(stage.full_name(name), shape, p, optimizer, box=box,
                                      index=rows, write=write)]


def plan(args, world, T, P, m):
    """--dry_run: the mesh, the schedule and every stage's costs, without starting a process
    (the lines Run.dry_run prints above rank 0's costs)."""
    config = model_config(args, Data.vocab_size_of(args.data))
    check_layout(config, T, P, args.sequence_parallel, args.cp, args.cp_impl)
    dtype = planned_dtype(args)
    mesh = Mesh(0, world, T, P, args.cp)
    per_stage = [costs(args, config, world, dtype, mesh.rank_of(0, s, 0)) for s in range(P)]
    return ([mesh.describe(world, args.ranks_per_node),
             f"{m} micro-batch(es) of {args.micro_batch_size} per replica per step (1F1B)"
             + (", ZeRO-1 over each DP group" if args.zero1 else "")
             + (", sequence parallelism in each TP group" if args.sequence_parallel else "")
             + context_parallel(args, config)]
            + [f"  stage {s} ({c['layout'].split(': ')[1]}): holds "
               f"{format_bytes(sum(v for _, v in c['held'].values()))}, sends+receives "
               f"{format_bytes(sum(v for _, v in c['sent'].values()))} per step"
               for s, c in enumerate(per_stage)]
            + ["(below: rank 0)"])


def describe(args, stage, m):
    """The launch's log line about this stage (rank 0's)."""
    first, n, params = stage.first_layer, len(stage.h), sum(p.numel() for p in stage.parameters())
    return (f"this stage: layers {first}-{first + n - 1}, {params:,} parameters on rank 0; "
            f"{m} micro-batch(es) of {args.micro_batch_size} per replica per step"
            + (", ZeRO-1 over each DP group" if args.zero1 else "")
            + (", sequence parallelism in each TP group" if stage.sp else "")
            + context_parallel(args, stage.config))


def context_parallel(args, config):
    """What the log and the dry run say about --cp (nothing at cp 1)."""
    if args.cp == 1:
        return ""
    return (f", context parallelism ({args.cp_impl}) over {args.cp} ranks, {config.block_size // args.cp} of "
            f"{config.block_size} tokens per sequence each"
            + ("; no dropout on the attention probabilities (as in 09)" if config.dropout > 0 else ""))


if __name__ == "__main__":
    main()
