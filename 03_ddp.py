"""03_ddp.py: data parallelism by hand, the way torch's DistributedDataParallel works inside.

Every rank holds the whole model and optimizer and trains on its own slice of the global
batch. After backward the gradients are averaged across ranks with all-reduce, so every
replica takes the same optimizer step and the replicas stay identical. Done naively, that
all-reduce waits for the whole backward. DDP instead packs the gradients into buckets
(25 MiB, --bucket_mb) in the reverse order of the parameters, which is roughly the order backward
produces them; the moment a bucket is full, its all-reduce starts asynchronously and runs
while backward computes the earlier layers' gradients (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training").

    global batch of step t:  [ rows 0..B/N | rows B/N..2B/N | ... | rows (N-1)B/N..B ]
                                   |              |                       |
    rank 0: model, grads, AdamW    |   rank 1: same replica        rank N-1: same replica
                                   v              v                       v
    backward, last layer first:  bucket 0 (ln_f, h[L-1]...) full -> all_reduce ─┐ overlaps
                                 bucket 1 (h[L-2]...)       full -> all_reduce ─┤ the rest of
                                 ...                                            │ backward
                                 bucket k (..., wpe, wte)   full -> all_reduce ─┘
    optimizer step: wait for every handle; gradients are now the global mean everywhere

Run:

    mpiexec -n 4 python 03_ddp.py --model shakespeare
    torchrun --standalone --nproc_per_node 8 03_ddp.py --model gpt2 --global_batch_size 480 --micro_batch_size 12
    python 03_ddp.py --no_overlap ...        # all-reduce each gradient after backward (naive)

One rank holds  a full replica, 16Ψ bytes (Ψ parameters): fp32 weights 4Ψ, gradients 4Ψ, AdamW 8Ψ
One rank sends  one all-reduce of every gradient per step, 4Ψ bytes (none on accumulation micro-steps);
                with Muon, each matrix's orthogonalised update broadcast from its one owner: e·Ψ_m bytes
                (Ψ_m the blocks' weight matrices' parameters, e bytes an element; ReplicatedMuon)

The costs and why buckets overlap: docs/strategies.md, section "03_ddp.py: data parallel".
"""


import math
from functools import partial

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist

from common import (autocast, build_model, check, count_params, Data, lr_at, make_optimizer, make_parser,
                    model_block_size, model_config, Muon, muon_apply, muon_momentum, orthogonalize, to_device,
                    TreeGrads, tree_all_reduce)


def add_flags(parser):
    g = parser.add_argument_group("03_ddp")
    g.add_argument("--bucket_mb", type=float, default=25.0, help="gradient bucket size in MiB")
    g.add_argument("--no_overlap", action="store_true",
                   help="naive: one blocking all-reduce per gradient after backward (no bucketed overlap)")
    return parser


FIRST_BUCKET_BYTES = 2**20


def bucket_groups(items, sizes, bucket_bytes):
    """`items` (the parameters, last layer first) in buckets of about `bucket_bytes` by their
    `sizes` in bytes; like DDP, the first bucket is small (1 MiB), so the first all-reduce
    starts early. (costs() counts the buckets, one all-reduce each, from the same split.)"""
    groups, current, size = [], [], 0
    for item, nbytes in zip(items, sizes):
        current.append(item)
        size += nbytes
        if size >= (min(bucket_bytes, FIRST_BUCKET_BYTES) if not groups else bucket_bytes):
            groups.append(current)
            current, size = [], 0
    return groups + [current] if current else groups


class GradientBuckets:
    """DDP's reducer. Parameters are grouped, in reverse order, into buckets of about
    `bucket_bytes`; each bucket is one flat tensor and every parameter's .grad is a view
    into it (DDP's gradient_as_bucket_view), so autograd accumulates straight into the
    buffer that is all-reduced and nothing is copied.

    The first bucket is capped at 1 MiB, as in DDP: the last layers' gradients are ready
    first, and a small bucket gets the network busy sooner.

    A post-accumulate-grad hook counts the gradients each bucket still waits for; when a
    bucket is complete it is launched as an asynchronous all-reduce. Buckets are launched
    strictly in index order, so every rank issues the same collectives in the same order
    (a requirement of every backend) even if its backward finished them in another.

    `group` is the data-parallel group, the ranks that hold replicas of these parameters:
    here the world, but passed in, so that the buckets copied into a bigger mesh (DP x TP,
    DP x PP) average over the replicas and nothing else."""

    def __init__(self, params, bucket_bytes, group, overlap):
        self.group, self.world_size = group, dist.get_world_size(group)
        self.overlap, self.sync = overlap, False
        params = [p for p in params if p.requires_grad]
        groups = bucket_groups(list(reversed(params)), [p.numel() * p.element_size() for p in reversed(params)],
                               bucket_bytes)
        self.buffers, self.bucket_of, self.sizes = [], {}, []
        for index, group in enumerate(groups):
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=params[0].dtype,
                                 device=params[0].device)
            offset = 0
            for p in group:
                p.grad = buffer[offset:offset + p.numel()].view_as(p)
                self.bucket_of[p] = index
                offset += p.numel()
                if overlap:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
            self.buffers.append(buffer)
            self.sizes.append(len(group))
        self.params = params
        self._reset()

    def _reset(self):
        self.waiting = list(self.sizes)  # gradients each bucket still waits for
        self.handles, self.next_to_launch = [], 0

    def _grad_ready(self, param):
        if not self.sync:  # a non-final micro-step: keep accumulating locally
            return
        self.waiting[self.bucket_of[param]] -= 1
        while self.next_to_launch < len(self.buffers) and self.waiting[self.next_to_launch] == 0:
            self._launch(self.next_to_launch)
            self.next_to_launch += 1

    def _launch(self, index):
        if self.world_size == 1:  # a replica alone: its gradients are the mean already, nothing to post
            return
        buffer = self.buffers[index]
        buffer.div_(self.world_size)  # sum of g/N = the mean (gloo has no AVG)
        # all-reduce (sum) this bucket's gradients across every data-parallel rank,
        # asynchronously: backward continues while it is in flight
        self.handles.append(dist.all_reduce(buffer, group=self.group, async_op=True))

    def finish(self):
        """Before the optimizer step: wait for every bucket's all-reduce."""
        if self.overlap:
            check(self.next_to_launch == len(self.buffers),
                  "a gradient never arrived (a parameter unused in forward?)")
            for handle in self.handles:
                handle.wait()
        elif self.world_size > 1:
            for p in self.params:  # the naive version: one blocking all-reduce per gradient
                p.grad.div_(self.world_size)
                dist.all_reduce(p.grad, group=self.group)  # sum of every replica's g/N
        self._reset()

    def zero_grad(self):
        for buffer in self.buffers:  # in place: .grad must stay a view of its bucket
            buffer.zero_()


def mean_over_replicas(value, group):
    """The mean of every replica's `value`, in place, on every replica of `group`: each
    replica's value is the mean over its own equal share of the batch, so their mean is the
    global batch's."""
    if dist.get_world_size(group) > 1:  # a replica alone posts nothing
        value /= dist.get_world_size(group)  # sum of value/N = the mean (gloo has no AVG)
        dist.all_reduce(value, group=group)  # one float from every replica, the sum to all
    return value


@torch.no_grad()
def evaluate(model, data, args, env, accum_steps, dp_group):
    """Mean loss of each split over eval_iters fixed global batches: each rank evaluates its
    slice, then the means are averaged across the replicas."""
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
        total /= args.eval_iters * accum_steps
        losses[split] = mean_over_replicas(total, dp_group).item()
    model.train()
    return losses


def main():
    run = Run(add_flags(make_parser(__doc__)), __file__)
    args = run.args
    check(args.bucket_mb > 0, f"--bucket_mb must be positive, got {args.bucket_mb}")
    env, accum_steps = run.start(costs, dp_size=run.world_size)  # processes up; auto: the largest that fits
    run.dry_run(costs, lambda config: [f"layout: {run.world_size} replicas, each {accum_steps} micro-batch(es) of "
                                       f"{args.micro_batch_size} per step"])
    torch.manual_seed(args.seed + env.rank)  # dropout: a different stream on every replica
    dp_group = dist.group.WORLD  # the data-parallel group: every rank holds a replica

    data = Data(args.data, args.seed, model_block_size(args))
    config = model_config(args, data.vocab_size)
    model = build_model(config, args.seed, env.device, recompute=args.recompute)
    # every replica starts from rank 0's weights (identical here by construction, but this
    # is what makes any initialisation or checkpoint safe)
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, group=dp_group, group_src=0)  # the first replica's values to all
    buckets = GradientBuckets(model.parameters(), args.bucket_mb * 2**20, dp_group,
                              overlap=not args.no_overlap)
    # AdamW, or Muon + AdamW with each matrix's Newton-Schulz run by one replica (ReplicatedMuon)
    optimizer = make_optimizer(model.named_parameters(), args, env, muon=partial(ReplicatedMuon, group=dp_group))
    tree = TreeGrads(lambda: buckets.buffers, accum_steps) if args.bitwise else None
    run.begin(config, optimizer, costs, layout={"strategy": "data parallel"},
              pieces=lambda: checkpoint_pieces(model, optimizer, env),
              evaluate=lambda: evaluate(model, data, args, env, accum_steps, dp_group),
              describe=f"{env.world_size} replicas, {accum_steps} micro-batch(es) of {args.micro_batch_size} "
                       f"per rank per step, {len(buckets.buffers)} gradient bucket(s)"
                       + (" (not overlapped)" if args.no_overlap else ""))

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
                buckets.sync = micro == accum_steps - 1 and not tree  # communicate only on the last micro-step
                with autocast(env):
                    _, loss = model(x[rows], y[rows])
                (loss if tree else loss / accum_steps).backward()  # accumulate the mean over this rank's rows
                loss_sum += loss.detach().float()
                if tree: tree.take(micro, loss)  # --bitwise: this micro-batch's gradients kept apart for one fixed tree
        if tree:  # --bitwise: every replica's tree, then one fixed tree over the replicas (below)
            loss_sum = bitwise_reduce(tree, buckets.buffers, dp_group, accum_steps)
        else:
            buckets.finish()  # gradients are now the mean over the global batch, on every rank
            loss_sum /= accum_steps  # this replica's mean loss
            mean_over_replicas(loss_sum, dp_group)  # the global batch's mean loss, for logging
        norm = None  # the global gradient norm, where clipping takes it (the guard reads it too)
        if args.grad_clip > 0:  # (--bitwise: each parameter's norm in turn, as a sharded layout takes it)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip,
                                                  foreach=False if tree else None)
        run.check(loss_sum, (p.grad for p in model.parameters()), norm)  # non-finite? asked to stop?
        optimizer.step()
        run.end_step(loss_sum)  # ledger, metrics, checkpoint, stop
        buckets.zero_grad()
    run.finish()


# ---- Beyond the lesson ----
# Not the strategy: Muon divided among the replicas, what a rank holds and sends (costs(), the
# ledger's theory), checkpoint pieces.

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


# ---- restated from 04_zero.py: muon_owners (word for word; tests/test_restated.py checks it) ----
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


def costs(args, config, world_size, dtype, rank=0):
    """The docstring's two lines as formulas, in bytes per rank (Ψ parameters, N ranks): a full fp32
    replica (autocast leaves the stored weights, and so the gradients, in fp32), and one
    all-reduce of every gradient per step plus the logged loss, whatever N > 1 (none alone). Muon adds its
    owners' broadcasts, every matrix's update once in the Newton-Schulz dtype (e·Ψ_m, none
    alone), and Newton-Schulz on the matrices this rank owns."""
    from infra.formulas import (activation_device_type, activation_terms, activations_of_layers, formula,
                                hidden_matrix_params, hidden_matrix_shapes, newton_schulz_flops, phase_peaks,
                                transient_terms)
    from common import param_shapes
    psi, _ = count_params(config)
    shapes = hidden_matrix_shapes(config) if args.optimizer == "muon" else []  # Muon's matrices, whole
    # activations: each replica runs 01's model on its micro-batch: 01's count, unchanged
    b = args.micro_batch_size or args.global_batch_size // world_size
    terms = activation_terms(config, b, config.block_size, dtype, activation_device_type(args))
    cost = {"layout": f"{world_size} replicas",
            "held": {"params": formula("4*Ψ", Ψ=psi), "grads": formula("4*Ψ", Ψ=psi),
                     # AdamW's two moments; Muon keeps one (its momentum) for the Ψ_m matrix entries
                     "optim": formula("8*Ψ", Ψ=psi) if args.optimizer == "adamw" else
                     formula("4*Ψ_m + 8*(Ψ - Ψ_m)", Ψ=psi, Ψ_m=hidden_matrix_params(config))},
            "sent": {} if world_size == 1 and not args.bitwise else  # a replica alone posts nothing
            {"all_reduce": formula("4*Ψ + 4*loss", Ψ=psi, loss=1)} if not args.bitwise else
            # --bitwise: the gradients and the loss, padded to N, to their owners and back (bitwise_reduce)
            {op: formula("4*(Ψ + loss + pad)", Ψ=psi, loss=1, pad=-(psi + 1) % world_size)
             for op in ("all_to_all_single", "all_gather_into_tensor")},
            # Muon: Newton-Schulz on the matrices this replica owns (infra.formulas.newton_schulz_flops)
            "muon_flops": newton_schulz_flops([shape for shape, owner in zip(shapes, muon_owners(shapes, world_size))
                                               if owner == rank]),
            "activations": activations_of_layers(terms, config.n_layer, args.recompute)}
    # the calls a step posts, each paying the network's latency once: a bucket's all-reduce (or, with
    # --no_overlap, a gradient's) and the loss's; --bitwise's one tree; Muon's broadcast per matrix
    sizes = [4 * math.prod(shape) for shape in reversed(param_shapes(config).values())]
    grads = len(sizes) if args.no_overlap else len(bucket_groups(sizes, sizes, args.bucket_mb * 2**20))
    cost["calls"] = {"all_reduce": formula("buckets + loss", buckets=grads, loss=1)} if not args.bitwise else \
        {op: formula("1") for op in cost["sent"]}
    cost["calls"] = {op: n for op, n in cost["calls"].items() if op in cost["sent"]}  # (none alone)
    if shapes and world_size > 1:  # ReplicatedMuon: each owner's orthogonalised updates to every replica
        cost["sent"]["broadcast"] = formula("e*Ψ_m", show="e", e=dtype.itemsize, Ψ_m=hidden_matrix_params(config))
        cost["calls"]["broadcast"] = formula("matrices", matrices=len(shapes))
    # every live tensor at its most, by phase (infra.formulas.phase_peaks: 01's; the gradients live in
    # their buckets, and the all-reduce works in place), and at start-up: the weights with
    # param_init's scratch, then the buckets, made whole before the first step
    t = transient_terms(config, b, config.block_size, dtype, activation_device_type(args), args.optimizer)
    muon = args.optimizer == "muon"
    cost["peak"] = phase_peaks(cost, t, **bitwise_peaks(args, psi, b, world_size, t))
    cost["startup"] = formula("params + max(init, grads)" + " + 4*Ψ_m" * muon, show="init", init=t["init"],
                              params=cost["held"]["params"], grads=cost["held"]["grads"],
                              Ψ_m=hidden_matrix_params(config) * muon)
    return cost


def bitwise_peaks(args, psi, b, world_size, t):
    """--bitwise's tensors in costs()'s peak: through the step the tree's partial sums of this replica's
    micro-batches (common.TreeSum), floor(log2 k) gradient copies at most; after it, bitwise_reduce's
    flat sums and the all_to_all's pieces, two copies, where the optimizer's update would otherwise
    be the most."""
    from infra.formulas import formula
    k = args.global_batch_size // (b * world_size)
    if not getattr(args, "bitwise", False):
        return {}
    sums = {"tree": formula("k*4*Ψ", show="k", k=k.bit_length() - 1, Ψ=psi)}
    return {"forward": sums, "backward": sums,
            "optimizer": {"update": formula("max(update, 2*4*Ψ)", update=t["update"], Ψ=psi)}}


def bitwise_reduce(tree, buffers, group, n):
    """--bitwise: this replica's tree of its n micro-batches (every bucket's gradients, then the loss)
    summed over the replicas by common.tree_all_reduce, the tree's upper levels in one fixed order,
    and divided once by the global batch's micro-batch count, as 01 --bitwise divides; the loss's
    mean returned. The same bytes as the ring's all-reduce (all_to_all, then all_gather)."""
    p = dist.get_world_size(group)
    flat = torch.cat(tree.total())  # the buckets' sums, then the loss's
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % p))  # a multiple of p elements
    tree_all_reduce(flat, group)
    flat.div_(n * p)
    offset = 0
    for buffer in buffers:
        buffer.copy_(flat[offset:offset + buffer.numel()])
        offset += buffer.numel()
    return flat[offset]


def checkpoint_pieces(model, optimizer, env):
    """Every parameter and its AdamW moments, whole: the replicas are equal, so rank 0
    writes them; every rank reads them (common.py's format, any script resumes it)."""
    from infra.checkpoint_format import param_pieces
    return [piece for name, p in model.named_parameters()
            for piece in param_pieces(name, p.shape, p, optimizer, write=env.master)]


if __name__ == "__main__":
    main()
