"""What every script shares, and no strategy: the GPT model (nanoGPT's, dense or a mixture of
experts), the optimizer and its schedule, the data, the shared command line, launch / device /
process groups, and a plain `Run` doing only what a plain loop needs; infra's Run extends it.
With `from common import Run`, a script and this file alone train with 01's losses, because a
parameter's initial value is a pure function of (seed, name) (`param_init`) and step t's global
batch one of (seed, split, t) (`Data.batch`). The contract is docs/design.md's.
"""

import argparse
import datetime
import functools
import hashlib
import math
import os
import pickle
import re
import socket
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
# torch 2.13 renames these two (*_single) and warns; the scripts keep the names every torch since 2.0 has
warnings.filterwarnings("ignore", message=r".*torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
SHAKESPEARE_TXT = os.path.join(HERE, "data", "tinyshakespeare.txt")
SHAKESPEARE_MISSING = (f"--data shakespeare_char reads {SHAKESPEARE_TXT}, which is missing: copy data/ beside "
                       "common.py, or pass --data synthetic or --data DIR (nanoGPT's train.bin, val.bin)")


# ---- The GPT model (nanoGPT's, with the same module names) ----

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64, as nanoGPT does
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    # mixture of experts (MoE below): E expert MLPs per block, each token sent to its top_k; 0 = dense
    n_expert: int = 0
    top_k: int = 2
    aux_loss_coef: float = 0.01  # Switch Transformer's load-balancing loss, per block (--balance aux)
    balance: str = "aux"  # aux: that loss; bias: DeepSeek-V3's bias on the routing scores; none
    bias_update_rate: float = 1e-3  # --balance bias: gamma, the bias's step per optimizer step
    capacity_factor: float = 0.0  # GShard's capacity per sequence: C·k·s/E rows per expert; 0 = dropless
    shared_experts: int = 0  # DeepSeek-MoE's always-on experts per block, beside the k routed ones


PRESETS = {
    # tiny: CPU tests; 4 layers and 4 heads so that tp, pp in {1, 2, 4} all divide it
    "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64, dropout=0.0, bias=True),
    # nanoGPT's "baby GPT" for shakespeare_char (config/train_shakespeare_char.py)
    "shakespeare": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, bias=False),
    # GPT-2's four sizes (context 1024), then Brown et al. 2020, Table 2.1 (context 2048): (layers, heads,
    # d_model). Two cannot be built as printed: XL's 24 heads of 128 do not make d_model 2048 (16 heads of
    # 128 here); 13B's 5140 is not a multiple of 40 (5120)
    **{name: dict(n_layer=layers, n_head=heads, n_embd=width, block_size=1024 if name.startswith("gpt2") else 2048,
                  dropout=0.0, bias=True) for name, (layers, heads, width) in {
        "gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600),
        "gpt3-small": (12, 12, 768), "gpt3-medium": (24, 16, 1024), "gpt3-large": (24, 16, 1536),
        "gpt3-xl": (24, 16, 2048), "gpt3-2.7b": (32, 32, 2560), "gpt3-6.7b": (32, 32, 4096),
        "gpt3-13b": (40, 40, 5120), "gpt3-175b": (96, 96, 12288)}.items()},
}


# the default: nanoGPT's baby GPT twice as deep, 24 heads of 16, so that the bare commands run at
# every node size: 24 heads divide tp = 1, 2, 3, 4, 6, 8, 12, 24; 12 layers give pp up to 12
DEFAULT_MODEL = "baby"
PRESETS[DEFAULT_MODEL] = dict(n_layer=12, n_head=24, n_embd=384, block_size=256, dropout=0.2, bias=False)
# its mixture of experts, 10_expert_parallel.py's default: 8 per block, 2 per token (8 divides --ep)
DEFAULT_MOE_MODEL = DEFAULT_MODEL + "-moe"
PRESETS[DEFAULT_MOE_MODEL] = dict(PRESETS[DEFAULT_MODEL], n_expert=8, top_k=2)
# two mixtures of experts people train, in this model's terms (for --dry_run, the fit check and plan.py; docs/
# strategies.md says what differs): Mixtral 8x7B (Jiang et al. 2024) and DeepSeek-V3 (2024)
PRESETS["mixtral-8x7b"] = dict(n_layer=32, n_head=32, n_embd=4096, block_size=4096, dropout=0.0, bias=False,
                               n_expert=8, top_k=2)
PRESETS["deepseek-v3"] = dict(n_layer=61, n_head=128, n_embd=7168, block_size=4096, dropout=0.0, bias=False,
                              n_expert=256, top_k=8)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


def route(logits, top_k, bias=None, capacity_factor=0.0):
    """Top-k routing (Mixtral's): each token to its k most probable experts, weighted by those k
    probabilities renormalised. Returns weights (B·T, k); `order`, the stable permutation grouping the
    B·T·k entries (i·k + j: token i's j-th choice) by expert; `counts` (E,); Switch Transformer's
    balancing loss E·Σ_e f_e·P_e (f_e: share of assignments, no gradient; P_e: mean router probability)
    per sequence, averaged, so the same however the batch is split; and `load` (E,), the entries each
    expert was chosen for. `bias`: DeepSeek-V3's, added to the scores to choose the experts only.
    `capacity_factor` C > 0: GShard's capacity with one sequence as the group, so that every layout
    drops what 01 drops (docs/strategies.md, "Routing options"); `order` then lists the dropped
    entries last, and `counts` counts the kept."""
    probs = F.softmax(logits.float(), dim=-1)  # (B, T, E), in fp32 also under autocast
    B, T, E = probs.shape
    experts = torch.topk(probs if bias is None else probs + bias, top_k, dim=-1).indices  # the bias only chooses
    top_p = probs.gather(-1, experts)
    weights = top_p / top_p.sum(dim=-1, keepdim=True)
    assigned = torch.zeros(B, E, device=probs.device).scatter_add_(  # f_e·k·T per sequence
        1, experts.view(B, -1), torch.ones(B, T * top_k, device=probs.device))
    aux = E * (assigned / (T * top_k) * probs.mean(dim=1)).sum(dim=1).mean()
    flat = experts.reshape(-1)
    load = torch.bincount(flat, minlength=E)
    if not capacity_factor:  # dropless
        return weights.view(B * T, top_k), torch.argsort(flat, stable=True), load, aux, load
    # each entry's place in its expert's queue, in GShard's order: sort (sequence, expert) pairs stably
    # in the order (sequence, choice j, position t); the place is the index less where the pair begins
    key = (experts.transpose(1, 2) + E * torch.arange(B, device=flat.device).view(B, 1, 1)).reshape(-1)
    sort = torch.argsort(key, stable=True)
    per = torch.bincount(key, minlength=B * E)
    place = torch.empty_like(sort).scatter_(0, sort, torch.arange(key.numel(), device=flat.device)
                                            - (per.cumsum(0) - per)[key[sort]])
    kept = place.view(B, top_k, T).transpose(1, 2).reshape(-1) < math.ceil(capacity_factor * top_k * T / E)
    flat = torch.where(kept, flat, E)  # the dropped entries, as an expert E past the last: last in order
    return weights.view(B * T, top_k), torch.argsort(flat, stable=True), torch.bincount(flat, minlength=E + 1)[:E], aux, load


def combine(out, order, weights):
    """Undo `route`'s grouping (row j of `out` is entry order[j]; the entries past out's rows, dropped,
    give zeros); each token's k outputs, weighted."""
    k = weights.size(1)
    out = out.new_zeros(weights.numel(), out.size(-1)).index_put((order[:out.size(0)],), out).view(-1, k, out.size(-1))
    return (out * weights.unsqueeze(-1)).sum(dim=1)


class Router(nn.Linear):
    """An MoE block's router: a Linear to E scores (no bias), then `route`. --balance bias's per-expert
    bias is a buffer (no gradient; update_expert_bias moves it; checkpointed). Training forwards sum
    the entries chosen per expert and dropped on the device (expert_load)."""

    def __init__(self, config):
        super().__init__(config.n_embd, config.n_expert, bias=False)
        self.top_k, self.capacity_factor, self.rate = config.top_k, config.capacity_factor, config.bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(config.n_expert) if config.balance == "bias" else None)
        self.load = self.dropped = None

    def forward(self, x):
        weights, order, counts, aux, load = route(super().forward(x), self.top_k, self.expert_bias,
                                                  self.capacity_factor)
        if torch.is_grad_enabled():  # a training forward (with --recompute: the one in backward)
            dropped = load.sum() - counts.sum()
            self.load, self.dropped = (load, dropped) if self.load is None else (self.load + load, self.dropped + dropped)
        return weights, order, counts, aux


class MoE(nn.Module):
    """A mixture of experts for the MLP (Shazeer et al. 2017): E of nanoGPT's MLPs and a Router;
    with --shared_experts S, DeepSeek-MoE's S MLPs that every token passes through, added to its
    routed output. Dropless by default: an expert's batch varies by step. Returns (out, aux)."""

    def __init__(self, config):
        super().__init__()
        self.router = Router(config)
        self.experts = nn.ModuleList([MLP(config) for _ in range(config.n_expert)])
        self.shared = nn.ModuleList([MLP(config) for _ in range(config.shared_experts)])
        self.top_k, self.rows = config.top_k, []

    def forward(self, x):
        B, T, C = x.shape
        weights, order, counts, aux = self.router(x)
        sizes = counts.tolist()
        if torch.is_grad_enabled() and self.router.capacity_factor:  # the rows the experts ran (expert_rows)
            self.rows.append(sum(sizes))
        rows = x.reshape(B * T, C)[order[:sum(sizes)] // self.top_k]  # the kept tokens, grouped by expert
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, rows.split(sizes))])
        return shared_plus(self.shared, combine(out, order, weights).view(B, T, C), x), aux


def shared_plus(shared, y, x):
    """y plus the shared experts' outputs on x (DeepSeek-MoE: the knowledge every token needs)."""
    for expert in shared:
        y = y + expert(x)
    return y


def expert_load(model):
    """The routers' counts since the last call, and reset: ((L, E) entries per expert chosen, (L,)
    entries dropped), on the device (none read on the host)."""
    routers = [block.mlp.router for block in model.transformer.h]
    load, dropped = torch.stack([r.load for r in routers]), torch.stack([r.dropped for r in routers])
    for r in routers:
        r.load = r.dropped = None
    return load, dropped


def expert_step(model, load=None, dropped=None):
    """After the optimizer step: --balance bias's update on the whole global batch's counts (by
    default the routers' own, expert_load, which are that where one process trains on it all: 01),
    then the metrics' routing keys as a function (read on the host only when a step is logged)."""
    if load is None:
        load, dropped = expert_load(model)
    update_expert_bias(model, load)
    return lambda: routing_metrics(load, dropped)


def routing_metrics(load, dropped):
    """expert_tokens (entries per expert, summed over the layers), expert_imbalance (max/mean of the
    entries per expert, in the worst layer) and dropped_fraction (of all entries, --capacity_factor)."""
    load = load.float()
    return {"expert_tokens": [int(n) for n in load.sum(dim=0).tolist()],
            "expert_imbalance": (load.max(dim=1).values / load.mean(dim=1)).max().item(),
            "dropped_fraction": (dropped.float().sum() / load.sum()).item()}


def expert_rows(model):
    """--capacity_factor: {"rows": the rows each block's experts ran, per micro-batch, since the last
    call} (what 01's costs() needs for its activations on the step's drops), and reset; else {}."""
    if not (model.config.n_expert and model.config.capacity_factor):
        return {}
    rows = [block.mlp.rows for block in model.transformer.h]
    for block in model.transformer.h:
        block.mlp.rows = []
    return {"rows": rows}


@torch.no_grad()
def update_expert_bias(model, load):
    """--balance bias, after the optimizer step (DeepSeek-V3): each router's bias moves by
    gamma·sign(mean load − load). `load` (L, E): the entries per expert of the whole global batch,
    the same on every rank, so that every rank's biases stay equal. Otherwise nothing."""
    for block, layer in zip(model.transformer.h, load):
        router = block.mlp.router
        if router.expert_bias is not None:
            router.expert_bias += router.rate * torch.sign(layer.float().mean() - layer)


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln_1(x)), then x + mlp(ln_2(x)); with experts, (x, its balancing loss)."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if config.n_expert else MLP(config)
        self.moe = config.n_expert > 0

    recompute = False  # --recompute: keep only the block's input, recompute the rest in backward

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            return recomputed(self.body, x)
        return self.body(x)

    def body(self, x):
        x = x + self.attn(self.ln_1(x))
        if self.moe:
            y, aux = self.mlp(self.ln_2(x))
            return x + y, aux
        return x + self.mlp(self.ln_2(x))


def param_init(name, shape, config, seed):
    """`name`'s initial value (GPT-2's), a pure function of (seed, name), so any rank builds any shard
    alone: N(0, 0.02), N(0, 0.02/sqrt(2*n_layer)) for c_proj, ones for LayerNorm, zeros for biases."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name:
        return torch.ones(shape)
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=generator)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying (Press & Wolf 2017): the output head is the token embedding
        self.transformer.wte.weight = self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, seed):
        for name, p in self.named_parameters():  # the tied weight is visited once, as wte
            p.copy_(param_init(name, p.shape, self.config, seed))
        for buffer in self.buffers():  # the routers' biases (--balance bias) start at zero
            buffer.zero_()
        return self

    def num_params(self, non_embedding=True):
        """Parameter count as nanoGPT reports it: without wpe (wte stays: it is also the head)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        aux = 0.0
        for block in self.transformer.h:
            x = block(x)
            if self.config.n_expert:  # an MoE block: (x, its load-balancing loss)
                x, aux = x[0], aux + x[1]
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: only the last position's logits are needed
            return self.lm_head(x[:, -1:, :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        if self.config.n_expert and self.training:  # the objective; evaluation reports the LM loss
            loss = loss + self.config.aux_loss_coef * aux
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[0][:, -1, :] / temperature
            if not torch.isfinite(logits).all():  # the last update can leave the weights non-finite (a huge --lr)
                print("error: the model's logits are not finite after its last step (too large an --lr?): no sample",
                      file=sys.stderr, flush=True)
                sys.exit(3)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)), dim=1)
        return idx


class _Recompute(torch.autograd.Function):
    """Activation recomputation (Chen et al. 2016): forward keeps only the input; backward runs `fn` again
    with the same autocast and random streams. By hand, not torch.utils.checkpoint, whose hooks hide the
    kept and recomputed tensors from the ActivationMeter, and so that trackers' streams (TP dropout) are restored."""

    @staticmethod
    def forward(ctx, fn, trackers, x):
        device_type = x.device.type
        ctx.fn, ctx.trackers = fn, trackers
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.rng = (device_rng_state(x.device), [t.state for t in trackers])
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)  # a tensor, or a tuple of them (an MoE block: x and its balancing loss)

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        now = (device_rng_state(x.device), [t.state for t in ctx.trackers])
        set_device_rng_state(x.device, ctx.rng[0])  # the dropout masks of the first forward
        for tracker, state in zip(ctx.trackers, ctx.rng[1]):
            tracker.state = state
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            out = ctx.fn(x)
        set_device_rng_state(x.device, now[0])  # the streams go on as if nothing was redone
        for tracker, state in zip(ctx.trackers, now[1]):
            tracker.state = state
        torch.autograd.backward(out, grads if isinstance(out, tuple) else grads[0])
        return None, None, x.grad


def recomputed(fn, x, trackers=()):
    """fn(x) with activation recomputation: only x is held for backward (see _Recompute)."""
    return _Recompute.apply(fn, tuple(trackers), x)


def preset_config(args):
    """The --model preset with the per-dimension overrides (--n_layer ... --bias) applied."""
    cfg = {"n_expert": 0, **PRESETS[args.model]}
    cfg.update({key: getattr(args, key) for key in cfg if getattr(args, key, None) is not None})
    if cfg["n_expert"]:  # --top_k, --aux_loss_coef and the routing options shape only a mixture of experts
        for key in ("top_k", "balance", "bias_update_rate", "capacity_factor", "shared_experts", "aux_loss_coef"):
            value = getattr(args, key, None)
            cfg[key] = value if value is not None else cfg.get(key, getattr(GPTConfig, key))
        if getattr(args, "aux_loss_coef", None) is None and cfg["balance"] != "aux":
            cfg["aux_loss_coef"] = 0.0  # the loss is --balance aux's (bias: DeepSeek-V3's small one if asked)
    return cfg


def model_block_size(args):
    """The context length of --model with its overrides (the data loader's, before the vocabulary)."""
    return preset_config(args)["block_size"]


def model_config(args, vocab_size):
    """GPTConfig from --model and the per-dimension overrides."""
    return GPTConfig(vocab_size=vocab_size, **preset_config(args))


def param_shapes(config):
    """{name: shape} of GPT(config)'s parameters in named_parameters() order (tied head once, as wte),
    from the config alone: costs need sizes, and a meta model's first init imports torch's bulk (1 s)."""
    h = config.n_embd

    def layer(name, *weight):  # a Linear (out, in) or a LayerNorm (h,), with its bias unless bias=False
        return {f"{name}.weight": weight, **({f"{name}.bias": weight[:1]} if config.bias else {})}

    def mlp(name):
        return {**layer(f"{name}.c_fc", 4 * h, h), **layer(f"{name}.c_proj", h, 4 * h)}
    shapes = {"transformer.wte.weight": (config.vocab_size, h), "transformer.wpe.weight": (config.block_size, h)}
    for i in range(config.n_layer):
        block = f"transformer.h.{i}"
        shapes.update({**layer(f"{block}.ln_1", h), **layer(f"{block}.attn.c_attn", 3 * h, h),
                       **layer(f"{block}.attn.c_proj", h, h), **layer(f"{block}.ln_2", h)})
        if config.n_expert:  # the router (no bias), then the experts, then the shared experts
            shapes[f"{block}.mlp.router.weight"] = (config.n_expert, h)
            for j in range(config.n_expert):
                shapes.update(mlp(f"{block}.mlp.experts.{j}"))
            for j in range(config.shared_experts):
                shapes.update(mlp(f"{block}.mlp.shared.{j}"))
        else:
            shapes.update(mlp(f"{block}.mlp"))
    shapes.update(layer("transformer.ln_f", h))
    return shapes


def count_params(config):
    """(Ψ: every parameter once, the tied embedding/head once; nanoGPT's count: Ψ less wpe)."""
    psi = sum(math.prod(shape) for shape in param_shapes(config).values())
    return psi, psi - config.block_size * config.n_embd


def build_model(config, seed, device, recompute=False):
    """The full model, initialised by `param_init`, on `device`; `recompute`: see Block."""
    model = GPT(config).init_weights(seed).to(device)
    for block in model.transformer.h:
        block.recompute = recompute
    return model


# ---- The optimizer and the learning-rate schedule (nanoGPT's) ----

ADAM_BETAS = (0.9, 0.95)


def is_decayed(shape):
    """nanoGPT's rule, decay on matrices only; by shape, so that a flat shard gets its rule too."""
    return len(shape) >= 2


def decay_groups(params):
    """(decayed, not decayed): the parameters that train, split by `is_decayed`."""
    params = [p for p in params if p.requires_grad]
    return [p for p in params if is_decayed(p.shape)], [p for p in params if not is_decayed(p.shape)]


def make_adamw(params, args, device_type, not_decayed=None):
    """AdamW in nanoGPT's two groups (decay_groups', or `params` and `not_decayed` given), fused on GPUs."""
    decayed, not_decayed = decay_groups(params) if not_decayed is None else (params, not_decayed)
    groups = [{"params": list(decayed), "weight_decay": args.weight_decay},
              {"params": list(not_decayed), "weight_decay": 0.0}]
    fused = device_type in ("cuda", "xpu")
    return torch.optim.AdamW(groups, lr=args.lr, betas=ADAM_BETAS, **({"fused": True} if fused else {}))


# Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025): the blocks' weight matrices take the
# momentum, made (nearly) orthogonal, as their update; the rest keep AdamW. Moonlight's scale,
# 0.2·sqrt(max(rows, cols)), matches the update's RMS to AdamW's: one lr and weight decay serve both.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: steepest slope at 0 that still converges
NS_STEPS = 5
MUON_MOMENTUM = 0.95


def is_hidden_matrix(name, shape):
    """Muon's share: the blocks' 2-D weights (attention, MLP, experts), by name (01's or 07's chunks')."""
    return len(shape) == 2 and re.search(r"(^|\.)h\.\d+\.", name) is not None and ".router." not in name


def orthogonalize(g, dtype=torch.float32):
    """Newton-Schulz: about U·Vᵀ of g = U·S·Vᵀ, every singular value pushed towards 1 by NS_STEPS
    odd quintic steps X <- a·X + (b·A + c·A·A)·X, A = X·Xᵀ, from X = g/‖g‖ on its wide side
    (A is then the smaller Gram matrix). No SVD: matrix products only, in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)  # singular values now at most 1, where the iteration converges
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_momentum(grad, momentum_buffer):
    """Nesterov momentum, element-wise: a strategy's shard of the matrix gets its shard of the update."""
    momentum_buffer.lerp_(grad, 1 - MUON_MOMENTUM)    # B <- μ·B + (1-μ)·g
    return grad.lerp(momentum_buffer, MUON_MOMENTUM)  # Nesterov: g + μ·(B - g)


def muon_apply(param, orthogonal, lr, weight_decay, shape):
    """Decoupled weight decay, then the step along the orthogonalised update scaled by Moonlight's
    0.2·sqrt(max(rows, cols)) of the whole matrix's `shape` (`param` may be a shard of it)."""
    param.mul_(1 - lr * weight_decay)
    param.add_(orthogonal.to(param.dtype), alpha=-lr * 0.2 * math.sqrt(max(shape)))


class Muon(torch.optim.Optimizer):
    """Muon for `matrices`, `adamw` (the rest) inside: one optimizer, one lr, one state table."""

    def __init__(self, matrices, adamw, args, ns_dtype):
        super().__init__([{"params": list(matrices), "weight_decay": args.weight_decay}], {"lr": args.lr})
        self.adamw, self.ns_dtype = adamw, ns_dtype
        self.state = adamw.state
        self.param_groups += adamw.param_groups  # the same dicts: the loop's lr reaches AdamW's groups
        for p in self.param_groups[0]["params"]:  # made now: a checkpoint (or a resume) finds it at once
            self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        group = self.param_groups[0]
        for p in group["params"]:
            if p.grad is not None:
                update = muon_momentum(p.grad, self.state[p]["momentum_buffer"])
                muon_apply(p, orthogonalize(update, self.ns_dtype), group["lr"], group["weight_decay"], p.shape)
        self.adamw.step()


def make_optimizer(named_params, args, env, muon=Muon):
    """adamw, or Muon for the blocks' matrices with Newton-Schulz in the run's dtype (as Jordan's);
    `muon`: Muon's class, or a strategy's Muon that divides the work among ranks (03's ReplicatedMuon)."""
    named = [(name, p) for name, p in named_params if p.requires_grad]
    if args.optimizer == "adamw":
        return make_adamw([p for _, p in named], args, env.device.type)
    rest = make_adamw([p for name, p in named if not is_hidden_matrix(name, p.shape)], args, env.device.type)
    return muon([p for name, p in named if is_hidden_matrix(name, p.shape)], rest, args, env.dtype)


def lr_at(step, args):
    """Linear warm-up, then cosine decay to min_lr at lr_decay_iters (nanoGPT's get_lr)."""
    if step < args.warmup_iters:
        return args.lr * (step + 1) / (args.warmup_iters + 1)
    if step >= args.lr_decay_iters:
        return args.min_lr
    ratio = (step - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


# ---- Data ----

SPLITS = {"train": 0, "val": 1}
SHAKESPEARE_TRAIN_FRACTION = 0.9  # the first 90% of the text is train, the rest val (nanoGPT's split)
EVAL_KEY = 2  # evaluation batches: streams of their own, the same at every evaluation


class _Stub:
    """What a pickle would build by calling something (an object, a numpy scalar, an exploit)."""

    def __new__(cls, *args):
        stub = object.__new__(cls)
        stub.args, stub.state = args, None
        return stub

    def __setstate__(self, state):
        self.state = state


class _PlainUnpickler(pickle.Unpickler):
    """A pickle's plain data only: every class or function it names is a _Stub, nothing runs."""

    def find_class(self, module, name):
        return type(f"{module}.{name}", (_Stub,), {"name": f"{module}.{name}"})


def _plain_int(value):
    """An int, or a pickled numpy integer scalar decoded without numpy's unpickling; else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, _Stub) and value.name.endswith("multiarray.scalar") and len(value.args) == 2:
        dtype, raw = value.args
        if isinstance(raw, _Stub) and raw.name == "_codecs.encode" and len(raw.args) == 2:  # protocols 0-2
            raw = raw.args[0].encode(raw.args[1]) if isinstance(raw.args[0], str) and raw.args[1] == "latin1" else None
        code = dtype.args[0] if isinstance(dtype, _Stub) and dtype.args else None
        if isinstance(code, str) and code[:1] in "iu" and isinstance(raw, bytes) and len(raw) == int(code[1:] or 0):
            state = dtype.state if isinstance(dtype.state, tuple) else ()
            order = "big" if len(state) > 1 and state[1] == ">" else "little"
            return int.from_bytes(raw, order, signed=code[0] == "i")
    return None


def read_vocab_size(meta_path):
    """A nanoGPT meta.pkl's top-level vocab_size (an int or numpy integer), none of its code run."""
    with open(meta_path, "rb") as f:
        meta = _PlainUnpickler(f).load()
    if not isinstance(meta, dict) or "vocab_size" not in meta:
        raise ValueError(f"{meta_path} has no top-level vocab_size")
    vocab = _plain_int(meta["vocab_size"])
    if vocab is None:
        kind = meta["vocab_size"].name if isinstance(meta["vocab_size"], _Stub) else type(meta["vocab_size"]).__name__
        raise ValueError(f"{meta_path}'s vocab_size is a {kind}, not an integer")
    return vocab


def token_dtype(spec):
    """A --data directory's token dtype: nanoGPT's uint16, or uint32 where its meta.pkl says
    dtype "uint32" (prepare.py's, for vocabularies above 65,536 tokens)."""
    meta = os.path.join(spec, "meta.pkl")
    if not os.path.isfile(meta):
        return np.dtype(np.uint16)
    with open(meta, "rb") as f:
        found = _PlainUnpickler(f).load()
    return np.dtype(np.uint32 if isinstance(found, dict) and found.get("dtype") == "uint32" else np.uint16)


class TokenFile:
    """A nanoGPT token file (uint16, or uint32) read by pread, not mmap: a truncated file is one line, not SIGBUS."""

    def __init__(self, path, dtype=np.dtype(np.uint16)):
        self.path, self.fd, self.dtype = path, os.open(path, os.O_RDONLY), dtype
        self.length = os.fstat(self.fd).st_size // dtype.itemsize

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):  # a plain range of tokens
            index = np.arange(*index.indices(self.length))
        index = np.asarray(index)
        rows = index.reshape(-1, index.shape[-1])
        out, size = np.empty(rows.shape, dtype=self.dtype), self.dtype.itemsize
        for r, row in enumerate(rows):
            data = os.pread(self.fd, size * len(row), size * int(row[0]))
            check(len(data) == size * len(row), f"{self.path} is now {os.fstat(self.fd).st_size} bytes, shorter than "
                  f"the {size * self.length} it had when the run started: it was truncated or rewritten under the "
                  "running job")
            out[r] = np.frombuffer(data, dtype=self.dtype)
        return out.reshape(index.shape)


def shakespeare_text():
    """The default corpus, data/tinyshakespeare.txt beside this file (a copied script needs data/ too)."""
    check(os.path.isfile(SHAKESPEARE_TXT), SHAKESPEARE_MISSING)
    with open(SHAKESPEARE_TXT, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def shakespeare_tokens():
    """The default corpus as (its characters, sorted: the vocabulary; the text as their indices),
    made once per process (the fit check, plan.py and Data ask; read-only, since they share it)."""
    text = shakespeare_text()
    chars = tuple(sorted(set(text)))
    lut = np.zeros(max(map(ord, chars)) + 1, dtype=np.uint16)
    lut[[ord(c) for c in chars]] = np.arange(len(chars), dtype=np.uint16)
    tokens = lut[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    tokens.flags.writeable = False
    return chars, tokens


def shakespeare_vocab_size():
    """The default corpus's character count."""
    return len(shakespeare_tokens()[0])


class Data:
    """Token streams, and batches the same whatever the world size: step t's windows come from a
    generator seeded by (seed, split, t); rank r of D takes rows [r·B/D, (r+1)·B/D) of 01's batch."""

    def __init__(self, spec, seed, block_size):
        self.seed, self.block_size, self.itos = seed, block_size, None
        if spec == "shakespeare_char":
            chars, tokens = shakespeare_tokens()
            self.itos = chars
            n = int(SHAKESPEARE_TRAIN_FRACTION * len(tokens))
            self.splits, self.vocab_size = {"train": tokens[:n], "val": tokens[n:]}, len(chars)
        elif spec == "synthetic":
            self.splits, self.vocab_size = synthetic_corpus(), SYNTHETIC_VOCAB
        else:
            self.splits = {s: TokenFile(os.path.join(spec, f"{s}.bin"), token_dtype(spec)) for s in SPLITS}
            self.vocab_size = Data.vocab_size_of(spec)

    @staticmethod
    def vocab_size_of(spec):
        """The vocabulary size of --data, without building its token streams (--dry_run)."""
        if spec == "shakespeare_char":
            return shakespeare_vocab_size()
        if spec == "synthetic":
            return SYNTHETIC_VOCAB
        vocab, _, problem = Data.vocabulary(spec)
        check(problem is None, problem)  # a dry run reads it before anything else is checked
        return vocab

    @staticmethod
    def vocabulary(spec):
        """(vocab_size, its source, None) of a --data directory, or (None, None, the problem)."""
        if not os.path.isdir(spec):
            return None, None, (f"--data {spec}: no such directory (expected shakespeare_char, synthetic, "
                                "or a directory with train.bin and val.bin)")
        meta = os.path.join(spec, "meta.pkl")
        if not os.path.exists(meta):
            return 50304, "GPT-2's padded vocabulary (there is no meta.pkl)", None
        try:
            vocab = read_vocab_size(meta)
        except Exception as e:  # a damaged or foreign meta.pkl
            return None, None, f"--data {spec}: cannot read vocab_size from {meta} ({e})"
        bits = 8 * token_dtype(spec).itemsize  # 32 where prepare.py wrote uint32 (above 65,536 tokens)
        if not 0 < vocab <= 1 << bits:
            return None, None, (f"--data {spec}: {meta} says vocab_size {vocab}; it must be in 1..{1 << bits} "
                                f"(uint{bits} tokens{'; meta.pkl dtype uint32 for more' if bits == 16 else ''})")
        return vocab, f"{meta}'s vocab_size", None

    def batch(self, split, step, global_batch_size, dp_rank=0, dp_size=1, eval_split=False):
        """(x, y) int64 (global_batch_size/dp_size, block_size): this rank's slice of `step`'s batch."""
        tokens = self.splits[split]
        stream = SPLITS[split] + (EVAL_KEY if eval_split else 0)
        rng = np.random.default_rng([self.seed, stream, step])
        starts = rng.integers(0, len(tokens) - self.block_size - 1, size=global_batch_size)
        per_rank = global_batch_size // dp_size
        starts = starts[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        window = np.arange(self.block_size + 1)
        xy = torch.from_numpy(np.asarray(tokens[starts[:, None] + window], dtype=np.int64))
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()

    def decode(self, ids):
        return " ".join(map(str, ids)) if self.itos is None else "".join(self.itos[i] for i in ids)


SYNTHETIC_VOCAB = 256
SYNTHETIC_TOKENS = {"train": 1 << 21, "val": 1 << 17}


def synthetic_corpus(n_train=SYNTHETIC_TOKENS["train"], n_val=SYNTHETIC_TOKENS["val"]):
    """A learnable stream for offline benchmarks: a Markov chain, 4 successors a token (loss ~log 4)."""
    rng = np.random.default_rng(1234)
    successors = rng.integers(0, SYNTHETIC_VOCAB, size=(SYNTHETIC_VOCAB, 4))
    choice = rng.integers(0, 4, size=n_train + n_val)
    # a loop (each token depends on the one before): ~0.25 s for 2M tokens on Python ints, 4x that on numpy scalars
    table, picks, token, tokens = successors.ravel().tolist(), choice.tolist(), 0, [0]
    for i in range(1, n_train + n_val):
        token = table[4 * token + picks[i]]
        tokens.append(token)
    stream = np.array(tokens, dtype=np.uint16)
    return {"train": stream[:n_train], "val": stream[n_train:]}


def to_device(t, env):
    """Host-to-device copy; pinned and non-blocking on GPUs so it overlaps compute."""
    if env.device.type in ("cuda", "xpu"):
        return t.pin_memory().to(env.device, non_blocking=True)
    return t.to(env.device)


FAKE_HOST = None  # tests: infra.fake_host puts its host_tensor here (this file imports nothing from infra)


def to_host(t, device):
    """`t` in host memory, pinned for asynchronous DMA; GPTPAR_FAKE_HOST=1 (tests): infra's HostTensor."""
    out = t.to("cpu", copy=True)
    if device.type in ("cuda", "xpu"):
        out = out.pin_memory()
    if FAKE_HOST and os.environ.get("GPTPAR_FAKE_HOST") == "1":  # tests: host memory told apart (infra.fake_host)
        out = FAKE_HOST(out)
    return out


# ---- The command line and validation ----

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(message)


def base_parser(doc):
    """An argparse parser whose errors are one line from rank 0 and exit 2 on every rank."""
    return _Parser(description=doc.split("\n\n")[0] if doc else None,
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def make_parser(doc, experts=False):
    """The shared flags (docs/design.md); `experts`: the script has a mixture of experts."""
    p = base_parser(doc)
    p.experts = experts
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(PRESETS), help="preset")
    for name, kind in (("n_layer", int), ("n_head", int), ("n_embd", int), ("block_size", int), ("dropout", float)):
        g.add_argument(f"--{name}", type=kind)  # each overrides the preset's
    g.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="biases in Linear and LayerNorm (preset's choice by default)")
    # a mixture of experts (01, 08 and 10 have one) and its routing: docs/strategies.md, "Routing options"
    g.add_argument("--n_expert", type=int, help="E expert MLPs per block, 0 = dense (preset's choice by default)")
    g.add_argument("--top_k", type=int, help="experts per token (default 2)")
    g.add_argument("--aux_loss_coef", type=float, help="load-balancing loss per block (0.01 with --balance aux)")
    g.add_argument("--balance", choices=["aux", "bias", "none"], help="Switch's loss (default), DeepSeek-V3's bias")
    g.add_argument("--bias_update_rate", type=float, help="--balance bias: its step per optimizer step (1e-3)")
    g.add_argument("--capacity_factor", type=float, help="GShard's capacity per sequence; 0 = dropless (default)")
    g.add_argument("--shared_experts", type=int, help="DeepSeek-MoE's always-on experts per block (default 0)")
    g = p.add_argument_group("data and batch")
    g.add_argument("--data", default="shakespeare_char", help="shakespeare_char (data/ beside common.py), "
                   "synthetic, or a directory with nanoGPT's train.bin/val.bin")
    # 48 divides every data-parallel size of one or two nodes: 1, 2, 3, 4, 6, 8, 12, 16, 24
    g.add_argument("--global_batch_size", type=int, default=48, help="sequences per optimizer step, all ranks")
    g.add_argument("--micro_batch_size", type=micro_batch_size_arg, default="auto",
                   help="sequences per forward per data-parallel rank, or auto: the largest that divides the "
                        "rank's share (with infra: that fits its memory)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_iters", type=int, default=5000)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min_lr", type=float, default=1e-4)
    g.add_argument("--warmup_iters", type=int, default=100)
    g.add_argument("--lr_decay_iters", type=int, default=None, help="end of the cosine decay (default: max_iters)")
    g.add_argument("--weight_decay", type=float, default=0.1)
    g.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="muon: Muon for the blocks' weight matrices, AdamW for the rest (one --lr)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--seed", type=int, default=1337)
    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval_interval", type=int, default=250, help="0 disables evaluation")
    g.add_argument("--eval_iters", type=int, default=20)
    g.add_argument("--log_interval", type=int, default=10)
    g = p.add_argument_group("checkpoints")
    g.add_argument("--out_dir", default="out")
    g.add_argument("--ckpt_interval", type=int, default=0, help="0: no checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from out_dir's checkpoint (this layout's; "
                   "with infra: any script's at any layout)")
    g.add_argument("--overwrite", action="store_true",
                   help="a new run may replace the checkpoint of another run in --out_dir (refused without it)")
    g = p.add_argument_group("system")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "xpu", "mps", "cpu"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on GPUs that support it, float32 elsewhere (float16 is refused)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    g.add_argument("--recompute", action="store_true", help="activation recomputation (Chen et al. 2016): keep "
                   "only each block's input for backward, and run its forward again there")
    g.add_argument("--bitwise", action="store_true", help="gradients summed in one fixed tree over the micro-"
                   "batches, deterministic kernels: DP, ZeRO, FSDP, PP equal 01 --bitwise (docs/numerics.md)")
    return p


def micro_batch_size_arg(text):
    """--micro_batch_size: "auto" or a whole number (the range is checked with the others)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number, got {text!r}") from None


MAX_BATCH = 2**24  # sequences per step: far more than any published run; a larger one is a typo
# The largest model these scripts build: a typo such as --n_expert 1000000 is one line, not minutes.
MAX_WIDTH = 2**20  # --n_embd: 85x GPT-3 175B's 12,288
MAX_MLPS = 2**16  # n_layer x max(1, n_expert) MLPs: 2x Switch-C's 15 x 2,048 experts
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week: longer than any job, within what the process group accepts


def parse_args(parser, argv=None):
    """The shared flags, validated alike on every rank; infra's Run checks what depends on files."""
    args = parser.parse_args(argv)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.max_iters
    cfg = preset_config(args)
    # float16 needs dynamic loss scaling whose overflow check every rank agrees on (sharded gradients
    # too); bfloat16 has float32's range and needs none, and A100, H100/H200, MI250X, Max 1550 have it
    check(args.dtype != "float16", "--dtype float16 is not supported: it needs loss scaling, "
          "which these scripts leave out; use --dtype bfloat16 (float32's range, no scaling needed)")
    for name, value in vars(args).items():  # nan and inf pass no range check below: refuse them here
        check(not isinstance(value, float) or math.isfinite(value), f"--{name} must be a finite number, got {value}")
    for name in ("global_batch_size", "micro_batch_size", "max_iters", "eval_iters", "log_interval"):
        value = getattr(args, name)
        check(value is None or value == "auto" or value > 0, f"--{name} must be positive, got {value}")
    for name in ("n_layer", "n_head", "n_embd", "block_size"):
        check(cfg[name] > 0, f"--{name} must be positive, got {cfg[name]}")
    for name in ("warmup_iters", "lr_decay_iters", "eval_interval", "weight_decay", "grad_clip", "lr", "min_lr"):
        check(getattr(args, name) >= 0, f"--{name} must not be negative, got {getattr(args, name)}")
    for name in ("lr", "min_lr"):  # the optimizers take the lr as a float32 scalar: past its range, a traceback
        check(getattr(args, name) <= torch.finfo(torch.float32).max,
              f"--{name} {getattr(args, name):g} is beyond float32's range (at most 3.4e38): no step can be taken with it")
    check(0 <= args.seed < 2**32, f"--seed must be in [0, 2^32), got {args.seed}")
    check(0.0 <= cfg["dropout"] < 1.0, f"--dropout must be in [0, 1), got {cfg['dropout']}")
    check(cfg["n_embd"] % cfg["n_head"] == 0, f"n_embd {cfg['n_embd']} is not divisible by n_head {cfg['n_head']}")
    check(cfg["n_expert"] >= 0, f"--n_expert must not be negative, got {cfg['n_expert']}")
    script = os.path.basename(sys.argv[0]) or "this script"
    check(not cfg["n_expert"] or getattr(parser, "experts", False), f"--n_expert {cfg['n_expert']}"
          f"{' (--model ' + args.model + ')' if args.n_expert is None else ''}: {script} has no mixture of "
          "experts; 01_single_gpu.py, 08_3d.py (--ep) and 10_expert_parallel.py have")
    check(cfg["n_expert"] or (args.top_k is None and args.aux_loss_coef is None),
          "--top_k and --aux_loss_coef belong to a mixture of experts: pass --n_expert E")
    routing = [f"--{key}" for key in ("balance", "bias_update_rate", "capacity_factor", "shared_experts")
               if getattr(args, key, None) is not None]
    check(cfg["n_expert"] or not routing, f"{' and '.join(routing)}: routing options of a mixture of experts: "
          "pass --n_expert E")
    if cfg["n_expert"]:
        given = "" if args.top_k is not None else " (the default: pass --top_k)"
        check(1 <= cfg["top_k"] <= cfg["n_expert"], f"--top_k must be in [1, n_expert = "
              f"{cfg['n_expert']}], got {cfg['top_k']}{given}")
        check(cfg.get("aux_loss_coef", 0) >= 0, f"--aux_loss_coef must not be negative, got {cfg['aux_loss_coef']}")
        check(cfg["balance"] != "none" or args.aux_loss_coef is None, "--aux_loss_coef with --balance none: "
              "none trains without balancing (--balance aux is the loss)")
        check(cfg["balance"] == "bias" or args.bias_update_rate is None, "--bias_update_rate is the step of "
              f"--balance bias's bias, and this run has --balance {cfg['balance']}")
        check(cfg["bias_update_rate"] >= 0, f"--bias_update_rate must not be negative, got {cfg['bias_update_rate']}")
        check(cfg["capacity_factor"] >= 0, f"--capacity_factor must not be negative, got {cfg['capacity_factor']} "
              "(0 = dropless)")
        check(cfg["shared_experts"] >= 0, f"--shared_experts must not be negative, got {cfg['shared_experts']}")
    check(cfg["n_embd"] <= MAX_WIDTH, f"--n_embd {cfg['n_embd']} is more than {MAX_WIDTH:,} (GPT-3 175B has "
          "12,288): a typo?")
    mlps = cfg["n_layer"] * max(1, cfg["n_expert"] + cfg.get("shared_experts", 0))
    check(mlps <= MAX_MLPS, f"--n_layer {cfg['n_layer']}" + (f" x --n_expert {cfg['n_expert']}" if cfg["n_expert"] else "")
          + (f" (+ {cfg['shared_experts']} shared)" if cfg.get("shared_experts") else "")
          + f" = {mlps:,} MLPs, more than the {MAX_MLPS:,} these scripts build (Switch-C, the largest published "
          "mixture of experts, has 30,720; GPT-3 175B 96 layers): a typo?")
    check(args.global_batch_size <= MAX_BATCH, f"--global_batch_size {args.global_batch_size} is more than "
          f"{MAX_BATCH:,} sequences per step: a typo?")
    check(0 < args.timeout <= MAX_TIMEOUT_S, f"--timeout must be in (0, {MAX_TIMEOUT_S}] seconds, got {args.timeout}")
    check(args.ckpt_interval >= 0, f"--ckpt_interval must not be negative, got {args.ckpt_interval}")
    check(not (args.resume and args.overwrite), "--resume continues the run in --out_dir, --overwrite replaces it: "
          "pass one")
    check(args.out_dir != "", "--out_dir is empty (an unset variable in a job script?): name a directory")
    return args


def check_batch(args, dp_size):
    """Gradient-accumulation steps = global / (micro · dp), which must be a whole number."""
    check(args.global_batch_size % (args.micro_batch_size * dp_size) == 0,
          f"--global_batch_size {args.global_batch_size} is not divisible by "
          f"micro_batch_size {args.micro_batch_size} x data-parallel size {dp_size}")
    accum = args.global_batch_size // (args.micro_batch_size * dp_size)
    # --bitwise: a rank's micro-batches must be one whole subtree of the global tree (TreeSum)
    check(not getattr(args, "bitwise", False) or dp_size == 1 or accum & (accum - 1) == 0,
          f"--bitwise needs a power of two of micro-batches per data-parallel rank, so that each rank's are one "
          f"subtree of the global batch's tree; {dp_size} ranks x {accum} micro-batch(es) of "
          f"{args.micro_batch_size}: choose --micro_batch_size so that it is")
    return accum


def check(condition, message, everyone=False):
    if not condition:
        fail(message, everyone)


def fail(message, everyone=False):
    """Bad input, seen alike by every rank: rank 0 (`everyone`: each) prints one line; all exit 2."""
    names = ("RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "PMI_RANK", "SLURM_PROCID", "FLUX_TASK_RANK")
    if everyone or next((int(os.environ[n]) for n in names if os.environ.get(n, "").isdigit()), 0) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---- --bitwise: one summation order for every layout ----

class TreeSum:
    """--bitwise: leaves 0..n-1 (each a list of tensors, e.g. one micro-batch's gradients) summed as
    one binary tree over their indices, whatever order they arrive in: only the grouping changes a
    float sum, and it is fixed here (docs/numerics.md, "The tree"). Node (level, i) is the sum of
    leaves [i·2^level, (i+1)·2^level); a node with no right half passes its left half up."""

    def __init__(self, n):
        self.n, self.levels, self.nodes, self.total = n, max(0, (n - 1).bit_length()), {}, None

    def add(self, index, leaf):
        """Leaf `index` in (its tensors are summed into in place); the sum, once every leaf is in."""
        level, i, node = 0, index, list(leaf)
        while level < self.levels:
            if i % 2 or (i + 1) << level < self.n:  # else no right half: the left one passes up
                other = self.nodes.pop((level, i ^ 1), None)
                if other is None:  # the sibling is still to come: wait for it
                    self.nodes[(level, i)] = node
                    return None
                left, right = (node, other) if i % 2 == 0 else (other, node)
                node = [a.add_(b) for a, b in zip(left, right)]
            level, i = level + 1, i // 2
        self.total = node
        return node


class TreeGrads:
    """--bitwise's gradient accumulation: after each micro-batch's backward (of its own mean loss,
    unscaled), `take` moves its gradients (`grads()`) and loss into a TreeSum of this rank's `n`
    micro-batches and zeroes them; `total()` is the subtree's sums, gradients then the loss."""

    def __init__(self, grads, n):
        self.grads, self.n, self.tree = grads, n, TreeSum(n)

    def take(self, index, loss):
        grads = self.grads()
        leaf = [g.clone() for g in grads] + [loss.detach().float().reshape(1)]
        for g in grads:
            g.zero_()
        self.tree.add(index, leaf)

    def total(self):
        total, self.tree = self.tree.total, TreeSum(self.n)
        return total


def tree_reduce_scatter(flat, group):
    """--bitwise's reduce-scatter: this rank's shard of the sum over `group` of `flat`, its p pieces
    added in one fixed tree of rank order (TreeSum(p)), where a ring's order depends on the rank."""
    p = dist.get_world_size(group)
    pieces = torch.empty_like(flat)
    dist.all_to_all_single(pieces, flat, group=group)  # piece j of every rank to rank j
    tree, c = TreeSum(p), flat.numel() // p
    for j in range(p):
        tree.add(j, [pieces[j * c:(j + 1) * c]])
    return tree.total[0]


def tree_all_reduce(flat, group):
    """--bitwise's all-reduce, in place: tree_reduce_scatter, then every rank's summed shard to all
    (all_gather): 2(p-1)/p of `flat` on the wire, a ring all-reduce's bytes, one order everywhere."""
    shard = tree_reduce_scatter(flat, group)
    dist.all_gather_into_tensor(flat, shard, group=group)  # every owner's summed shard, to every rank
    return flat


def grad_norm(grads):
    """--bitwise's global gradient norm as clip_grad_norm_ takes it (each parameter's norm, then the
    norm of those in nanoGPT's order): every layout that holds whole gradients gets 01's bits."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


def deterministic(device):
    """--bitwise: kernels that give the same bits on every run; one thread per rank on CPU, where a
    reduction split over threads sums in an order that depends on how many (docs/numerics.md)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if device.type == "cpu":
        torch.set_num_threads(1)


# ---- Launchers, devices, process groups, random streams ----

@dataclass
class Launch:
    kind: str  # torchrun | mpi | slurm | env (MPI's launcher, MASTER_ADDR/PORT's rendezvous) | single
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1


def detect_launcher(environ):
    """Rank, local rank, world size from the environment (docs/design.md's order); unexported: None."""
    e, seen = environ, []

    def geti(*names):
        for n in names:
            if e.get(n, "") != "":
                seen.append(f"{n}={e[n]}")
                check(e[n].strip().isdigit(), f"{n}={e[n]} in the environment is not a whole number")
                return int(e[n])
        return None

    if "RANK" in e and "WORLD_SIZE" in e:
        world = geti("WORLD_SIZE")
        launch = Launch("torchrun", geti("RANK"), geti("LOCAL_RANK") or 0, world, geti("LOCAL_WORLD_SIZE") or world)
    elif "OMPI_COMM_WORLD_RANK" in e:
        launch = Launch("mpi", geti("OMPI_COMM_WORLD_RANK"), geti("OMPI_COMM_WORLD_LOCAL_RANK"),
                        geti("OMPI_COMM_WORLD_SIZE"), geti("OMPI_COMM_WORLD_LOCAL_SIZE"))
    elif "PALS_RANKID" in e:  # Cray PALS (Polaris, Aurora); srun's cray_shasta plugin (PMI_SIZE since 23.02)
        launch = Launch("mpi", geti("PALS_RANKID"), geti("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"),
                        geti("PMI_SIZE", "PALS_SIZE", "SLURM_NTASKS"),
                        geti("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"))
    elif "PMI_RANK" in e and "PMI_SIZE" in e:  # MPICH Hydra, Intel MPI, flux run (and Cray MPICH under srun)
        launch = Launch("mpi", geti("PMI_RANK"),
                        geti("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", "FLUX_TASK_LOCAL_ID"),
                        geti("PMI_SIZE"), geti("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"))
    elif "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        ntasks, nnodes = geti("SLURM_NTASKS"), geti("SLURM_NNODES") or 1
        # the most tasks any node holds, where Slurm does not say (fewer threads, never more)
        per_node = geti("SLURM_NTASKS_PER_NODE") or -(-ntasks // nnodes)
        launch = Launch("slurm", geti("SLURM_PROCID"), geti("SLURM_LOCALID") or 0, ntasks, per_node)
    else:
        return Launch("single")
    (r, w, lr, lw), seen = (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size), " ".join(seen)
    check(w != 0 and lw != 0, f"a world of no ranks ({seen})")
    check(r < (w or r + 1) and (lr or 0) < (lw or (lr or 0) + 1), f"rank {r} (local rank {lr}) is outside its world of "
          f"{w} ranks ({lw} on this node): {seen}; unset what a launcher did not set", everyone=True)
    return launch


def first_slurm_host(nodelist):
    """'nid[001-004,010],x' -> 'nid001' (what `scontrol show hostnames | head -1` prints)."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist.split("]")[0] + "]"
    if "[" not in head:
        return head
    prefix, ranges = head.split("[")
    return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]


@dataclass
class Env:
    launch: Launch
    device: torch.device
    backend: str
    dtype: torch.dtype
    rank = property(lambda self: self.launch.rank)
    world_size = property(lambda self: self.launch.world_size)
    master = property(lambda self: self.launch.rank == 0)


BATCH_JOB_VARIABLES = ("PBS_JOBID", "SLURM_JOB_ID", "FLUX_JOB_ID")  # set inside a PBS, Slurm or Flux job
# a launcher that binds one device to each rank sets one of these (srun --gpus-per-task, affinity scripts)
DEVICE_MASKS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")


def xpu_backend():
    """Intel GPUs: native XPU and xccl (torch >= 2.8), else IPEX and oneCCL's "ccl"; None: no XPU."""
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        try:
            import intel_extension_for_pytorch  # noqa: F401  (registers the XPUs)
        except ImportError:
            return None
    if not torch.xpu.is_available():
        return None
    if getattr(dist, "is_xccl_available", lambda: False)():
        return "xccl"
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401  (registers the "ccl" backend)
        return "ccl"
    except ImportError:
        return "xccl"  # init_process_group names what is missing


def pick_device(requested, local_rank, local_world_size=1):
    """cuda (NVIDIA, ROCm) -> xpu -> mps -> cpu and its backend; device local_rank % count. In a batch
    job no accelerator is an error, never a silent CPU run (the facility's GPU module not loaded)."""
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        kind, backend = "cuda", "nccl"
    else:
        kind, backend = "xpu", xpu_backend() if requested in ("auto", "xpu") else None
    if backend:
        count = torch.get_device_module(kind).device_count()
        # more ranks than devices put two on one (NCCL refuses it), unless the launcher bound one to each
        bound = count == 1 and any(os.environ.get(v) for v in DEVICE_MASKS)
        if local_world_size > count and not bound:
            if local_rank == count:  # the first rank that would share (one line per node)
                say(f"error: {local_world_size} ranks on {socket.gethostname()} but {count} {kind} devices: local ranks "
                    f"{count} and up would share one; start at most {count} per node, or bind one to each rank", sys.stderr)
            sys.exit(2)
        return torch.device(kind, local_rank % count), backend
    if requested in ("auto", "mps") and torch.backends.mps.is_available():
        return torch.device("mps"), "gloo"
    check(requested in ("auto", "cpu"), f"--device {requested} is not available on this machine")
    job = next((v for v in BATCH_JOB_VARIABLES if os.environ.get(v)), None)
    check(requested == "cpu" or job is None,
          f"no GPU visible in batch job {os.environ.get(job or '', '')} ({job} is set; torch finds no CUDA, ROCm "
          "or XPU device): load the facility's PyTorch module, or pass --device cpu")
    return torch.device("cpu"), "gloo"


_MPI_COMM = None


def mpi_comm():
    return _MPI_COMM  # mpi4py's COMM_WORLD when the job was launched by mpiexec (and it matches), else None


def torch_too_old(version):
    """One line when this torch predates 2.6, whose group-numbered peers (P2POp(group_peer=),
    broadcast(group_src=), reduce(group_dst=)) the scripts call: older ones fail mid-run with a TypeError."""
    major, minor = (int(n) for n in re.match(r"(\d+)\.(\d+)", version).groups())
    return None if (major, minor) >= (2, 6) else (
        f"torch {version} is older than 2.6, whose P2POp(group_peer=) and broadcast(group_src=) the scripts call: "
        "load a newer one (Polaris: module use /soft/modulefiles; module load conda; Aurora: module load frameworks; "
        "Perlmutter: module load pytorch; Frontier: pip install torch for your ROCm in miniforge3)")


def setup(args, launch=None, distributed=True):
    """The launcher, device and process group (one rank's for a lone process): an Env. infra.launch's
    setup is this one hardened (another job's store told apart, one line when a rank cannot join, and
    an uncaught exception on any rank ends the job)."""
    problem = torch_too_old(torch.__version__)
    check(problem is None, problem)
    launch = launch or detect_launcher(os.environ)
    if launch.kind == "mpi":
        launch = _mpi_world(launch)
    device, backend = pick_device(args.device, launch.local_rank, launch.local_world_size)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if (
        device.type == "cuda" and torch.cuda.is_bf16_supported() or device.type == "xpu") else torch.float32
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.local_world_size))
    if getattr(args, "bitwise", False):  # (a Namespace made by hand may lack it)
        deterministic(device)
    if device.type in ("cuda", "xpu"):  # before init_process_group, so NCCL / XCCL bind the right device
        torch.get_device_module(device).set_device(device)
    env = Env(launch, device, backend, dtype)
    if distributed:
        join(env, args.timeout, init_method=_rendezvous(launch))
    return env


def join(env, timeout_s, **where):
    """init_process_group for env's rank at `where` (init_method=, or store=), --timeout for every group."""
    # gloo takes CPU and CUDA tensors only, and MPS has no collective backend of its own
    check(env.device.type != "mps" or env.world_size == 1, f"MPS has no collective backend ({env.world_size} "
          "ranks asked): run 01_single_gpu.py on MPS, or pass --device cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    # a group made later by dist.new_group gets torch's default timeout (30 minutes on gloo),
    # not the world's: make --timeout theirs too, so a frozen peer ends every group's wait
    dist.distributed_c10d.default_pg_timeout = dist.distributed_c10d.default_pg_nccl_timeout = timeout
    # device_id: NCCL/XCCL make the world's communicator now, and split every sub-group's from it
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            device_id=env.device if env.backend in ("nccl", "xccl") else None, **where)


def _mpi_world(launch):
    """MPI's world, checked against the launcher's: under srun's cray_shasta plugin a PyPI mpi4py is a
    world of one on every rank; then Slurm's variables, or MASTER_ADDR/PORT, are the rendezvous."""
    global _MPI_COMM
    try:
        from mpi4py import MPI  # importing it calls MPI_Init
        comm, have = MPI.COMM_WORLD, "mpi4py's MPI sees"
        size, rank = comm.Get_size(), comm.Get_rank()
    except ImportError:
        comm, have, size, rank = None, "mpi4py is not installed, which sees", 1, 0
    if comm and launch.world_size in (None, size) and launch.rank == rank:
        _MPI_COMM, launch.world_size = comm, size
        if launch.local_rank is None or launch.local_world_size is None:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
            launch.local_rank, launch.local_world_size = node.Get_rank(), node.Get_size()
        return launch
    slurm = detect_launcher({k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PALS_", "OMPI_"))})
    if slurm.kind == "slurm" and slurm.rank == launch.rank:
        return slurm
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT") and launch.world_size:
        local = launch.local_rank or 0  # (a local size not given: at least this rank's)
        return Launch("env", launch.rank, local, launch.world_size, launch.local_world_size or local + 1)
    fail(f"the launcher's variables make this rank {launch.rank} of {launch.world_size}, but {have} rank {rank} "
         f"of {size}: build mpi4py on the launcher's MPI (MPICC=mpicc pip install --no-binary mpi4py mpi4py), "
         "or export MASTER_ADDR and MASTER_PORT (a rendezvous without MPI)", everyone=launch.rank != 0)


def _rendezvous(launch):
    """Where the ranks meet: torchrun's env://; under MPI, rank 0's host and a free port, broadcast;
    else MASTER_ADDR (or the first host) and MASTER_PORT (or one derived from the job id)."""
    if launch.kind == "single":
        return f"tcp://127.0.0.1:{_free_port()}"
    e, port = os.environ, os.environ.get("MASTER_PORT", "")
    check(port == "" or port.isdigit() and int(port) < 65536, f"MASTER_PORT={port} is not a port number (1-65535)")
    if launch.kind == "torchrun":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not e.get(v)]
        check(not missing, f"RANK and WORLD_SIZE are set (a torchrun-style launch) but {' and '.join(missing)} "
              f"{'is' if len(missing) == 1 else 'are'} not: export MASTER_ADDR=<rank 0's host> and "
              "MASTER_PORT=<a free port>, or start the job with torchrun, mpiexec or srun")
        return "env://"
    if launch.kind == "mpi":
        addr = e.get("MASTER_ADDR") or socket.gethostname() if launch.rank == 0 else None
        port = int(port or 0) or _free_port() if launch.rank == 0 else None
        addr, port = _MPI_COMM.bcast((addr, port), root=0)
        return f"tcp://{addr}:{port}"
    addr = e.get("MASTER_ADDR") or first_slurm_host(e.get("SLURM_NODELIST", "localhost"))
    # a port of this job's own (jobs sharing a node differ in id; 20000 ports apart before they meet)
    return f"tcp://{addr}:{int(port or 0) or 20000 + int(e.get('SLURM_JOB_ID') or 0) % 20000}"


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def teardown(env):
    """End the process group in step: nobody destroys it while another rank may still talk
    to it, and under mpiexec rank 0, which hosts the rendezvous store, leaves last."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if _MPI_COMM is not None:
        _MPI_COMM.Barrier()
    sys.stdout.flush()
    sys.stderr.flush()


def autocast(env):
    """bf16 autocast (weights and optimizer stay fp32; float16 is refused: no loss scaling)."""
    if env.dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=env.device.type, dtype=env.dtype)


def synchronize(env):
    """Wait until the device has run all the work queued on it: a host sync (at once on CPU)."""
    torch.get_device_module(env.device).synchronize()


def device_rng_state(device):
    """The state of the generator dropout on `device` draws from (the CPU's, or the device's)."""
    if device.type in ("cuda", "xpu"):
        return torch.get_device_module(device).get_rng_state(device)
    return torch.mps.get_rng_state() if device.type == "mps" else torch.get_rng_state()


def set_device_rng_state(device, state):
    if device.type in ("cuda", "xpu"):
        return torch.get_device_module(device).set_rng_state(state, device)
    (torch.mps.set_rng_state if device.type == "mps" else torch.set_rng_state)(state)


def rng_state(env):
    """This rank's random streams: the CPU generator and, on an accelerator, the device's."""
    state = {"cpu": torch.get_rng_state()}
    if env.device.type != "cpu":
        state["device"] = device_rng_state(env.device)
    return state


def set_rng_state(env, state):
    torch.set_rng_state(state["cpu"])
    if "device" in state and env.device.type != "cpu":
        set_device_rng_state(env.device, state["device"])


# ---- The run protocol, plain ----

# The run infrastructure's own flags (infra's add_run_flags): this file's Run refuses them by name
# (tests/test_copy.py: exactly the flags a script's --help loses in a copy)
INFRA_FLAGS = ("dry_run", "world_size", "ranks_per_node", "machine", "gpu_mem_gb", "rehearse", "no_fit_check",
               "metrics", "wandb", "time_limit", "export", "export_hf", "profile", "unverified", "check_gradients")


class Run:
    """The run protocol: what every main() does alike, so that main() shows its strategy. This one
    does what nanoGPT's loop does (evaluation, one log line per step, a checkpoint per rank at
    --ckpt_interval and --resume from it at the same layout); infra's Run (infra/run.py) adds the rest
    at the same calls:

        run = Run(parser, __file__)                       # the command line; who this process is
        env, accum_steps = run.start(costs, dp_size=D)    # the processes started, the micro-batch chosen
        run.dry_run(costs, layout_lines)                  # (infra: --dry_run prints the plan, exits 0)
        ... the model, the strategy, the optimizer ...
        run.begin(config, optimizer, costs, ...)          # --resume (infra: any layout; the ledger's formulas)
        for step in run.steps():                          # evaluations at --eval_interval; the clock
            lr = lr_at(step, args) ...                    # the learning rate, set in the loop
            with run.meter:                               # (infra: the activations autograd holds)
                ... forwards and backwards ...
            run.check(loss, grads, norm)                  # (infra: non-finite? asked to stop?)
            optimizer.step()
            run.end_step(loss)                            # one line at --log_interval; the checkpoint
        run.finish()                                      # end the process group in step
    """

    meter = nullcontext()  # infra: counts the activations saved for backward
    cost = None  # infra: this rank's costs(), the ledger's theory

    def __init__(self, parser, script):
        infra_only = [a.split("=")[0] for a in parser.parse_known_args()[1] if a.split("=")[0][2:] in INFRA_FLAGS]
        check(not infra_only, f"{' '.join(infra_only)} need{'s' * (len(infra_only) == 1)} infra, the run "
              "infrastructure: copy the infra package (infra/) beside this script and import Run from it")
        self.args, self.script = parse_args(parser), os.path.basename(script)
        self.launch = detect_launcher(os.environ)
        self.world_size, self.env = self.launch.world_size, None

    def start(self, costs, dp_size, aim=1, multiple=1, ranks=(0,), groups=None):
        """`setup`, `groups(env)`, the micro-batch (auto: micro_batch_sizes' largest; infra's: fits)."""
        self.env = setup(self.args, self.launch)
        self.groups = groups(self.env) if groups else None
        if self.args.micro_batch_size == "auto":
            self.args.micro_batch_size = micro_batch_sizes(self.args, dp_size, aim, multiple)[0]
        return self.env, check_batch(self.args, dp_size)

    def dry_run(self, costs, layout_lines=lambda config: []):
        """infra's Run: --dry_run prints the layout and its costs and exits. Here: nothing."""

    def begin(self, config, optimizer, costs, layout, pieces, evaluate, describe, held=None, extra_rng=None,
              after_resume=None):
        """One line about the model, and --resume: returns the `extra_rng()` streams read back (or None).
        infra's Run also resumes any layout (from `pieces()`) and sets the ledger's formulas."""
        args, env = self.args, self.env
        self.optimizer, self._evaluate, self.extra_rng, self.start_step = optimizer, evaluate, extra_rng, 0
        self.layout = {**layout, "world_size": env.world_size}
        self.path = os.path.join(args.out_dir, f"plain_ckpt_rank{env.rank}.pt")
        self.log_model(config, describe)
        if args.resume:
            return self.resume(after_resume)
        check(not args.ckpt_interval or args.overwrite or not os.path.exists(self.path), f"{self.path} holds "
              "another run's checkpoint: --resume it, or --overwrite it")

    def log_model(self, config, describe):
        log(self.env, f"model: {count_params(config)[1] / 1e6:.2f}M parameters (nanoGPT's count), device "
                      f"{self.env.device}, {str(self.env.dtype).replace('torch.', '')}, {describe}")

    def checkpointed(self):
        """(tensors, states): what this rank's optimizer updates (a view into a buffer, ZeRO's flat shard,
        as that whole buffer, so that what was gathered into it comes back too) and its state: with the step
        and the random streams, all a rank needs to go on at the same layout (04 gathers in `after_resume`)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        buffers = {id(t): t for t in (p if p._base is None else p._base for p in params)}
        return list(buffers.values()), [self.optimizer.state[p] for p in params]

    def save(self, step):
        """nanoGPT's checkpoint, one torch.save file per rank (tensors and plain values), replaced whole."""
        tensors, states = self.checkpointed()
        try:
            os.makedirs(self.args.out_dir, exist_ok=True)
            torch.save({"step": step, "layout": self.layout, "tensors": [t.detach() for t in tensors],
                        "states": [dict(state) for state in states], "rng": rng_state(self.env),
                        "extra_rng": self.extra_rng and self.extra_rng()}, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)
        except OSError as e:
            fail(f"cannot write checkpoint {self.path}: {e}", everyone=True)
        log(self.env, f"checkpoint step {step}: {self.args.out_dir}/plain_ckpt_rank*.pt")

    def resume(self, after_resume):
        """--resume: each rank's file read back, once all agree they hold one step of this layout."""
        env, (tensors, states) = self.env, self.checkpointed()
        try:
            saved = torch.load(self.path, weights_only=True)  # tensors and plain values: nothing runs
            problem = (f"{self.path} was written by {saved['layout']}, this run is {self.layout}: resuming another "
                       "layout (resharding) needs infra (copy the infra package (infra/) beside this script)"
                       if saved["layout"] != self.layout else f"{self.path} holds another model (other shapes)"
                       if [t.shape for t in saved["tensors"]] != [t.shape for t in tensors] else None)
        except Exception as e:  # missing, truncated, not a checkpoint
            saved, problem = {}, f"--resume: cannot read {self.path} ({type(e).__name__}: {str(e)[:200]})"
        found = [(problem, saved.get("step"))] * env.world_size
        if env.world_size > 1:
            dist.all_gather_object(found, found[0], group=dist.group.WORLD)
        check(all(p is None for p, _ in found), next((p for p, _ in found if p), None))
        check(len(set(found)) == 1, f"--resume: the ranks' checkpoints are of steps {[s for _, s in found]}")
        with torch.no_grad():
            for tensor, value in zip(tensors, saved["tensors"]):
                tensor.copy_(value)
            for state, values in zip(states, saved["states"]):
                for key, value in values.items():
                    state[key] = state[key].copy_(value) if torch.is_tensor(state.get(key)) else value
        set_rng_state(env, saved["rng"])
        if after_resume:  # what the strategy derives from what it holds
            after_resume()
        self.start_step = saved["step"]
        log(env, f"resumed step {self.start_step} from {self.args.out_dir}/plain_ckpt_rank*.pt")
        return saved["extra_rng"]

    def steps(self):
        """Steps from the resumed one to --max_iters, each clocked; evaluations at --eval_interval."""
        args = self.args
        for step in progress(self.env, self.start_step, args.max_iters):
            if args.eval_interval and step % args.eval_interval == 0:
                self.evaluate(step)
            self.step, self.t0 = step, time.perf_counter()
            yield step
        if args.eval_interval and args.max_iters > self.start_step:
            self.evaluate(args.max_iters)

    def evaluate(self, step):
        losses = self._evaluate()
        log(self.env, f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        return losses

    def check(self, loss, grads, norm=None):
        """infra's Run: do all ranks agree a loss or gradient is non-finite, or to stop? Here: nothing."""

    def end_step(self, loss, extra=None, **step_costs):
        """One line at --log_interval; `loss` is read only then (reading it waits for the device)."""
        args, step = self.args, self.step
        if step % args.log_interval == 0 or step == args.max_iters - 1:
            loss = loss.item()
            dt = time.perf_counter() - self.t0
            tokens = args.global_batch_size * model_block_size(args)
            log(self.env, f"step {step}: loss {loss:.4f}, lr {self.optimizer.param_groups[0]['lr']:.2e}, "
                          f"{dt * 1e3:.0f} ms, {tokens / dt:,.0f} tok/s")
        if args.ckpt_interval and ((step + 1) % args.ckpt_interval == 0 or step + 1 == args.max_iters):
            self.save(step + 1)

    def log(self, message):
        log(self.env, message)

    def finish(self):
        """End the process group in step."""
        teardown(self.env)


def micro_batch_sizes(args, dp_size, aim=1, multiple=1):
    """auto's micro-batches, largest first: divisors of a replica's share leaving at least `aim` of
    them, their number a multiple of `multiple` where any is (pipelines: m >= 2p; interleaved: p | m)."""
    check(args.global_batch_size % dp_size == 0, f"--global_batch_size {args.global_batch_size} "
          f"is not divisible by the data-parallel size {dp_size}")
    share = args.global_batch_size // dp_size
    sizes = [b for b in range(share, 0, -1) if share % b == 0]
    sizes = [b for b in sizes if (share // b) % multiple == 0] or sizes
    return [b for b in sizes if share // b >= aim] or sizes[-1:]


def log(env, message):
    """Print on rank 0 only."""
    if env.master:
        say(message)


def say(message, file=None):
    """Print and flush, through tqdm so a progress bar is not torn. A stream that cannot be written
    (a pipe's reader gone, a terminal hung up) is pointed at /dev/null: the run trains on."""
    file = file or sys.stdout
    if file is None:  # started with that descriptor closed
        return
    from tqdm import tqdm
    try:
        tqdm.write(message, file=file)
        file.flush()
    except OSError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, file.fileno())  # what is still buffered goes there too, at exit
            os.close(devnull)
        except (OSError, ValueError):
            pass


def progress(env, start, stop):
    """Rank 0's tqdm progress bar over optimizer steps, on a terminal (not in job logs)."""
    from tqdm import tqdm
    return tqdm(range(start, stop), initial=start, total=stop, disable=not (env.master and sys.stderr.isatty()),
                dynamic_ncols=True, mininterval=2.0, leave=False)
