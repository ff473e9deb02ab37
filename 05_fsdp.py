"""05_fsdp.py: fully sharded data parallelism by hand, the way PyTorch's FSDP2 builds it.

Like ZeRO-3 (04_zero.py), every rank keeps only 1/N of the parameters, gradients and optimizer
state, and gathers a unit's parameters just before it runs. FSDP adds what makes that fast and
able to hold models larger than one device:

  * units: each transformer block is one unit, plus a root unit (the embeddings, wte also the
    tied head, and the final norm), gathered with one all-gather and reduced with one
    reduce-scatter each;
  * per-parameter sharding on dim 0: rank r of a shard group of S ranks holds rows
    [r·k, (r+1)·k) of every parameter (padded to S·k rows), an ordinary tensor the optimizer
    uses as it is; a unit's shards are packed into one buffer for its all-gather (copy-in)
    and unpacked after (copy-out);
  * prefetch: while block i computes, block i+1's all-gather is already in flight (forward),
    and block i-1's in backward;
  * reshard after forward: a block's parameters are freed until backward gathers them again;
  * meta-device initialisation: the model is built on the meta device (no memory) and each
    parameter drawn as 01 draws it, one at a time, keeping only this rank's rows: the full
    model never exists anywhere.

    parameter (rows)     [ rows 0..k | rows k..2k | ... | rows (S-1)k..Sk, padding ]
                            rank 0      rank 1             rank S-1
    each rank holds      its rows of every parameter in fp32, their gradients, AdamW's moments

    forward, block i:   wait all-gather(i) ─> launch all-gather(i+1) ─> compute i ─> free i
    backward, block i:  wait all-gather(i) ─> launch all-gather(i-1) ─> compute grads of i
                        ─> reduce-scatter grads(i) (async) ─> free params and full grads of i

Run:

    mpiexec -n 4 python 05_fsdp.py --model gpt2-medium
    torchrun --standalone --nproc_per_node 8 05_fsdp.py --model gpt2-xl --replicate 2   # HSDP 2 x 4

One rank holds  16Ψ/S of fp32 shards (params 4, grads 4, AdamW 8) + the root and one block gathered (two with prefetch)
One rank sends  per micro-batch: all-gather eΨ (e bytes an element) in forward and again in backward (the root
                once per step), reduce-scatter 4Ψ of gradients (fp32; --reduce_dtype bfloat16 halves it)

The options (--no_prefetch, --no_reshard, --reduce_dtype, HSDP's --replicate, --offload) and
the formulas: docs/strategies.md, section "05_fsdp.py: FSDP".
"""

import math

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist
import torch.nn as nn

from common import (autocast, check, Data, GPT, is_hidden_matrix, lr_at, make_adamw, make_parser,
                    model_config, Muon, muon_apply, muon_momentum, orthogonalize, param_init, param_shapes, to_device,
                    to_host, TreeGrads, TreeSum, tree_all_reduce, tree_reduce_scatter)


class Unit:
    """One FSDP unit: the parameters of a module, each sharded on dim 0 across the shard
    group. `shards` are this rank's fp32 rows (nn.Parameters: the optimizer's); `params` are
    the module's own parameters, holding the gathered full tensors only while needed."""

    def __init__(self, name, named_params, fsdp, shapes):
        self.name, self.fsdp = name, fsdp
        self.names, self.params = zip(*named_params)
        self.shapes = [shapes[n] for n in self.names]  # the full shapes, from the meta model
        S, r = fsdp.shard_size, fsdp.shard_rank
        self.rows = [math.ceil(shape[0] / S) for shape in self.shapes]  # rows per rank
        self.shard_numels = [rows * math.prod(shape[1:]) for rows, shape in zip(self.rows, self.shapes)]
        self.offsets = [sum(self.shard_numels[:j]) for j in range(len(self.params))]
        self.numel = sum(self.shard_numels)  # this rank's share of the unit (padded)
        self.shards = []
        for full_name, shape, rows in zip(self.names, self.shapes, self.rows):
            full = param_init(full_name, shape, fsdp.config, fsdp.seed)  # one full parameter, on CPU
            shard = torch.zeros((rows,) + tuple(shape[1:]))
            mine = full[r * rows:(r + 1) * rows]  # this rank's rows (the last rank may get padding)
            shard[:mine.shape[0]] = mine
            self.shards.append(nn.Parameter(fsdp.home(shard)))
        self.gathered, self.pending, self.full = False, None, None
        self.waiting = len(self.params)

    # -- parameters ----------------------------------------------------------------------
    def start_gather(self):
        """Launch the all-gather of the whole unit (asynchronously)."""
        if self.gathered or self.pending is not None:
            return
        S, dtype = self.fsdp.shard_size, self.fsdp.compute_dtype
        packed = self.fsdp.copy_in(self.shards)  # this rank's rows of every parameter, one buffer
        out = torch.empty(S * self.numel, dtype=dtype, device=self.fsdp.device)
        # every shard-group rank's rows of every parameter of this unit -> all of them
        handle = dist.all_gather_into_tensor(out, packed, group=self.fsdp.shard_group, async_op=True)
        self.pending = (handle, out)
        self.fsdp.track(+self.gathered_bytes())  # the memory is taken from here on

    def finish_gather(self):
        """Wait for this unit's all-gather and give the module its full parameters."""
        if self.gathered:
            return
        self.start_gather()
        handle, out = self.pending
        handle.wait()
        self.pending = None
        out = out.view(self.fsdp.shard_size, self.numel)  # [rank, this rank's packed shards]
        if self.full is None:  # each parameter's full rows, made once; their memory comes and goes (release)
            self.full = [torch.empty((self.fsdp.shard_size * rows,) + tuple(shape[1:]), dtype=out.dtype,
                                     device=out.device) for rows, shape in zip(self.rows, self.shapes)]
            for p, full, shape in zip(self.params, self.full, self.shapes):
                p.data = full[:shape[0]]  # drop the padding rows
        for full, offset, numel in zip(self.full, self.offsets, self.shard_numels):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            full.view(self.fsdp.shard_size, numel).copy_(out[:, offset:offset + numel])  # copy-out
        self.gathered = True

    # The parameters stay views of `full` for the whole run; what comes and goes is the memory
    # under it (its storage resized, as PyTorch FSDP frees its parameters). Giving the module
    # new tensors instead frees nothing in training: autograd keeps the weights a block's
    # forward used (a Linear saves its weight) until backward reaches the block, so every
    # block's gathered copy would be alive when backward begins, and the gather before a
    # block's backward would make a second one.
    def release(self):
        if self.gathered:
            self.fsdp.track(-self.gathered_bytes())
            for full in self.full:
                full.untyped_storage().resize_(0)
            self.gathered = False

    def gathered_bytes(self):
        return self.fsdp.shard_size * self.numel * self.fsdp.compute_dtype.itemsize

    # -- gradients -----------------------------------------------------------------------
    def grad_ready(self):
        """Called as each parameter's full gradient is complete; on the last one: pack the
        unit's gradients and reduce-scatter them (async), then free what is no longer needed.
        One reduce-scatter is in flight at a time (as in FSDP): the previous unit's is finished
        first, so its packed full gradients are freed now, not at the end of backward."""
        self.waiting -= 1
        if self.waiting:
            return
        fsdp, S = self.fsdp, self.fsdp.shard_size
        fsdp.finish_reductions()
        packed = torch.zeros(S, self.numel, dtype=fsdp.reduce_dtype, device=fsdp.device)
        for p, shape, offset, numel, rows in zip(self.params, self.shapes, self.offsets, self.shard_numels, self.rows):
            grad = p.grad.to(fsdp.reduce_dtype).view(shape[0], -1)
            padded = torch.zeros(S * rows, grad.shape[1], dtype=fsdp.reduce_dtype, device=fsdp.device)
            padded[:shape[0]] = grad
            packed[:, offset:offset + numel] = padded.view(S, numel)  # rank r's rows -> row r
            p.grad = None  # the full gradient is freed: only the shard will be kept
        if fsdp.bitwise:  # --bitwise: into the unit's tree, reduced in one fixed order once whole (below)
            fsdp.bitwise.add(self, packed)
        else:
            packed.div_(fsdp.world_size)  # sum of g/N = the mean over every data-parallel rank
            out = torch.empty(self.numel, dtype=fsdp.reduce_dtype, device=fsdp.device)
            # sum over the shard group; rank r receives the rows it owns of every gradient
            handle = dist.reduce_scatter_tensor(out, packed.view(-1), group=fsdp.shard_group, async_op=True)
            fsdp.reductions.append((handle, self, out, packed))
        self.waiting = len(self.params)
        if fsdp.reshard and self is not fsdp.root:
            self.release()

    def accumulate(self, out):
        for shard, offset, numel in zip(self.shards, self.offsets, self.shard_numels):
            piece = out[offset:offset + numel].view_as(shard).float().to(shard.device)  # --offload: down
            shard.grad = piece.clone() if shard.grad is None else shard.grad.add_(piece)


def shard_groups(world_size, replicate, rank):
    """(this rank's shard group, its replicate group or None): consecutive ranks form a shard
    group (one node), rank i of every shard group a replicate group. Made before the fit
    check (Run.start's groups=), so that the room it reads has their communicators' buffers."""
    S, shard, replicate_group = world_size // replicate, None, None
    for g in range(replicate):
        group = dist.new_group(list(range(g * S, (g + 1) * S)), group_desc="shard")  # the ledger's name
        shard = group if g == rank // S else shard
    for i in range(S):
        group = dist.new_group(list(range(i, world_size, S)), group_desc="replicate")
        replicate_group = group if i == rank % S and replicate > 1 else replicate_group
    return shard, replicate_group


class FSDP:
    """The units of the model and the schedule of their collectives, over the `groups` of
    shard_groups()."""

    def __init__(self, model, config, args, env, groups):
        self.config, self.seed, self.device = config, args.seed, env.device
        self.world_size, R = env.world_size, args.replicate
        S = self.shard_size = env.world_size // R
        self.shard_rank, self.replica = env.rank % S, env.rank // S
        self.shard_group, self.replicate_group = groups  # shard_groups()
        # (--bitwise: the gathered parameters in fp32, as 01's weights under autocast, so that LayerNorm
        # and the embedding read the same values; autocast casts the matmuls' inputs alike)
        self.compute_dtype = torch.float32 if args.bitwise else env.dtype
        self.reduce_dtype = getattr(torch, args.reduce_dtype)
        self.prefetch, self.reshard = not args.no_prefetch, not args.no_reshard
        self.gathered_now = self.gathered_peak = 0
        self.reductions = []
        shapes = {k: p.shape for k, p in model.named_parameters()}
        materialize(model, env.device, self.compute_dtype)
        root = [(k, p) for k, p in model.named_parameters() if not k.startswith("transformer.h.")]
        self.root = Unit("root", root, self, shapes)
        self.blocks = [Unit(f"h.{i}", [(f"transformer.h.{i}.{k}", p) for k, p in block.named_parameters()],
                            self, shapes) for i, block in enumerate(model.transformer.h)]
        self.units = [self.root] + self.blocks
        self.bitwise = BitwiseTrees(self, args, list(shapes)) if args.bitwise else None  # (below)
        for unit in self.units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: unit.grad_ready())
        for i, block in enumerate(model.transformer.h):
            block.register_forward_pre_hook(lambda m, a, i=i: self.before_forward(i))
            block.register_forward_hook(lambda m, a, out, i=i: self.after_forward(i, out))

    def track(self, delta):
        self.gathered_now += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_now)

    # -- the schedule ---------------------------------------------------------------------
    def before_forward(self, i):
        self.blocks[i].finish_gather()
        if self.prefetch and i + 1 < len(self.blocks):
            self.blocks[i + 1].start_gather()  # overlaps block i's compute

    def after_forward(self, i, out):
        if self.reshard:
            self.blocks[i].release()  # free until backward needs it again
        if out.requires_grad:
            out.register_hook(lambda grad, i=i: self.before_backward(i))

    def before_backward(self, i):
        self.blocks[i].finish_gather()
        if self.prefetch and i > 0:
            self.blocks[i - 1].start_gather()  # overlaps block i's backward

    def begin(self):
        """Before each micro-batch's forward (training or evaluation): the root stays
        gathered throughout, since the embeddings are used at both ends of the model; block
        0's gather is posted again (every block was released after the last backward)."""
        self.root.finish_gather()
        if self.prefetch:
            self.blocks[0].start_gather()

    def finish_reductions(self):
        """Finish the reduce-scatter in flight (and, HSDP, all-reduce its shard across the
        replicas) and accumulate the gradient shard; called before the next unit's starts
        and after each micro-batch's backward."""
        for handle, unit, out, _ in self.reductions:
            handle.wait()
            if self.replicate_group is not None:
                dist.all_reduce(out, group=self.replicate_group)  # sum the replicas' shards
            self.add_reduced(unit, out)
        self.reductions = []

    def add_reduced(self, unit, out):
        """Add a reduced gradient shard into the unit's (OffloadedFSDP: on its way to the host)."""
        unit.accumulate(out)

    def after_backward(self):
        """After each micro-batch's backward: its last reduce-scatter in."""
        self.finish_reductions()
        if self.bitwise:
            self.bitwise.micro += 1

    def end(self):
        for unit in self.units:
            unit.release()
        if self.bitwise:
            self.bitwise.micro = 0

    def home(self, t):
        """Where the fp32 shards (and so their gradients and AdamW's state) live: the device."""
        return t.to(self.device)

    def copy_in(self, shards):
        """FSDP2's copy-in: `shards` flattened one after the other into one buffer, in the
        compute dtype, on the device: the all-gather's input."""
        return torch.cat([s.detach().view(-1) for s in shards]).to(self.device, self.compute_dtype)

    def shards(self):
        return [s for unit in self.units for s in unit.shards]

    def clip_grad_norm(self, max_norm):
        """Global norm from the shards (padding rows are zero); the replicas hold equal shards."""
        if self.bitwise:  # --bitwise: from each parameter's norm, taken whole (BitwiseTrees)
            total_norm = self.bitwise.norm()
        else:
            squares = sum(s.grad.float().pow(2).sum() for s in self.shards()).to(self.device)
            dist.all_reduce(squares, group=self.shard_group)  # the sum over the shard group
            total_norm = squares.sqrt()
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).to(self.shards()[0].device)
        for s in self.shards():
            s.grad.mul_(coef)
        return total_norm


def fsdp_optimizer(fsdp, args, env):
    """AdamW on this rank's fp32 rows only (ZeRO's P_os), fused on GPUs; with --offload the
    rows are in host memory and it runs on the CPU. --optimizer muon: fsdp_muon, below."""
    device_type = "cpu" if args.offload else env.device.type  # --offload: the optimizer on the CPU
    if args.optimizer == "muon":
        return fsdp_muon(fsdp, args, env, device_type)
    return make_adamw(fsdp.shards(), args, device_type)


def add_flags(parser):
    g = parser.add_argument_group("05_fsdp")
    g.add_argument("--no_prefetch", action="store_true", help="gather each unit only when it is needed")
    g.add_argument("--no_reshard", action="store_true",
                   help="keep blocks gathered from forward to backward (ZeRO-2 behaviour)")
    g.add_argument("--reduce_dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the gradient reduce-scatter")
    g.add_argument("--replicate", type=int, default=1, help="HSDP: replicas (shard groups of world/R ranks)")
    g.add_argument("--offload", action="store_true",
                   help="CPU offload: the fp32 shards, their gradients and AdamW state in (pinned) host memory, "
                        "the optimizer steps on the CPU")
    return parser


@torch.no_grad()
def evaluate(model, fsdp, data, args, env, accum_steps, dp_group):
    """Mean loss of each split over eval_iters fixed global batches (each rank its slice)."""
    model.eval()
    losses = {}
    for split in ("train", "val"):
        total = torch.zeros((), device=env.device)
        for k in range(args.eval_iters):
            x, y = data.batch(split, k, args.global_batch_size, env.rank, env.world_size, eval_split=True)
            x, y = to_device(x, env), to_device(y, env)
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                fsdp.begin()
                with autocast(env):
                    _, loss = model(x[rows], y[rows])
                total += loss.float()
        total /= args.eval_iters * accum_steps * env.world_size
        dist.all_reduce(total, group=dp_group)  # the global mean
        losses[split] = total.item()
    fsdp.end()
    model.train()
    return losses


def main():
    run = Run(add_flags(make_parser(__doc__)), __file__)
    args = run.args
    check(args.replicate >= 1 and run.world_size % args.replicate == 0,
          f"--replicate {args.replicate} does not divide the world size {run.world_size}")
    check_bitwise(args, run.world_size // args.replicate)
    env, accum_steps = run.start(costs, dp_size=run.world_size,  # processes up; auto: the largest that fits,
                                 groups=lambda env: shard_groups(env.world_size, args.replicate, env.rank))
    run.dry_run(costs, lambda config: layout_lines(args, run.world_size, accum_steps))
    torch.manual_seed(args.seed + env.rank)  # dropout: a different stream on every rank
    dp_group = dist.group.WORLD  # the data-parallel group: every rank, each with its slice of the batch

    config = model_config(args, Data.vocab_size_of(args.data))
    data = Data(args.data, args.seed, config.block_size)
    with torch.device("meta"):
        model = GPT(config)  # no memory: shapes only
    for block in model.transformer.h:
        block.recompute = args.recompute
    fsdp = (OffloadedFSDP if args.offload else FSDP)(model, config, args, env, run.groups)  # only its rows
    tree = TreeGrads(lambda: [], accum_steps) if args.bitwise else None
    # fused on GPUs; with --offload the shards are on the host and AdamW runs on the CPU
    optimizer = fsdp_optimizer(fsdp, args, env)  # AdamW (or Muon + AdamW) on this rank's fp32 rows
    run.begin(config, optimizer, costs, layout={"strategy": "fsdp", "replicate": args.replicate},
              pieces=lambda: checkpoint_pieces(fsdp, optimizer), held=lambda: held_bytes(fsdp, optimizer),
              evaluate=lambda: evaluate(model, fsdp, data, args, env, accum_steps, dp_group),
              describe=describe(fsdp, args, accum_steps))

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
                fsdp.begin()  # the root unit (gathered once per step) and the first block's prefetch
                with autocast(env):
                    _, loss = model(x[rows], y[rows])
                (loss if tree else loss / accum_steps).backward()  # accumulate the mean over this rank's rows
                fsdp.after_backward()  # this micro-batch's gradient shards are in
                loss_sum += loss.detach().float()
                if tree:  # --bitwise: the losses too, summed in one fixed tree
                    tree.take(micro, loss)
        fsdp.end()  # free the root (and, with --no_reshard, every block)
        loss_sum /= accum_steps * env.world_size
        if tree:  # --bitwise: the same tree over ranks as the gradients' (BitwiseTrees)
            loss_sum = fsdp.bitwise.loss(tree, dp_group)
        else:
            dist.all_reduce(loss_sum, group=dp_group)  # the global batch's mean loss, for logging
        norm = fsdp.clip_grad_norm(args.grad_clip) if args.grad_clip > 0 else None  # the global norm
        run.check(loss_sum, (s.grad for s in fsdp.shards()), norm)  # non-finite? asked to stop?
        optimizer.step()  # AdamW on this rank's fp32 rows only
        if step == run.start_step and run.cost:  # next to the ledger: the gathered parameters, their bound
            log_gathered(run, fsdp)
        run.end_step(loss_sum, lambda: {"gathered_peak_bytes": fsdp.gathered_peak,  # ledger, metrics, ckpt, stop
                                        "gathered_bound_bytes": run.cost["gathered"][1]})
        optimizer.zero_grad(set_to_none=True)
    run.finish()


# ---- Beyond the lesson ----
# Not the strategy: --offload's copies, Muon on dim-0 shards, what a rank holds and sends (costs(),
# the ledger's theory), the dry run's lines, checkpoint pieces.

def check_bitwise(args, S):
    """--bitwise holds where the sums are the global tree's: fp32 reductions, and with replicas a
    shard group of a power of two of ranks (each replica's ranks then one subtree)."""
    check(not args.bitwise or args.reduce_dtype == "float32", "--bitwise reduces in fp32, as 01 accumulates: "
          "drop --reduce_dtype bfloat16")
    check(not args.bitwise or args.replicate == 1 or S & (S - 1) == 0, f"--bitwise with --replicate needs a power "
          f"of two of ranks per shard group (each replica's ranks one subtree of the global tree), not {S}")


class BitwiseTrees:
    """--bitwise: each unit's gradients summed in one fixed binary tree over the global batch's
    micro-batches (common.TreeSum): this rank's k micro-batches as the subtree it owns, the shard
    group's ranks by common.tree_reduce_scatter, HSDP's replicas by common.tree_all_reduce of the
    shard (the global tree's upper levels when a shard group is a power of two of ranks), divided
    once by the global count. The shard group then gathers the unit's mean gradient for a moment:
    each parameter's norm is taken from it, whole, as 01 --bitwise takes it (a norm summed from
    shards would group the squares by the layout)."""

    def __init__(self, fsdp, args, order):
        self.fsdp, self.micro, self.norms, self.order = fsdp, 0, {}, order  # order: nanoGPT's names
        self.k = args.global_batch_size // (args.micro_batch_size * fsdp.world_size)
        self.trees = {unit: TreeSum(self.k) for unit in fsdp.units}

    def add(self, unit, packed):
        fsdp, S = self.fsdp, self.fsdp.shard_size
        total = self.trees[unit].add(self.micro, [packed.view(-1)])
        if total is None:
            return  # more of this rank's micro-batches to come
        self.trees[unit] = TreeSum(self.k)
        shard = tree_reduce_scatter(total[0], fsdp.shard_group)
        if fsdp.replicate_group is not None:
            R = dist.get_world_size(fsdp.replicate_group)
            padded = torch.nn.functional.pad(shard, (0, -shard.numel() % R))  # a multiple of R elements
            shard = tree_all_reduce(padded, fsdp.replicate_group)[:unit.numel]
        shard.div_(self.k * fsdp.world_size)
        full = torch.empty(S * unit.numel, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard, group=fsdp.shard_group)  # the unit's whole gradient, once
        full = full.view(S, unit.numel)
        for name, shape, offset, numel, rows in zip(unit.names, unit.shapes, unit.offsets, unit.shard_numels,
                                                    unit.rows):
            whole = full[:, offset:offset + numel].reshape(S * rows, -1)[:shape[0]].reshape(shape).contiguous()
            self.norms[name] = torch.linalg.vector_norm(whole)
        fsdp.add_reduced(unit, shard)

    def norm(self):
        """The global norm from every parameter's, in nanoGPT's order, as clip_grad_norm_ takes it."""
        return torch.linalg.vector_norm(torch.stack([self.norms[name] for name in self.order]))

    def loss(self, tree, group):
        """The losses' tree over every rank, as the gradients' (a vector of N, one loss each), and its mean."""
        n = dist.get_world_size(group)
        flat = torch.nn.functional.pad(tree.total()[0], (0, n - 1))
        return tree_all_reduce(flat, group)[0] / (self.k * n)


class OffloadedFSDP(FSDP):
    """--offload (CPU offload, as FSDP's CPUOffload and ZeRO-Offload): the fp32 shards, their
    gradients and AdamW's state live in host memory, pinned when there is an accelerator
    (async DMA), and AdamW steps on the CPU (fsdp_optimizer). The copies: a unit's shards go up
    at each gather, staged in pinned memory, on a side stream; each reduced gradient shard goes
    down on it while backward goes on, and lands (one wait for all, then the host's sums) after
    the micro-batch's backward (HostCopies)."""

    def __init__(self, model, config, args, env, groups):
        super().__init__(model, config, args, env, groups)
        self.copies = HostCopies(env.device)  # on a side stream
        self.landing = []  # (unit, gradient shard on its way down)

    def home(self, t):
        """Host memory, pinned when there is an accelerator (async DMA)."""
        return to_host(t, self.device)

    def copy_in(self, shards):
        """Up from the host, staged in pinned memory, on the side stream."""
        return self.copies.up(shards, self.compute_dtype)

    def add_reduced(self, unit, out):
        """Down to the host, beside backward; after_backward adds it in."""
        self.landing.append((unit, self.copies.down(out, unit.shards[0])))

    def after_backward(self):
        super().after_backward()  # the last reduce-scatter in (--bitwise: the next micro-batch's leaf)
        if self.landing:
            self.copies.wait()
            for unit, out in self.landing:
                unit.accumulate(out)
            self.landing = []


# ---- restated from 04_zero.py: HostCopies (word for word; tests/test_restated.py checks it) ----
class HostCopies:
    """--offload's copies between the device and host memory on a side stream. The copies
    down run beside the compute stream's kernels instead of between them (ZeRO-Offload's
    overlap of the gradients' trip down with the rest of backward):

        compute stream   ..B(l)..  reduce-scatter(l) ..B(l-1)..  ..B(l-2)..           | host reads
        side stream                          down(l) ─────────> down(l-1) ──>      wait()

    down(t): a pinned copy of device tensor `t`, arriving; the side stream first waits for
    the kernels queued so far (those that made t). wait(): the host waits for the side
    stream, so for every copy down and for the kernels queued before the last one: in effect
    for the micro-batch's backward, once per micro-batch, before the CPU adds them up.
    up(tensors, dtype): the host tensors packed into one pinned staging buffer (a torch.cat
    of pinned tensors is not pinned) and copied to the device in `dtype`; the host does not
    wait, but the compute stream waits for the copy from the moment up() is called, so every
    kernel queued after it waits too: a copy up overlaps no compute (call it when its tensor
    is needed, not ahead). On a CPU run (no streams) both are the plain copies. On one GPU
    they ran a few steps at one rank (docs/measured.md, "One GPU"); whether the copies overlap
    the compute there is unmeasured."""

    def __init__(self, device):
        self.device = device
        accelerated = device.type in ("cuda", "xpu")
        self.module = torch.get_device_module(device) if accelerated else None
        self.stream = self.module.Stream(device) if accelerated else None

    def down(self, t, like):
        """`t` (on the device) in host memory, where `like` is."""
        if self.stream is None:
            return t.to(like.device)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(self.module.current_stream(self.device))  # after the kernels that make t
        with self.module.stream(self.stream):
            out.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # t's memory is not reused before the copy has read it
        return out

    def wait(self):
        """The host waits for the copies down (not for the compute stream)."""
        if self.stream is not None:
            self.stream.synchronize()

    def up(self, tensors, dtype):
        """The host `tensors`, flattened one after the other, as one device tensor in `dtype`."""
        if self.stream is None:
            return torch.cat([t.detach().view(-1) for t in tensors]).to(self.device, dtype)
        staged = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=True)
        torch.cat([t.detach().view(-1) for t in tensors], out=staged)
        with self.module.stream(self.stream):  # from the side stream's own memory: no wait before
            out = torch.empty(staged.shape, dtype=staged.dtype, device=self.device)
            out.copy_(staged, non_blocking=True)
        current = self.module.current_stream(self.device)
        current.wait_stream(self.stream)  # the compute stream reads `out` only once it has arrived
        out.record_stream(current)
        return out.to(dtype)
# ---- end restated ----


def materialize(model, device, dtype):
    """Start-up: swap the meta-device parameters for empty ones on `device` (tied ones stay tied)."""
    new = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(0, dtype=dtype, device=device))
                module._parameters[name] = new[id(p)]


# Muon on dim-0 shards: each matrix orthogonalised whole, by one owner rank of the shard group

def fsdp_muon(fsdp, args, env, device_type):
    """--optimizer muon: Muon for the blocks' matrices, each put together whole by one owner of
    the shard group (04's FlatMuon: a rank's rows of a matrix are a contiguous range of its
    elements, its padding rows left out), AdamW for the rest. With HSDP every replica group
    does the same, on equal shards."""
    matrices, rest, S = [], [], fsdp.shard_size
    for unit in fsdp.units:
        for name, shape, rows, shard in zip(unit.names, unit.shapes, unit.rows, unit.shards):
            if not is_hidden_matrix(name, shape):
                rest.append(shard)
                continue
            row = math.prod(shape[1:])  # elements per row: rank r holds rows [r·rows, (r+1)·rows)
            ranges = [(min(r * rows, shape[0]) * row, min((r + 1) * rows, shape[0]) * row) for r in range(S)]
            matrices.append((shape, shard, ranges))
    return FlatMuon(matrices, make_adamw(rest, args, device_type), args, env, fsdp.shard_group)


# ---- restated from 04_zero.py: muon_owners, muon_balance, FlatMuon (word for word; tests/test_restated.py checks it) ----
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


class FlatMuon(Muon):
    """Muon on ZeRO's flat shards. Momentum is element-wise, so each rank keeps its shard's, as
    it keeps AdamW's moments. Newton-Schulz is not: it needs the whole matrix, which the flat
    cut scatters over one or more ranks (a matrix may straddle shard boundaries). Two
    all-to-alls per step move whole matrices, by hand:

        rank r: its pieces U_r of every matrix's update (the momentum, in the NS dtype)
          ── all-to-all ──>  owner o: all pieces of each matrix it owns, laid end to end,
                             O = orthogonalize(U), cut back into the same pieces
          <── all-to-all ──  rank r: O_r of every matrix, applied to its piece

    `matrices`: [(shape, piece, ranges)]: the full shape, this rank's piece (a tensor whose
    .grad is its gradient; None where it holds nothing; 05's rows end in padding, which is
    left out) and every rank's range [a, b) of the matrix's elements (04's matrix_ranges)."""

    def __init__(self, matrices, adamw, args, env, group):
        super().__init__([piece for _, piece, _ in matrices if piece is not None], adamw, args, env.dtype)
        self.matrices, self.group, self.device = matrices, group, env.device
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.owners = muon_owners([shape for shape, _, _ in matrices], self.world_size)

    @torch.no_grad()
    def step(self):
        group, N, me = self.param_groups[0], self.world_size, self.rank
        owned = [[i for i, owner in enumerate(self.owners) if owner == t] for t in range(N)]
        length = lambda i, r: self.matrices[i][2][r][1] - self.matrices[i][2][r][0]  # rank r's piece of i
        updates = [muon_momentum(piece.grad, self.state[piece]["momentum_buffer"]).reshape(-1)[:length(i, me)]
                   .to(self.device, self.ns_dtype) if piece is not None else None
                   for i, (_, piece, _) in enumerate(self.matrices)]
        out_sizes = [sum(length(i, me) for i in owned[t]) for t in range(N)]  # to owner t
        in_sizes = [sum(length(i, r) for i in owned[me]) for r in range(N)]  # from rank r
        # 1: to each owner (in rank order) this rank's pieces of the matrices it owns
        send = torch.cat([torch.zeros(0, dtype=self.ns_dtype, device=self.device)] +
                         [updates[i] for t in range(N) for i in owned[t] if updates[i] is not None])
        pieces = send.new_empty(sum(in_sizes))
        dist.all_to_all_single(pieces, send, in_sizes, out_sizes, group=self.group)
        starts = [sum(in_sizes[:r]) for r in range(N)]  # where rank r's pieces begin
        for i in owned[me]:  # each of my matrices put together, orthogonalised, cut back in place
            shape, _, ranges = self.matrices[i]
            whole = torch.cat([pieces[starts[r]:starts[r] + length(i, r)] for r in range(N)])
            whole = orthogonalize(whole.view(shape), self.ns_dtype).reshape(-1)
            for r, (a, b) in enumerate(ranges):
                pieces[starts[r]:starts[r] + b - a] = whole[a:b]
                starts[r] += b - a
        # 2: the orthogonalised pieces back to the ranks that hold them
        back = send.new_empty(send.numel())
        dist.all_to_all_single(back, pieces, out_sizes, in_sizes, group=self.group)
        offset = 0
        for t in range(N):
            for i in owned[t]:
                shape, piece, _ = self.matrices[i]
                if piece is not None:
                    n = length(i, me)
                    muon_apply(piece.view(-1)[:n], back[offset:offset + n].to(piece.device), group["lr"],
                               group["weight_decay"], shape)
                    offset += n
        self.adamw.step()
# ---- end restated ----


def costs(args, config, world_size, dtype, rank=0):
    """The docstring's formulas in bytes per rank. S = N/R ranks per shard group; Ψ counts
    every parameter with its rows padded to a multiple of S (each rank holds ceil(rows/S)
    rows); e is the compute dtype's element size, rb the reduce dtype's, m the micro-batches
    per step. --optimizer muon: Ψ_m of Ψ are Muon's (one fp32 moment, not two); this rank
    sends its Ψ_mr elements of them to their owners and receives back, in the compute dtype,
    the Ψ_o elements of the matrices it owns (fsdp_optimizer)."""
    from infra.formulas import (activation_device_type, activation_terms, activations_of_layers, formula,
                                newton_schulz_flops, phase_peaks, plus, transient_terms)
    S, R = world_size // args.replicate, args.replicate
    padded = {k: math.ceil(shape[0] / S) * S * math.prod(shape[1:]) for k, shape in param_shapes(config).items()}
    root = sum(v for k, v in padded.items() if not k.startswith("transformer.h."))
    per_block = [sum(v for k, v in padded.items() if k.startswith(f"transformer.h.{i}.")) for i in range(config.n_layer)]
    psi, blocks = sum(padded.values()), sum(per_block)
    e, rb = 4 if args.bitwise else dtype.itemsize, getattr(torch, args.reduce_dtype).itemsize  # --bitwise: fp32
    m = args.global_batch_size // (args.micro_batch_size * world_size)
    reshard, prefetch = not args.no_reshard, not args.no_prefetch
    # blocks are gathered in every micro-batch's forward and backward, or once per step
    # when they stay gathered (--no_reshard); the root once per step. At the peak: the root
    # and one block gathered, two with prefetch, every block without resharding
    resident = config.n_layer if not reshard else (2 if prefetch else 1)

    matrices = [(k, shape) for k, shape in param_shapes(config).items()
                if args.optimizer == "muon" and is_hidden_matrix(k, shape)]
    owners, r = muon_owners([shape for _, shape in matrices], S), rank % S  # r: in the shard group
    rows = {k: math.ceil(shape[0] / S) for k, shape in matrices}

    def f(expr):  # root, blocks: the root unit's and the blocks' Ψ; block: the largest block's
        return formula(expr, show="e rb m k", Ψ=psi, S=S, N=world_size, e=e, rb=rb, m=m, k=resident, root=root,
                       blocks=blocks, block=max(per_block), loss=1, norm=1,
                       Ψ_m=sum(padded[k] for k, _ in matrices),
                       Ψ_mr=sum((min((r + 1) * rows[k], s[0]) - min(r * rows[k], s[0])) * s[1] for k, s in matrices),
                       Ψ_o=sum(math.prod(s) for (_, s), owner in zip(matrices, owners) if owner == r))
    held = {"params": f("4*Ψ/S"), "grads": f("4*Ψ/S"), "optim": f("8*Ψ/S - 4*Ψ_m/S") if matrices else f("8*Ψ/S")}
    if args.offload:  # the shards and AdamW in host memory: the device keeps the gathered units only
        held = {"params": f("0"), "grads": f("0"), "optim": f("0"), **{f"{k} (host)": v for k, v in held.items()}}
    sent = {"all_gather_into_tensor[shard]": f("e*(root + 2*m*blocks)" if reshard else "e*(root + blocks)"),
            "reduce_scatter_tensor[shard]": f("m*rb*Ψ"),
            "all_reduce[shard]": f("4*norm" if args.grad_clip > 0 else "0"),
            "all_reduce": f("4*loss")}
    if R > 1:
        sent["all_reduce[replicate]"] = f("m*rb*Ψ/S")
    if args.bitwise:  # BitwiseTrees: each unit's gradients to their owners, the sums back (and across the
        # replicas, each unit's shard padded to R), the loss (one per rank) to its owner and back
        rep = sum(math.ceil(u // S / R) * R for u in [root] + per_block) * S
        sent = {"all_gather_into_tensor[shard]": f("e*(root + 2*m*blocks) + 4*Ψ" if reshard else "e*(root + blocks) + 4*Ψ"),
                "all_to_all_single[shard]": f("4*Ψ"), "all_to_all_single": f("4*N"),
                "all_gather_into_tensor": f("4*N")}
        if R > 1:
            sent["all_to_all_single[replicate]"] = sent["all_gather_into_tensor[replicate]"] = \
                formula("4*Ψ_R/S", Ψ_R=rep, S=S)
    if matrices:  # Muon: this rank's rows to their owners, its own matrices' rows back
        muon = f("e*(Ψ_mr + Ψ_o)")
        sent["all_to_all_single[shard]"] = plus(sent["all_to_all_single[shard]"], muon) if args.bitwise else muon  # (--bitwise's too)
    sent = {k: v for k, v in sent.items() if v[1]}
    # the calls a step posts, each paying the network's latency once: a unit's (U: the root and a
    # unit per block) gather, reduce-scatter and replica all-reduce, the blocks gathered in forward
    # and backward of every micro-batch (once per step without resharding); --bitwise's trees
    def c(expr):
        return formula(expr, show="m", U=1 + config.n_layer, m=m, loss=1, norm=1)
    gathers = "1 + m*2*(U - 1)" if reshard else "U"
    calls = {"all_gather_into_tensor[shard]": c(gathers), "reduce_scatter_tensor[shard]": c("m*U"),
             "all_reduce[shard]": c("norm"), "all_reduce": c("loss"), "all_reduce[replicate]": c("m*U")}
    if args.bitwise:
        calls = {"all_gather_into_tensor[shard]": c(f"{gathers} + U"), "all_to_all_single[shard]": c("U"),
                 "all_to_all_single": c("loss"), "all_gather_into_tensor": c("loss"),
                 "all_to_all_single[replicate]": c("U"), "all_gather_into_tensor[replicate]": c("U")}
    if matrices:  # Muon's two all-to-alls
        calls["all_to_all_single[shard]"] = plus(calls.get("all_to_all_single[shard]"), c("2"))
    calls = {k: v for k, v in calls.items() if k in sent}
    gathered = f("e*(root + k*block)")
    # activations: each rank runs 01's model on its micro-batch; sharding the model states
    # leaves them as they are, but the residual stream is in the compute dtype
    terms = activation_terms(config, args.micro_batch_size, config.block_size, dtype, activation_device_type(args),
                             param_dtype=torch.float32 if args.bitwise else dtype)  # the gathered units
    cost = {"layout": f"FSDP over {S} ranks" + (f" x {R} replicas" if R > 1 else ""),
            "held": held, "sent": sent, "calls": calls, "gathered": gathered, "muon": matrices,
            # Muon: Newton-Schulz on the matrices this rank owns in its shard group, whole (every replica's too)
            "muon_flops": newton_schulz_flops([s for (_, s), owner in zip(matrices, owners) if owner == r]),
            "activations": activations_of_layers(terms, config.n_layer, args.recompute)}
    # every live tensor at its most, by phase (infra.formulas.phase_peaks). Forward peaks at its end,
    # with the root and the last block gathered (the prefetched next block exists only
    # while a block with fewer activations behind it runs). Backward: the packed copy of a
    # unit's gradients to reduce-scatter (rb per element), one in flight at a time, beside
    # what backward holds (its gradients replace saved tensors backward has freed; when gloo
    # completes the reduce-scatter moves the peak by up to 4%). AdamW: each parameter's shard
    t = transient_terms(config, args.micro_batch_size, config.block_size, dtype, activation_device_type(args),
                        args.optimizer, update=max(padded.values()) // S,  # gathered in the compute dtype:
                        casts=None if args.bitwise else 0)  # nothing to cast (--bitwise: fp32, cast as 01's)
    forward = {"gathered": f("e*(root + block)")} if reshard else {}
    unit = formula("rb*block", show="rb", rb=rb, block=max(per_block))
    tree, unit = bitwise_peaks(args, f, terms["layer"], R, m) or ({}, unit)
    cost["peak"] = phase_peaks(cost, t, forward={**forward, **tree}, backward={"unit": unit, **tree})
    # start-up: the shards alone (the model is built on the meta device), each parameter drawn
    # whole by param_init before its rows are kept; Muon's momentum is made with it
    cost["startup"] = formula("params + init" + " + 4*Ψ_m/S" * bool(matrices), show="init", params=plus(
        *(v for k, v in held.items() if k.startswith("params"))), init=t["init"], Ψ_m=f("Ψ_m")[1], S=S)
    return cost


def bitwise_peaks(args, f, layer, R, m):
    """--bitwise's tensors in costs()'s peak, ({tree}, unit), or None without it (or one micro-batch).
    Through the forwards and backwards, BitwiseTrees' partial sums of every unit's packed gradient
    (common.TreeSum over this rank's m micro-batches): one copy of 4Ψ per 1-bit of the micro-batches
    taken so far, k = floor(log2 m) at most (as 01's), less the gradient shards (4Ψ/S), made only when
    the last micro-batch's reductions land. That last backward holds P = popcount(m - 1) copies, and
    once its first unit (a block) is over, its saved tensors gone, that unit's P copies are one sum
    beside the new packed gradient (2 - P more), and the reduction's buffers: the all_to_all's pieces
    (4·block), the whole mean gradient gathered for the norms (4·block), the shard added in
    (4·block/S); with replicas the pieces are freed once their shard, padded to R (4·block/S), is
    all-reduced over them. The plain path's packed copy is the unit term this replaces."""
    from infra.formulas import formula
    if not args.bitwise or m < 2:
        return None
    k, P = m.bit_length() - 1, bin(m - 1).count("1")
    tree = {"tree": formula("k*4*Ψ - 4*Ψ/S", show="k", k=k, Ψ=f("Ψ"), S=f("S"))}
    reduction = "4*block + 2*4*block/S" if R > 1 else "2*4*block + 4*block/S"
    return tree, formula(f"max(0, (P - k)*4*Ψ + (2 - P)*4*block + {reduction} - layer)", show="k P", k=k, P=P,
                         Ψ=f("Ψ"), block=f("block"), S=f("S"), layer=layer)


def log_gathered(run, fsdp):
    """Once, next to the ledger: the gathered parameters at the peak against costs()'s bound."""
    from infra.formulas import format_bytes
    formula, bound = run.cost["gathered"]
    numel = sum(shape.numel() for unit in fsdp.units for shape in unit.shapes)  # Ψ, unpadded
    run.log(f"gathered parameters at the peak: {format_bytes(fsdp.gathered_peak)} (bound: {formula} = "
            f"{format_bytes(bound)}); full model {format_bytes(4 * numel)} in fp32")


def layout_lines(args, world_size, accum_steps):
    """The dry run's layout lines: the shard groups, and how Muon's owners share the work (the
    gathered parameters at the peak are among what it prints of costs())."""
    config = model_config(args, Data.vocab_size_of(args.data))
    matrices = [shape for name, shape in param_shapes(config).items()
                if args.optimizer == "muon" and is_hidden_matrix(name, shape)]
    S = world_size // args.replicate
    return ([f"layout: shard groups of {S} consecutive ranks x {args.replicate} replica(s); "
             f"{accum_steps} micro-batch(es) of {args.micro_batch_size} per rank per step"]
            + ([f"  warning: a shard group of {S} ranks spans nodes of {args.ranks_per_node}: "
                "use --replicate (HSDP) to keep the gathers inside a node"] if S > args.ranks_per_node else [])
            + ([muon_balance(matrices, S)] if matrices else []))


def held_bytes(fsdp, optimizer):
    """Model-state bytes this rank holds, counted from the live tensors: the fp32 shards,
    their gradients and AdamW's moments; with --offload all of it in host memory (the
    device has the gathered units only)."""
    from infra.ledger import state_bytes
    held = state_bytes(fsdp.shards(), optimizer)
    if isinstance(fsdp, OffloadedFSDP):
        held = {"params": 0, "grads": 0, "optim": 0, **{f"{k} (host)": v for k, v in held.items()}}
    return held


def describe(fsdp, args, accum_steps):
    """The start line's layout."""
    replicas = fsdp.world_size // fsdp.shard_size
    return (f"built on the meta device; reduce {str(fsdp.reduce_dtype).replace('torch.', '')}; "
            f"{len(fsdp.units)} units sharded over {fsdp.shard_size} ranks"
            + (f" x {replicas} replicas (HSDP)" if replicas > 1 else "")
            + f"; prefetch {'on' if fsdp.prefetch else 'off'}, reshard {'on' if fsdp.reshard else 'off'}"
            + f"; {accum_steps} micro-batch(es) of {args.micro_batch_size} per rank per step")


def checkpoint_pieces(fsdp, optimizer):
    """This rank's rows of every parameter (dim-0 shards, without the padding rows) and
    their AdamW moments, in common.py's format: any script resumes it at any layout. With
    HSDP the replicas hold equal shards: replica 0 writes them; every replica reads."""
    from infra.checkpoint_format import param_pieces
    pieces = []
    for unit in fsdp.units:
        for name, shape, rows, shard in zip(unit.names, unit.shapes, unit.rows, unit.shards):
            lo, hi = fsdp.shard_rank * rows, min((fsdp.shard_rank + 1) * rows, shape[0])
            if lo < hi:  # the last ranks may hold padding only
                pieces += param_pieces(name, shape, shard, optimizer, box=[[lo, hi]] + [[0, s] for s in shape[1:]],
                                       index=slice(0, hi - lo), write=fsdp.replica == 0)
    return pieces


if __name__ == "__main__":
    main()