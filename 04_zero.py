"""04_zero.py: ZeRO stages 1, 2 and 3 by hand (Rajbhandari et al. 2020), --stage 1|2|3.

Data parallelism keeps N identical copies of everything. ZeRO (Zero Redundancy Optimizer)
keeps the data-parallel loop but partitions the model states across the N ranks, so each
rank stores and updates only 1/N of them:

    stage 1  P_os      optimizer state (AdamW moments, fp32 master weights) partitioned
    stage 2  P_os+g    ... and gradients: each rank keeps only its partition's gradients
    stage 3  P_os+g+p  ... and parameters: a block's weights exist in full only while it runs

The parameters are grouped into units, one per transformer block plus a root unit (the token
embedding, which is also the tied output head, the position embedding and the final
LayerNorm). Each unit is one flat buffer, padded to a multiple of N and cut into N equal
shards; rank r owns shard r of every unit, so that each reduce-scatter and all-gather moves
one unit:

    unit (flat, padded)   [ block 3 : ln_1 | attn.c_attn | attn.c_proj | ln_2 | mlp.c_fc | mlp.c_proj | pad ]
    shards                [  rank 0   |  rank 1   |  rank 2   |  rank 3   ]
    each rank holds       its shard's AdamW exp_avg + exp_avg_sq (+ fp32 master) and reduced
                          gradient; stages 1-2 also every parameter, stage 1 every gradient

One optimizer step, per rank:

    stage 1: forward/backward on full params -> full grads (kept) -> reduce-scatter grads
             (rank r gets the mean of shard r) -> AdamW on shard r -> all-gather params
    stage 2: as stage 1, but the grads are reduce-scattered in every micro-batch's backward
             (nothing is kept to accumulate), and each unit's full grads freed at once
    stage 3: before each block's forward (and again before its backward): all-gather its
             params; after: free them (the root unit stays gathered for the whole step).
             Gradients as in stage 2. After AdamW: nothing to gather, the next forward
             gathers on demand

A unit's reduce-scatter starts, asynchronously, the moment backward has produced the unit's
last gradient, and runs while backward goes on to the earlier blocks (DDP's buckets, with the
units as the buckets). Stages 2-3 keep one in flight at a time, so that at most one unit's
fp32 gradients are alive beside the shards:

    backward, last micro-batch   [ block 3 ][ block 2 ][ block 1 ][ block 0 ][ root ]
    reduce-scatters (async)                 [ rs 3 ]   [ rs 2 ]   [ rs 1 ]   [ rs 0 ][ rs root ]
                                                                 wait for all -> clip, AdamW

Run:

    mpiexec -n 4 python 04_zero.py --stage 3 --model gpt2
    torchrun --standalone --nproc_per_node 8 04_zero.py --stage 2 --model gpt2-medium --micro_batch_size 4
    mpiexec -n 3 python 04_zero.py --resume ...   # resume any checkpoint (any script, any layout)

One rank holds  in fp32, stage 1: 4Ψ + 4Ψ + 12Ψ/N; stage 2: 4Ψ + 12Ψ/N; stage 3: 16Ψ/N + the units it gathers
One rank sends  reduce-scatter 4Ψ (stages 2-3: per micro-batch) + all-gather 4Ψ (stage 3: each block twice per micro-batch)

The start-up on the meta device, the one-in-flight rule, mixed precision, --offload
(ZeRO-Offload) and the formulas: docs/strategies.md, section "04_zero.py: ZeRO".
"""

import math

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist
from torch import nn

from common import (autocast, check, Data, GPT, is_decayed, is_hidden_matrix, lr_at, make_adamw,
                    make_parser, model_block_size, model_config, Muon, muon_apply, muon_momentum, orthogonalize,
                    param_init, param_shapes, to_device, to_host, TreeGrads, TreeSum, tree_all_reduce)


class Unit:
    """The parameters of one module as one flat buffer, padded to a multiple of N and cut
    into N equal shards, N the size of the data-parallel `group`; this rank (its rank r in
    the group) owns elements [lo, hi) = [r·shard, (r+1)·shard). `full` is the whole buffer in
    the compute dtype (stage 3: its memory given back while the unit is not gathered); `master` is this
    rank's fp32 shard, the copy the optimizer updates. Built where it lives, one parameter at a
    time, from `init(name, shape)` (common.param_init, a pure function of (seed, name)): stages
    1-2 write the whole buffer they keep, stage 3 only the pieces in this rank's shard."""

    def __init__(self, name, prefix, named_params, shapes, init, group, env, compute_dtype, keep_full,
                 offload=False):
        self.name = name
        self.names, self.params = zip(*named_params)  # the module's own (empty) parameters
        self.shapes = [shapes[prefix + k] for k in self.names]  # the full shapes, from the meta model
        self.offsets, offset = [], 0
        for shape in self.shapes:
            self.offsets.append(offset)
            offset += shape.numel()
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_numel = math.ceil(offset / n)
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        self.device, self.dtype = env.device, compute_dtype
        # the fp32 master shard, from the fp32 initialisation: a view of the full buffer when
        # that is fp32 and kept (stages 1-2 on CPU), else a buffer of its own; with --offload
        # in host memory, with the gradient shard the optimizer reads
        alias = keep_full and compute_dtype == torch.float32 and not offload
        full = torch.zeros(self.shard_numel * n, dtype=compute_dtype, device=env.device) if keep_full else None
        shard = None if alias else torch.zeros(self.shard_numel, dtype=torch.float32)
        self.initialise(init, prefix, full, shard)
        place = (lambda t: to_host(t, env.device)) if offload else (lambda t: t.to(env.device))
        self.master = full[self.lo:self.hi] if alias else place(shard)
        self.grad_shard = place(torch.zeros(self.shard_numel, dtype=torch.float32))
        self.grad_full = None
        if keep_full:
            self.bind(full)
        else:  # stage 3: the parameters' views are made once, over memory given back at once
            self.bind(torch.empty(self.shard_numel * n, dtype=compute_dtype, device=env.device))
            self.release()

    def initialise(self, init, prefix, full, shard):
        """Write each parameter's initial value into the whole unit `full` (if kept) and its
        part in this rank's range [lo, hi) into the fp32 `shard` (if a buffer of its own)."""
        for k, shape, offset in zip(self.names, self.shapes, self.offsets):
            a, b = max(offset, self.lo), min(offset + shape.numel(), self.hi)  # the part in shard r
            if full is None and a >= b:
                continue  # stage 3: none of this parameter is ours, nothing to build
            value = init(prefix + k, shape).view(-1)  # one whole parameter, fp32, on the host
            if full is not None:
                full[offset:offset + shape.numel()].copy_(value)  # to the compute dtype and device
            if shard is not None and a < b:
                shard[a - self.lo:b - self.lo].copy_(value[a - offset:b - offset])

    def bind(self, full):
        """Point every parameter of the unit at its slice of `full` (the whole unit)."""
        self.full, self.gathered = full, True
        for p, shape, offset in zip(self.params, self.shapes, self.offsets):
            p.data = full[offset:offset + shape.numel()].view(shape)

    # -- stage 3: the whole unit's memory, taken and given back in place --------------------
    # The parameters stay views of `full` for the whole run; what comes and goes is the
    # memory under it (its storage resized, as PyTorch FSDP frees its flat parameters).
    # Dropping the tensor instead would free nothing in training: autograd keeps the
    # weights a block's forward used (a Linear saves weight.t(), a view of `full`) until
    # backward reaches the block, so every block's gathered copy, the whole model, would
    # be alive when backward begins. Emptied in place, those saved views hold no memory,
    # and the gather before the block's backward refills the same storage under them.
    def allocate(self):
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.gathered = True

    def release(self):
        """Stage 3: give back the full parameters' memory; only the shard remains."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def segments(self):
        """(k, (start, stop, decayed)) pieces of this rank's shard, one per parameter k it
        overlaps, plus the padding (k None): the optimizer gets one tensor per piece so that
        weight decay applies to matrices only, exactly as in 01 (and Muon finds its matrices)."""
        pieces = []
        for k, (shape, offset) in enumerate(zip(self.shapes, self.offsets)):
            a, b = max(offset, self.lo), min(offset + shape.numel(), self.hi)
            if a < b:
                pieces.append((k, (a - self.lo, b - self.lo, is_decayed(shape))))
        covered = pieces[-1][1][1] if pieces else 0
        if covered < self.shard_numel:  # padding (or nothing of this unit on this rank)
            pieces.append((None, (covered, self.shard_numel, False)))
        return pieces


class ZeRO:
    """The partitioned model states of one stage, and its collectives, over the data-parallel
    `group` (here the world; passed in, so that the class copied into a bigger mesh
    partitions over the replicas and nothing else)."""

    def __init__(self, model, stage, group, env, args):
        """`model`: a GPT on the meta device (shapes only). Its parameters are swapped for
        empty ones on the device, and each unit builds only what this rank keeps (above)."""
        self.stage, self.group, self.world_size = stage, group, dist.get_world_size(group)
        # (--bitwise: the working copy in fp32, as 01's weights under autocast, so that LayerNorm and
        # the embedding read the same values; autocast casts the matmuls' inputs alike)
        self.compute_dtype = torch.float32 if args.bitwise else env.dtype
        self.device, self.offload = env.device, args.offload
        self.gathered_now = self.gathered_peak = 0  # stage 3: the gathered units' bytes (track)
        shapes = {k: p.shape for k, p in model.named_parameters()}
        materialize(model, env.device, self.compute_dtype)
        init = lambda name, shape: param_init(name, shape, model.config, args.seed)
        unit = lambda name, prefix, named: Unit(name, prefix, named, shapes, init, group, env, self.compute_dtype,
                                                keep_full=stage < 3, offload=args.offload)
        self.root = unit("root", "", [(k, p) for k, p in model.named_parameters() if not k.startswith("transformer.h.")])
        self.blocks = [unit(f"transformer.h.{i}.", f"transformer.h.{i}.", list(block.named_parameters()))
                       for i, block in enumerate(model.transformer.h)]
        self.units = [self.root] + self.blocks
        self.unit_of = {p: u for u in self.units for p in u.params}
        self.offset_of = {p: offset for u in self.units for p, offset in zip(u.params, u.offsets)}
        self.optimizer = self.shard_optimizer(args, env)  # P_os: on this rank's shards only (below)
        if stage == 1:  # full gradients, kept through accumulation: one fp32 buffer per unit
            for unit in self.units:
                unit.grad_full = torch.zeros_like(unit.full, dtype=torch.float32)
        # stage 1: add each micro-batch's gradient into the fp32 sum as backward produces it;
        # every stage: reduce-scatter a unit as soon as backward has produced all its
        # gradients (stage 1: only in the last micro-batch's backward; see sync)
        for p in self.unit_of:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.first, self.sync, self.shard_empty = True, stage > 1, True
        self.bitwise = BitwiseTrees(self, args, list(shapes)) if args.bitwise else None  # --bitwise: one fixed order (below)
        self.pending, self.reduced, self.waiting = [], False, {u: len(u.params) for u in self.units}
        if stage == 3:
            for block, unit in zip(model.transformer.h, self.blocks):
                block.register_forward_pre_hook(lambda module, args, unit=unit: self.gather(unit))
                block.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))

    # -- stage 3: parameters gathered on demand ------------------------------------------
    def gather(self, unit):
        if not unit.gathered:
            unit.allocate()
            self.track(+unit.full.numel() * unit.full.element_size())  # the whole unit's memory, from here on
            # every rank's shard of this unit -> the whole unit, on every rank
            dist.all_gather_into_tensor(unit.full, self.working_shard(unit), group=self.group)

    def release(self, unit):
        if unit.gathered:
            unit.release()
            self.track(-unit.full.numel() * unit.full.element_size())

    def track(self, delta):
        """The bytes of gathered units alive now, and their most this step (costs()'s
        `gathered`: the root and the one block being run)."""
        self.gathered_now += delta
        self.gathered_peak = max(self.gathered_peak, self.gathered_now)

    def _after_forward(self, unit, out):
        self.release(unit)  # free the block's parameters until backward needs them again
        if out.requires_grad:  # when backward reaches this block's output, gather it first
            out.register_hook(lambda grad: self.gather(unit))

    def gather_root(self):
        """Stage 3: the root unit (the embeddings, wte also the output head, and the final
        norm) is used at both ends of the model, so it stays gathered for the whole step or
        evaluation."""
        if self.stage == 3:
            self.gather(self.root)

    def release_root(self):
        if self.stage == 3:
            self.release(self.root)

    # -- gradients reduce-scattered while backward runs -----------------------------------
    def before_backward(self, first, last):
        """Stage 1 reduces the accumulated gradients once, during the last micro-batch's
        backward; stages 2-3 reduce in every micro-batch's backward. The first micro-batch
        writes stage 1's fp32 sums where later ones add to them (nothing to zero)."""
        self.first, self.sync = first or bool(self.bitwise), self.stage > 1 or last or bool(self.bitwise)

    def _grad_ready(self, param):
        unit = self.unit_of[param]
        if self.stage == 1:  # this micro-batch's gradient (compute dtype) into the kept fp32 sum
            offset = self.offset_of[param]
            total = unit.grad_full[offset:offset + param.numel()]
            total.copy_(param.grad.view(-1)) if self.first else total.add_(param.grad.view(-1))
            param.grad = None
        if not self.sync:  # stage 1, a micro-batch before the last: only accumulate locally
            return
        self.waiting[unit] -= 1
        if self.waiting[unit] > 0:
            return
        if self.stage == 1:  # the full gradients, accumulated, stay (stage 1 keeps them)
            flat = unit.grad_full
        else:  # the unit's gradients in fp32, reduced in fp32 as 03 and 05 reduce them
            # one reduce-scatter in flight at a time (05's rule): finish the previous unit's
            # first, so that its full-size input is freed before this one is allocated
            self.finish_reductions()
            flat = torch.zeros(unit.shard_numel * self.world_size, dtype=torch.float32, device=unit.device)
            for p, offset in zip(unit.params, unit.offsets):
                flat[offset:offset + p.numel()].copy_(p.grad.view(-1))
                p.grad = None  # the full gradient is freed at once: only the shard is kept
        if self.bitwise:  # --bitwise: into the unit's tree, reduced in one fixed order once whole (below)
            self.bitwise.add(unit, flat)
        else:
            flat.div_(self.world_size)  # sum of g/N = the mean (gloo has no AVG)
            # the step's first reduction lands in the gradient shard itself (nothing to zero, no
            # copy); a later one (stages 2-3 accumulating), or one for the host, in a buffer
            shard = unit.grad_shard if self.shard_empty and not self.offload else \
                torch.empty(unit.shard_numel, dtype=torch.float32, device=unit.device)
            # sum every rank's gradients of this unit; rank r receives shard r; asynchronous, so
            # backward continues on the earlier blocks meanwhile
            handle = dist.reduce_scatter_tensor(shard, flat, group=self.group, async_op=True)
            self.pending.append((handle, unit, shard, flat))  # holds `flat` until the wait
            self.reduced = True
        if self.stage == 3 and unit is not self.root:
            self.release(unit)  # its backward is over: drop the gathered parameters

    def finish_reductions(self):
        """Wait for the reduce-scatters in flight and add the reduced shards that were not
        reduced into place; dropping them frees their full-size inputs (stages 2-3)."""
        for handle, unit, shard, _ in self.pending:
            handle.wait()
            if shard is not unit.grad_shard:  # a later micro-batch's reduction (or one for the host)
                self.add_reduced(unit, shard)
        self.pending = []

    def add_reduced(self, unit, shard):
        """Write (the step's first) or add a reduced shard into the unit's gradient shard."""
        unit.grad_shard.copy_(shard) if self.shard_empty else unit.grad_shard.add_(shard)

    def after_backward(self):
        """After each micro-batch's backward: wait for its reduce-scatters (stage 1: all of
        them, and none but in the last micro-batch; stages 2-3: the last one)."""
        if self.sync:
            check(all(w == 0 for w in self.waiting.values()),
                  "a gradient never arrived (a parameter unused in forward?)")
        self.finish_reductions()
        self.shard_empty = self.shard_empty and not self.reduced
        self.reduced, self.waiting = False, {u: len(u.params) for u in self.units}
        if self.bitwise:
            self.bitwise.micro += 1

    # -- the update ----------------------------------------------------------------------
    def shard_optimizer(self, args, env):
        """ZeRO's P_os: the optimizer gets this rank's shard only, one tensor per parameter
        piece (so that weight decay applies to matrices only, exactly as in 01), each with its
        piece of the gradient shard as .grad. AdamW is fused on GPUs; with --offload the shards
        are in host memory and it runs on the CPU. --optimizer muon: zero_muon, below."""
        decayed, not_decayed = [], []
        for unit in self.units:
            unit.pieces = []  # the optimizer's tensors, in order (for the checkpoint)
            for k, (a, b, decay) in unit.segments():
                piece = unit.master[a:b]
                piece.grad = unit.grad_shard[a:b]  # the optimizer reads this rank's gradient shard
                (decayed if decay else not_decayed).append(piece)
                unit.pieces.append(piece)
        device_type = "cpu" if args.offload else env.device.type
        if args.optimizer == "muon":  # Muon for the hidden matrices, AdamW for the rest
            return zero_muon(self, decayed, not_decayed, args, env, device_type)
        return make_adamw(decayed, args, device_type, not_decayed=not_decayed)

    def clip_grad_norm(self, max_norm):
        """The global gradient norm from the shards (padding is zero), as clip_grad_norm_."""
        if self.bitwise:  # --bitwise: from each parameter's norm, taken whole (BitwiseTrees)
            total_norm = self.bitwise.norm()
        else:
            squares = sum(u.grad_shard.pow(2).sum() for u in self.units).to(self.device)
            dist.all_reduce(squares, group=self.group)  # the sum of every rank's squared shard norms
            total_norm = squares.sqrt()
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).to(self.root.grad_shard.device)
        for unit in self.units:
            unit.grad_shard.mul_(coef)
        return total_norm

    def working_shard(self, unit):
        """This rank's shard in the compute dtype on the device, the all-gather's input."""
        return unit.master.to(self.device, unit.dtype, copy=True)

    def step(self):
        self.optimizer.step()  # AdamW on this rank's shards only (--offload: on the CPU)
        self.gather_params()

    def gather_params(self):
        """Stages 1-2: every rank's updated (or loaded) master shard -> the whole unit, on every
        rank, in the compute dtype. Stage 3 gathers from the masters at the next forward."""
        if self.stage < 3:
            # every unit's all-gather issued at once, then one wait for them all: the messages
            # go out back to back (as ZeroRedundancyOptimizer's broadcasts do) instead of one
            # round trip per unit; each input shard is held until its gather is waited on
            shards = [self.working_shard(unit) for unit in self.units]
            handles = [dist.all_gather_into_tensor(unit.full, shard, group=self.group, async_op=True)
                       for unit, shard in zip(self.units, shards)]
            for handle in handles:
                handle.wait()

    def zero_grad(self):
        """The next step's first micro-batch and first reduction overwrite the sums."""
        self.shard_empty = True
        if self.bitwise:
            self.bitwise.micro = 0


def add_flags(parser):
    g = parser.add_argument_group("04_zero")
    g.add_argument("--stage", type=int, default=1, choices=[1, 2, 3], help="ZeRO stage")
    g.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload: fp32 master shard, gradient shard and AdamW state in (pinned) host "
                        "memory, the optimizer steps on the CPU")
    return parser


@torch.no_grad()
def evaluate(model, zero, data, args, env, accum_steps, dp_group):
    """Mean loss of each split over eval_iters fixed global batches: each rank evaluates its
    slice, then the means are averaged across ranks."""
    model.eval()
    zero.gather_root()
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
        dist.all_reduce(total, group=dp_group)  # the sum of every rank's mean/N: the global mean
        losses[split] = total.item()
    zero.release_root()
    model.train()
    return losses


def main():
    run = Run(add_flags(make_parser(__doc__)), __file__)
    args = run.args
    env, accum_steps = run.start(costs, dp_size=run.world_size)  # processes up; auto: the largest that fits
    run.dry_run(costs, lambda config: layout_lines(args, run.world_size, accum_steps))
    torch.manual_seed(args.seed + env.rank)  # dropout: a different stream on every rank
    dp_group = dist.group.WORLD  # the data-parallel group: every rank, each with its slice of the batch

    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    with torch.device("meta"):
        model = GPT(config)  # no memory: shapes only
    for block in model.transformer.h:
        block.recompute = args.recompute
    zero = (OffloadedZeRO if args.offload else ZeRO)(model, args.stage, dp_group, env, args)  # only what it keeps
    tree = TreeGrads(lambda: [], accum_steps) if args.bitwise else None
    run.begin(config, zero.optimizer, costs, layout={"strategy": "zero", "stage": args.stage},
              pieces=lambda: checkpoint_pieces(zero), held=lambda: held_bytes(zero),
              evaluate=lambda: evaluate(model, zero, data, args, env, accum_steps, dp_group),
              describe=describe(zero, args, accum_steps),
              after_resume=zero.gather_params)  # each rank read its shards: the full parameters from them

    for step in run.steps():
        lr = lr_at(step, args)  # linear warm-up, then cosine decay (nanoGPT's get_lr)
        for group in zero.optimizer.param_groups:
            group["lr"] = lr
        x, y = data.batch("train", step, args.global_batch_size, env.rank, env.world_size)
        x, y = to_device(x, env), to_device(y, env)
        loss_sum = torch.zeros((), device=env.device)
        zero.gather_root()  # stage 3: the root (wte is also the head) stays gathered for the step
        with run.meter:
            for micro in range(accum_steps):
                rows = slice(micro * args.micro_batch_size, (micro + 1) * args.micro_batch_size)
                with autocast(env):
                    _, loss = model(x[rows], y[rows])
                zero.before_backward(micro == 0, micro == accum_steps - 1)  # stage 1: reduces in the last
                (loss if tree else loss / accum_steps).backward()  # accumulate the mean over this rank's rows
                zero.after_backward()  # this micro-batch's gradient shards are in (stage 1: the last's)
                loss_sum += loss.detach().float()
                if tree:  # --bitwise: the losses too, summed in one fixed tree
                    tree.take(micro, loss)
        zero.release_root()
        loss_sum /= accum_steps * env.world_size
        if tree:  # --bitwise: the same tree over ranks as the gradients' (BitwiseTrees)
            loss_sum = zero.bitwise.loss(tree)
        else:
            dist.all_reduce(loss_sum, group=dp_group)  # the global batch's mean loss, for logging
        norm = zero.clip_grad_norm(args.grad_clip) if args.grad_clip > 0 else None  # the global norm
        run.check(loss_sum, (u.grad_shard for u in zero.units), norm)  # non-finite? asked to stop?
        zero.step()  # AdamW on the shards, then (stages 1-2) all-gather the parameters
        run.end_step(loss_sum, lambda: gathered_row(run, zero))  # ledger, metrics, checkpoint, stop
        zero.zero_grad()
    run.finish()


# ---- Beyond the lesson ----
# Not the strategy: --offload's copies, Muon on flat shards, what a rank holds and sends (costs(),
# the ledger's theory), the dry run's lines, checkpoint pieces.

class BitwiseTrees:
    """--bitwise: each unit's gradients summed in one fixed binary tree over the global batch's
    micro-batches (common.TreeSum): this rank's k micro-batches as the subtree it owns, then the
    ranks' sums by common.tree_all_reduce (all_to_all, a tree in rank order on each shard's owner,
    all_gather), divided once by the global count. Every rank then holds the unit's whole mean
    gradient for a moment: each parameter's norm is taken from it, whole, as 01 --bitwise takes it
    (a norm summed from shards would group the squares by the layout), and only the shard is kept."""

    def __init__(self, zero, args, order):
        self.zero, self.micro, self.norms, self.order = zero, 0, {}, order  # order: nanoGPT's names
        self.k = args.global_batch_size // (args.micro_batch_size * zero.world_size)
        self.trees = {unit: TreeSum(self.k) for unit in zero.units}

    def add(self, unit, flat):
        zero = self.zero
        leaf = flat.clone() if flat is unit.grad_full else flat  # stage 1 reuses its buffer
        total = self.trees[unit].add(self.micro, [leaf])
        if total is None:
            return  # more of this rank's micro-batches to come
        self.trees[unit] = TreeSum(self.k)
        flat = tree_all_reduce(total[0], zero.group).div_(self.k * zero.world_size)
        for name, p, offset in zip(unit.names, unit.params, unit.offsets):
            self.norms[unit.name + name if unit is not zero.root else name] = \
                torch.linalg.vector_norm(flat[offset:offset + p.numel()].view(p.shape))
        unit.grad_shard.copy_(flat[unit.lo:unit.hi])

    def norm(self):
        """The global norm from every parameter's, in nanoGPT's order, as clip_grad_norm_ takes it."""
        return torch.linalg.vector_norm(torch.stack([self.norms[name] for name in self.order]))

    def loss(self, tree):
        """The losses' tree over ranks, as the gradients' (a vector of N, one loss each), and its mean."""
        n = self.zero.world_size
        flat = torch.nn.functional.pad(tree.total()[0], (0, n - 1))
        return tree_all_reduce(flat, self.zero.group)[0] / (self.k * n)


class OffloadedZeRO(ZeRO):
    """--offload (ZeRO-Offload, Ren et al. 2021): the fp32 master, the gradient shard and
    AdamW's state live in pinned host memory (Unit puts them there) and AdamW steps on the CPU
    (shard_optimizer). The copies: each reduced gradient shard goes down to the host on a side
    stream while backward goes on, and lands once per micro-batch; each master shard goes up,
    in the compute dtype, as the all-gather's input (HostCopies)."""

    def __init__(self, model, stage, group, env, args):
        super().__init__(model, stage, group, env, args)
        self.copies = HostCopies(env.device)  # on a side stream
        self.landing = []  # (unit, gradient shard on its way down)

    def add_reduced(self, unit, shard):
        """Down to the host, beside backward; land() adds it in."""
        self.landing.append((unit, self.copies.down(shard, unit.grad_shard)))

    def land(self):
        """After a micro-batch's backward: wait for its gradient shards' copies down (one wait
        for all of them), then write or add them into the host's shards."""
        if self.landing:
            self.copies.wait()
        for unit, shard in self.landing:
            ZeRO.add_reduced(self, unit, shard)
        self.landing = []

    def after_backward(self):
        self.finish_reductions()
        self.land()
        super().after_backward()

    def working_shard(self, unit):
        """Up from the host, staged in pinned memory, on the side stream."""
        return self.copies.up([unit.master], unit.dtype)


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


def materialize(model, device, dtype):
    """Start-up: swap the meta-device parameters for empty ones on `device` (tied ones stay tied): the
    units point them at their buffers (as 05_fsdp.py's materialize)."""
    new = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(0, dtype=dtype, device=device))
                module._parameters[name] = new[id(p)]


# Muon on flat shards: each matrix orthogonalised whole, by one owner rank

def zero_muon(zero, decayed, not_decayed, args, env, device_type):
    """--optimizer muon on ZeRO's flat shards: FlatMuon for the hidden matrices, each with this
    rank's piece of it (matrix_ranges of every unit), AdamW for the other pieces."""
    matrices, theirs = [], set()
    for unit in zero.units:
        names = [k if unit is zero.root else unit.name + k for k in unit.names]
        for k, ranges in matrix_ranges(names, unit.shapes, zero.world_size):
            mine = [piece for (j, _), piece in zip(unit.segments(), unit.pieces) if j == k]
            matrices.append((unit.shapes[k], mine[0] if mine else None, ranges))
            theirs.update(id(piece) for piece in mine)
    adamw = make_adamw([p for p in decayed if id(p) not in theirs], args, device_type,
                       not_decayed=[p for p in not_decayed if id(p) not in theirs])
    return FlatMuon(matrices, adamw, args, env, zero.group)


def matrix_ranges(names, shapes, n):
    """The hidden matrices (common.is_hidden_matrix) of one unit, given its parameters' full
    names and shapes in flattening order, cut into n shards as Unit cuts them: [(k, ranges)]
    for parameter k, ranges[r] = the elements [a, b) of the matrix that rank r's shard holds
    (a == b where it holds none)."""
    shard = math.ceil(sum(map(math.prod, shapes)) / n)
    matrices, offset = [], 0
    for k, (name, shape) in enumerate(zip(names, shapes)):
        clip = lambda x: min(max(x - offset, 0), math.prod(shape))
        if is_hidden_matrix(name, shape):
            matrices.append((k, [(clip(r * shard), clip((r + 1) * shard)) for r in range(n)]))
        offset += math.prod(shape)
    return matrices


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


def unit_numels(config):
    """Elements of the root unit and of each block, as ZeRO groups them (from shapes only)."""
    numels = [0] * (config.n_layer + 1)
    for name, shape in param_shapes(config).items():  # transformer.h.<i>. goes to unit i + 1, the rest to the root
        numels[int(name.split(".")[2]) + 1 if name.startswith("transformer.h.") else 0] += math.prod(shape)
    return numels


def muon_layout(config, n):
    """Muon's matrices in ZeRO's order, as it cuts them over n ranks: [(full shape, ranges)]
    (matrix_ranges of every unit; from shapes only)."""
    shapes = param_shapes(config).items()
    units = [[(k, shape) for k, shape in shapes if not k.startswith("transformer.h.")]]
    units += [[(k, shape) for k, shape in shapes if k.startswith(f"transformer.h.{i}.")] for i in range(config.n_layer)]
    return [(unit[k][1], ranges) for unit in units
            for k, ranges in matrix_ranges([name for name, _ in unit], [shape for _, shape in unit], n)]


def costs(args, config, world_size, dtype, rank=0):
    """The docstring's formulas in bytes per rank. Ψ is the parameter count with every unit
    padded to a multiple of N (as the flat shards are), e the bytes of a working parameter
    element (4 in fp32, 2 in bf16; gradients are summed and reduced in fp32: 4), K = 8
    (AdamW's two fp32 moments) plus 4 for the fp32 master when it is a copy of its own
    (mixed precision), m the micro-batches per step. --optimizer muon: Ψ_mr of this rank's
    elements are Muon's (one fp32 moment, not two), and it sends its pieces of them to their
    owners and receives back, in the compute dtype, the Ψ_o elements of the matrices it owns."""
    from infra.formulas import (activation_device_type, activation_terms, activations_of_layers, formula,
                                newton_schulz_flops, phase_peaks, plus, transient_terms)
    n, stage = world_size, args.stage
    shards = [math.ceil(numel / n) for numel in unit_numels(config)]
    psi, root = sum(shards) * n, shards[0] * n
    e = 4 if args.bitwise else dtype.itemsize  # --bitwise: the working copy stays fp32 (ZeRO)
    K = 8 if e == 4 else 12
    m = args.global_batch_size // (args.micro_batch_size * n)

    matrices = muon_layout(config, n) if args.optimizer == "muon" else []
    owners = muon_owners([shape for shape, _ in matrices], n)

    def f(expr):  # Ψ padded to N per unit; root and blocks: the root unit's and the blocks' Ψ, block the largest's
        return formula(expr, show="e K m", Ψ=psi, N=n, e=e, K=K, m=m, root=root, blocks=psi - root,
                       block=max(shards[1:], default=0) * n,
                       Ψ_mr=sum(b - a for _, ranges in matrices for a, b in ranges[rank:rank + 1]),
                       Ψ_o=sum(math.prod(shape) for (shape, _), owner in zip(matrices, owners) if owner == rank))
    held = {"optim": f("K*Ψ/N - 4*Ψ_mr") if matrices else f("K*Ψ/N")}
    if stage == 1:
        # the full fp32 gradients (kept through accumulation) + the reduced fp32 shard
        held.update(params=f("e*Ψ"), grads=f("4*Ψ + 4*Ψ/N"))
    else:  # stage 3 in mixed precision gathers its parameters from the fp32 master (optim)
        held.update(params=f("e*Ψ") if stage == 2 else f("4*Ψ/N") if e == 4 else f("0"), grads=f("4*Ψ/N"))
    if args.offload:  # ZeRO-Offload: what stays on the device, and the host's share (AdamW + master)
        held = {"params": f("e*Ψ") if stage < 3 else f("0"), "grads": f("4*Ψ") if stage == 1 else f("0"),
                "optim": f("0"), "grads (host)": f("4*Ψ/N"),
                "optim (host)": f("(8 + 4)*Ψ/N - 4*Ψ_mr") if matrices else f("(8 + 4)*Ψ/N")}
    clipping = args.grad_clip > 0
    sent = {"all_reduce": formula("4*loss + 4*norm" if clipping else "4*loss", loss=1, norm=1)}
    if stage == 1:
        sent.update(reduce_scatter_tensor=f("4*Ψ"), all_gather_into_tensor=f("e*Ψ"))
    else:  # stages 2 and 3 reduce-scatter every micro-batch; 3 gathers each block twice in it
        sent.update(reduce_scatter_tensor=f("m*4*Ψ"),
                    all_gather_into_tensor=f("e*Ψ") if stage == 2 else f("e*(root + m*2*blocks)"))
    if args.bitwise:  # the gradients and the loss (one per rank) to their owners and back (BitwiseTrees)
        sent = {"all_to_all_single": f("4*Ψ + 4*N"),
                "all_gather_into_tensor": f("4*Ψ + 4*N + " + ("e*Ψ" if stage < 3 else "e*(root + m*2*blocks)"))}
    if matrices:  # Muon: this rank's pieces to their owners, its own matrices' pieces back
        muon = f("e*(Ψ_mr + Ψ_o)")
        sent["all_to_all_single"] = plus(sent["all_to_all_single"], muon) if args.bitwise else muon  # (--bitwise's too)
    # the calls a step posts, each paying the network's latency once: one per unit (U: the root
    # and a unit per block) and collective; stage 3 gathers the blocks in forward and backward of
    # every micro-batch; --bitwise a unit's tree each and the loss's; Muon's two all-to-alls
    U, c = len(shards), formula  # noqa: E731
    gathers = "U" if stage < 3 else "1 + m*2*(U - 1)"
    calls = {"all_reduce": c("loss + norm" if clipping else "loss", loss=1, norm=1),
             "reduce_scatter_tensor": c("U" if stage == 1 else "m*U", show="m", U=U, m=m),
             "all_gather_into_tensor": c(gathers, show="m", U=U, m=m)}
    if args.bitwise:
        calls = {"all_to_all_single": c("U + loss", U=U, loss=1),
                 "all_gather_into_tensor": c(f"U + loss + {gathers}", show="m", U=U, m=m, loss=1)}
    if matrices:
        calls["all_to_all_single"] = plus(calls.get("all_to_all_single"), c("2"))
    # activations: each rank runs 01's model on its micro-batch; partitioning the model
    # states leaves them as they are (01's count per micro-batch)
    terms = activation_terms(config, args.micro_batch_size, config.block_size, dtype, activation_device_type(args),
                             param_dtype=torch.float32 if args.bitwise else dtype)  # the working parameters
    cost = {"layout": f"ZeRO stage {stage} over {n} ranks", "held": held, "sent": sent, "calls": calls,
            "activations": activations_of_layers(terms, config.n_layer, args.recompute)}
    if stage == 3:  # the working parameters at the peak: the root, gathered all step, and the block being
        cost["gathered"] = f("e*(root + block)")  # run (its backward releases it before the next is gathered)
    # Muon: Newton-Schulz on the matrices this rank owns, whole (infra.formulas.newton_schulz_flops)
    cost["muon_flops"] = newton_schulz_flops([shape for (shape, _), owner in zip(matrices, owners) if owner == rank])
    # every live tensor at its most, by phase (infra.formulas.phase_peaks), with ZeRO's own: stages 2-3
    # in backward hold a unit's gradients as backward makes them (e) and its fp32 flat
    # reduce-scatter input, one unit in flight at a time (the previous one's is waited for
    # first); AdamW works on the shards' pieces, one per parameter (at most ⌈unit/N⌉ elements)
    t = transient_terms(config, args.micro_batch_size, config.block_size, dtype, activation_device_type(args),
                        args.optimizer, update=min(max(map(math.prod, param_shapes(config).values())), max(shards)),
                        casts=None if args.bitwise else 0)  # stored in the compute dtype: nothing to cast
    # (--bitwise stores them in fp32, so autocast casts them as 01's weights)
    # (a unit's buffers come when its block's backward is over and its saved tensors are gone)
    unit = formula("max(0, (e + 4)*max(root, block) - layer)", show="e", e=e, root=root, layer=terms["layer"],
                   block=max(shards[1:], default=0) * n) if stage > 1 else None
    tree = bitwise_peaks(args, psi, m)
    cost["peak"] = phase_peaks(cost, t, forward=tree, backward={"unit": unit, **tree})
    # start-up builds only what this rank keeps, unit by unit: its shards (the fp32 master,
    # a buffer of its own unless it is the fp32 working copy), the gradients' buffers, and
    # stage 1-2's working copy; stage 3 binds the parameters' views over one whole unit's
    # memory, given back at once, or param_init's scratch, whichever is larger
    master = f("4*Ψ/N") if e == 2 and not args.offload else None
    cost["startup"] = formula("params + grads" + " + master" * bool(master) + " + max(init, e*unit)" * (stage == 3),
                              show="init e", params=held["params"], grads=held["grads"], master=master,
                              init=t["init"], e=e, unit=max(root, max(shards[1:], default=0) * n))
    return cost


def bitwise_peaks(args, psi, m):
    """--bitwise's tensors in costs()'s peak: through the forwards and backwards, BitwiseTrees' partial
    sums of every unit's flat gradient (common.TreeSum over this rank's m micro-batches), one copy of
    4Ψ per 1-bit of the micro-batches taken so far, floor(log2 m) at most (as 01's); the reduced
    gradient goes into the shard ZeRO keeps anyway, so the optimizer's phase holds nothing more."""
    from infra.formulas import formula
    if not args.bitwise or m < 2:
        return {}
    return {"tree": formula("k*4*Ψ", show="k", k=m.bit_length() - 1, Ψ=psi)}


def describe(zero, args, accum_steps):
    """The start line's layout: Ψ (the tied embedding and head once) and Ψ with every unit
    padded to a multiple of N, as the flat shards are."""
    numel = sum(shape.numel() for u in zero.units for shape in u.shapes)
    padded = sum(u.shard_numel for u in zero.units) * zero.world_size
    return (f"ZeRO stage {args.stage} over {zero.world_size} ranks, {len(zero.units)} units, Ψ = {numel:,} padded "
            f"to {padded:,}, {accum_steps} micro-batch(es) of {args.micro_batch_size} per rank per step")


def gathered_row(run, zero):
    """Stage 3's metrics keys: the gathered units' bytes at their peak, measured (ZeRO.track)
    and costs()'s `gathered`."""
    if zero.stage < 3:
        return {}
    return {"gathered_peak_bytes": zero.gathered_peak, "gathered_bound_bytes": run.cost["gathered"][1]}


def layout_lines(args, world_size, accum_steps):
    """The dry run's layout line."""
    config = model_config(args, Data.vocab_size_of(args.data))
    return ([f"layout: ZeRO stage {args.stage} over {world_size} ranks (units: root + {config.n_layer} blocks, "
             f"each cut into {world_size} shards), {accum_steps} micro-batch(es) of {args.micro_batch_size} "
             "per rank per step"]
            + ([muon_balance([shape for shape, _ in muon_layout(config, world_size)], world_size)]
               if args.optimizer == "muon" else []))


def held_bytes(zero):
    """Model-state bytes this rank holds, counted from the live tensors (the fp32 master
    counts as optimizer state when it is a separate copy, as in the paper)."""
    from infra.ledger import tensor_bytes
    units = zero.units
    masters = [u.master for u in units]
    moments = [v for state in zero.optimizer.state.values() for k, v in state.items()
               if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")]
    full_grads = [u.grad_full for u in units if u.grad_full is not None]
    if zero.offload:  # the device keeps the working parameters (and stage 1's full grads)
        return {"params": tensor_bytes([u.full for u in units]) if zero.stage < 3 else 0,
                "grads": tensor_bytes(full_grads), "optim": 0,
                "grads (host)": tensor_bytes([u.grad_shard for u in units]),
                "optim (host)": tensor_bytes(moments + masters)}
    if zero.stage < 3:
        params = tensor_bytes([u.full for u in units])
        separate_master = tensor_bytes(masters + [u.full for u in units]) - params  # 0 when a view
    else:
        params = tensor_bytes(masters) if zero.compute_dtype == torch.float32 else 0
        separate_master = 0 if zero.compute_dtype == torch.float32 else tensor_bytes(masters)
    grads = tensor_bytes(full_grads + [u.grad_shard for u in units])
    return {"params": params, "grads": grads, "optim": tensor_bytes(moments) + separate_master}


def checkpoint_pieces(zero):
    """This rank's flat shard of every unit cut at parameter boundaries: each piece is the
    elements [a, b) of one parameter flattened (ZeRO's P_os, and P_p in stage 3), with its
    AdamW moments; the padding is not saved. In common.py's format, so any script resumes
    it at any layout, and this script resumes any other's. Every rank writes its shard;
    rank 0 commits the set with a metadata file, last."""
    from infra.checkpoint_format import param_pieces
    pieces = []
    for unit in zero.units:
        optimizer_tensors = iter(unit.pieces)  # one per parameter this shard overlaps
        for name, shape, offset in zip(unit.names, unit.shapes, unit.offsets):
            a, b = max(offset, unit.lo), min(offset + shape.numel(), unit.hi)
            if a < b:
                full_name = name if unit is zero.root else unit.name + name
                pieces += param_pieces(full_name, shape, next(optimizer_tensors), zero.optimizer,
                                       flat=(a - offset, b - offset))
    return pieces


if __name__ == "__main__":
    main()