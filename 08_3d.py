"""08_3d.py: data x tensor x pipeline parallelism in one standalone script (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), with
sequence parallelism and context parallelism as a fourth dimension (--sequence_parallel, --cp).

The world of N = D·P·C·T ranks is a mesh, outermost first DP x PP x CP x TP. Tensor parallelism
(T) splits every layer and talks twice per layer forward and backward, so its groups are
consecutive ranks, on one node's fast links; context parallelism (C) splits every sequence and
meets the other ranks' keys in every attention; pipeline parallelism (P) splits the layers into
stages and sends only a micro-batch's activations across a boundary; data parallelism (D)
replicates the whole pipeline and averages the gradients once per step, outermost, across nodes.

    global rank = ((dp·P + pp)·C + cp)·T + tp          N = 8, D = P = T = 2, C = 1:

                     pipeline stage 0     stage 1           rank: (dp, pp, tp)
    replica dp = 0   [ 0 | 1 ]  ──acts──>  [ 2 | 3 ]        0:(0,0,0) 1:(0,0,1)
                       TP pair     <─grads─  TP pair        2:(0,1,0) 3:(0,1,1)
    replica dp = 1   [ 4 | 5 ]  ──acts──>  [ 6 | 7 ]        4:(1,0,0) ... 7:(1,1,1)
                     0-4, 1-5, 2-6, 3-7: data-parallel groups (gradient all-reduce)

How the axes compose (Mesh, Stage, DataParallel and ZeRO1, main's step):
  * inside a stage, 06_tensor_parallel.py's Megatron TP on the stage's TP group: column- and
    row-parallel linears with the f and g operators, vocab-parallel embedding and cross-entropy
    (which parameter is split along which dimension: TP_PLAN), with --sequence_parallel the
    residual stream between layers in sequence shards;
  * inside attention, with --cp C, 09_context_parallel.py's ring or Ulysses on the CP group: the
    ranks of a CP group hold the same stage's same TP shard, each s/C tokens of every sequence;
  * across stages, 07_pipeline.py's 1F1B and its Pipeline on the PP group, each rank exchanging
    with the rank of the next stage at the same (CP, TP) place;
  * across replicas, the gradients averaged over the D·C ranks of DP x CP (they hold the same
    weights): one all-reduce (DataParallel), or reduce-scatter, an update of this rank's share
    of the optimizer state and an all-gather (--zero1: ZeRO1, 04_zero.py's stage 1); the two
    have one interface, so the step is the same for both;
  * with --n_expert E --ep N, 10's experts as every MLP, E/N per rank, on EP groups of DP x CP ranks.
Three things only the composition has: the tied embedding (the first stage's wte shard and the last
stage's head shard are two copies, kept equal by all-reducing their gradients between the two
ranks); the clipping norm (every parameter counted once: a TP-replicated one on one TP rank, the
tied copy once, summed over the stages); the data (a replica reads its slice of the global batch, a
CP rank its tokens of it, and only the first stage the inputs and the last the targets).

This file does not import the others: 08's own code comes first, and the pieces of 06, 07, 09
and 10 it needs follow at the end, restated word for word, with the same names and the same code,
each fenced as restated from its source (tests/test_restated.py checks every fence).

Run:

    mpiexec -n 8 python 08_3d.py --tp 2 --pp 2 --model gpt2          # D = 2
    sbatch jobs/frontier_3d.sh                                         # 2 nodes x 8 GCDs
    mpiexec -n 8 python 08_3d.py --tp 2 --pp 2 --cp 2 --sequence_parallel --model tiny

One rank holds: 16 bytes x (its stage's TP-split parameters / T + its TP-replicated ones), the
optimizer state / (D·C) with --zero1; 1F1B's micro-batches in flight of its stage's activations;
with experts E/N of each layer's, whole (16 bytes each), replicated over TP.
One rank sends, per micro-batch: in every layer TP's four all-reduces of b·s·h (SP: four
reduce-scatters and six all-gathers), CP's K/V hops or all-to-alls, the experts' dispatch and
combine; across each stage boundary its b·s·h activation and the gradient back; per step its
gradients over DP x CP (the experts' over expert_dp). Derivations, pictures, formulas: docs/strategies.md, "08_3d.py".
"""

import math
import time
from contextlib import contextmanager

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.variable import Variable
from torch.nn import functional as F

from common import (autocast, check, combine, Data, device_rng_state, is_decayed, is_hidden_matrix, lr_at,
                    make_adamw, make_parser, model_config, MoE, Muon, muon_apply, muon_momentum, orthogonalize,
                    param_init, preset_config, recomputed, set_device_rng_state, shared_plus, to_device)


# ---------------------------------------------------------------------------------------
# The mesh
# ---------------------------------------------------------------------------------------

class Mesh:
    """Coordinates and process groups of the 4D mesh, outermost first DP x PP x CP x TP: the
    world's ranks laid out as one tensor, ranks[dp, pp, cp, tp] = ((dp·P + pp)·C + cp)·T + tp
    (picotron's torch.arange(world).view(dp, pp, cp, tp)). TP innermost (it talks most: every
    layer, on the critical path), then CP (K/V or all-to-alls every layer, overlappable), then
    PP (one activation per micro-batch per boundary), DP outermost (once per step)."""

    AXES = ("dp", "pp", "cp", "tp")  # outermost first: the dimensions of `ranks`

    def __init__(self, rank, world, tp_size, pp_size, cp_size=1):
        self.rank, self.tp_size, self.pp_size, self.cp_size = rank, tp_size, pp_size, cp_size
        self.dp_size = world // (tp_size * pp_size * cp_size)
        self.ranks = torch.arange(world).view(self.dp_size, pp_size, cp_size, tp_size)
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = self.coordinates(rank)
        # the gradient reduction runs over DP x CP: CP ranks hold the same weights and see
        # other tokens of the same sequences (09's "every rank's share of the global mean")
        self.reduce_size, self.reduce_rank = self.dp_size * cp_size, self.dp_rank * cp_size + self.cp_rank
        self.cp_ranks = self.ranks[self.dp_rank, self.pp_rank, :, self.tp_rank].tolist()  # this rank's CP group
        self.tp_group = self.pp_group = self.dp_group = self.mp_group = None  # make_groups()
        self.embedding_group = self.cp_group = None

    def rank_of(self, dp_rank, pp_rank, cp_rank=0, tp_rank=0):
        return int(self.ranks[dp_rank, pp_rank, cp_rank, tp_rank])

    def coordinates(self, rank):
        """(dp_rank, pp_rank, cp_rank, tp_rank) of a global rank."""
        return tuple(int(i) for i in (self.ranks == rank).nonzero()[0])

    def groups_over(self, *axes):
        """Every group whose ranks differ only along `axes` (("tp",): the TP groups), each a
        list of ranks in rank order: `axes` moved innermost, the rest flattened outside."""
        inner = [i for i, a in enumerate(self.AXES) if a in axes]
        outer = [i for i in range(len(self.AXES)) if i not in inner]
        size = math.prod(self.ranks.shape[i] for i in inner)
        return self.ranks.permute(*outer, *inner).reshape(-1, size).tolist()

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
                group = dist.new_group(ranks, group_desc=name)  # the name the ledger counts it under
                if self.rank in ranks:
                    setattr(self, attribute, group)
        for ranks in self.groups_over("pp"):  # the tied embedding: first and last stage
            group = dist.new_group(sorted({ranks[0], ranks[-1]}), group_desc="embedding")
            if self.rank in ranks:
                self.embedding_group = group
        return self


# ---------------------------------------------------------------------------------------
# A pipeline stage, tensor-parallel (06's layers, restated at the end of this file)
# ---------------------------------------------------------------------------------------

class Stage(nn.Module):
    """This rank's pipeline stage, tensor-parallel: layers [first_layer, first_layer + n),
    the vocab-parallel embedding on the first stage, the final norm and head on the last.
    With sequence parallelism (sp) the residual stream in and out is [b, s/T, h]: this TP
    rank's sequence shard. With context parallelism (cp, a ContextParallel) the stage sees
    only its CP rank's tokens, `positions` (s/C of every sequence; with SP, [b, s/(C·T), h])."""

    def __init__(self, config, mesh, first_layer, n_layers, rng, recompute=False, sp=False, cp=None):
        super().__init__()
        tp_size, h, group = mesh.tp_size, config.n_embd, mesh.tp_group
        self.config, self.mesh, self.first_layer, self.rng, self.sp = config, mesh, first_layer, rng, sp
        self.positions = torch.arange(config.block_size) if cp is None else \
            token_positions(config.block_size, cp.C, cp.cp_rank, cp.impl)  # in the order held
        self.is_first, self.is_last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp_size - 1
        self.vocab_local = shard_shape("wte.weight", (config.vocab_size, h), tp_size)[0]  # 06's, from TP_PLAN
        self.padded_vocab = self.vocab_local * tp_size
        self.vocab_start = mesh.tp_rank * self.vocab_local
        if self.is_first:
            self.wte = VocabParallelEmbedding(self.vocab_local, h, self.vocab_start, group, sp)
            self.wpe = nn.Embedding(config.block_size, h)
            self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([TPBlock(config, tp_size, sp, rng, group) for _ in range(n_layers)])  # 06's
        for block in self.h:
            block.recompute = recompute
            if cp is not None:  # 06's attention, its heads attending across the CP group (below)
                block.attn = ContextParallelAttention(config, tp_size, sp, rng, group, cp)
            block.mlp = MeshMoE(config, mesh, sp) if config.n_expert else block.mlp  # 10's experts (below)
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

    @torch.no_grad()
    def init_weights(self, seed):
        """01's initial values (common.param_init: by name and full shape), each rank taking
        its TP pieces of them (06's shard_boxes, from TP_PLAN); the vocabulary's padding rows
        zero."""
        for name, p in self.named_parameters():
            full, boxes = shard_boxes(name, p.shape, self.config.vocab_size, self.mesh.tp_size, self.mesh.tp_rank)
            value = param_init(self.full_name(name), full, self.config, seed)
            p.zero_()
            for box, index in boxes:
                p[index] = value[tuple(slice(lo, hi) for lo, hi in box)]
        return self

    def forward(self, x, targets=None):
        T, t, group = self.mesh.tp_size, self.mesh.tp_rank, self.mesh.tp_group
        if self.is_first:
            pos, n = self.positions, len(self.positions)  # the real positions of the tokens
            if self.sp:  # held (a CP rank's, else all); with SP this TP rank's n/T of them
                pos = pos[t * n // T:(t + 1) * n // T]
            x = self.wte(x) + self.wpe(pos.to(x.device))
            if self.sp:  # dropout on a sequence shard: this TP rank's own stream
                with self.rng.sharded():
                    x = self.drop(x)
            else:  # on the replicated stream: the one the TP group shares
                x = self.drop(x)
        for block in self.h:
            x = block(x)
        if self.is_last:
            x = self.ln_f(x)  # the tied head: this rank's vocabulary, of the tokens held
            if self.sp:  # a column-parallel Linear too: keeps the sequence shard only
                logits = AllGatherSequenceLinear.apply(x, self.lm_head.weight, None, group)
            else:
                logits = F.linear(CopyToTP.apply(x, group), self.lm_head.weight)
            logits, targets = logits.view(-1, logits.size(-1)), targets.view(-1)  # one TP rank: 01's loss, its bits
            return F.cross_entropy(logits, targets) if T == 1 else \
                VocabParallelCrossEntropy.apply(logits, targets, self.vocab_start, self.config.vocab_size, group)
        return x


def counted_once(stage, name):
    """Whether this rank's copy of parameter `name` is the one that counts, in the global
    gradient norm and in the checkpoint written: the tied head's copy on the first stage
    only, a TP-replicated parameter on TP rank 0 only (TP-split ones on every TP rank)."""
    tied_copy = name == "lm_head.weight" and not stage.is_first
    return not tied_copy and (tp_split(name) is not None or stage.mesh.tp_rank == 0)


# ---------------------------------------------------------------------------------------
# Data parallelism across replicas: plain all-reduce or ZeRO-1, behind one interface
# ---------------------------------------------------------------------------------------

class DataParallel:
    """Plain data parallelism over the DP group: every replica holds its stage's TP pieces
    whole, with their gradients and AdamW state, and averages the gradients with one
    all-reduce per step. ZeRO1 below has the same interface: `optimizer`,
    `reduce_gradients()`, `grad_tensors()` (for the guard and the norm), `squared_norm()`
    with its `norm_group`, `step()`, `zero_grad()` (the bytes held and the checkpoint pieces:
    held_bytes() and checkpoint_pieces(), beyond the lesson)."""

    def __init__(self, stage, mesh, args, env):
        self.stage, self.mesh, self.params = stage, mesh, dense_parameters(stage)  # the experts: ExpertReplicas'
        self.optimizer = make_adamw(self.params, args, env.device.type) if args.optimizer == "adamw" else \
            ShardedMuon(DenseStage(stage), args, env, mesh.tp_group, replicas=mesh.dp_group)  # Muon: 06's, each once
        self.norm_group = mesh.mp_group  # one replica's stages and TP ranks: every gradient once

    def reduce_gradients(self):
        """The mean gradient on every replica: one all-reduce of this rank's flat gradients."""
        if self.mesh.reduce_size == 1:  # one replica, no CP: its gradients are the mean, nothing to post
            return
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
            if counted_once(self.stage, name) and not is_expert(name):
                squares += p.grad.float().pow(2).sum()
        return squares

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


class ZeRO1:
    """ZeRO stage 1 over the DP group (as 04_zero.py's stage 1; with CP the D·C ranks of
    DP x CP, Megatron's distributed optimizer's group), DataParallel's interface: this
    rank's parameters as one flat buffer padded to a multiple of D; DP rank d owns
    shard d of it, with its AdamW state (P_os); gradients are reduce-scattered, parameters
    all-gathered after the update.

    --optimizer muon: the hidden matrices stay outside the flat buffer, whole on every DP rank,
    for 06's ShardedMuon on the TP group (docs/strategies.md's 08 section says why)."""

    def __init__(self, stage, mesh, args, env):
        self.stage, self.mesh, self.params, device = stage, mesh, dense_parameters(stage), env.device
        self.muon = args.optimizer == "muon"
        named = [(name, p) for name, p in stage.named_parameters() if not is_expert(name)]  # ExpertReplicas: those
        matrices = [(name, p) for name, p in named if self.muon and is_hidden_matrix(name, p.shape)]
        named = [(name, p) for name, p in named if not (self.muon and is_hidden_matrix(name, p.shape))]
        D = mesh.reduce_size  # the DP group: D x C ranks with CP, which hold the same weights
        numel = sum(p.numel() for _, p in named)
        self.shard = math.ceil(numel / D)
        self.flat = torch.zeros(self.shard * D, device=device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.lo, self.hi = lo, hi = mesh.reduce_rank * self.shard, (mesh.reduce_rank + 1) * self.shard
        self.grad_shard = torch.zeros(self.shard, device=device)
        self.segments = []  # (parameter, [a, b) of it flattened, the optimizer's tensor of them)
        self.counted = []  # [a, b) of the shard whose gradients count in the norm (counted_once)
        offset, pieces = 0, {True: [], False: []}
        for name, p in named:
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
        # Muon's matrices: their gradients in one buffer of their own, whole on every DP rank
        self.matrix_grad = torch.zeros(sum(p.numel() for _, p in matrices), device=device)
        offset = 0
        for name, p in matrices:
            p.grad = self.matrix_grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.matrices_counted = [p for name, p in matrices if counted_once(stage, name)]
        if self.muon:  # 06's, on this replica's TP group, with AdamW on the flat shard inside
            self.optimizer = ShardedMuon(DenseStage(stage), args, env, mesh.tp_group, rest=self.optimizer, replicas=mesh.dp_group)
        self.norm_group = None  # the whole world: DP shards x stages x TP pieces

    def reduce_gradients(self):
        if self.mesh.reduce_size == 1:  # one replica, no CP: the shard is the whole buffer, nothing to post
            return self.grad_shard.copy_(self.flat_grad)
        self.flat_grad.div_(self.mesh.reduce_size)
        # sum the replicas' gradients; DP rank d receives shard d
        dist.reduce_scatter_tensor(self.grad_shard, self.flat_grad, group=self.mesh.dp_group)
        if self.muon:  # Muon's matrices: the mean, whole, on every DP rank (as DataParallel's)
            self.matrix_grad.div_(self.mesh.reduce_size)
            dist.all_reduce(self.matrix_grad, group=self.mesh.dp_group)

    def grad_tensors(self):
        return [self.grad_shard] + ([self.matrix_grad] if self.muon else [])

    def squared_norm(self):
        """Σ g² over this DP rank's shard of the gradients that count, before the world's sum
        (Muon's matrices, the same on every DP rank, counted by DP rank 0's)."""
        weights = torch.zeros_like(self.grad_shard)
        for a, b in self.counted:
            weights[a:b] = 1.0
        squares = (self.grad_shard.pow(2) * weights).sum()
        for p in self.matrices_counted if self.mesh.reduce_rank == 0 else []:
            squares += p.grad.pow(2).sum()
        return squares

    def step(self):
        self.optimizer.step()  # AdamW on the shard (with Muon: ShardedMuon on the matrices first)
        if self.mesh.reduce_size == 1:  # one replica: its shard, updated in place, is the whole buffer
            return
        # every DP rank's updated shard -> the whole parameter buffer on every DP rank
        mine = self.flat[self.lo:self.hi].clone()
        dist.all_gather_into_tensor(self.flat, mine, group=self.mesh.dp_group)

    def zero_grad(self):
        self.flat_grad.zero_()
        self.grad_shard.zero_()
        self.matrix_grad.zero_()


def clip_grad_norm(replicas, max_norm):
    """Scale the gradients so that their global norm, every parameter counted once over the
    whole model, is at most max_norm."""
    squares = replicas.squared_norm()
    if dist.get_world_size(replicas.norm_group) > 1:  # a one-rank group posts nothing
        dist.all_reduce(squares, group=replicas.norm_group)  # over the ranks of distinct gradients
    total_norm = squares.sqrt() if squares.dim() == 0 else torch.linalg.vector_norm(squares)  # (--bitwise: norms)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in replicas.grad_tensors():
        g.mul_(coef)
    return total_norm


# ---------------------------------------------------------------------------------------
# One step's pieces: this replica's micro-batches, the loss
# ---------------------------------------------------------------------------------------

def replica_micro_batches(data, split, step, stage, mesh, args, env, m, eval_split=False):
    """This rank's part of the global batch in m micro-batches: its DP replica's rows and, with
    CP, its CP rank's tokens of them (stage.positions); loaded by the first stage (the tokens)
    and the last (the targets) only, None on the stages between."""
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
    if dist.get_world_size(mesh.pp_group) > 1:  # a one-rank group posts nothing (here and below)
        dist.all_reduce(loss_sum, group=mesh.pp_group)  # the last stage's loss (+ every stage's aux), to all
    loss_sum /= m * mesh.reduce_size
    if mesh.reduce_size > 1:
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
    g.add_argument("--ep", type=int, default=1, help="with --n_expert: expert-parallel ranks (out of DP x CP)")
    return parser


@torch.no_grad()
def evaluate(stage, pipeline, mesh, data, args, env, m):
    stage.eval()
    losses = {}
    for split in ("train", "val"):
        total = 0.0
        for k in range(args.eval_iters):
            xs, ys = replica_micro_batches(data, split, k, stage, mesh, args, env, m, eval_split=True)
            loss_sum, _, _ = pipeline.run(forward_rounds(mesh.pp_size, m, 1), xs, ys, m, train=False)
            total += global_mean(loss_sum, mesh, m).item()
        losses[split] = total / args.eval_iters
    stage.train()
    return losses


def main():
    run = Run(add_flags(make_parser(__doc__, experts=True)), __file__)
    args = run.args
    world, T, P, C = run.world_size, args.tp, args.pp, args.cp
    D = check_mesh(world, T, P, C)  # world / (T·P·C); CP ranks split the same sequences: the batch is shared by D
    # m micro-batches per replica; auto: the largest that fits every stage, about 2·pp of them to fill a
    # pipeline; the mesh's groups first, so that the fit check's room holds their communicators
    env, m = run.start(costs, dp_size=D, aim=2 * P if P > 1 else 1, ranks=[s * C * T for s in range(P)],
                       groups=lambda env: expert_groups(Mesh(env.rank, world, T, P, C).make_groups(), args))
    run.dry_run(costs, lambda config: plan(args, world, T, P, m))  # the mesh and every stage's bytes
    mesh = run.groups
    config = model_config(args, Data.vocab_size_of(args.data))
    data = Data(args.data, args.seed, config.block_size)
    check_layout(config, T, P, args.sequence_parallel, C, args.cp_impl, args.bitwise)
    run.log(describe_mesh(mesh, world))
    torch.manual_seed(args.seed + 1000 * mesh.reduce_rank + mesh.pp_rank)  # dropout: one stream per TP group
    rng = ShardedRNG(args.seed, env.rank, env.device)  # and this TP rank's own (attention, SP regions)
    cp = ContextParallel(mesh.cp_group, mesh.cp_ranks, env.rank, args.cp_impl) if C > 1 else None

    first_layer, n_layers = chunk_layers(config.n_layer, P)[mesh.pp_rank]  # 07's, one chunk per stage
    stage = Stage(config, mesh, first_layer, n_layers, rng, args.recompute, args.sequence_parallel, cp)
    stage = stage.init_weights(args.seed).to(env.device)
    ends = P > 1 and (stage.is_first or stage.is_last)  # the tied embedding's copies: wte, head
    tied = (stage.wte if stage.is_first else stage.lm_head).weight if ends else None
    replicas = with_experts((ZeRO1 if args.zero1 else DataParallel)(stage, mesh, args, env), stage, args, m)  # same
    replicas = BitwiseReplicas(replicas, stage, m) if args.bitwise else replicas  # --bitwise: 01's tree (below)
    act_shape = (args.micro_batch_size, config.block_size // C // (T if stage.sp else 1), config.n_embd)
    pipeline = Pipeline([stage], env, mesh.pp_group, 1, act_shape, timed=False,  # 07's, on this pipeline
                        tree=replicas if args.bitwise else None)  # (--bitwise: the tree its backwards fill)
    rounds = schedule_rounds("1f1b", P, mesh.pp_rank, m)  # ("F" | "B", micro-batch, chunk 0)
    extra_rng = run.begin(config, replicas.optimizer, costs, describe=describe(args, stage, m),
                          layout={"strategy": "3d", "dp": D, "pp": P, "tp": T, "zero1": args.zero1,
                                  "sequence_parallel": args.sequence_parallel, **({"ep": args.ep} if config.n_expert else {}),
                                  **({"cp": C, "cp_impl": args.cp_impl} if C > 1 else {})},
                          pieces=lambda: checkpoint_pieces(replicas), held=lambda: held_bytes(replicas),
                          evaluate=lambda: evaluate(stage, pipeline, mesh, data, args, env, m),
                          extra_rng=lambda: {"tp": rng.state})
    resume_sharded_rng(rng, extra_rng, run.log)  # the same layout: this rank's own dropout stream continues too

    for step in run.steps():
        lr = lr_at(step, args)  # linear warm-up, then cosine decay (nanoGPT's get_lr)
        for group in replicas.optimizer.param_groups:
            group["lr"] = lr
        xs, ys = replica_micro_batches(data, "train", step, stage, mesh, args, env, m)  # first, last stage
        with run.meter:
            loss_sum, _, _ = pipeline.run(rounds, xs, ys, m)  # 1F1B; TP (and CP) in the stage
        loss = global_mean(loss_sum + balancing_loss(stage), mesh, m)  # with experts, each stage's blocks' aux
        if tied is not None and not args.bitwise:  # the two copies of the wte shard stay equal: sum their gradients
            dist.all_reduce(tied.grad, group=mesh.embedding_group)
        if stage.sp:  # the replicated parameters saw only this rank's sequence shard
            all_reduce_sequence_parallel_grads(stage, mesh.tp_group)
        replicas.reduce_gradients()  # the mean over the replicas (ZeRO-1: this DP rank's shard)
        norm = clip_grad_norm(replicas, args.grad_clip) if args.grad_clip > 0 else None  # the global norm
        run.check(loss, replicas.grad_tensors(), norm)  # non-finite? asked to stop?
        replicas.step()  # AdamW (ZeRO-1: on this DP rank's shard, then the parameters all-gathered)
        run.end_step(loss, **routing(stage))  # ledger, metrics, checkpoint, stop (with experts: on the routing)
        replicas.zero_grad()
    run.finish()


# ---- Beyond the lesson ----
# costs() and its pieces (the ledger's theory, the dry run, the fit check and plan.py), the
# bytes held and the checkpoint pieces, the mesh and the stage as the log and the dry run print
# them; then the pieces of 06, 07, 09 and 10 restated word for word, and the experts in the mesh.

def costs(args, config, world_size, dtype, rank=0, received=None, sent=None):
    """The cost per rank of docs/strategies.md's 08 section, for `rank`, axis by axis. In every
    formula L is the layers of this rank's stage, s the tokens of a sequence on this CP rank
    (s/C), e the bytes of the compute dtype, m the micro-batches per step, Ψ_rank this rank's
    parameters and Ψ_r the TP-replicated ones among them, Ψ_x its experts' (E/N of each layer's).
    `received`, `sent`: with experts, the rows this rank's experts received and the rows it sent in
    this step, per layer per micro-batch (routing()); without them, balanced routing: k·b·s·C each,
    and with --capacity_factor the most the capacity lets in (10's bound, on the C·s tokens routed)."""
    from common import param_shapes
    from infra.formulas import newton_schulz_flops, plus
    T, P, C, N = args.tp, args.pp, args.cp, getattr(args, "ep", 1)
    check_experts(args, config.n_expert, world_size)  # first: the formulas divide by ep
    # the layout first too: the fit check (Run.start) prices a layout before main() checks it
    check_layout(config, T, P, args.sequence_parallel, C, args.cp_impl, getattr(args, "bitwise", False))
    D = world_size // (T * P * C)
    mesh = Mesh(rank, world_size, T, P, C)  # coordinates only, no groups
    first_layer, n_layers = stage_layers(config.n_layer, P)[mesh.pp_rank]
    split, n_local, vocab_local, matrices, casts = stage_sizes(config, T, P, mesh.pp_rank, args.sequence_parallel)
    E, experts = config.n_expert, expert_sizes(config)  # every expert of the stage is in stage_sizes' count:
    n_local += n_layers * (E // max(N, 1) - E) * experts  # this rank keeps E/N of each layer's
    S = config.shared_experts if E else 0  # --shared_experts: replicated, in stage_sizes' count already
    casts += n_layers * ((E // max(N, 1) + S) * (experts - expert_vectors(config)) + E * config.n_embd)  # and router's
    owners = muon_owners(matrices, T) if args.optimizer == "muon" else []  # Muon: the stage's, whole
    x = dict(T=T, P=P, C=C, D=D, L=n_layers, m=args.global_batch_size // (args.micro_batch_size * D),
             b=args.micro_batch_size, s=config.block_size // C, h=config.n_embd, a=config.n_head,
             V=vocab_local * T, e=dtype.itemsize, Ψ_rank=n_local, Ψ_r=n_local - split, loss=1,
             norm=len(param_shapes(config)) if getattr(args, "bitwise", False) else 1,  # --bitwise: 01's norms
             Ψ_m=sum(map(math.prod, matrices)),
             Ψ_o=sum(math.prod(shape) for shape, owner in zip(matrices, owners) if owner == mesh.tp_rank),
             E=E, N=N, Ψ_x=n_layers * E // max(N, 1) * experts,
             Ψ_xm=n_layers * E // max(N, 1) * (experts - expert_vectors(config)) * (args.optimizer == "muon"))
    if E and received is None and config.capacity_factor:  # the capacity's bound: at most R rows a layer
        capacity = math.ceil(config.capacity_factor * config.top_k * config.block_size / E)  # per sequence
        received = [[min(x["b"] * E * capacity, N * config.top_k * x["b"] * config.block_size)] * x["m"]] * n_layers
    ends = (mesh.pp_rank == 0, mesh.pp_rank == P - 1)  # first, last stage
    mine = [shape for shape, owner in zip(matrices, owners) if owner == mesh.tp_rank]  # this TP rank's, whole
    h, G = config.n_embd, D * C // N  # G: the ranks holding the same experts (expert_dp)
    whole = [(4 * h, h), (h, 4 * h)] * (n_layers * E // N) if x["Ψ_xm"] else []  # Muon's: its experts' matrices
    rows_sent, (held, sent) = sent, dp_costs(args, x)
    sent.update(tp_costs(args, x, *ends))
    sent.update(pp_costs(args, x, *ends))
    for op, f in cp_costs(args, x).items():  # the ring's K/V share send/recv with the pipeline
        sent[op] = plus(sent.get(op), f)
    for op, f in (expert_costs(args, config, x, received, rows_sent) if E else {}).items():
        sent[op] = plus(sent.get(op), f)  # (the routing counts' all-reduce over the world: beside ZeRO1's norm)
    layout = (f"dp {mesh.dp_rank}, pp {mesh.pp_rank}{f', cp {mesh.cp_rank}' if C > 1 else ''}, tp {mesh.tp_rank}: "
              f"layers {first_layer}-{first_layer + n_layers - 1}, Ψ_rank {split:,} split + {n_local - split:,} "
              "replicated" + (f" (of them {x['Ψ_x']:,} in {E // N} of {E} experts per layer)" if E else ""))
    rank_cost = {"layout": layout, "held": held, "sent": {k: v for k, v in sent.items() if v[1]},
                 "calls": call_costs(args, x, sent, *ends, broadcasts=(len(mine), len(whole))),
                 # Muon: Newton-Schulz on the stage's matrices this TP rank owns, whole, each in one of
                 # the D·C replicas (--zero1 too: docs/strategies.md's 08 section), and on its experts' it owns
                 # among the G ranks holding them (10's); infra.formulas.newton_schulz_flops
                 "muon_flops": newton_schulz_flops([shape for shape, own in zip(mine, muon_owners(mine, D * C))
                                                    if own == mesh.reduce_rank] +
                                                   [shape for shape, own in zip(whole, muon_owners(whole, G))
                                                    if own == mesh.reduce_rank // N]),
                 "activations": activation_costs(args, config, dtype, x, min(P - mesh.pp_rank, x["m"]), *ends,
                                                 received=received)}
    # every live tensor at its most, by phase (infra.formulas.phase_peaks on this rank's shards and s
    # tokens), with 07's boundaries (its boundary_terms: a stage with a next one holds its
    # output until the send completes and the gradient received with it, fp32 b·s·h each,
    # b·(s/T)·h with SP, act_shape in main; free_output frees the outputs in flight);
    # AdamW's largest tensor: the vocabulary slice at the ends, else c_fc's 4h²/T. Start-up:
    # the shards, each parameter drawn whole by param_init
    from infra.formulas import activation_device_type, formula, phase_peaks, transient_terms
    t = transient_terms(config, x["b"], x["s"], dtype, activation_device_type(args), args.optimizer, tp=T,
                        last=ends[1], kept=False, casts=casts,  # one copy a step: autocast's cache
                        update=max([4 * h * h // T] + [vocab_local * h] * any(ends)),
                        matrix=max(((math.prod(m), min(m)) for m in matrices), default=(0, 0)))
    # (DataParallel's all-reduce takes a flat copy of the gradients, freed before the update)
    flat = None if args.zero1 else {"update": formula("max(4*Ψ_rank, update)", show="update",
                                                      Ψ_rank=n_local - x["Ψ_x"], update=t["update"])}
    sp = "/T" * args.sequence_parallel  # with SP a boundary tensor is the TP rank's s/T positions
    out, dy = (formula("4*b*s*h" + sp, b=x["b"], s=x["s"], h=h, T=T) for _ in "xy")
    sends = P > 1 and not ends[1]
    forward = {"boundary": formula("out + dy", out=out, dy=dy)} if sends else {}
    backward = {"boundary": formula("dy", dy=dy)} if sends else {}
    if E:  # 10's: a layer's routed rows, packed for the dispatch all-to-all (with CP, the CP group's)
        forward["dispatch"] = formula("e*k*b*s*C*h", show="e", e=x["e"], k=config.top_k, b=x["b"], s=x["s"], C=C,
                                      h=h)
    if args.sequence_parallel:  # SP's own (06's AllGatherSequenceLinear and ReduceScatterSequence, restated):
        # forward peaks in a row-parallel Linear's reduce-scatter: its partial sum and the sum's
        # rank-major copy, e·bsh each (the whole sequence), and the shard returned, e·bsh/T;
        # backward in a column-parallel Linear's (c_fc's; the head's on the last stage): the MLP-wide
        # gradient (the logits' fp32 one at the head, whichever is larger), the gathered input and
        # its gradient (e·bsh each), that gradient in fp32 and its rank-major copy for the
        # reduce-scatter (4bsh each) and the shard returned (4bsh/T)
        sizes = {**{k: x[k] for k in ("b", "s", "V", "T", "e")}, "h": h}
        forward["scatter"] = formula("2*e*b*s*h + e*b*s*h/T", show="e", **sizes)
        backward["gradients"] = formula(("max(4*b*s*V/T, 4*e*b*s*h/T)" if ends[1] else "4*e*b*s*h/T")
                                        + " + 2*e*b*s*h + 2*4*b*s*h + 4*b*s*h/T", show="e", **sizes)
    if C > 1 and args.cp_impl == "ring" and fused_kernel(activation_device_type(args), dtype, h // config.n_head) == "explicit":
        # 09's explicit ring block (its fp32 scores, a chunk of c queries at a time) on this TP rank's heads
        c = min(x["s"], query_chunk(x["b"], config.n_head // T, x["s"]))
        for phase, expr in zip((forward, backward), explicit_block_terms("(a/T)", "(h/T)", c < x["s"], x["e"])):
            phase["scores"] = cost(expr, x, c=c)
    rank_cost["peak"] = phase_peaks(rank_cost, t, forward=forward, backward=backward, optimizer=flat)
    rank_cost["startup"] = formula("params + init", show="init", params=held["params"], init=t["init"])
    return rank_cost


def cost(expr, x, **more):
    """One of 08's formulas at this rank's symbols; m and e printed by value. Only the symbols
    the expression names are handed on: formula() remembers its answers by the symbols it is
    given, and a rank's dozen others would only make every answer new (plan.py asks thousands)."""
    from infra.formulas import formula
    if expr not in _NAMES:
        import re
        _NAMES[expr] = set(re.findall(r"[^\W\d]\w*", expr))
    return formula(expr, show="m e n p", **{k: v for k, v in x.items() if k in _NAMES[expr]}, **more)


_NAMES = {}  # the names in each of cost()'s expressions


def dp_costs(args, x):
    """The memory and DP lines of docs/strategies.md's 08 section (its group: the D·C ranks of
    DP x CP). With Muon the Ψ_m/T matrix elements keep one moment, and with --zero1 they stay
    outside the flat buffer: whole on every DP rank (weights, gradients, momentum),
    all-reduced (ZeRO1, and the section's "Muon with ZeRO-1")."""
    muon = args.optimizer == "muon"
    if getattr(args, "bitwise", False):  # (tp 1, cp 1) the replicas' tree instead of the sum (BitwiseReplicas)
        return bitwise_costs(args, x)
    if args.zero1:
        flat = "Ψ_rank" + " - Ψ_m/T" * muon + " - Ψ_x" * bool(x["Ψ_x"])  # AdamW's flat buffer
        flat = f"({flat})" if muon or x["Ψ_x"] else flat
        pad, own = f"D*C*ceil({flat}/(D*C))", " + 4*Ψ_m/T" if muon else ""  # padded to D·C; Muon's matrices
        whole = " + 4*Ψ_x" if x["Ψ_x"] else ""  # the experts whole, their moments too (ExpertReplicas)
        moments = " + 4*Ψ_xm + 8*(Ψ_x - Ψ_xm)" if x["Ψ_xm"] else whole.replace("4", "8")  # Muon's: one
        held = {"params": cost(f"4*{pad}{own}{whole}", x),
                "grads": cost(f"4*({pad} + ceil({flat}/(D*C))){own}{whole}", x),
                "optim": cost(f"8*ceil({flat}/(D*C)){own}{moments}", x)}
        sent = {"all_reduce[dp]": cost(f"4*loss{own}", x), "reduce_scatter_tensor[dp]": cost(f"4*{pad}", x),
                "all_gather_into_tensor[dp]": cost(f"4*{pad}", x)} if x["D"] * x["C"] > 1 else {}  # none alone
    else:
        held = {"params": cost("4*Ψ_rank", x), "grads": cost("4*Ψ_rank", x),
                "optim": cost("4*(Ψ_m/T + Ψ_xm) + 8*(Ψ_rank - Ψ_m/T - Ψ_xm)" if x["Ψ_xm"] else
                              "4*Ψ_m/T + 8*(Ψ_rank - Ψ_m/T)" if muon else "8*Ψ_rank", x)}
        dense = "4*loss + 4*(Ψ_rank - Ψ_x)" if x["Ψ_x"] else "4*loss + 4*Ψ_rank"  # the experts: over expert_dp
        sent = {"all_reduce[dp]": cost(dense if x["D"] * x["C"] > 1 else "0", x)}  # none alone
    if muon and x["T"] > 1:  # 06's Muon on each TP group: this rank's update shards to their owners, its own back
        sent["all_to_all_single[tp]"] = cost("e*(Ψ_m/T + Ψ_o)", x)
    if muon and x["D"] * x["C"] > 1:  # its own matrices, each orthogonalised by one replica, broadcast to the others
        sent["broadcast[dp]"] = cost("e*Ψ_o", x)
    if args.grad_clip > 0 and x["T"] * x["P"] * (x["D"] * x["C"] if args.zero1 else 1) > 1:
        sent["all_reduce" if args.zero1 else "all_reduce[model]"] = cost("4*norm", x)  # the squared norm's sum
    return held, sent


def bitwise_costs(args, x):
    """dp_costs under --bitwise (tp 1, cp 1; BitwiseReplicas): the state held as without it; over DP
    the gradients and the loss, padded to D, to their owners and back (common.tree_all_reduce: a
    ring all-reduce's bytes), instead of the all-reduce (ZeRO1: the reduce-scatter, and Muon's
    matrices' all-reduce); the logged loss's all-reduce as ever; the norm's sum one float per
    parameter of 01 (norm = their count)."""
    from infra.formulas import plus
    plain = dict(vars(args), bitwise=False)
    held, sent = dp_costs(type(args)(**plain), x)
    if x["D"] > 1:
        tree = cost("4*(Ψ_rank + loss + pad)", x, pad=-(x["Ψ_rank"] + 1) % x["D"])
        sent["all_reduce[dp]"] = cost("4*loss", x)
        sent.pop("reduce_scatter_tensor[dp]", None)
        sent["all_to_all_single[dp]"] = tree
        sent["all_gather_into_tensor[dp]"] = plus(sent.get("all_gather_into_tensor[dp]"), tree)  # (ZeRO1: and its own)
    return held, sent


def tp_costs(args, x, first, last):
    """The TP and SP lines (docs/strategies.md's 08 section): the embedding's on the first stage only, the head's
    and the loss statistics (3·4bs) on the last only; --recompute repeats g (2e per layer)."""
    again = " + m*L*2*e*b*s*h" if args.recompute else ""
    if x["T"] == 1 and not args.sequence_parallel:  # a one-rank TP group posts nothing
        return {}
    if x["E"]:
        return expert_tp_costs(args, x, first, last)
    if not args.sequence_parallel:
        return {"all_reduce[tp]": cost("m*(L*(2*e + 2*4)*b*s*h" + " + 4*b*s*h" * first
                                       + " + 4*b*s*h + 3*4*b*s" * last + ")" + again, x)}
    return {"all_gather_into_tensor[tp]": cost("m*(L*(2*2*e + 2*e)" + " + 4" * first + " + 2*e" * last
                                               + ")*b*s*h" + again, x),
            "reduce_scatter_tensor[tp]": cost("m*(L*(2*e + 2*4)" + " + 4" * first + " + 4" * last
                                              + ")*b*s*h" + again, x),
            "all_reduce[tp]": cost("m*3*4*b*s + 4*Ψ_r" if last else "4*Ψ_r", x)}


def expert_sizes(config):
    """One expert's parameters (an MLP of common.py: c_fc and c_proj, 8h² and the biases)."""
    h = config.n_embd
    return 8 * h * h + expert_vectors(config)


def expert_vectors(config):
    """One expert's biases: c_fc's 4h and c_proj's h (none without --bias)."""
    return 5 * config.n_embd if config.bias else 0


def expert_costs(args, config, x, received, rows_sent=None):
    """The experts' lines (docs/strategies.md's 08 section; 10's formulas on this stage's L
    layers, on the b·s tokens of a micro-batch every TP rank routes, b·s·C with CP, whose
    tokens are gathered): the dispatch and combine all-to-alls of the k·b·s routed rows (S, the
    rows sent, where --capacity_factor drops some) and of the R rows received back, forward and
    again in backward (and in --recompute's forward), + the E counts; the experts' gradients
    summed over expert_dp (D·C/N ranks), and with Muon each expert matrix broadcast by its owner
    among them (10's ReplicatedMuon); the experts' squared norm over the EP group; with CP the
    all-gather of the CP group's tokens (fp32) and the reduce-scatter of their gradients, per
    layer and micro-batch; once per step every layer's entries per expert and dropped, int64,
    summed over the world (routing(): --balance bias and the metrics)."""
    from infra.formulas import formula
    L, m, k, b, s, C = x["L"], x["m"], config.top_k, x["b"], x["s"], x["C"]
    R = sum(map(sum, received)) if received is not None else L * m * k * b * s * C
    p = 3 if args.recompute else 2  # forward, backward (and the forward again)
    tokens = "b*s*C" if C > 1 else "b*s"
    S = f"L*m*k*{tokens}" if rows_sent is None else "S"  # the routed rows, or those this step sent
    sent = {"all_to_all_single[ep]": formula(f"p*e*h*({S} + R) + (p - 1)*8*E*L*m", show="e m p R S",
                                             **{**x, "p": p, "k": k, "R": R, "S": sum(map(sum, rows_sent or []))}),
            "all_reduce": formula("8*n_layer*(E + 1)" if x["T"] * x["P"] * x["D"] * x["C"] > 1 else "0",
                                  show="n_layer", n_layer=config.n_layer, E=x["E"])}
    if C > 1:
        sent["all_gather_into_tensor[cp]"] = cost(("2*" if args.recompute else "") + "m*L*4*b*s*C*h", x)
        sent["reduce_scatter_tensor[cp]"] = cost("m*L*4*b*s*C*h", x)
    if x["D"] * x["C"] > x["N"]:
        sent["all_reduce[expert_dp]"] = cost("4*Ψ_x", x)
        if x["Ψ_xm"]:
            sent["broadcast[expert_dp]"] = cost("e*Ψ_xm", x)
    if args.grad_clip > 0 and x["N"] > 1 and not args.zero1:  # (ZeRO1's norm: over the world already)
        sent["all_reduce[ep]"] = cost("4*norm", x)
    return sent


def expert_tp_costs(args, x, first, last):
    """tp_costs with experts, which are replicated over TP: per layer only the attention's f and g
    (06's), and with SP the routed sequence's all-gather (4bsh, fp32: the LayerNorm's output)
    and its gradient's reduce-scatter instead of the MLP's column- and row-parallel Linears'."""
    if not args.sequence_parallel:
        return {"all_reduce[tp]": cost("m*(L*(e + 4)*b*s*h" + " + 4*b*s*h" * first
                                       + " + 4*b*s*h + 3*4*b*s" * last + ")"
                                       + (" + m*L*e*b*s*h" if args.recompute else ""), x)}
    return {"all_gather_into_tensor[tp]": cost("m*(L*(3*e + 4)" + " + 4" * first + " + 2*e" * last + ")*b*s*h"
                                               + (" + m*L*(e + 4)*b*s*h" if args.recompute else ""), x),
            "reduce_scatter_tensor[tp]": cost("m*(L*(e + 2*4)" + " + 4" * first + " + 4" * last + ")*b*s*h"
                                              + (" + m*L*e*b*s*h" if args.recompute else ""), x),
            "all_reduce[tp]": cost("m*3*4*b*s + 4*Ψ_r" if last else "4*Ψ_r", x)}


def pp_costs(args, x, first, last):
    """The PP line (docs/strategies.md's 08 section), n the stage boundaries this rank sits on; the logged loss."""
    sent = {"all_reduce[pp]": cost("4*loss", x)} if x["P"] > 1 else {}  # none in a one-stage pipeline
    if x["P"] > 1:
        sent["send"] = sent["recv"] = cost("m*n*4*b*s*h" + "/T" * args.sequence_parallel, x, n=2 - first - last)
        if first or last:  # (--bitwise: every micro-batch's, added pairwise before the tree)
            sent["all_reduce[embedding]"] = cost("4*m*V/T*h" if getattr(args, "bitwise", False) else "4*V/T*h", x)
    return sent


def cp_costs(args, x):
    """The CP line (docs/strategies.md's 08 section), on this TP rank's heads (h/T)."""
    if x["C"] == 1:
        return {}
    if args.cp_impl == "ring":
        ring = cost(f"m*L*({6 if args.recompute else 4}*(C - 1)*e*b*s*h/T + 8*C*b*s*h/T)", x)
        return {"send": ring, "recv": ring}
    return {"all_to_all_single[cp]": cost(f"m*L*{12 if args.recompute else 8}*e*b*s*h/T", x)}


def call_costs(args, x, sent, first, last, broadcasts=(0, 0)):
    """The calls a step posts on each key of `sent`, each paying the network's latency once:
    per micro-batch and layer 06's f and g twice each (SP: the all-gathers again in backward; g
    again with --recompute; with experts the attention's only, and with SP the routed sequence's
    gather and its gradient's scatter), the ends' and the loss's statistics; the pipeline's sends
    and receives per boundary, the CP ring's K and V per hop (dK, dV's C hops in backward) or
    Ulysses' four all-to-alls per pass; once per step the DP buffer's, the norm's, the loss's (with
    Muon and ZeRO1 its matrices' too). Muon: its two all-to-alls over TP, one broadcast per matrix
    it owns (`broadcasts`: the dense ones over DP, the experts' over expert_dp). Experts, per
    layer and micro-batch: the rows out and back in each pass, the counts in each forward (and
    with CP the tokens' all-gather in each forward, their gradients' reduce-scatter); once per
    step the expert_dp all-reduce, the EP group's norm, the routing counts' over the world."""
    from infra.formulas import plus
    p, E = 3 if args.recompute else 2, bool(x["E"])
    muon, bitwise = args.optimizer == "muon", getattr(args, "bitwise", False)  # bitwise: BitwiseReplicas' tree
    calls = {"all_reduce[dp]": cost("2" if (not args.zero1 or muon) and not bitwise else "1", x),
             "reduce_scatter_tensor[dp]": cost("1", x), "all_to_all_single[dp]": cost("1", x),
             "all_gather_into_tensor[dp]": cost("2" if args.zero1 and bitwise else "1", x),
             "all_reduce": cost("n", x, n=(args.zero1 and args.grad_clip > 0) + E),  # ZeRO1's norm, the counts
             "all_reduce[model]": cost("1", x), "all_reduce[pp]": cost("1", x), "all_reduce[embedding]": cost("1", x),
             "send": cost("m*n", x, n=2 - first - last) if x["P"] > 1 else None,
             "all_to_all_single[cp]": cost("m*L*p*4", x, p=p), "all_to_all_single[tp]": cost("2", x),
             "broadcast[dp]": cost("n", x, n=broadcasts[0]), "broadcast[expert_dp]": cost("n", x, n=broadcasts[1]),
             "all_to_all_single[ep]": cost("L*m*(2*p + p - 1)", x, p=p),
             "all_gather_into_tensor[cp]": cost("m*L*(p - 1)", x, p=p), "reduce_scatter_tensor[cp]": cost("m*L", x),
             "all_reduce[expert_dp]": cost("1", x), "all_reduce[ep]": cost("1", x)}
    # per layer: f and g (and the gathers, scatters) of the attention and the MLP, or with experts the
    # attention's and the routed sequence's; --recompute's forward again
    (f_g, again), (gathers, again_g), (scatters, again_s) = ((2, 1), (4, 2), (3, 1)) if E else ((4, 2), (6, 2), (4, 2))
    if not args.sequence_parallel:
        calls["all_reduce[tp]"] = cost(f"m*({f_g}*L{' + 1' * first}{' + 4' * last})"
                                       + f" + m*{again}*L" * args.recompute, x)
    else:
        calls.update({"all_gather_into_tensor[tp]": cost(f"m*({gathers}*L{' + 1' * first}{' + 2' * last})"
                                                         + f" + m*{again_g}*L" * args.recompute, x),
                      "reduce_scatter_tensor[tp]": cost(f"m*({scatters}*L{' + 1' * first}{' + 1' * last})"
                                                        + f" + m*{again_s}*L" * args.recompute, x),
                      "all_reduce[tp]": cost("m*3 + 1" if last else "1", x)})
    if x["C"] > 1 and args.cp_impl == "ring":
        calls["send"] = plus(calls["send"], cost("m*L*(p*2*(C - 1) + 2*C)", x, p=p))
    calls["recv"] = calls["send"]
    return {op: calls[op] for op in sent if sent[op][1]}


def activation_costs(args, config, dtype, x, in_flight, first, last, received=None):
    """The activations line (docs/strategies.md's 08 section): infra.formulas.activation_terms with 06's vocabulary-parallel
    ends (the embedding's out-of-slice mask, b·s bool; the head's input, this rank's fp32
    softmax of V/T and the target mask) and, with CP, 09's attention; `in_flight` of them.
    With experts and this step's `received` rows (per layer per micro-batch): expert_activations."""
    from infra.formulas import (activation_device_type, activation_terms, activations_of_layers, formula, plus,
                                sdpa_logsumexp)
    T, C, sp, device_type = x["T"], x["C"], args.sequence_parallel, activation_device_type(args)
    sp_T, attention = "/T" if sp else "", None
    if C > 1 and args.cp_impl == "ring":
        attention = cost("(3*e*b*s*h + e*b*s*h)/T + 4*b*(a/T)*s", x)
    elif C > 1:
        lse = sdpa_logsumexp("(a/(T*C))", "(C*s)", dtype, device_type)
        attention = cost(f"(3*e*b*s*h + e*b*s*h + e*b*s*h)/T + {lse}", x)

    def layer_terms(rows=None):  # `rows`: those a layer's experts received (None: k·b·s)
        terms = activation_terms(config, x["b"], x["s"], dtype, device_type, tp=T, sp=sp, attention=attention,
                                 expert_rows=rows)
        terms["embedding"] = plus(terms["embedding"], cost("b*s", x))
        if config.dropout > 0 and config.bias and device_type not in ("cuda", "xpu") and T > 1:
            # the row-parallel bias is added after g (one TP rank: inside F.linear), promoting the output to fp32: CPU's
            # dropout masks (in their input's dtype) are then fp32 (the attention's only, with experts)
            terms["layer"] = plus(terms["layer"], cost(f"{1 if x['E'] else 2}*(4 - e)*b*s*h{sp_T}", x))
        if x["E"] and (sp or C > 1):  # the router keeps the gathered sequence, not a column-parallel Linear's
            # shard (SP); with CP, every token of the sequences: the MoE's terms of the other (C - 1)·b·s
            terms["layer"] = plus(terms["layer"], cost(f"e*b*s*C*h - e*b*s*h{sp_T}", x), cost(
                "(C - 1)*(e*k*b*s*h + 4*b*s*(E + 2*k + 1))", x, k=config.top_k) if C > 1 else None)
        if x["E"] and C > 1 and config.shared_experts:  # the shared experts run on those too (activation_terms'
            # S·(8e + c)·bsh, c: autocast's cast of their input; d: their output dropout's mask)
            gpu, e = device_type in ("cuda", "xpu"), x["e"]
            terms["layer"] = plus(terms["layer"], formula(
                "(C - 1)*S*(8*e + c + d)*b*s*h", show="e c d", **x, S=config.shared_experts, c=0 if e == 4 else e,
                d=(1 if gpu else e) if config.dropout > 0 else 0))
        if T > 1:  # (one TP rank takes 01's F.cross_entropy, and activation_terms' head is its)
            terms["head"] = cost(f"(4*b*s*h + 8*b*s + e*b*s*h){sp_T} + 4*b*s*V/T + b*s", x)
        return terms
    if not x["E"] or received is None:
        return activations_of_layers(layer_terms(), x["L"], args.recompute, first, last, in_flight)
    return expert_activations(args, layer_terms, received, in_flight, first, last)


def expert_activations(args, layer_terms, received, k, first, last):
    """The activations with this step's routing: layer l of micro-batch i holds its term on the
    R_li rows its experts received. 1F1B keeps k consecutive micro-batches in flight (after
    F(j): j-k+1 ... j), so the peak is the heaviest such window; with --recompute the others
    keep their block inputs, and the oldest's backward holds the inputs below layer l and l's
    internals (the heaviest l, i)."""
    from infra.formulas import formula
    ends, L, m = layer_terms(), len(received), len(received[0])
    layers = {(l, i): layer_terms(rows)["layer"] for l, per_micro in enumerate(received)
              for i, rows in enumerate(per_micro)}
    named = {"embedding": ends["embedding"], "head": ends["head"], "input": ends["block_input"]}
    emb, head = "embedding + " * first, " + head" * last
    if args.recompute:
        options = [formula(f"(k - 1)*({emb}L*input{head}) + {emb}max(L*input{head}, l*input + layer)",
                           show="k L l", k=k, L=L, l=l, layer=layer, **named) for (l, i), layer in layers.items()]
    else:
        options = []
        for j in range(k - 1, m):
            window = range(j - k + 1, j + 1)
            terms = {f"layer_{l}_{i}": layers[(l, i)] for i in window for l in range(L)}
            expr = " + ".join(f"{emb}{' + '.join(f'layer_{l}_{i}' for l in range(L))}{head}" for i in window)
            options.append(formula(expr, **terms, **named))
    return max(options, key=lambda a: a[1])


_STAGE_SIZES = {}


def stage_sizes(config, T, P, pp_rank, sp=False):
    """(parameters TP_PLAN splits, all parameters, vocabulary rows, the full shapes of its
    hidden matrices, the elements autocast copies for one forward) of a TP rank of stage
    pp_rank, counted on a Stage built on the meta device; remembered, since the fit check and
    plan.py price many micro-batches of one layout. With experts, all E of every block (and its
    router's E rows), the Stage built with one (DeepSeek-V3's 61 x 256 would take half a minute).
    A stage's counts depend only on its layer count and on whether it is the first or the last
    (the embedding, the head): the middle stages of every pp share one Stage's count."""
    from dataclasses import replace
    n_layers = stage_layers(config.n_layer, P)[pp_rank][1]
    key = (repr(config), T, n_layers, pp_rank == 0, pp_rank == P - 1, sp)
    if key not in _STAGE_SIZES:
        mesh = Mesh(pp_rank * T, P * T, T, P)  # stage pp_rank's TP rank 0: coordinates only
        first_layer, n_layers = stage_layers(config.n_layer, P)[pp_rank]
        with torch.device("meta"):
            stage = Stage(replace(config, n_expert=min(config.n_expert, 1)), mesh, first_layer, n_layers, None)
        others = n_layers * max(config.n_expert - 1, 0) * (expert_sizes(config) + config.n_embd)
        split = sum(p.numel() for name, p in stage.named_parameters() if tp_split(name) is not None)
        matrices = [shard_boxes(name, p.shape, 0, T, 0)[0] for name, p in stage.named_parameters()
                    if is_hidden_matrix(name, p.shape) and not is_expert(name)]  # ShardedMuon's, whole
        # the weights autocast's cache holds, cast once per step (07's Pipeline.run) and saved for
        # backward: the split matmul weights (the replicated ones are LayerNorms' and wpe); wte as the
        # head only (the first stage's lookup reads it in fp32); with SP not the column-parallel ones
        # nor the head: AllGatherSequenceLinear casts them itself and saves the fp32 weight
        casts = sum(p.numel() for name, p in stage.named_parameters() if tp_split(name) is not None
                    and p.dim() == 2 and (stage.is_last or not name.endswith("wte.weight"))
                    and not (sp and tp_split(name)[0] in ("column", "vocab")))
        _STAGE_SIZES[key] = split, sum(p.numel() for p in stage.parameters()) + others, stage.vocab_local, matrices, \
            casts
    return _STAGE_SIZES[key]


def check_mesh(world, T, P, C):
    """The data-parallel size D = world / (T·P·C), once the mesh's sizes are seen to fit the world."""
    check(T >= 1 and P >= 1 and C >= 1, f"--tp, --pp and --cp must be positive, got {T}, {P} and {C}")
    check(world % (T * P * C) == 0, f"world size {world} is not divisible by tp {T} x pp {P}"
          + (f" x cp {C}" if C > 1 else "") + f" = {T * P * C}")
    return world // (T * P * C)


def check_layout(config, T, P, sp=False, C=1, impl="ring", bitwise=False):
    # --bitwise: at tp 1 and cp 1 a stage computes a micro-batch as 01 does (the loss is F.cross_entropy,
    # a row-parallel bias is added inside F.linear); TP and CP split its sums (docs/numerics.md)
    check(not bitwise or (T == 1 and C == 1 and not sp), "--bitwise holds in 08_3d.py at --tp 1 --cp 1 (dp x pp, "
          "--zero1) only: tensor and context parallelism split one micro-batch's sums (the gradient oracle, "
          "--check_gradients, bounds them instead)")
    check(not bitwise or not config.n_expert, "--bitwise is not implemented in 08_3d.py with --n_expert: "
          "10_expert_parallel.py has it at --ep 1")
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


def describe_mesh(mesh, world, ranks_per_node=None):
    """The mesh as the log and the dry run print it: every rank's coordinates (the first
    replicas), and whether each TP and CP group stays inside a node."""
    D, P, C, T = mesh.dp_size, mesh.pp_size, mesh.cp_size, mesh.tp_size
    if C == 1:
        lines = [f"mesh: {world} ranks = {D} data-parallel x {P} pipeline x {T} tensor-parallel "
                 f"(rank = dp·{P * T} + pp·{T} + tp)"]
    else:
        lines = [f"mesh: {world} ranks = {D} data-parallel x {P} pipeline x {C} context-parallel x "
                 f"{T} tensor-parallel (rank = dp·{P * C * T} + pp·{C * T} + cp·{T} + tp)"]
    shown, ranks = range(D) if D <= 4 else [0, 1, D - 1], mesh.ranks.tolist()  # (a list reads faster than rank_of)
    for d in shown:
        if d == D - 1 and D > 4:
            lines.append(f"  ... ({D - 3} more replicas)")
        row = [f"{ranks[d][s][c][t]:>3}:(dp {d}, pp {s}" + (f", cp {c}" if C > 1 else "") + f", tp {t})"
               for s in range(P) for c in range(C) for t in range(T)]
        lines.append("  " + "  ".join(row))
    if ranks_per_node:
        for name, axis, size in (("TP", "tp", T), ("CP", "cp", C)):
            if name == "CP" and C == 1:
                continue
            spans = max(len({r // ranks_per_node for r in ranks}) for ranks in mesh.groups_over(axis))
            where = "inside one node" if spans == 1 else \
                f"spans {spans} nodes (slow: keep {axis}{' x tp' if axis == 'cp' else ''} <= ranks per node)"
            lines.append(f"  {ranks_per_node} ranks per node: every {name} group {where}")
    return "\n".join(lines)


def held_bytes(replicas):
    """The model-state bytes this rank holds, counted from the live tensors: DataParallel's
    parameters, gradients and optimizer state; ZeRO1's flat buffers (through the parameters'
    views of them), the reduced shard and AdamW's state (with Muon: the matrices, their
    gradients and momentum too)."""
    from infra.ledger import state_bytes
    held = state_bytes(replicas.params, replicas.optimizer)
    dense = getattr(replicas, "dense", replicas)  # ExpertReplicas: around DataParallel or ZeRO1
    if isinstance(dense, ZeRO1):
        held["grads"] += dense.grad_shard.untyped_storage().nbytes()
    return held


def checkpoint_pieces(replicas):
    """This rank's pieces of common.py's checkpoint format. DataParallel: DP replica 0 (CP rank
    0) writes the parameters (TP pieces of its stage) and their moments. ZeRO1: DP replica 0
    writes the parameters and Muon's momentum; every DP rank writes the AdamW moments it owns:
    each optimizer tensor holds elements [a, b) of one parameter flattened; where that meets a
    TP piece of the parameter (elements [s, e) of it, a box of 01's tensor), it is the elements
    [x - s, y - s) of the box."""
    from infra.checkpoint_format import param_pieces
    if isinstance(replicas, BitwiseReplicas):  # --bitwise: around DataParallel or ZeRO1
        return checkpoint_pieces(replicas.dense)
    stage, write = replicas.stage, replicas.mesh.reduce_rank == 0
    named = [(name, p) for name, p in stage.named_parameters() if not is_expert(name)]
    if isinstance(replicas, ExpertReplicas):  # the experts written by the first EP group (DP x CP ranks 0..ep-1)
        experts = [(name, p) for name, p in stage.named_parameters() if is_expert(name)]
        return checkpoint_pieces(replicas.dense) + [
            piece for name, p in experts for piece in tp_pieces(stage, name, p, replicas.optimizer,
                                                                write=replicas.mesh.reduce_rank < replicas.mesh.ep_size)] + [
            piece for name, b in stage.named_buffers() for piece in tp_pieces(stage, name, b, None, write=write)]  # biases
    if isinstance(replicas, DataParallel):
        return [piece for name, p in named for piece in tp_pieces(stage, name, p, replicas.optimizer, write=write)]
    muon = {name for name, p in named if replicas.muon and is_hidden_matrix(name, p.shape)}
    pieces = [piece for name, p in named
              for piece in tp_pieces(stage, name, p, replicas.optimizer if name in muon else None, write=write)]
    whole = {p: tp_pieces(stage, name, p, None, write=True) for name, p in named if name not in muon}
    for p, a, b, segment in replicas.segments:
        for piece in whole[p]:
            # where the piece starts in p: a dim-0 slice of p, or all of it
            s = piece.tensor.storage_offset() - p.data.storage_offset()
            x, y = max(a, s), min(b, s + piece.tensor.numel())
            if x < y:
                name, mine = piece.name.removeprefix("model/"), slice(x - a, y - a)  # of segment
                pieces += param_pieces(name, piece.shape, segment, replicas.optimizer, box=piece.box,
                                       flat=(x - s, y - s), index=mine, write=piece.write, model=False)
    return pieces


def tp_pieces(stage, name, p, optimizer, write):
    """Where this rank's TP piece `p` of parameter `name` sits in 01's full parameter
    (06's shard_boxes, from TP_PLAN), as pieces of common.py's format: vocabulary rows without
    the padding, [Q_t; K_t; V_t] rows as three pieces, c_fc rows, c_proj columns, replicated
    parameters whole. Written where they count once (counted_once: a replicated parameter by
    TP rank 0 of each stage, the tied embedding by the first stage; the last stage's copy is
    read, never written). With the optimizer: the AdamW moments too."""
    from infra.checkpoint_format import param_pieces
    shape, boxes = shard_boxes(name, p.shape, stage.config.vocab_size, stage.mesh.tp_size, stage.mesh.tp_rank)
    write = write and counted_once(stage, name)
    return [piece for box, index in boxes
            for piece in param_pieces(stage.full_name(name), shape, p, optimizer, box=box,
                                      index=index, write=write)]


def stage_layers(n_layer, pp):
    """(first layer, layer count) of each stage: 07's chunk_layers at one chunk per stage."""
    return chunk_layers(n_layer, pp)


def one_f_one_b(p, stage, m):
    """1F1B's order on `stage`, as (kind, micro-batch): 07's schedule at one chunk per stage."""
    return [(kind, i) for kind, i, _ in schedule("1f1b", p, stage, m)]


def plan(args, world, T, P, m):
    """--dry_run: the mesh, the schedule and every stage's costs, without starting a process
    (the lines Run.dry_run prints above rank 0's costs)."""
    from infra.formulas import format_bytes
    from infra.dry_run import planned_dtype
    config = model_config(args, Data.vocab_size_of(args.data))
    check_layout(config, T, P, args.sequence_parallel, args.cp, args.cp_impl, getattr(args, "bitwise", False))
    dtype = planned_dtype(args)
    mesh = Mesh(0, world, T, P, args.cp)
    per_stage = [costs(args, config, world, dtype, mesh.rank_of(0, s, 0)) for s in range(P)]
    return ([describe_mesh(mesh, world, args.ranks_per_node),
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


# ---------------------------------------------------------------------------------------
# --bitwise at tp 1 and cp 1: 07's StageTree on every stage, then 03's tree over the replicas
# ---------------------------------------------------------------------------------------

class BitwiseReplicas:
    """--bitwise (tp 1, cp 1: dp x pp, --zero1 or not): DataParallel's interface around `dense`
    (DataParallel or ZeRO1), and the tree 07's Pipeline fills (take, finish), so that every
    gradient is summed in the one binary tree over the global batch's micro-batches that 01
    --bitwise sums in (common.TreeSum; docs/numerics.md). On a stage, as 07's StageTree: after
    micro-batch i's backward its gradients are copied out of .grad (zeroed for the next, so that
    ZeRO1's views of its flat buffer stay) into leaf i of this replica's TreeSum(m), the last
    stage adding its loss; where the tied embedding's two copies sit on two stages, their m
    per-micro-batch gradients are added pairwise over the embedding group first, as 01's one
    backward adds the head's and the lookup's. Then, as 03's bitwise_reduce, the replicas' sums
    (each replica's m micro-batches are one subtree: m a power of two) by common.tree_all_reduce
    over DP, divided once by the global batch's D·m into .grad (ZeRO1 then takes its shard). The
    clipping norm is 01's: each parameter's norm, whole, then the norm of those."""

    def __init__(self, dense, stage, m):
        from common import TreeSum
        self.dense, self.stage, self.mesh, self.m = dense, stage, stage.mesh, m
        self.params, self.optimizer, self.norm_group = dense.params, dense.optimizer, dense.norm_group
        ends = self.mesh.pp_size > 1 and (stage.is_first or stage.is_last)  # the tied copies, on two stages
        self.tied = (stage.wte if stage.is_first else stage.lm_head).weight if ends else None
        self.others = [p for p in stage.parameters() if p is not self.tied]  # a leaf's tensors, in this order
        self.tree, self.tied_leaves = TreeSum(m), {}

    def take(self, i, c, part, out):
        """Micro-batch i's gradients (its B: 1F1B, one chunk per stage), copied out of .grad, which
        is zeroed for the next micro-batch; `out`: on the last stage the micro-batch's loss."""
        leaf = [p.grad.clone() for p in self.others] + [out.detach().float().reshape(1)] * self.stage.is_last
        if self.tied is not None:
            self.tied_leaves[i] = self.tied.grad.clone()
        for p in self.stage.parameters():
            p.grad.zero_()
        self.tree.add(i, leaf)

    def finish(self):
        """The global tree's sums, divided by D·m, into .grad; returns the losses' sum on DP rank 0
        of the last stage and 0 elsewhere, which global_mean's sums over PP and DP keep (x + 0 = x)."""
        from common import TreeSum, tree_all_reduce
        total, self.tree = self.tree.total, TreeSum(self.m)
        grads, loss = total[:len(self.others)], total[len(self.others):] or [torch.zeros(1, device=total[0].device)]
        if self.tied is not None:
            leaves = torch.stack([self.tied_leaves.pop(i) for i in range(self.m)])
            dist.all_reduce(leaves, group=self.mesh.embedding_group)  # lookup + head of each micro-batch, both ends
            tree = TreeSum(self.m)
            for i in range(self.m):
                tree.add(i, [leaves[i]])
            grads.append(tree.total[0])
        D = self.mesh.reduce_size
        flat = torch.cat([g.reshape(-1) for g in grads] + loss)
        flat = F.pad(flat, (0, -flat.numel() % D))  # a multiple of D elements
        if D > 1:  # a one-rank group posts nothing
            tree_all_reduce(flat, self.mesh.dp_group)  # the replicas' sums, in one tree of DP rank order
        offset = 0
        for p in self.others + [self.tied] * (self.tied is not None):
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p)).div_(self.m * D)
            offset += p.numel()
        return flat[offset].clone() if self.mesh.reduce_rank == 0 else torch.zeros((), device=flat.device)

    def reduce_gradients(self):
        """Done by finish(), in the tree; ZeRO1 takes its shard of the reduced buffer."""
        if isinstance(self.dense, ZeRO1):
            self.dense.grad_shard.copy_(self.dense.flat_grad[self.dense.lo:self.dense.hi])

    def grad_tensors(self):
        return self.dense.grad_tensors()

    def squared_norm(self):
        """Not Σ g² but each parameter's norm, whole, at its place in 01's order (0 where another
        rank counts it: counted_once, and with ZeRO1, whose norm group is the world, DP rank 0),
        which clip_grad_norm sums over norm_group (x + 0 = x) and takes the norm of, as 01's
        clip_grad_norm_ does."""
        from common import param_shapes
        names = list(param_shapes(self.stage.config))
        norms = torch.zeros(len(names), device=self.params[0].device)
        if self.norm_group is None and self.mesh.reduce_rank > 0:
            return norms
        for name, p in self.stage.named_parameters():
            if counted_once(self.stage, name):
                norms[names.index(self.stage.full_name(name))] = torch.linalg.vector_norm(p.grad)
        return norms

    def step(self):
        self.dense.step()

    def zero_grad(self):
        self.dense.zero_grad()


# =======================================================================================
# Restated, word for word, from 06_tensor_parallel.py, 07_pipeline.py, 09_context_parallel.py and 10:
# the same names and the same code (tests/test_restated.py checks every block against its source)
# =======================================================================================


# ---- restated from 06_tensor_parallel.py: muon_owners, ShardedMuon (word for word; tests/test_restated.py checks it) ----
def muon_owners(shapes, group_size):
    """The rank that orthogonalises each hidden matrix (given their full shapes): largest
    first to the least-loaded rank (LPT), so the group's Newton-Schulz work is spread as
    evenly as whole matrices allow. The same on every rank: no communication."""
    owners, load = [None] * len(shapes), [0] * group_size
    for i in sorted(range(len(shapes)), key=lambda i: -math.prod(shapes[i])):
        owners[i] = min(range(group_size), key=lambda t: load[t])
        load[owners[i]] += math.prod(shapes[i])
    return owners


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
# ---- end restated ----


# ---- restated from 06_tensor_parallel.py: TP_PLAN, tp_split, shard_shape, shard_boxes (word for word; tests/test_restated.py checks it) ----
# the tensor-parallel plan, and where a shard lies

# parameter-name suffix -> (how, dim, parts): the group splits dimension `dim` T ways; with
# parts = 3 that dimension is three blocks stacked (c_attn's rows [Q; K; V]), each split, so
# that rank t holds its heads of Q, K and V. The vocabulary is padded to a multiple of T.
# Every parameter not named is replicated: LayerNorms, the position embedding, the
# row-parallel biases (added once, after g).
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
# ---- end restated ----


# ---- restated from 06_tensor_parallel.py: CopyToTP, ReduceFromTP, all_gather_sequence, reduce_scatter_sequence, AllGatherSequenceLinear, ReduceScatterSequence (word for word; tests/test_restated.py checks it) ----
# Megatron's f and g, and their sequence-parallel forms

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
# ---- end restated ----


# ---- restated from 06_tensor_parallel.py: ShardedRNG, resume_sharded_rng (word for word; tests/test_restated.py checks it) ----
# dropout streams

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
# ---- end restated ----


# ---- restated from 06_tensor_parallel.py: ColumnParallelLinear, RowParallelLinear, parallel_linear, VocabParallelEmbedding, VocabParallelCrossEntropy (word for word; tests/test_restated.py checks it) ----
# the parallel layers

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
# ---- end restated ----


# ---- restated from 06_tensor_parallel.py: TPAttention, TPMLP, TPBlock (word for word; tests/test_restated.py checks it) ----
# the tensor-parallel block

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
# ---- end restated ----


# ---- restated from 06_tensor_parallel.py: all_reduce_sequence_parallel_grads (word for word; tests/test_restated.py checks it) ----
# the replicated parameters' gradients with sequence parallelism

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
# ---- end restated ----


# ---------------------------------------------------------------------------------------
# 08's own additions to 06's pieces (not restated): the last stage's copy of the tied head
# in the plan, and attention across the CP group
# ---------------------------------------------------------------------------------------

# a last stage that is not the first holds a copy of the tied head's shard: the same rows
TP_PLAN["lm_head.weight"] = TP_PLAN["wte.weight"]


class ContextParallelAttention(TPAttention):
    """06's TPAttention whose queries meet the keys of every rank of the CP group: 09's
    attention (a ContextParallel: the ring or Ulysses) on this TP rank's heads, the CP rank's
    tokens only, without dropout as in 09."""

    def __init__(self, config, tp_size, sp, rng, group, cp):
        super().__init__(config, tp_size, sp, rng, group)
        self.cp = cp

    def attend(self, q, k, v):
        return self.cp.attention(q, k, v)


# ---- restated from 07_pipeline.py: schedule_rounds, schedule, forward_rounds, forward_tag, backward_tag, chunk_stage, stage_rank, exchanges (word for word; tests/test_restated.py checks it) ----

def schedule_rounds(kind, p, rank, m, v=1):
    """The rounds of rank `rank` of `p` for `m` micro-batches (v chunks per rank for the
    interleaved schedule): one action per round, except in the interleaved steady state (a
    forward and a backward) and in ZB-H1, where a W rides in the round of the I before it
    (it runs while that round's messages travel)."""
    if kind == "gpipe":  # every forward, then every backward
        return [(("F", i, 0),) for i in range(m)] + [(("B", i, 0),) for i in range(m)]
    if kind == "1f1b":
        warmup = min(p - rank - 1, m)  # forwards before the first backward reaches this stage
        forwards = [("F", i, 0) for i in range(m)]
        backwards = [("B", i, 0) for i in range(m)]
        order = forwards[:warmup]
        for i in range(m - warmup):  # steady state: one forward, one backward
            order += [forwards[warmup + i], backwards[i]]
        return [(action,) for action in order + backwards[m - warmup:]]  # cool-down
    if kind == "interleaved":  # Megatron's: forwards visit chunks in groups of p micro-batches
        total = m * v

        def forward_action(k):
            return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

        def backward_action(k):
            return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        return ([(forward_action(k),) for k in range(warmup)]
                + [(forward_action(warmup + k), backward_action(k)) for k in range(total - warmup)]  # steady state
                + [(backward_action(k),) for k in range(total - warmup, total)])  # cool-down
    # zero bubble, ZB-H1 (Qi et al. 2023, Fig. 3; as sail-sg/zero-bubble-pipeline-parallelism's
    # ZeroBubbleH1Pipeline orders it): 1F1B's warm-up and F/I steady state, but stage `rank`
    # defers the W of its first `rank` backwards; from then on each I is followed by the W of
    # the oldest micro-batch whose W is pending, and the deferred Ws fill the tail, where
    # 1F1B's later stages sit idle
    assert kind == "zb", kind
    warmup = min(p - rank - 1, m)
    rounds, w = [(("F", i, 0),) for i in range(warmup)], 0
    for k in range(m):
        if warmup + k < m:  # steady state: one forward, then one backward
            rounds.append((("F", warmup + k, 0),))
        if k >= rank or warmup + k >= m:  # cool-down backwards always take their W
            rounds.append((("I", k, 0), ("W", w, 0)))
            w += 1
        else:
            rounds.append((("I", k, 0),))
    return rounds + [(("W", j, 0),) for j in range(w, m)]


def schedule(kind, p, rank, m, v=1):
    """The actions of schedule_rounds(), one after the other."""
    return [action for actions in schedule_rounds(kind, p, rank, m, v) for action in actions]


def forward_rounds(p, m, v):
    """Evaluation's rounds: forwards only, micro-batches in groups of p through chunk 0,
    then chunk 1, ... (the interleaved order without its backwards); v = 1: 0..m-1."""
    return [(("F", i, c),) for group in range(0, m, p) for c in range(v)
            for i in range(group, min(group + p, m))]


def forward_tag(i, g, n):
    """The tag of the activation that chunk g (of n in the pipeline) sends forward for
    micro-batch i: one number per (micro-batch, chunk), i·n + g."""
    return i * n + g


def backward_tag(i, g, n, m):
    """The tag of the input gradient that chunk g sends back for micro-batch i: after all m·n
    forward tags, n·m + i·n + g."""
    return n * m + forward_tag(i, g, n)


def chunk_stage(p, rank, c, vee=False):
    """The pipeline position (global chunk) of rank `rank`'s c-th chunk: c·p + rank
    (interleaved: rank r holds r, r+p, ...), or in a V (ZB-V, DualPipeV: two chunks per
    rank) r on the way down and 2p-1-r on the way back, so rank 0 holds the first and the
    last chunk and rank p-1 the two in the middle, passed from one to the other in memory."""
    return (2 * p - 1 - rank if c else rank) if vee else c * p + rank


def stage_rank(p, g, vee=False):
    """The rank that holds global chunk g (the inverse of chunk_stage)."""
    return (g if g < p else 2 * p - 1 - g) if vee else g % p


def exchanges(rounds, p, rank, v, m, vee=False):
    """What the rank posts, one batch_isend_irecv per entry: before the first round, the
    receives it needs; after each round, the sends of what it computed (outputs to the next
    stage, input gradients to the previous) together with the receives of the next round.
    Megatron's p2p calls: send_forward_recv_forward after a forward (..._recv_backward when a
    backward follows), send_backward_recv_backward after a backward (..._recv_forward), and
    send_forward_backward_recv_forward_backward after an interleaved steady-state round.
    An entry: [("send" | "recv", peer stage, tag)], tags from forward_tag and backward_tag.
    vee: the chunks sit in a V (chunk_stage), and a peer may be the rank itself (the V's turn).

    Why one batch per round, sends and receives together: under NCCL a send completes only
    once its receive is posted, and a rank's batches complete one after another. Posted this
    way, no cycle of ranks waiting on each other's later batches forms (tests/test_schedules.py
    replays every rank's posting order under NCCL's rules; in a V, exchanges_for_nccl reorders
    the receives). Posted one batch per action instead, the interleaved schedule deadlocked
    on NCCL whenever m > p, though gloo, which buffers sends, ran it."""
    n = p * v

    def receives(actions):
        for kind, i, c in actions:
            g = chunk_stage(p, rank, c, vee)
            if kind == "F" and g > 0:  # chunk g-1's output, the input of chunk g
                yield "recv", stage_rank(p, g - 1, vee), forward_tag(i, g - 1, n)
            if kind in "BI" and g < n - 1:  # the gradient of chunk g's output, from chunk g+1
                yield "recv", stage_rank(p, g + 1, vee), backward_tag(i, g + 1, n, m)

    def sends(actions):
        for kind, i, c in actions:
            g = chunk_stage(p, rank, c, vee)
            if kind == "F" and g < n - 1:
                yield "send", stage_rank(p, g + 1, vee), forward_tag(i, g, n)
            if kind in "BI" and g > 0:
                yield "send", stage_rank(p, g - 1, vee), backward_tag(i, g, n, m)

    following = rounds[1:] + [()]
    return [list(receives(rounds[0]))] + [list(sends(actions)) + list(receives(nxt))
                                          for actions, nxt in zip(rounds, following)]

# ---- end restated ----


# ---- restated from 07_pipeline.py: chunk_layers (word for word; tests/test_restated.py checks it) ----

def chunk_layers(n_layer, n_chunks):
    """(first layer, layer count) of each of the n_chunks chunks, in pipeline order: n_layer
    is cut as evenly as it goes, the last n_layer % n_chunks chunks taking one layer more
    (under 1F1B the first stages hold the most micro-batches of activations, so they get
    the fewer layers)."""
    base, extra = divmod(n_layer, n_chunks)
    sizes = [base + (c >= n_chunks - extra) for c in range(n_chunks)]
    return [(sum(sizes[:c]), sizes[c]) for c in range(n_chunks)]

# ---- end restated ----


# ---- restated from 07_pipeline.py: free_output, backward_from_freed, Pipeline (word for word; tests/test_restated.py checks it) ----

def free_output(out):
    """Free a stage output's storage once it has been sent (Megatron-LM's
    deallocate_output_tensor): backward needs only the graph `out` is the root of, never its
    values, so a micro-batch in flight keeps its activations, not its b·s·h output. `out` is
    no view (the chunk's last residual add): freeing a view would free nothing."""
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def backward_from_freed(out, grad):
    """out.backward(grad) for an output free_output emptied (Megatron's custom_backward):
    backward() would check grad's shape against out's, now [1], so autograd's engine runs it."""
    Variable._execution_engine.run_backward(tensors=(out,), grad_tensors=(grad,), keep_graph=False,
                                            create_graph=False, inputs=(), allow_unreachable=True,
                                            accumulate_grad=True)


class Pipeline:
    """This rank's chunks and the stages of its pipeline `group`: the rank's stage is its
    rank in the group, and its messages name their peers by stage (group_peer), so that a
    pipeline inside a bigger mesh (08_3d.py) talks to its own stages only. `deferred`: zero
    bubble's list where I leaves its W (split_backward). `timed`: mark every F, B, I and W
    on the device's own timeline, to measure the bubble (08_3d.py measures none). `vee`: the
    chunks sit in a V (chunk_stage), so the rank passes some messages to itself, in memory."""

    def __init__(self, chunks, env, group, v, act_shape, deferred=None, timed=True, vee=False, tree=None):
        self.chunks, self.env, self.group, self.v, self.act_shape = chunks, env, group, v, act_shape
        self.p, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.deferred, self.timed, self.vee, self.tree = deferred, timed, vee, tree  # tree: --bitwise (StageTree)
        self.to_self = {}  # messages to this rank itself: one stage, or the V's turn

    def post(self, exchange, sends):
        """Post one exchange: its sends (of tensors in `sends`) and its receives, together in one
        batch_isend_irecv (NCCL: one request for the batch); returns (requests, {tag: tensor
        arriving}). A message to this rank itself passes in memory (pass_in_memory)."""
        ops, arriving = [], {}
        for op, peer, tag in exchange:
            if peer == self.rank:  # one stage, or the V's turn: no message at all
                if op == "send":
                    self.to_self[tag] = self.pass_in_memory(*sends[tag])
                else:
                    arriving[tag] = self.to_self.pop(tag)
            elif op == "send":  # an activation forward or a gradient back, b·s·h
                ops.append(dist.P2POp(dist.isend, sends[tag][0], group=self.group, group_peer=peer, tag=tag))
            else:
                arriving[tag] = torch.empty(self.act_shape, device=self.env.device)
                ops.append(dist.P2POp(dist.irecv, arriving[tag], group=self.group, group_peer=peer, tag=tag))
        return (dist.batch_isend_irecv(ops) if ops else []), arriving

    def complete(self, requests, exchange, sends):
        """Wait for the whole exchange, sends included (as Megatron's _communicate does), then
        free each output sent (free_output). No deadlock follows: the exchanges keep NCCL's
        rules (a rank's batches complete in order, a send once its receive is posted). Under
        gloo it is what frees the outputs: a send is complete to wait() only."""
        for request in requests:
            request.wait()
        requests.clear()  # a finished request still holds its tensors: let them go now
        for op, peer, tag in exchange:
            if op == "send" and peer != self.rank and sends[tag][1]:
                free_output(sends[tag][0])

    @staticmethod
    def pass_in_memory(tensor, free):
        """A message to this rank itself: the same storage, detached from the sender's graph;
        a sent output then keeps only its graph (free_output), as after a send."""
        passed = tensor.detach()
        if free:
            free_output(tensor)
        return passed

    def run(self, rounds, inputs, targets, m, train=True, posts=None):
        """Run one step's rounds, posting exchanges() between them (or `posts`, those ordered
        for NCCL in a V); returns the summed loss (last stage), the peak number of
        micro-batch chunks in flight (forward done, backward not; with zero bubble: W not),
        and when timed a function giving the share of the time this rank computed (1 - it is
        its measured bubble; call it after the step: it reads the device's events).

        bf16: the whole schedule is one autocast region, so autocast's cache casts each
        weight once per step, not once per micro-batch in flight; backward runs with autocast
        off, as it does outside a region."""
        n, posts = self.p * self.v, posts or exchanges(rounds, self.p, self.rank, self.v, m, self.vee)
        self.saved, self.weights, self.spans = {}, {}, []  # (i, c) -> (x, out); (i, c) -> its W nodes
        self.in_flight = self.peak = 0
        loss_sum, start = torch.zeros((), device=self.env.device), self.mark()
        with autocast(self.env):
            requests, received = self.post(posts[0], {})  # the first round's receives
            self.complete(requests, posts[0], {})
            for actions, exchange in zip(rounds, posts[1:]):
                sends = {}  # what this round sends: {tag: (tensor, free it once sent)}
                for kind, i, c in actions:
                    g = chunk_stage(self.p, self.rank, c, self.vee)  # this chunk's place in the pipeline
                    if kind == "F":  # in: the tokens, or chunk g-1's activation; out: to chunk g+1, or the loss
                        x = inputs[i] if g == 0 else received.pop(forward_tag(i, g - 1, n)).requires_grad_(train)
                        out = self.timed_span(self.forward, x, i, c, targets[i] if g == n - 1 else None, train, m)
                        if g == n - 1:
                            loss_sum += out.detach().float()
                        else:
                            sends[forward_tag(i, g, n)] = (out if train else out.detach(), train)
                        del x, out  # the input lives on in self.saved, the output as the message
                    elif kind in "BI":  # d loss / d out: 1 on the last chunk, else what chunk g+1 sent back
                        dy = received.pop(backward_tag(i, g + 1, n, m)) if g < n - 1 else None
                        dx = self.timed_span(self.backward, kind, i, c, dy)
                        if g > 0:  # x's gradient, back to chunk g-1
                            sends[backward_tag(i, g, n, m)] = (dx, False)
                        del dy, dx  # the message in `sends` is the only reference left
                requests, arriving = self.post(exchange, sends)  # this round's sends, the next one's receives
                for kind, i, c in actions:
                    if kind == "W":  # zero bubble: nobody waits for W, so it runs while the messages travel
                        self.timed_span(self.weight_gradient, i, c)
                self.complete(requests, exchange, sends)
                received.update(arriving)
        self.whole = whole = (start, self.mark())  # kept with self.spans for --measure_bubble's timeline
        spans = self.spans
        loss_sum = self.tree.finish() if self.tree and train else loss_sum  # --bitwise: the tree's sums, into .grad
        return loss_sum, self.peak, (lambda: self.busy_fraction(spans, whole)) if self.timed else None

    def forward(self, x, i, c, target, train, m):
        """F: chunk c on micro-batch i, kept for its backward; the last chunk's output is the
        loss, whose backward is that of the mean over the m micro-batches."""
        with torch.set_grad_enabled(train):  # in run()'s autocast region
            out = self.chunks[c](x, target)
        if train:
            self.saved[(i, c)] = (x, out / m if target is not None and not self.tree else out)  # (--bitwise: /m once)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        return out

    def backward(self, kind, i, c, dy):
        """B (or I, the input gradient only, on split Linears): from the loss, or from the
        gradient `dy` received for the output that was sent and freed; returns dx to send back."""
        x, out = self.saved.pop((i, c))
        with torch.autocast(self.env.device.type, enabled=False):  # backward: autocast off
            if dy is None:
                out.backward()
            else:
                backward_from_freed(out, dy)
        if self.tree: self.tree.take(i, c, "B" if self.deferred is None else "I", out)  # --bitwise: apart, for the tree
        if self.deferred is not None:  # zero bubble: the split Linears left their W nodes in `deferred`
            self.weights[(i, c)] = self.deferred[:]
            self.deferred.clear()
            if kind == "B":  # a whole backward: its W at once
                self.weight_gradient(i, c)
        else:
            self.in_flight -= 1
        return x.grad

    def weight_gradient(self, i, c):
        """W: dW = dyᵀ·x of every Linear of chunk c for micro-batch i, into .grad; frees x and dy."""
        with torch.autocast(self.env.device.type, enabled=False):
            torch.autograd.backward(self.weights.pop((i, c)))
        if self.tree: self.tree.take(i, c, "W")  # --bitwise: the Linears' weight gradients, apart, for the tree
        self.in_flight -= 1

    def timed_span(self, work, *args):
        """work(*args), between two marks when timed: the spans are the compute time."""
        if not self.timed:
            return work(*args)
        begin = self.mark()
        result = work(*args)
        self.spans.append((begin, self.mark()))
        return result

    def mark(self):
        """Now, on this rank's compute stream: a device event recorded behind the kernels
        already queued, which the host does not wait for, or on CPU the host clock. A wait()
        on an NCCL receive only makes the stream wait, so a span never counts the wait."""
        if not self.timed:
            return None
        if self.env.device.type == "cpu":
            return time.perf_counter()
        event = torch.Event(self.env.device, enable_timing=True)
        event.record()
        return event

    @staticmethod
    def busy_fraction(spans, whole):
        """The share of the schedule's time, `whole` (its first and last marks), that its
        `spans` took: read after the step, where waiting for the last event costs no overlap."""
        def seconds(start, end):
            if isinstance(start, float):
                return end - start
            end.synchronize()  # this event only, not the device
            return start.elapsed_time(end) / 1e3
        return sum(seconds(*span) for span in spans) / seconds(*whole)

# ---- end restated ----


# ---- restated from 09_context_parallel.py: zigzag_chunks, token_positions (word for word; tests/test_restated.py checks it) ----
# the tokens a CP rank holds

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
# ---- end restated ----


# ---- restated from 09_context_parallel.py: Ring, ring_block, part, aten, fused_kernel, sdpa_accepts, kernel_blocks, block_forward, block_backward, EXPLICIT_SCORES, query_chunk, explicit_in_chunks, explicit_backward_in_chunks, explicit_block_terms, scores, explicit_block_forward, explicit_block_backward, merge, RingAttention (word for word; tests/test_restated.py checks it) ----
# ring attention

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
# ---- end restated ----


# ---- restated from 09_context_parallel.py: seq_to_heads, heads_to_seq, SeqToHeads, HeadsToSeq, ulysses_attention (word for word; tests/test_restated.py checks it) ----
# Ulysses

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
# ---- end restated ----


# ---- restated from 09_context_parallel.py: ContextParallel (word for word; tests/test_restated.py checks it) ----
# the attention over the CP group

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
# ---- end restated ----



# ---- restated from 10_expert_parallel.py: AllToAll, ExpertParallelMoE, is_expert (word for word; tests/test_restated.py checks it) ----
# 10's dispatch and combine, on the mesh's EP group

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


def is_expert(name):
    return ".experts." in name
# ---- end restated ----


# ---- restated from 10_expert_parallel.py: ReplicatedMuon (word for word; tests/test_restated.py checks it) ----
# Muon for the experts' matrices, replicated over expert_dp (10's, itself 03's)
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

# ---- end restated ----


# ---------------------------------------------------------------------------------------
# Experts in the mesh (--n_expert E --ep N): 10's dispatch and combine on EP groups carved out
# of each DP x CP group, as Megatron-core folds expert parallelism into data parallelism
# ---------------------------------------------------------------------------------------

def check_experts(args, E, world):
    """--ep divides each (pp, tp) place's D·C ranks of DP x CP and the E experts; what 08 does not
    do with experts is refused in one line, with the reason."""
    N, T, P, C = getattr(args, "ep", 1), args.tp, args.pp, args.cp
    check(N >= 1, f"--ep must be positive, got {N}")
    check(E > 0 or N == 1, f"--ep {N} places experts: pass --n_expert E (or a mixture-of-experts --model)")
    if not E:
        return
    replicas = world // (T * P * C) * C  # the DP x CP ranks at one (pp, tp) place
    check(replicas % N == 0, f"--ep {N} does not divide the {replicas} data-parallel x context-parallel ranks "
          "of each (pp, tp) place, out of which the expert-parallel groups are carved")
    check(E % N == 0, f"--n_expert {E} is not divisible by --ep {N}: every rank holds E/ep whole experts")
    check(not (args.optimizer == "muon" and T > 1 and getattr(args, "shared_experts", None)),
          "--shared_experts with --optimizer muon at --tp > 1 is not implemented in 08_3d.py: ShardedMuon moves "
          "and prices every matrix as TP-split, and the shared experts are replicated over TP (use --tp 1)")


def expert_groups(mesh, args):
    """With experts, the mesh's expert groups: each DP x CP group (the ranks at one (pp, tp)
    place, which hold the same weights) cut into EP groups of --ep consecutive ranks, which hold
    every expert once between them ("ep": the dispatch and combine all-to-alls), and the ranks
    at the same place of their EP groups, which hold the same experts ("expert_dp": their
    gradients' sum). Every rank creates every group, in the same order."""
    E = preset_config(args)["n_expert"]
    check_experts(args, E, dist.get_world_size())  # on every rank, before any group is made
    mesh.ep_size = N = args.ep
    mesh.ep_rank = mesh.reduce_rank % N  # consecutive DP x CP ranks: its place in its EP group
    if not E:
        return mesh
    for kind, attribute in (("ep", "ep_group"), ("expert_dp", "expert_dp_group")):
        for ranks in mesh.groups_over("dp", "cp"):  # in DP x CP rank order: reduce_rank
            parts = [ranks[i:i + N] for i in range(0, len(ranks), N)] if kind == "ep" else \
                [ranks[j::N] for j in range(N)]
            for members in parts:
                group = dist.new_group(members, group_desc=kind)  # the name the ledger counts it under
                if mesh.rank in members:
                    setattr(mesh, attribute, group)
    return mesh


class MeshMoE(ExpertParallelMoE):
    """10's ExpertParallelMoE as a stage's MLP: this rank's E/ep experts, the dispatch and
    combine on the mesh's EP group. Replicated over TP, as a LayerNorm is: every TP rank routes
    the same tokens through its own EP group (with SP the sequence gathered first, and this
    rank's shard of the output kept), so outputs and gradients are 01's; expert TP (the experts
    split over tp) is not done. With CP the CP group's tokens are gathered too: the balancing
    loss is per sequence, and so sees every token of it. The block's balancing loss enters
    backward where the block's output does (Megatron-core's MoEAuxLossAutoScaler): a
    pipeline's every stage adds its own blocks' terms, as 01's loss sums every block's."""

    def __init__(self, config, mesh, sp):
        with torch.device("meta"):
            moe = MoE(config)  # shapes only: this rank keeps its experts and the router
        N, place = getattr(mesh, "ep_size", 1), getattr(mesh, "ep_rank", 0)  # (costs()' Mesh: all the experts)
        super().__init__(moe, range(place * config.n_expert // N, (place + 1) * config.n_expert // N),
                         getattr(mesh, "ep_group", None))
        self.to_empty(device=torch.empty(0).device)  # where the stage is built (meta for costs())
        for buffer in self.buffers():  # --balance bias: the router's bias starts at zero, as 01's
            buffer.zero_()
        self.mesh, self.sp, self.aux_coef = mesh, sp, config.aux_loss_coef
        self.aux_grad, self.aux = None, []  # with_experts: d loss / d aux; the training forwards' aux
        self.in_order = None  # with_experts: (sort, back), where the gathered tokens are not in position order

    def forward(self, x):
        mesh = self.mesh  # the sequence's shards: SP's over TP, then CP's (backward: the gradients summed)
        parts = [(mesh.tp_group, mesh.tp_size, mesh.tp_rank)] * self.sp + \
            [(mesh.cp_group, mesh.cp_size, mesh.cp_rank)] * (mesh.cp_size > 1)
        for group, _, _ in parts:  # every token of the micro-batch's sequences on every rank
            x = GatherSequence.apply(x, group)
        if self.in_order is not None:  # --capacity_factor drops by position (GShard's order): route them so
            x = x[:, self.in_order[0]]
        y, aux = super().forward(x)
        if self.in_order is not None:  # and back to the order held
            y = y[:, self.in_order[1]]
        if self.training and torch.is_grad_enabled():  # a training forward (with --recompute: in backward)
            self.aux.append(aux.detach())
        y = BalancingLoss.apply(y, aux, self.aux_grad)
        for _, size, index in reversed(parts):  # this rank's tokens of the output: its CP part, its SP shard
            n = y.size(1) // size
            y = y[:, index * n:(index + 1) * n]
        return y


class GatherSequence(torch.autograd.Function):
    """[b, s/T, h] -> [b, s, h] (06's all_gather_sequence, over TP or CP); backward the sum of
    every rank's gradient, this rank's shard kept (reduce_scatter_sequence)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad.contiguous(), ctx.group), None


class BalancingLoss(torch.autograd.Function):
    """Identity on a block's output; when the output's gradient arrives, the balancing loss's
    starts too: d loss / d aux = aux_loss_coef / m (/T with SP, whose TP ranks' sums add up)."""

    @staticmethod
    def forward(ctx, y, aux, grad):
        ctx.grad = grad
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, torch.full((), ctx.grad, device=grad_y.device), None


class DenseStage:
    """The stage as 06's ShardedMuon reads it (model.named_parameters()): its parameters but the experts',
    whose matrices ExpertReplicas gives to 10's ReplicatedMuon over expert_dp (a dense stage: all)."""

    def __init__(self, stage):
        self.stage = stage

    def named_parameters(self):
        return [(name, p) for name, p in self.stage.named_parameters() if not is_expert(name)]


def dense_parameters(stage):
    """The stage's parameters but the experts' (DataParallel's and ZeRO1's: every replica's)."""
    return [p for name, p in stage.named_parameters() if not is_expert(name)]


def with_experts(replicas, stage, args, m):
    """`replicas` itself for a dense model; with experts, ExpertReplicas around it, and each
    block's balancing-loss gradient set: the loss is the mean over m micro-batches. With CP and
    --capacity_factor, the permutation that puts the CP ranks' gathered tokens (ring: zigzag
    chunks) in position order, and back, since the capacity keeps a sequence's first tokens."""
    if not stage.config.n_expert:
        return replicas
    config, C = stage.config, stage.mesh.cp_size
    held = torch.cat([token_positions(config.block_size, C, r, args.cp_impl) for r in range(C)])  # as gathered
    sort = torch.argsort(held).to(next(stage.parameters()).device)
    for block in stage.h:
        block.mlp.aux_grad = config.aux_loss_coef / m / (stage.mesh.tp_size if stage.sp else 1)
        if config.capacity_factor and not torch.equal(held, held.sort().values):
            block.mlp.in_order = sort, torch.argsort(sort)
    return ExpertReplicas(replicas, stage, args)


class ExpertReplicas:
    """DataParallel's interface for a stage with experts: `dense` (DataParallel or ZeRO1) for
    every parameter but the experts', and beside it the experts, whole with their AdamW state
    (not sharded by --zero1), in the same optimizer: their gradients already hold the tokens of
    their EP group (the all-to-alls brought them back), so they are summed over expert_dp, the
    ranks holding the same experts, and divided by D·C, as the dense ones; in the norm each
    expert counts once, summed over the EP group."""

    def __init__(self, dense, stage, args):
        self.dense, self.stage, self.mesh = dense, stage, stage.mesh
        named = [(name, p) for name, p in stage.named_parameters() if is_expert(name)]
        self.experts = [p for _, p in named]
        self.counted = [p for name, p in named if counted_once(stage, name)]
        self.params, self.optimizer, self.norm_group = dense.params + self.experts, dense.optimizer, dense.norm_group
        muon = args.optimizer == "muon"
        matrices = [p for name, p in named if muon and is_hidden_matrix(name, p.shape)]  # Muon's: whole experts'
        adamw, taken = getattr(self.optimizer, "adamw", self.optimizer), {id(p) for p in matrices}  # Muon's AdamW
        for decayed, weight_decay in ((True, args.weight_decay), (False, 0.0)):
            adamw.add_param_group({"params": [p for p in self.experts if is_decayed(p.shape) == decayed
                                              and id(p) not in taken], "weight_decay": weight_decay})
            if adamw is not self.optimizer:  # Muon holds AdamW's groups as its own: the loop's lr reaches it
                self.optimizer.param_groups.append(adamw.param_groups[-1])
        if muon:  # 10's Muon for the experts: each matrix's owner among the ranks holding it (expert_dp); it
            # steps the dense Muon after its own, and the dense replicas step it (ZeRO1: then the all-gather)
            self.optimizer = dense.optimizer = ReplicatedMuon(matrices, self.optimizer, args, self.optimizer.ns_dtype,
                                                              self.mesh.expert_dp_group)

    def reduce_gradients(self):
        self.dense.reduce_gradients()
        grads = [p.grad for p in self.experts]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.mesh.reduce_size)
        if dist.get_world_size(self.mesh.expert_dp_group) > 1:  # a one-rank group posts nothing
            dist.all_reduce(flat, group=self.mesh.expert_dp_group)  # the sum over the ranks holding these experts
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def grad_tensors(self):
        return self.dense.grad_tensors() + [p.grad for p in self.experts]

    def squared_norm(self):
        """The dense Σ g², and the experts' once each: where the norm's sum runs over one
        replica (DataParallel's model group), summed over the EP group first; where it runs over
        the world (ZeRO1), counted by the first EP group only (DP x CP ranks 0..ep-1)."""
        squares = torch.zeros((), device=self.experts[0].device)
        for p in self.counted if self.norm_group is not None or self.mesh.reduce_rank < self.mesh.ep_size else []:
            squares += p.grad.float().pow(2).sum()
        if self.norm_group is not None and dist.get_world_size(self.mesh.ep_group) > 1:
            dist.all_reduce(squares, group=self.mesh.ep_group)  # the squares of every expert of these layers
        return self.dense.squared_norm() + squares

    def step(self):
        self.dense.step()  # the experts' AdamW groups step with the dense ones (Muon: dense.optimizer, the experts')

    def zero_grad(self):
        self.dense.zero_grad()
        for p in self.experts:
            p.grad = None


def balancing_loss(stage):
    """aux_loss_coef x the balancing losses of this stage's blocks over the step's
    micro-batches (0 without experts), for the logged loss; and reset."""
    if not stage.config.n_expert:
        return 0.0
    blocks = [block.mlp for block in stage.h]
    total = stage.config.aux_loss_coef * torch.stack([a for mlp in blocks for a in mlp.aux]).sum()
    for mlp in blocks:
        mlp.aux = []
    return total


def routing(stage):
    """After the optimizer step, with experts (nothing without): the global batch's entries per expert
    and dropped of every layer, summed over the world (the TP x CP ranks of a (dp, pp) place route the
    same gathered tokens: T·C copies of its counts); --balance bias moves this stage's routers' biases
    on their layers' (common.update_expert_bias, as 01 and 10 do); the metrics' routing keys
    (common.routing_metrics); and what this step's costs() depend on: the rows this rank's experts
    received and the rows it sent, per layer per micro-batch. The routers' counts are reset."""
    from types import SimpleNamespace
    from common import routing_metrics, update_expert_bias
    config, mesh, blocks = stage.config, stage.mesh, [block.mlp for block in stage.h]
    if not config.n_expert:
        return {}
    counts = torch.zeros(config.n_layer, config.n_expert + 1, dtype=torch.int64, device=blocks[0].router.load.device)
    mine = slice(stage.first_layer, stage.first_layer + len(blocks))  # this stage's layers' rows
    counts[mine] = torch.stack([torch.cat([mlp.router.load, mlp.router.dropped.view(1)]) for mlp in blocks])
    if dist.get_world_size() > 1:  # (L, E + 1) int64: the global batch's, T·C times over
        dist.all_reduce(counts, group=dist.group.WORLD)
    counts = counts.div_(mesh.tp_size * mesh.cp_size, rounding_mode="floor")  # exact: integers, T·C copies
    load, dropped = counts[:, :-1], counts[:, -1]
    update_expert_bias(SimpleNamespace(transformer=SimpleNamespace(h=stage.h)), load[mine])  # (the blocks it reads)
    received, sent = [mlp.received for mlp in blocks], [mlp.sent for mlp in blocks]
    for mlp in blocks:
        mlp.received, mlp.sent = [], []
        mlp.router.load = mlp.router.dropped = None
    return {"received": received, "sent": sent, "extra": lambda: routing_metrics(load, dropped)}


if __name__ == "__main__":
    main()
