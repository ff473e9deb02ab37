"""08_3d.py: data x tensor x pipeline parallelism in one standalone script (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM").

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
f and g operators, vocab-parallel embedding and cross-entropy). Across stages: 1F1B as in
07_pipeline.py, each TP rank exchanging with the same TP rank of the next stage. Across
replicas: gradients all-reduced in each DP group, or with --zero1 reduce-scattered, each DP
rank updating its 1/D of the optimizer state and all-gathering the parameters (ZeRO stage 1,
as in 04_zero.py). Only what is needed is restated here: this file does not import the others.

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

Cost per rank (Ψ parameters, b micro-batch, s sequence, h width, L layers, m micro-batches):

    memory:  16Ψ_rank bytes, Ψ_rank = Ψ_stage,sharded/T + Ψ_stage,replicated (fp32 weights,
             gradients, AdamW); --zero1: weights 4Ψ_rank and gradients 4Ψ_rank (both padded
             to a multiple of D) + the reduced gradient shard 4Ψ_rank/D + AdamW 8Ψ_rank/D
    TP:      all-reduce of b·s·h, 4 per layer per micro-batch: the two forward ones (g) in the
             compute dtype, the two backward ones (f) in fp32; + the embedding's and the
             head's (fp32) and 3·b·s loss statistics (fp32) on the last stage
    PP:      send and receive of b·s·h (fp32, the residual stream) per micro-batch per
             stage boundary; the wte shard's gradient between first and last stage
    DP:      all-reduce of this rank's 4·Ψ_rank gradient bytes per step (--zero1:
             reduce-scatter + all-gather of the padded 4Ψ_rank)
    logging: the loss all-reduced over the stages and the replicas (4 bytes each) and, with
             clipping, the squared norm over the replica (over the world with --zero1; 4
             bytes); the exact terms are costs() below
"""

import math
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.variable import Variable
from torch.nn import functional as F

from common import (activation_device_type, activation_phases, activation_terms, ActivationMeter,
                    autocast, check, check_batch, count_params, Data, decay_groups,
                    device_rng_state, dry_run, flops_per_token, format_bytes, Guard, is_decayed,
                    launch_for, LEDGER, log, lr_at, make_adamw, make_parser, Metrics,
                    model_block_size, model_config, param_init, param_pieces, parse_args,
                    planned_dtype, print_ledger, progress, recomputed, resume_checkpoint,
                    run_config, save_checkpoint, seeded_rng_state, set_device_rng_state, setup,
                    state_bytes, synchronize, teardown, tensor_bytes, to_device)


def add_flags(parser):
    g = parser.add_argument_group("08_3d")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (innermost)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--zero1", action="store_true", help="shard the optimizer state across each DP group")
    return parser


# ---------------------------------------------------------------------------------------
# The mesh
# ---------------------------------------------------------------------------------------

class Mesh:
    """Coordinates and process groups; TP innermost, then PP, then DP."""

    def __init__(self, rank, world, tp_size, pp_size):
        self.tp_size, self.pp_size, self.dp_size = tp_size, pp_size, world // (tp_size * pp_size)
        self.dp_rank, self.pp_rank, self.tp_rank = self.coordinates(rank)
        self.next = self.rank_of(self.dp_rank, self.pp_rank + 1, self.tp_rank) if self.pp_rank < pp_size - 1 else None
        self.prev = self.rank_of(self.dp_rank, self.pp_rank - 1, self.tp_rank) if self.pp_rank > 0 else None
        self.tp_group = self.pp_group = self.dp_group = self.mp_group = self.embedding_group = None  # make_groups()

    def rank_of(self, dp_rank, pp_rank, tp_rank):
        return (dp_rank * self.pp_size + pp_rank) * self.tp_size + tp_rank

    def coordinates(self, rank):
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        return rank // (self.pp_size * self.tp_size), (rank // self.tp_size) % self.pp_size, rank % self.tp_size

    def make_groups(self):
        """The process groups of this rank (a collective: every rank creates every group, in
        the same order)."""
        tp_size, pp_size = self.tp_size, self.pp_size
        for d in range(self.dp_size):
            for s in range(pp_size):
                group = dist.new_group([self.rank_of(d, s, t) for t in range(tp_size)])
                if (d, s) == (self.dp_rank, self.pp_rank):
                    self.tp_group = LEDGER.name_group(group, "tp")
            group = dist.new_group([self.rank_of(d, s, t) for s in range(pp_size) for t in range(tp_size)])
            if d == self.dp_rank:
                self.mp_group = LEDGER.name_group(group, "model")  # one replica: TP x PP
        for s in range(pp_size):
            for t in range(tp_size):
                group = dist.new_group([self.rank_of(d, s, t) for d in range(self.dp_size)])
                if (s, t) == (self.pp_rank, self.tp_rank):
                    self.dp_group = LEDGER.name_group(group, "dp")
        for d in range(self.dp_size):
            for t in range(tp_size):
                group = dist.new_group([self.rank_of(d, s, t) for s in range(pp_size)])
                if (d, t) == (self.dp_rank, self.tp_rank):
                    self.pp_group = LEDGER.name_group(group, "pp")
                ends = sorted({self.rank_of(d, 0, t), self.rank_of(d, pp_size - 1, t)})
                group = dist.new_group(ends)
                if (d, t) == (self.dp_rank, self.tp_rank):
                    self.embedding_group = LEDGER.name_group(group, "embedding")
        return self

    def describe(self, world, ranks_per_node=None):
        lines = [f"mesh: {world} ranks = {self.dp_size} data-parallel x {self.pp_size} pipeline x "
                 f"{self.tp_size} tensor-parallel (rank = dp·{self.pp_size * self.tp_size} + pp·{self.tp_size} + tp)"]
        shown = range(self.dp_size) if self.dp_size <= 4 else [0, 1, self.dp_size - 1]
        for d in shown:
            if d == self.dp_size - 1 and self.dp_size > 4:
                lines.append(f"  ... ({self.dp_size - 3} more replicas)")
            row = [f"{self.rank_of(d, s, t):>3}:(dp {d}, pp {s}, tp {t})"
                   for s in range(self.pp_size) for t in range(self.tp_size)]
            lines.append("  " + "  ".join(row))
        if ranks_per_node:
            nodes = lambda ranks: sorted({r // ranks_per_node for r in ranks})  # noqa: E731
            tp_nodes = max(len(nodes([self.rank_of(d, s, t) for t in range(self.tp_size)]))
                           for d in range(self.dp_size) for s in range(self.pp_size))
            lines.append(f"  {ranks_per_node} ranks per node: every TP group "
                         + ("inside one node" if tp_nodes == 1 else f"spans {tp_nodes} nodes (slow: keep tp <= ranks per node)"))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Tensor parallelism inside a stage (restated from 06_tensor_parallel.py, on the TP group)
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
        dist.all_reduce(grad, group=ctx.group)  # sum the input-gradient parts of every rank's weight shard
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


class ColumnParallelLinear(nn.Module):
    """Y_t = f(X) A_t: this rank's block of output columns (rows of nn.Linear's weight)."""

    def __init__(self, in_features, out_local, bias, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        self.group = group

    def forward(self, x):
        return F.linear(CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = g(X_t B_t) + bias: this rank's block of input rows; the bias is added once,
    after the reduction."""

    def __init__(self, in_local, out_features, bias, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group

    def forward(self, x):
        y = ReduceFromTP.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rank t holds rows [start, start + V/T) of the (padded) token embedding."""

    def __init__(self, vocab_local, n_embd, start, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, n_embd))
        self.start, self.group = start, group

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # other ranks' tokens contribute zeros
        return ReduceFromTP.apply(x, self.group)


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
        target_logit = shifted.gather(-1, local_target.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~mine, 0.0)
        dist.all_reduce(target_logit, group=group)  # only the owning rank contributes the target's logit
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
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


class TPBlock(nn.Module):
    def __init__(self, config, tp_size, group):
        super().__init__()
        h = config.n_embd
        self.ln_1 = nn.LayerNorm(h, bias=config.bias)
        self.attn = nn.Module()
        self.attn.c_attn = ColumnParallelLinear(h, 3 * h // tp_size, config.bias, group)
        self.attn.c_proj = RowParallelLinear(h // tp_size, h, config.bias, group)
        self.ln_2 = nn.LayerNorm(h, bias=config.bias)
        self.mlp = nn.Module()
        self.mlp.c_fc = ColumnParallelLinear(h, 4 * h // tp_size, config.bias, group)
        self.mlp.c_proj = RowParallelLinear(4 * h // tp_size, h, config.bias, group)
        self.n_head_local, self.dropout = config.n_head // tp_size, nn.Dropout(config.dropout)
        self.p_attn = config.dropout

    recompute = False  # --recompute: keep the block's input only (its g all-reduces run again in backward)

    def forward(self, x, rng):
        if self.recompute and torch.is_grad_enabled():
            return recomputed(lambda t: self.body(t, rng), x, trackers=[rng])  # the TP rank's stream too
        return self.body(x, rng)

    def body(self, x, rng):
        q, k, v = self.attn.c_attn(self.ln_1(x)).chunk(3, dim=-1)  # this rank's heads
        B, T, C = q.shape
        q, k, v = (t.view(B, T, self.n_head_local, C // self.n_head_local).transpose(1, 2) for t in (q, k, v))
        with rng.sharded():  # attention dropout acts inside this rank's heads: its own stream
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p_attn if self.training else 0.0)
        x = x + self.dropout(self.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))
        return x + self.dropout(self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)))))


class ShardedRNG:
    """Megatron's model-parallel RNG tracker, reduced to one stream: `with rng.sharded():`
    swaps the device's default generator (the stream the TP group shares) to this rank's
    own stream and back."""

    def __init__(self, seed, rank, device):
        self.device = device
        self.state = seeded_rng_state(device, seed + 2718 + rank)

    @contextmanager
    def sharded(self):
        shared = device_rng_state(self.device)
        set_device_rng_state(self.device, self.state)
        try:
            yield
        finally:
            self.state = device_rng_state(self.device)
            set_device_rng_state(self.device, shared)


class Stage(nn.Module):
    """This rank's pipeline stage, tensor-parallel: layers [first_layer, first_layer + n),
    the vocab-parallel embedding on the first stage, the final norm and head on the last."""

    def __init__(self, config, mesh, first_layer, n_layers, rng):
        super().__init__()
        tp_size, h, group = mesh.tp_size, config.n_embd, mesh.tp_group
        self.config, self.mesh, self.first_layer, self.rng = config, mesh, first_layer, rng
        self.is_first, self.is_last = mesh.pp_rank == 0, mesh.pp_rank == mesh.pp_size - 1
        self.padded_vocab = math.ceil(config.vocab_size / tp_size) * tp_size
        self.vocab_local = self.padded_vocab // tp_size
        self.vocab_start = mesh.tp_rank * self.vocab_local
        if self.is_first:
            self.wte = VocabParallelEmbedding(self.vocab_local, h, self.vocab_start, group)
            self.wpe = nn.Embedding(config.block_size, h)
            self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([TPBlock(config, tp_size, group) for _ in range(n_layers)])
        if self.is_last:
            self.ln_f = nn.LayerNorm(h, bias=config.bias)
            # the tied head: the embedding itself, or (on another stage) a copy of its shard
            self.lm_head = self.wte if self.is_first else VocabParallelEmbedding(self.vocab_local, h, self.vocab_start,
                                                                                 group)

    def full_name(self, name):
        if name.startswith("h."):
            index, rest = name[2:].split(".", 1)
            return f"transformer.h.{self.first_layer + int(index)}.{rest}"
        return {"lm_head.weight": "transformer.wte.weight"}.get(name, "transformer." + name)

    @staticmethod
    def tp_sharded(name):
        """Split across the TP group (else replicated: LayerNorms, c_proj biases, wpe)."""
        return name.endswith(("wte.weight", "lm_head.weight", "c_attn.weight", "c_attn.bias", "c_fc.weight",
                              "c_fc.bias", "c_proj.weight"))

    def shard(self, name, full):
        """This TP rank's piece of the full parameter `full` (01's value)."""
        T, t, h = self.mesh.tp_size, self.mesh.tp_rank, self.config.n_embd
        if name.endswith(("wte.weight", "lm_head.weight")):
            padded = torch.zeros(self.padded_vocab, h)
            padded[:full.shape[0]] = full
            return padded[self.vocab_start:self.vocab_start + self.vocab_local]
        if "c_attn" in name:  # [Q; K; V] rows: this rank's heads of each
            return torch.cat([part.chunk(T)[t] for part in full.chunk(3)])
        if "c_fc" in name:
            return full.chunk(T)[t]
        if name.endswith("c_proj.weight"):
            return full.chunk(T, dim=1)[t]
        return full  # replicated

    def checkpoint_pieces(self, name, p, optimizer, write):
        """Where this rank's TP shard of parameter `name` sits in 01's full parameter (as
        06_tensor_parallel.py says it), as pieces of common.py's format: vocab rows without
        the padding, [Q_t; K_t; V_t] rows as three pieces, c_fc rows, c_proj columns;
        replicated parameters are written by TP rank 0 of each stage, the tied embedding's
        rows by the first stage only (the last stage's copy is read, never written). With
        the optimizer: the AdamW moments too."""
        T, t, h, full = self.mesh.tp_size, self.mesh.tp_rank, self.config.n_embd, self.full_name(name)
        rest = [[0, s] for s in p.shape[1:]]
        if name in ("wte.weight", "lm_head.weight"):
            lo, hi = self.vocab_start, min(self.vocab_start + self.vocab_local, self.config.vocab_size)
            return param_pieces(full, (self.config.vocab_size, h), p, optimizer, box=[[lo, hi]] + rest,
                                index=slice(0, hi - lo), write=write and name == "wte.weight") if lo < hi else []
        if "c_attn" in name:  # rows j·h + [t·h/T, (t+1)·h/T) for Q, K, V
            n = p.shape[0] // 3
            return [piece for j in range(3) for piece in param_pieces(
                full, (3 * h,) + tuple(p.shape[1:]), p, optimizer, box=[[j * h + t * n, j * h + (t + 1) * n]] + rest,
                index=slice(j * n, (j + 1) * n), write=write)]
        if "c_fc" in name:
            return param_pieces(full, (p.shape[0] * T,) + tuple(p.shape[1:]), p, optimizer,
                                box=[[t * p.shape[0], (t + 1) * p.shape[0]]] + rest, write=write)
        if name.endswith("c_proj.weight"):
            cols = p.shape[1]
            return param_pieces(full, (p.shape[0], cols * T), p, optimizer,
                                box=[[0, p.shape[0]], [t * cols, (t + 1) * cols]], write=write)
        return param_pieces(full, p.shape, p, optimizer, write=write and t == 0)  # replicated

    @torch.no_grad()
    def init_weights(self, seed):
        c = self.config
        full_shapes = {"wte.weight": (c.vocab_size, c.n_embd), "lm_head.weight": (c.vocab_size, c.n_embd),
                       "c_attn.weight": (3 * c.n_embd, c.n_embd), "c_attn.bias": (3 * c.n_embd,),
                       "c_fc.weight": (4 * c.n_embd, c.n_embd), "c_fc.bias": (4 * c.n_embd,),
                       "mlp.c_proj.weight": (c.n_embd, 4 * c.n_embd), "attn.c_proj.weight": (c.n_embd, c.n_embd)}
        for name, p in self.named_parameters():
            shape = next((s for suffix, s in full_shapes.items() if name.endswith(suffix)), p.shape)
            p.copy_(self.shard(name, param_init(self.full_name(name), shape, c, seed)))
        return self

    def forward(self, x, targets=None):
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:
            x = block(x, self.rng)
        if self.is_last:
            x = CopyToTP.apply(self.ln_f(x), self.mesh.tp_group)
            logits = F.linear(x, self.lm_head.weight)  # the tied head: this rank's vocabulary
            return VocabParallelCrossEntropy.apply(logits.view(-1, logits.size(-1)), targets.view(-1),
                                                   self.vocab_start, self.config.vocab_size, self.mesh.tp_group)
        return x


# ---------------------------------------------------------------------------------------
# Pipeline parallelism across stages (restated from 07_pipeline.py: 1F1B)
# ---------------------------------------------------------------------------------------

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
        posted.extend((request, t if free else None) for request, (_, t, _, free) in zip(requests, pending))
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
# Data parallelism across replicas: plain all-reduce or ZeRO-1
# ---------------------------------------------------------------------------------------

class ZeroOne:
    """ZeRO stage 1 over the DP group (restated from 04_zero.py): this rank's parameters as
    one flat buffer padded to a multiple of D; DP rank d owns shard d of it, with its AdamW
    state; gradients are reduce-scattered, parameters all-gathered after the update."""

    def __init__(self, stage, mesh, args, device):
        self.params = list(stage.parameters())
        self.mesh, D = mesh, mesh.dp_size
        numel = sum(p.numel() for p in self.params)
        self.shard = math.ceil(numel / D)
        self.flat = torch.zeros(self.shard * D, device=device)
        self.flat_grad = torch.zeros_like(self.flat)
        offset, pieces = 0, {True: [], False: []}
        self.segments = []  # (parameter, [a, b) of it flattened, the optimizer's tensor), for checkpoints
        lo, hi = mesh.dp_rank * self.shard, (mesh.dp_rank + 1) * self.shard
        self.grad_shard = torch.zeros(self.shard, device=device)
        for p in self.params:
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
            offset += n
        if offset < hi:  # padding: no decay, stays zero
            piece = self.flat[max(offset, lo):hi]
            piece.grad = self.grad_shard[max(offset, lo) - lo:]
            pieces[False].append(piece)
        self.lo, self.hi = lo, hi
        self.optimizer = make_adamw(pieces[True], pieces[False], args, device.type)

    def reduce(self):
        self.flat_grad.div_(self.mesh.dp_size)
        # sum the replicas' gradients; DP rank d receives shard d
        dist.reduce_scatter_tensor(self.grad_shard, self.flat_grad, group=self.mesh.dp_group)

    def step(self):
        self.optimizer.step()
        # every DP rank's updated shard -> the whole parameter buffer on every DP rank
        dist.all_gather_into_tensor(self.flat, self.flat[self.lo:self.hi].clone(), group=self.mesh.dp_group)

    def zero_grad(self):
        self.flat_grad.zero_()
        self.grad_shard.zero_()

    def checkpoint_pieces(self, tp_pieces):
        """The AdamW moments this DP rank owns: each optimizer tensor holds elements [a, b)
        of one parameter flattened; where that meets a TP piece of the parameter (elements
        [s, e) of it, a box of 01's tensor), it is the elements [x - s, y - s) of the box."""
        pieces = []
        for p, a, b, segment in self.segments:
            for piece in tp_pieces[p]:
                s = piece.tensor.storage_offset() - p.data.storage_offset()  # a dim-0 slice of p, or all of it
                x, y = max(a, s), min(b, s + piece.tensor.numel())
                if x < y:
                    pieces += param_pieces(piece.name.removeprefix("model/"), piece.shape, segment, self.optimizer,
                                           box=piece.box, flat=(x - s, y - s), index=slice(x - a, y - a),
                                           write=piece.write, model=False)
        return pieces


# ---------------------------------------------------------------------------------------
# One step's pieces: this replica's micro-batches, the loss, the gradients across replicas
# ---------------------------------------------------------------------------------------

def micro_batches(data, split, step, stage, mesh, args, env, m, eval_split=False):
    """This replica's rows in m micro-batches; only the first stage needs tokens and the
    last targets."""
    if not (stage.is_first or stage.is_last):
        return [None] * m, [None] * m
    x, y = data.batch(split, step, args.global_batch_size, mesh.dp_rank, mesh.dp_size, eval_split=eval_split)
    x, y = to_device(x, env), to_device(y, env)
    b = args.micro_batch_size
    return [x[i * b:(i + 1) * b] for i in range(m)], [y[i * b:(i + 1) * b] for i in range(m)]


def global_mean(loss_sum, mesh, m):
    """The mean loss over every micro-batch of every replica, on every rank."""
    dist.all_reduce(loss_sum, group=mesh.pp_group)  # the last stage's loss, to every stage
    loss_sum /= m * mesh.dp_size
    dist.all_reduce(loss_sum, group=mesh.dp_group)  # the mean over the replicas
    return loss_sum


@torch.no_grad()
def evaluate(stage, mesh, data, args, env, m, act_shape):
    stage.eval()
    losses = {}
    for split in ("train", "val"):
        total = 0.0
        for k in range(args.eval_iters):
            xs, ys = micro_batches(data, split, k, stage, mesh, args, env, m, eval_split=True)
            total += global_mean(run_pipeline(stage, mesh, env, xs, ys, m, act_shape, train=False), mesh, m).item()
        losses[split] = total / args.eval_iters
    stage.train()
    return losses


def average_over_replicas(stage, mesh):
    """Plain DP: the mean gradient on every replica, one all-reduce of this rank's flat
    gradients over its DP group."""
    params = list(stage.parameters())
    for p in params:
        p.grad.div_(mesh.dp_size)
    flat = torch.cat([p.grad.view(-1) for p in params])
    dist.all_reduce(flat, group=mesh.dp_group)  # sum over the replicas of this (pp, tp) rank
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def counted_once(stage, mesh, name):
    """Whether this rank's copy of parameter `name` counts in the global gradient norm: the
    tied head's copy counts on the first stage only, a TP-replicated parameter on TP rank 0."""
    tied_copy = name == "lm_head.weight" and not stage.is_first
    return not tied_copy and (stage.tp_sharded(name) or mesh.tp_rank == 0)


def clip_grad_norm(stage, zero, mesh, max_norm):
    """Scale the gradients so that their global norm, every parameter counted once over the
    whole model, is at most max_norm."""
    if zero:
        # the DP shard of this rank's flat gradients, weighted per element by counted_once
        weights = torch.zeros_like(zero.flat_grad)
        offset = 0
        for name, p in stage.named_parameters():
            weights[offset:offset + p.numel()] = float(counted_once(stage, mesh, name))
            offset += p.numel()
        squares = (zero.grad_shard.pow(2) * weights[zero.lo:zero.hi]).sum()
        dist.all_reduce(squares)  # over the whole world: DP shards x stages x TP shards
        grads = [zero.grad_shard]
    else:
        squares = torch.zeros((), device=next(stage.parameters()).device)
        for name, p in stage.named_parameters():
            if counted_once(stage, mesh, name):
                squares += p.grad.float().pow(2).sum()
        dist.all_reduce(squares, group=mesh.mp_group)  # every stage and TP shard of this replica
        grads = [p.grad for p in stage.parameters()]
    coef = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


def held_bytes(stage, optimizer, zero):
    """The model-state bytes this rank holds, counted from the live tensors."""
    if not zero:
        return state_bytes(stage.parameters(), optimizer)
    return {"params": tensor_bytes([zero.flat]), "grads": tensor_bytes([zero.flat_grad, zero.grad_shard]),
            "optim": state_bytes([], optimizer)["optim"]}


def stage_layers(n_layer, pp):
    """(first layer, layer count) of each stage: as even as it goes, the last n_layer % pp
    stages one layer more (under 1F1B the first stages hold the most activations)."""
    base, extra = divmod(n_layer, pp)
    sizes = [base + (s >= pp - extra) for s in range(pp)]
    return [(sum(sizes[:s]), sizes[s]) for s in range(pp)]


def default_micro_batch(args, dp, pp):
    """Without --micro_batch_size, a pipeline (pp > 1) gets about 2·pp micro-batches per
    replica (the largest divisor of the replica's batch at most batch/(2·pp)); pp = 1 none."""
    if args.micro_batch_size is None and args.global_batch_size % dp == 0:
        rows = args.global_batch_size // dp
        target = max(1, rows // (2 * pp)) if pp > 1 else rows
        args.micro_batch_size = max(b for b in range(1, target + 1) if rows % b == 0)


def costs(args, config, world_size, dtype, rank=0):
    """The docstring's formulas in bytes for `rank`. Ψ_rank = this rank's parameters (its
    stage's, TP-sharded, fp32). TP: per micro-batch and layer two all-reduces of b·s·h in the
    compute dtype (the row-parallel outputs, b_c bytes) and two in fp32 (the gradients
    entering f), + the embedding's (fp32) on the first stage, the head's (fp32) and 3 b·s of
    loss statistics on the last; --recompute repeats the two compute-dtype all-reduces (g in
    the recomputed forward). PP: b·s·h fp32 (the residual stream) per micro-batch per
    boundary each way, and the tied embedding's gradient shard between the first and last
    stage. DP: 4Ψ_rank of gradients (--zero1: reduce-scatter + all-gather of the flat buffer
    padded to D). Control: the logged loss, 4 bytes over pp and over dp; with clipping, the
    squared norm, 4 bytes over the model group (--zero1: over the world, the shards' sum)."""
    T, P = args.tp, args.pp
    D = world_size // (T * P)
    mesh = Mesh(rank, world_size, T, P)  # coordinates only, no groups
    first_layer, n_layers = stage_layers(config.n_layer, P)[mesh.pp_rank]
    with torch.device("meta"):
        stage = Stage(config, mesh, first_layer, n_layers, None)
    n_local = sum(p.numel() for p in stage.parameters())
    m = args.global_batch_size // (args.micro_batch_size * D)
    if args.zero1:
        shard = math.ceil(n_local / D)
        held = {"params": ("4Ψ_rank (padded to D)", 4 * shard * D),
                "grads": ("4Ψ_rank + its DP shard", 4 * (shard * D + shard)),
                "optim": ("8Ψ_rank / D", 8 * shard)}
    else:
        held = {"params": ("4Ψ_rank", 4 * n_local), "grads": ("4Ψ_rank", 4 * n_local), "optim": ("8Ψ_rank", 8 * n_local)}
    bsh = args.micro_batch_size * config.block_size * config.n_embd  # one activation, elements
    bs = args.micro_batch_size * config.block_size
    bc = dtype.itemsize
    tp_bytes = m * ((2 * bc + 8) * n_layers * bsh + (4 * bsh if stage.is_first else 0)
                    + (4 * bsh + 12 * bs if stage.is_last else 0))
    sent = {"all_reduce[tp]": (f"{m} micro x ({n_layers} layers x (2·{bc} + 2·4) b·s·h + embedding/head 4 b·s·h "
                               "+ loss 3·4 b·s)", tp_bytes),
            "all_reduce[pp]": ("4 loss", 4),
            "all_reduce[dp]": ("4 loss" + ("" if args.zero1 else " + 4Ψ_rank grads"),
                               4 + (0 if args.zero1 else 4 * n_local))}
    if P > 1:
        boundaries = 2 - stage.is_first - stage.is_last  # stage boundaries this rank sits on
        sent["send"] = sent["recv"] = (f"{m} micro x {boundaries} x 4 b·s·h", m * boundaries * 4 * bsh)
        if stage.is_first or stage.is_last:
            sent["all_reduce[embedding]"] = ("4 x wte shard grad", 4 * stage.vocab_local * config.n_embd)
    if args.zero1:
        shard = math.ceil(n_local / D)
        sent["reduce_scatter_tensor[dp]"] = ("4Ψ_rank (padded)", 4 * shard * D)
        sent["all_gather_into_tensor[dp]"] = ("4Ψ_rank (padded)", 4 * shard * D)
    if args.grad_clip > 0:
        sent["all_reduce" if args.zero1 else "all_reduce[model]"] = ("4 norm", 4)
    if args.recompute:  # backward runs each block's forward again, its g all-reduces too
        f, v = sent["all_reduce[tp]"]
        sent["all_reduce[tp]"] = (f"{f} + {m} micro x {n_layers} x 2·{bc} b·s·h recomputed", v + m * n_layers * 2 * bc * bsh)
    # activations: Megatron's TP split of each micro-batch's (common.activation_terms with
    # tp), the vocabulary-parallel ends as in 06 (the embedding's out-of-slice mask, b·s
    # bool; the head's input, fp32 softmax of V/T and target mask), and 1F1B's micro-batches
    # in flight (p - stage) walked through this stage's schedule
    b, s, h, e = args.micro_batch_size, config.block_size, config.n_embd, dtype.itemsize
    terms = activation_terms(config, b, s, dtype, activation_device_type(args), tp=T)
    emb_f, emb = terms["embedding"]
    terms["embedding"] = (f"{emb_f} + bs", emb + b * s)
    if config.dropout > 0 and config.bias and activation_device_type(args) not in ("cuda", "xpu"):
        # the row-parallel bias is added after g, promoting the output to fp32: CPU's
        # dropout masks (in their input's dtype) are then fp32
        layer_f, layer = terms["layer"]
        terms["layer"] = (f"{layer_f} + 2·{4 - e}bsh", layer + 2 * (4 - e) * b * s * h)
    terms["head"] = (f"4bsh + 8bs + {e}bsh + 4bsV/T + bs", 4 * b * s * h + 8 * b * s + e * b * s * h
                     + 4 * b * s * stage.vocab_local + b * s)
    now = peak = 0
    for kind, i in one_f_one_b(P, mesh.pp_rank, m):
        kept, during = activation_phases(terms, n_layers, args.recompute, stage.is_first, stage.is_last)
        peak = max(peak, now + kept if kind == "F" else now - kept + during)
        now += kept if kind == "F" else -kept
    per_stage = ("embedding + max(n·input + head, (n-1)·input + layer)" if args.recompute
                 else "n·layer + embedding + head")
    activations = (f"1F1B: {min(P - mesh.pp_rank, m)} micro-batch(es) in flight x ({per_stage}), TP-sharded", peak)
    return {"layout": f"dp {mesh.dp_rank}, pp {mesh.pp_rank}, tp {mesh.tp_rank}: layers {first_layer}-{first_layer + n_layers - 1}",
            "held": held, "sent": {k: v for k, v in sent.items() if v[1]}, "activations": activations}


def check_layout(config, T, P):
    check(config.n_head % T == 0, f"n_head {config.n_head} is not divisible by tp {T}: "
          "each TP rank must own whole attention heads")
    check(config.n_layer >= P, f"n_layer {config.n_layer} is fewer than pp {P}: every stage needs a layer")


def plan(args, world, T, P, m):
    """--dry_run: the mesh, the schedule and every stage's costs, without starting a process."""
    config = model_config(args, Data.vocab_size_of(args.data))
    check_layout(config, T, P)
    dtype = planned_dtype(args)
    mesh = Mesh(0, world, T, P)
    per_stage = [costs(args, config, world, dtype, mesh.rank_of(0, s, 0)) for s in range(P)]
    dry_run(args, "08_3d.py", config, per_stage[0],
            [mesh.describe(world, args.ranks_per_node),
             f"{m} micro-batch(es) of {args.micro_batch_size} per replica per step (1F1B)"
             + (", ZeRO-1 over each DP group" if args.zero1 else "")]
            + [f"  stage {s} ({c['layout'].split(': ')[1]}): holds "
               f"{format_bytes(sum(v for _, v in c['held'].values()))}, sends+receives "
               f"{format_bytes(sum(v for _, v in c['sent'].values()))} per step" for s, c in enumerate(per_stage)]
            + ["(below: rank 0)"])


def main():
    args = parse_args(add_flags(make_parser(__doc__)))
    launch = launch_for(args)
    world, T, P = launch.world_size, args.tp, args.pp
    check(T >= 1 and P >= 1, f"--tp and --pp must be positive, got {T} and {P}")
    check(world % (T * P) == 0, f"world size {world} is not divisible by tp {T} x pp {P} = {T * P}")
    D = world // (T * P)
    default_micro_batch(args, D, P)
    accum_steps = check_batch(args, dp_size=D)
    m = accum_steps  # micro-batches per replica per step
    if args.dry_run:
        plan(args, world, T, P, m)
    env = setup(args, launch)
    guard = Guard(args, env)  # every step: non-finite values, SIGTERM/SIGUSR1, --time_limit
    mesh = Mesh(env.rank, world, T, P).make_groups()
    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    check_layout(config, T, P)
    log(env, mesh.describe(world))
    torch.manual_seed(args.seed + 1000 * mesh.dp_rank + mesh.pp_rank)  # shared by the TP group of a stage
    rng = ShardedRNG(args.seed, env.rank, env.device)

    first_layer, n_layers = stage_layers(config.n_layer, P)[mesh.pp_rank]
    stage = Stage(config, mesh, first_layer, n_layers, rng).init_weights(args.seed).to(env.device)
    for block in stage.h:
        block.recompute = args.recompute
    zero = ZeroOne(stage, mesh, args, env.device) if args.zero1 else None
    optimizer = zero.optimizer if zero else make_adamw(*decay_groups(stage.parameters()), args, env.device.type)
    tied = [stage.wte.weight] if stage.is_first else []
    tied += [stage.lm_head.weight] if stage.is_last and not stage.is_first else []

    run = run_config(args, config, {"strategy": "3d", "dp": D, "pp": P, "tp": T, "zero1": args.zero1})

    def checkpoint_pieces():
        """Common.py's format, which any script resumes at any layout: DP replica 0 writes
        the parameters (TP shards of its stage) and, without --zero1, their moments; with
        --zero1 every DP rank writes the moments it owns."""
        tp_pieces = {p: stage.checkpoint_pieces(name, p, None, write=True) for name, p in stage.named_parameters()}
        pieces = [piece for name, p in stage.named_parameters()
                  for piece in stage.checkpoint_pieces(name, p, None if zero else optimizer, write=mesh.dp_rank == 0)]
        return pieces + (zero.checkpoint_pieces(tp_pieces) if zero else [])

    start_step = 0
    if args.resume:  # a checkpoint of any script, at any layout: each rank reads its shards
        start_step, extra_rng = resume_checkpoint(args.out_dir, env, checkpoint_pieces(), run, optimizer)
        if extra_rng is not None:  # the same layout: this rank's own dropout stream too
            rng.state = extra_rng["tp"]

    nano_params = count_params(config)[1]
    log(env, f"model: {nano_params / 1e6:.2f}M parameters (nanoGPT's count), device {env.device}, "
             f"{str(env.dtype).replace('torch.', '')}; this stage: layers {first_layer}-"
             f"{first_layer + n_layers - 1}, {sum(p.numel() for p in stage.parameters()):,} parameters on rank 0; "
             f"{m} micro-batch(es) of {args.micro_batch_size} per replica per step"
             f"{', ZeRO-1 over each DP group' if args.zero1 else ''}")
    cost = costs(args, config, world, env.dtype, env.rank)
    metrics = Metrics(args, env, flops_per_token(config, nano_params), cost)
    meter = ActivationMeter()

    act_shape = (args.micro_batch_size, config.block_size, config.n_embd)

    def save(step):
        save_checkpoint(args, step, env, checkpoint_pieces(), run, optimizer, extra_rng={"tp": rng.state})
        LEDGER.take()

    LEDGER.take()
    for step in progress(env, start_step, args.max_iters):
        if args.eval_interval and step % args.eval_interval == 0:
            losses = evaluate(stage, mesh, data, args, env, m, act_shape)
            log(env, f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            metrics.write({"step": step, "val_loss": losses["val"], "train_loss": losses["train"]})
            LEDGER.take()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()

        xs, ys = micro_batches(data, "train", step, stage, mesh, args, env, m)
        meter.start()
        loss_sum = run_pipeline(stage, mesh, env, xs, ys, m, act_shape)
        activations = meter.stop()
        loss_sum = global_mean(loss_sum, mesh, m)
        if P > 1 and tied:
            for weight in tied:  # the two copies of the wte shard stay equal
                dist.all_reduce(weight.grad, group=mesh.embedding_group)
        if zero:
            zero.reduce()  # reduce-scatter: this DP rank's shard of the mean gradient
        else:
            average_over_replicas(stage, mesh)  # plain DP: all-reduce, the mean on every replica
        if args.grad_clip > 0:
            clip_grad_norm(stage, zero, mesh, args.grad_clip)
        # all ranks agree: a non-finite loss or gradient ends the run here, before the update;
        # a stop signal or --time_limit ends it after this step's checkpoint
        stop = guard.check(step, loss_sum, [zero.grad_shard] if zero else (p.grad for p in stage.parameters()))
        if zero:
            zero.step()
        else:
            optimizer.step()

        comm = LEDGER.take()
        held = held_bytes(stage, optimizer, zero)
        if step == start_step:
            print_ledger(env, held, comm, cost, activations)
        if step % args.log_interval == 0 or step == args.max_iters - 1:
            loss_value = loss_sum.item()
            synchronize(env)
            metrics.step(step, loss_value, lr, time.perf_counter() - t0, held, comm, activations=activations)
        if zero:
            zero.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)
        if stop or args.ckpt_interval and ((step + 1) % args.ckpt_interval == 0 or step + 1 == args.max_iters):
            save(step + 1)
        if stop:
            guard.stop(step + 1)  # say how to resume, exit 0 on every rank

    if args.eval_interval and args.max_iters > start_step:
        losses = evaluate(stage, mesh, data, args, env, m, act_shape)
        log(env, f"step {args.max_iters}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        metrics.write({"step": args.max_iters, "val_loss": losses["val"], "train_loss": losses["train"]})
    teardown(env)


if __name__ == "__main__":
    main()
