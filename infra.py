"""The run infrastructure: what makes a training script a reference rather than a loop. Its
`Run` extends common.py's plain one at the same calls (see common.Run's docstring), with:

  * the command line of the infrastructure (--out_dir ... --dry_run, below) and its checks;
  * start-up: the run's files checked and out_dir locked (agreed by every rank), the fit check
    and --micro_batch_size auto (the largest micro-batch that fits every rank's memory);
  * the guard: a non-finite loss or gradient stops every rank before the update; SIGTERM,
    SIGUSR1 and --time_limit stop after a checkpoint;
  * the communication ledger (torch.distributed's calls counted by operation and group) and
    the activation meter (saved-tensor hooks), printed once next to the script's costs();
  * metrics (JSONL, wandb), the dry run, and the checkpoint files.

A numbered script's only tie to this module is `from infra import Run`; its costs() and
checkpoint pieces import what they need from here inside the function, so a copy of the script
with `from common import Run` and common.py alone imports and trains."""

import argparse
import ast
import dataclasses
import atexit
import collections
import collections.abc
import errno
import gc
import inspect
import io
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import zlib
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import wraps

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import common
from common import (Data, Env, GPTConfig, Launch, SHAKESPEARE_TRAIN_FRACTION, SHAKESPEARE_TXT, SPLITS, SYNTHETIC_TOKENS,
                    check, check_batch, count_params, detect_launcher, fail, log, micro_batch_sizes,
                    model_block_size, model_config, pick_device, progress, rng_state, say, set_rng_state, setup,
                    synchronize, teardown)

STARTED = time.monotonic()  # --time_limit counts from here (the job's walltime runs since about then)


# ----------------------------------------------------------------------------------------
# The infrastructure's command line
# ----------------------------------------------------------------------------------------

# The GPU memory of the facilities' nodes (per rank: a GCD of an MI250X, a tile of a Max 1550),
# for a dry run's fit verdict (--machine) and plan.py: ALCF Polaris 4 A100 40 GB; ALCF Aurora
# 768 GiB HBM per node over 12 tiles, 64 GiB each (counted as 64 GB: the lower reading);
# OLCF Frontier 64 GB HBM per GCD; NERSC Perlmutter 4 A100 40 GB (its 80 GB nodes:
# --gpu_mem_gb 80). The sources are cited in plan.py's MACHINES, which reads this table.
GPU_MEMORY_GB = {"polaris": 40, "aurora": 64, "frontier": 64, "perlmutter": 40}


def add_run_flags(parser):
    """The flags of the infrastructure, added to a script's parser (common.make_parser's)."""
    g = parser.add_argument_group("metrics")
    g.add_argument("--metrics", default=None, help="JSONL file, one object per logged step")
    g.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also log the metrics rows to Weights & Biases from rank 0 (optional package; "
                        "WANDB_MODE=offline on nodes without internet, `wandb sync` later)")
    g = parser.add_argument_group("checks, export and stopping")
    g.add_argument("--no_fit_check", action="store_true",
                   help="skip the check, before the model is built, that this rank's costs() fit in its memory")
    g.add_argument("--unverified", action="store_true",
                   help="--resume a set whose metadata records no checksums (read unchecked, with a warning)")
    g.add_argument("--export", default=None, metavar="FILE",
                   help="also write the final checkpoint consolidated into one file (nanoGPT's ckpt.pt format)")
    g.add_argument("--time_limit", type=float, default=None, metavar="MINUTES",
                   help="stop cleanly, with a checkpoint, before this many minutes from the start "
                        "(the job's walltime less a margin)")
    g = parser.add_argument_group("dry run (no launcher, network or accelerator needed)")
    g.add_argument("--dry_run", action="store_true",
                   help="validate the configuration for --world_size ranks, print the layout and what "
                        "one rank holds and sends per step, and exit")
    g.add_argument("--world_size", type=int, default=None, help="ranks of the dry run")
    g.add_argument("--ranks_per_node", type=int, default=None,
                   help="ranks per node of the dry run's mesh (default: all on one node)")
    g.add_argument("--machine", choices=sorted(GPU_MEMORY_GB),
                   help="the dry run's GPUs, for the fit verdict and --micro_batch_size auto (their memory)")
    g.add_argument("--gpu_mem_gb", type=float, default=None,
                   help="the dry run's GPU memory in GB, for the fit verdict (instead of --machine); without "
                        "either, --device cpu plans for this host's memory")
    g.add_argument("--rehearse", default=None, metavar="RANKS",
                   help="execute the real steps of these ranks of a --world_size run (0,17,511 | roles | all) in "
                        "this one process, on the fake backend with fake tensors: what each holds and sends next to "
                        "costs(); every rank's posting order (the others' by the mesh's symmetry) replayed under NCCL's "
                        "rules (infra.py: rehearsal)")
    return parser


def parse_args(parser, argv=None):
    """common.parse_args with the infrastructure's flags added and checked."""
    args = common.parse_args(add_run_flags(parser), argv)
    check(args.rehearse is None or args.rehearse.strip() != "", "--rehearse is empty (an unset variable?): "
          "name the ranks (0,17,511), roles or all")
    check(not (args.dry_run and args.rehearse), "--dry_run prices the layout from the formulas, --rehearse executes "
          "it: pass one")
    if args.dry_run or args.rehearse:
        check(args.world_size is not None and args.world_size > 0,
              f"{'--rehearse' if args.rehearse else '--dry_run'} needs --world_size N (the number of ranks to "
              "plan for), N > 0")
        args.ranks_per_node = args.ranks_per_node or args.world_size
        check(args.ranks_per_node > 0, f"--ranks_per_node must be positive, got {args.ranks_per_node}")
        check(args.gpu_mem_gb is None or args.gpu_mem_gb > 0, f"--gpu_mem_gb must be positive, got {args.gpu_mem_gb}")
        check(not (args.machine and args.gpu_mem_gb), "--machine and --gpu_mem_gb both give the GPU's memory: pass one")
    else:
        check(args.world_size is None and args.ranks_per_node is None and args.machine is None
              and args.gpu_mem_gb is None, "--world_size, --ranks_per_node, --machine and --gpu_mem_gb belong to "
              "--dry_run (a launch takes its size from the launcher and its memory from the device)")
    check(args.time_limit is None or args.time_limit > 0, f"--time_limit must be positive, got {args.time_limit}")
    check(not args.export or args.ckpt_interval, "--export consolidates the final checkpoint: "
          "it needs --ckpt_interval (the final step is always saved)")
    check(not args.unverified or args.resume, "--unverified belongs to --resume (a set without checksums)")
    check(args.wandb != "", "--wandb needs a project name, got an empty one (an unset variable in a job script?): "
          "name the project, or leave --wandb out")
    check(not args.wandb or wandb_installed(), f"--wandb {args.wandb}: the wandb package is not installed "
          "(it is optional: pip install wandb)")
    return args


def wandb_installed():
    try:
        import wandb  # noqa: F401  (optional: imported only when --wandb is given)
        return True
    except ImportError:
        return False


def flops_per_token(config, n_params):
    """Training FLOPs per token, PaLM appendix B (as nanoGPT's estimate_mfu): 6N for the
    matrix multiplies forward and backward, plus 12·L·H·Q·T for attention."""
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, config.block_size
    if config.n_expert:  # a token runs through top_k of the E experts: count only the active ones
        n_params -= L * (config.n_expert - config.top_k) * expert_params(config)
    return 6 * n_params + 12 * L * H * Q * T


def newton_schulz_flops(shapes):
    """Muon's Newton-Schulz FLOPs per step on the matrices of full `shapes` (those one rank
    orthogonalises), as one formula. common.orthogonalize turns a tall matrix on its wide side,
    so X is r x c with r <= c, and each of its NS_STEPS steps runs three matrix products:

        A = X·Xᵀ      2r²c        (r x c times c x r)
        A·A           2r³         inside B = b·A + c·A·A (one addmm)
        B·X           2r²c        inside X <- a·X + B·X (one addmm)

    NS_STEPS·(4Σr²c + 2Σr³) over the matrices: what torch.utils.flop_counter counts of
    orthogonalize (2 per multiply-add; the normalisation and the additions are not counted)."""
    from common import NS_STEPS
    wide = [(min(shape), max(shape)) for shape in shapes]
    return formula("NS*(4*Σr2c + 2*Σr3)", show="NS", NS=NS_STEPS, Σr2c=sum(r * r * c for r, c in wide),
                   Σr3=sum(r ** 3 for r, _ in wide))


def expert_params(config):
    """Parameters of one MLP (one expert): c_fc h x 4h and c_proj 4h x h, with their biases."""
    h = config.n_embd
    return 8 * h * h + (5 * h if config.bias else 0)


# ----------------------------------------------------------------------------------------
# The data checked before the run: every token file scanned once per job
# ----------------------------------------------------------------------------------------

DATA_SCAN_CHUNK = 1 << 24  # tokens per read when scanning a file for out-of-vocabulary ids (32 MiB)


def data_problem(spec, block_size, rank=0, world_size=1):
    """The reason this --data cannot be used with this block size, or None. Each rank
    scans its 1/world_size slice of every token file once for ids outside the vocabulary
    (a chunked pass over the memmap), so the whole of every file is checked once per job;
    `agree` then makes every rank act on whatever any rank found."""
    if spec in ("shakespeare_char", "synthetic"):
        if spec == "shakespeare_char" and not os.path.exists(SHAKESPEARE_TXT):
            return common.SHAKESPEARE_MISSING  # a script copied without data/
        if spec == "synthetic":
            lengths = SYNTHETIC_TOKENS
        else:
            n = len(open(SHAKESPEARE_TXT, encoding="utf-8").read())
            lengths = {"train": int(SHAKESPEARE_TRAIN_FRACTION * n), "val": n - int(SHAKESPEARE_TRAIN_FRACTION * n)}
        for split, n in lengths.items():
            if n < block_size + 2:
                return (f"--data {spec}: its {split} split holds {n} tokens; block_size {block_size} "
                        f"needs at least block_size+2 = {block_size + 2} (lower --block_size)")
        return None
    vocab, source, problem = Data.vocabulary(spec)
    if problem:
        return problem
    for split in SPLITS:
        path = os.path.join(spec, f"{split}.bin")
        if os.path.isdir(path):
            return f"--data {spec}: {path} is a directory, not a token file"
        if not os.path.exists(path):
            return f"--data {spec}: {split}.bin is missing"
        if not os.path.isfile(path):  # a FIFO, a socket, a device: token files are read at random positions
            return f"--data {spec}: {path} is not a regular file (a FIFO, socket or device): token files must be files"
        size = os.path.getsize(path)
        if size % 2:
            return f"{path} is {size} bytes, not a whole number of uint16 tokens (truncated or not nanoGPT's format?)"
        if size // 2 < block_size + 2:
            return (f"{path} holds {size // 2} tokens, fewer than block_size+2 = {block_size + 2} "
                    "(the batch sampler needs one window of block_size+1 tokens and a choice of start)")
        try:
            tokens = np.memmap(path, dtype=np.uint16, mode="r")
        except OSError as e:  # unreadable: permissions, a stale network mount
            return f"{path} cannot be read: {e.strerror or e}"
        lo, hi = rank * len(tokens) // world_size, (rank + 1) * len(tokens) // world_size
        for a in range(lo, hi, DATA_SCAN_CHUNK):
            chunk = np.asarray(tokens[a:min(hi, a + DATA_SCAN_CHUNK)])
            if chunk.max() >= vocab:
                at = a + int(np.argmax(chunk >= vocab))
                return (f"{path} holds token id {int(tokens[at])} at position {at}, outside the vocabulary: "
                        f"ids must be below {vocab}, {source}")
    return None



# ----------------------------------------------------------------------------------------
# Host memory apart from the device on a CPU: the fake host (GPTPAR_FAKE_HOST=1, tests)
# ----------------------------------------------------------------------------------------

# On a CPU run host and device are one memory, so a host tensor handed to a device op or a
# collective goes unseen there and fails on the first GPU. Under GPTPAR_FAKE_HOST=1 the
# host's tensors are HostTensors, on a device of their own (HOST), and are refused where a
# GPU would refuse them.
HOST = torch.device("cpu", 1)


class HostTensor(torch.Tensor):
    """A tensor in the fake host's memory. Ops among host tensors (AdamW's host-side math)
    give host tensors; an op that mixes one with a tensor of the run's device raises, as
    CUDA does, and so does a collective (CommLedger's device check: its device is HOST).
    Explicit transfers pass: copy_, and .to(device) (a device tensor) or .to(HOST); so do
    view_as and its kin, which read only the other tensor's shape."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:  # (a new method-wrapper at each access: ==, not is)
            return HOST
        if func is torch.Tensor.copy_:  # a transfer either way; the destination stays where it is
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **kwargs)
            return args[0]
        if func in (torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as):  # only its shape
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(type(args[0]))
        if func in (_TENSOR_TO, _to, torch.Tensor.cpu):  # (torch names the patched .to, _to)
            to = torch.device("cpu") if func is torch.Tensor.cpu else _target_device(args[1:], kwargs)
            if to not in (None, HOST):  # up to the device: a plain tensor
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs).as_subclass(torch.Tensor)
        tensors = [t for a in list(args) + list(kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        if not all(isinstance(t, HostTensor) for t in tensors):
            raise RuntimeError(f"{func.__name__} mixes a tensor in host memory with one on the device "
                               "(GPTPAR_FAKE_HOST=1): a GPU refuses this; move one of them first")
        return super().__torch_function__(func, types, args, kwargs)


def _target_device(args, kwargs):
    """The device a .to(...) call's arguments name (None: it keeps the tensor's)."""
    return torch._C._nn._parse_to(*args, **{k: v for k, v in kwargs.items() if k != "copy"})[0]


_TENSOR_TO = torch.Tensor.to  # torch's own, before host_tensor() teaches it the HOST device


def _to(self, *args, **kwargs):
    """Tensor.to under the fake host: a move to HOST (`x.to(host_tensor.device)`) gives a
    host tensor (a patch of the method, not a TorchFunctionMode: a mode is off inside
    backward, where 05 moves gradient shards down to the host)."""
    out = _TENSOR_TO(self, *args, **kwargs)
    if not isinstance(self, HostTensor) and _target_device(args, kwargs) == HOST:
        return (out.clone() if out is self else out).as_subclass(HostTensor)
    return out


def host_tensor(t):
    """`t` as a HostTensor; teaches Tensor.to the HOST device for the rest of the process."""
    torch.Tensor.to = _to
    return t.as_subclass(HostTensor)



# ----------------------------------------------------------------------------------------
# The run protocol
# ----------------------------------------------------------------------------------------

class Run(common.Run):
    """common.Run, the run protocol, with the infrastructure at the same calls:

        run = Run(parser, __file__)                     # + the infrastructure's flags
        env, accum_steps = run.start(costs, dp_size=D)  # + files checked, out_dir locked, the
                                                        #   fit check, auto by memory, the guard
        run.dry_run(costs, layout_lines)                # --dry_run: print the plan, exit 0
        run.begin(config, optimizer, costs, ...)        # + resume; the ledger's formulas; metrics
        for step in run.steps():                        # + the ledger's window opens
            with run.meter:                             # + the activations autograd holds
            run.check(loss, grads, norm)                # + non-finite? asked to stop? (every rank)
            run.end_step(loss)                          # + ledger, metrics, checkpoint, stop
        run.finish()                                    # + out_dir released

    The ledger's window: a step's traffic is what the torch.distributed calls between the
    yield of steps() and end_step() send. Evaluation and checkpoint traffic is taken out
    after each, and control messages (the ranks' agreement on a problem) are never counted; the
    guard's flags are, as all_reduce[guard]."""

    def __init__(self, parser, script):
        self.args, self.script = parse_args(parser), os.path.basename(script)
        self.launch = launch_for(self.args)  # for --dry_run: rank 0 of --world_size planned ranks
        self.world_size = self.launch.world_size
        self.meter = ActivationMeter()  # `with run.meter:` around a step's forwards and backwards
        self.env, self.chose, self.fit_lines, self.syncs, self.grad_norm = None, None, [], None, None

    def start(self, costs, dp_size, aim=1, multiple=1, ranks=(0,), groups=None):
        """The processes started (common.setup) with the ledger installed, the run's files
        checked and out_dir locked (agreed by every rank, before anything heavy), the
        script's process groups made (`groups(env)`, kept as run.groups) and the guard armed
        (SIGTERM / SIGUSR1 / --time_limit; its group too), every group warmed by one
        collective, and then the micro-batch: --micro_batch_size as given, or for auto (the
        default) the largest that divides a replica's share of the global batch and fits
        every rank's memory (the fit check's need, from costs(), against its room), preferring
        at least `aim` micro-batches per step and a multiple of `multiple` (pipelines). The
        ranks' rooms differ and they must agree on one micro-batch: the smallest choice wins
        (one all-reduce). Then the fit check. Groups first, because on GPUs each
        communicator takes its buffers from the device at its first collective (NCCL: some
        MiB per peer and channel): read before them, the room is too large. For --dry_run
        nothing starts: the choice is made against planned_room() at `ranks` (the ranks whose
        costs differ) and env is None. Returns (env, accumulation steps)."""
        args = self.args
        if args.rehearse:  # --rehearse: the named ranks' real steps on the fake backend, then exit (rehearsal)
            return rehearsal_start(self, costs, dp_size, aim, multiple, ranks, sys._getframe(1), groups)
        if not args.dry_run:
            self.env = setup(args, self.launch)
            LEDGER.install(self.env.device)
            if os.environ.get("GPTPAR_COUNT_SYNCS") == "1":
                self.syncs = HostSyncs(self.env.device)
            log_node_map(self.env)
            agree(self.env, startup_problem(args, self.env))
            made = []
            with recording_groups(made):
                self.groups = groups(self.env) if groups else None
                self.guard = Guard(args, self.env)
            self.groups_up = warm_groups(self.env, made)
        if args.micro_batch_size == "auto":
            self.choose_micro_batch(costs, dp_size, aim, multiple, ranks)
        accum_steps = check_batch(args, dp_size)
        self.fit_lines = ([self.chose] if self.chose else []) + self.planned_fit(costs, ranks)
        if not args.dry_run:
            if self.chose:
                log(self.env, self.chose)
            if not args.no_fit_check:  # against the room the choice was made for (read again later,
                # after the other ranks have grown, it could refuse what auto chose)
                agree(self.env, fit_problem(args, self.env, costs, self.room))
            self.before_step = memory_mark(self.env)  # what step 0's check measures from
        return self.env, accum_steps

    def choose_micro_batch(self, costs, dp_size, aim, multiple, ranks):
        args, env = self.args, self.env
        if args.dry_run:
            room, dtype, device_type = planned_room(args), planned_dtype(args), planned_device_type(args)
        else:
            room, dtype, device_type, ranks = memory_room(env), env.dtype, env.device.type, (env.rank,)
        sizes = micro_batch_sizes(args, dp_size, aim, multiple)
        micro = sizes[0] if room is None else next(
            (b for b in sizes if rank_need(args, costs, self.world_size, dtype, device_type, ranks,
                                           micro_batch_size=b) <= room), sizes[-1])
        if not args.dry_run and env.world_size > 1:
            chosen = torch.tensor([micro], device=env.device)
            with LEDGER.paused():  # control traffic, not a step's
                dist.all_reduce(chosen, op=dist.ReduceOp.MIN, group=dist.group.WORLD)
            micro = int(chosen.item())
        args.micro_batch_size, self.room = micro, room
        self.chose = (f"--micro_batch_size auto: {micro} (of the {args.global_batch_size // dp_size} sequences per "
                      f"replica, the largest that fits{' every rank' if self.world_size > 1 else ''}"
                      f"{f', at least {aim} micro-batches' if aim > 1 else ''})")

    room = None  # the memory the micro-batch was chosen for (None: read it at the fit check)
    step_costs = None  # the step's own inputs run.cost was last evaluated for (end_step)
    groups, groups_up, before_step = None, 0, None  # the script's groups; how many this rank is in; memory_mark()

    def planned_fit(self, costs, ranks):
        """A dry run's fit verdict, the launch's fit check against planned_room() (else none)."""
        args = self.args
        room = planned_room(args) if args.dry_run else None
        if room is None:
            return ["fit: not checked (name the GPU: --machine or --gpu_mem_gb; or --device cpu for this host)"
                    ] if args.dry_run else []
        dtype, device_type = planned_dtype(args), planned_device_type(args)

        def need(**changes):
            return rank_need(args, costs, self.world_size, dtype, device_type, ranks, **changes)
        needed, per = need(), (f"of --gpu_mem_gb {args.gpu_mem_gb:g}" if args.gpu_mem_gb else f"of a {args.machine} GPU"
                               if args.machine else f"this host's room (MemAvailable, the job's cgroup, ulimit -v) / "
                                                    f"{args.ranks_per_node} rank(s)")
        usable = f"{GPU_USABLE:.0%} " if args.gpu_mem_gb or args.machine else ""
        verdict = "fits" if needed <= room else f"does not fit: {fit_fixes(args, need, room, device_type)}"
        return [f"fit: {verdict} (needs {format_bytes(needed)} per rank: {allowance_text(device_type)}; "
                f"room {format_bytes(room)}, {usable}{per})"]

    def dry_run(self, costs, layout_lines=lambda config: []):
        """With --dry_run: print the layout (`layout_lines(config)`, the script's lines) and
        what one rank holds and sends, from the script's costs(), with the checks a launch
        makes; exit 0. Otherwise nothing."""
        if self.args.dry_run:
            args = self.args
            config = model_config(args, Data.vocab_size_of(args.data))
            lines = layout_lines(config)  # the script's own checks of the layout first
            dry_run(args, self.script, config, costs(args, config, self.world_size, planned_dtype(args)),
                    [*self.fit_lines, *lines])

    def costs_of(self, **step):
        """This rank's costs() for the run's config (with `step`'s own arguments: 10's routing)."""
        args, env = self.args, self.env
        by_rank = "rank" in inspect.signature(self.costs).parameters
        cost = self.costs(args, self.config, env.world_size, env.dtype, **({"rank": env.rank} if by_rank else {}),
                          **step)
        if env.world_size > 1:  # the protocol's own traffic: the guard's flags (Guard)
            cost = {**cost, "sent": {**cost["sent"], "all_reduce[guard]": ("3 flags x 4 B", GUARD_BYTES)}}
        return cost

    def begin(self, config, optimizer, costs, layout, pieces, evaluate, describe, held=None, extra_rng=None,
              after_resume=None):
        """After the model, the strategy and the optimizer exist. `costs`: the script's
        costs(), evaluated for this rank: the ledger's theory column (`run.cost`). `layout`:
        what a checkpoint records of this strategy's layout (the same layout resumes bit for
        bit). `pieces()`: this rank's checkpoint pieces; `held()`: the model-state bytes it
        holds, by kind (default: the optimizer's parameters, their gradients and its state);
        `evaluate()`: {"train": loss, "val": loss} over --eval_iters batches; `extra_rng()`:
        random streams besides the default ones (a TP rank's own dropout stream);
        `after_resume()`: what the strategy rebuilds from what it read. Resumes from
        --resume (a checkpoint of any script at any layout) and returns the extra streams read
        back (same layout only; else None)."""
        args, env = self.args, self.env
        self.config, self.costs = config, costs
        self.cost = self.costs_of()
        self.optimizer, self.pieces = optimizer, pieces
        if self.syncs:
            self.syncs.exempt(optimizer)
        # what the optimizer updates, unless the script counts its own (host copies, flat shards)
        self.held = held or (lambda: state_bytes([p for g in optimizer.param_groups for p in g["params"]], optimizer))
        self._evaluate, self.extra_rng = evaluate, extra_rng
        self.run_config = run_config(args, config, layout)
        self.start_step, extra = 0, None
        if args.resume:
            self.start_step, extra = resume_checkpoint(args.out_dir, env, pieces(), self.run_config, optimizer,
                                                            unverified=args.unverified)
            if after_resume:  # what the strategy rebuilds from the pieces it read (not a step's traffic)
                after_resume()
            if self.start_step >= args.max_iters:  # a finished run: nothing to train, say so
                log(env, f"note: the checkpoint is at step {self.start_step} and --max_iters is {args.max_iters}: "
                         "nothing to train (to train on, raise --max_iters and keep --lr_decay_iters)")
                if getattr(args, "export", None):
                    export_agreed(args, env, self.start_step)
        nano_params = count_params(config)[1]
        log(env, f"model: {nano_params / 1e6:.2f}M parameters (nanoGPT's count), device {env.device}, "
                 f"{str(env.dtype).replace('torch.', '')}, {describe}")
        self.metrics = Metrics(args, env, flops_per_token(config, nano_params), self.cost,
                               config={"script": self.script, "preset": args.model, **self.run_config})
        setup_traffic = LEDGER.take()  # the set-up's traffic (weights broadcast, groups made) is not a step's
        if setup_traffic:
            log(env, f"set-up traffic (not a step's): {setup_traffic}")
        return extra

    def steps(self):
        """The optimizer steps, from the resumed one to --max_iters: evaluates at
        --eval_interval (and after the last step), opens the ledger's window, starts the clock."""
        args = self.args
        for step in progress(self.env, self.start_step, args.max_iters):
            if args.eval_interval and step % args.eval_interval == 0:
                self.evaluate(step)
            self.step = LEDGER.step = step
            LEDGER.phase = "step"
            # the meter's hooks cost ~1.6% of a step's CPU: they run on the steps whose figures
            # are read (the ledger's first, the logged ones), not on the others
            self.meter.measured = step == self.start_step or self.logged(step)
            reset_peak_memory(self.env)  # mem_peak_bytes: this step's, not since the start
            self.stopping, self.t0 = False, time.perf_counter()
            if self.syncs:
                self.syncs.start()
            yield step
        if args.eval_interval and args.max_iters > self.start_step:
            self.evaluate(args.max_iters)

    def logged(self, step):
        """Whether `step` writes a metrics row: at --log_interval, and the last step."""
        return step % self.args.log_interval == 0 or step == self.args.max_iters - 1

    def evaluate(self, step):
        LEDGER.step, LEDGER.phase = step, "evaluation"
        losses = self._evaluate()
        log(self.env, f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        self.metrics.write({"step": step, "val_loss": losses["val"], "train_loss": losses["train"]})
        LEDGER.take()  # evaluation traffic is not a training step's
        return losses

    def check(self, loss, grads, norm=None):
        """Right before the optimizer step, with this rank's loss and gradient tensors (and the
        global gradient norm where clipping took it: then read instead of the gradients): a
        non-finite value ends the run here, before the update, on every rank; a stop asked of
        any rank (a signal, --time_limit) ends it after the next step's checkpoint (Guard)."""
        LEDGER.phase = "optimizer"  # the guard's flags, the update and what follows it
        self.stopping = self.guard.check(self.step, loss, grads, norm)
        self.grad_norm = norm  # the global gradient norm clipping took (logged: the oracle compares it with 01's)

    def end_step(self, loss, extra=None, **step_costs):
        """After the optimizer step, with the global batch's mean loss (a tensor, read only
        when logged): the ledger (printed once, next to the formulas), the metrics row at
        --log_interval (`extra`: the script's own keys, a dict or a function making one), the
        checkpoint at --ckpt_interval, and the stop when one was agreed. `step_costs`: what
        this step's costs() depend on besides the layout (10's routing)."""
        args, env, step = self.args, self.env, self.step
        comm = LEDGER.take()
        syncs = self.syncs.stop() if self.syncs else None  # the step's own, before the logging's
        logged = self.logged(step)
        # costs() that depend on the step (10's routing) are evaluated only where they are read
        # (the ledger's first step, a logged step), and only when the step's inputs changed
        if step_costs and (step == self.start_step or logged) and step_costs != self.step_costs:
            self.cost, self.step_costs = self.costs_of(**step_costs), step_costs
            self.metrics.theory(self.cost)
        live = self.meter.live_peaks(env)  # every live tensor's bytes at their most, by phase (or None)
        if step == self.start_step:
            print_ledger(env, self.held(), comm, self.cost, self.meter.peak)
            self.fit_after_step()
        if logged:
            norm, self.grad_norm = self.grad_norm, None
            if norm is None:
                loss = loss.item()
            else:  # read together: one host sync, as for the loss alone
                loss, norm = torch.stack([loss.detach().float().reshape(()),
                                          torch.as_tensor(norm).detach().float().to(loss.device)]).tolist()
            synchronize(env)
            extra = extra() if callable(extra) else extra
            if norm is not None:
                extra = {**(extra or {}), "grad_norm": norm}
            if syncs is not None:
                extra = {**(extra or {}), "host_syncs": syncs}
            self.metrics.step(step, loss, self.optimizer.param_groups[0]["lr"], time.perf_counter() - self.t0,
                              self.held(), comm, extra, activations=self.meter.peak, live=live)
        if self.stopping or args.ckpt_interval and ((step + 1) % args.ckpt_interval == 0 or step + 1 == args.max_iters):
            self.save(step + 1)
        if self.stopping:
            self.guard.stop(step + 1)  # says how to resume; exits 0 on every rank

    def fit_after_step(self):
        """After the first step: the fit check's estimate against what the step really took,
        on the rank where the estimate was most off, in one line (one all-gather). On GPUs
        what a rank took from the room the check read: the allocator's peak reservation
        grown since then (mem_peak_bytes is its allocated part) and the device memory taken
        outside the allocator meanwhile (communicators made by the step's first send/recv,
        library workspaces). On CPU the process's peak resident memory grown since the check
        (VmHWM, reset there), which also holds what glibc's heap keeps after freeing; and
        beside it what the ledger counts of costs()'s own terms: the live model state and the
        activations saved for backward."""
        env = self.env
        if self.before_step is None:
            return
        device_type = env.device.type
        took, parts = memory_taken(env, self.before_step)
        counted = sum(v for kind, v in self.held().items() if device_type == "cpu" or "host" not in kind) \
            + (self.meter.peak or 0)
        mine = torch.tensor([fit_need(self.cost, device_type), -1 if took is None else took, counted,
                             fit_base(self.cost, device_type), *parts], dtype=torch.float64, device=env.device)
        everyone = [torch.empty_like(mine) for _ in range(env.world_size)] if env.world_size > 1 else [mine]
        if env.world_size > 1:
            with LEDGER.paused():  # control traffic, once
                dist.all_gather(everyone, mine, group=dist.group.WORLD)
        rows = [[int(value) for value in row.tolist()] for row in everyone]
        if all(row[1] < 0 for row in rows):
            log(env, "fit after step 0: not measured (the device reports no memory)")
            return
        rank = max(range(len(rows)), key=lambda r: rows[r][1] / max(rows[r][0], 1))
        estimate, took, counted, base, *parts = rows[rank]
        if device_type == "cpu":
            how = ("CPU: the peak resident memory grown since the fit check" if parts[0] else "CPU: the peak "
                   "resident memory since the process began (VmHWM could not be reset)") + ", glibc's kept heap included"
        else:
            how = (f"the allocator's peak reservation grown by {format_bytes(parts[0])}, of it allocated at the peak "
                   f"(mem_peak) {format_bytes(parts[1])}, + {format_bytes(parts[2])} outside it: communicators, "
                   "workspaces")
        off = took / estimate - 1
        log(env, f"fit after step 0: rank {rank} took {format_bytes(took)} ({how}) against the fit check's "
                 f"{format_bytes(estimate)} ({allowance_text(device_type)}, its room read with "
                 f"{self.groups_up} process group(s) up): the estimate was {abs(off):.0%} "
                 f"{'low' if off > 0 else 'high'}; the ledger counted {format_bytes(counted)} (model state + "
                 f"saved activations) of costs()'s peak of every live tensor, {format_bytes(base)}")

    def save(self, step):
        LEDGER.phase = "checkpoint"
        save_checkpoint(self.args, step, self.env, self.pieces(), self.run_config, self.optimizer,
                        extra_rng=self.extra_rng() if self.extra_rng else None)
        LEDGER.take()  # checkpoint traffic is not a training step's

    def finish(self):
        """Release out_dir and end the process group in step (common's teardown)."""
        ignore_stop_signals()
        self.guard.settle()  # the last step's flags, in flight
        agree(self.env, WRITE_FAILURES[0] if WRITE_FAILURES else None)  # a metrics row lost at the end
        self.metrics.close()  # --wandb: the run finished, its files complete
        release_out_dir()
        teardown(self.env)


# ----------------------------------------------------------------------------------------
# Starting: start-up checks agreed by every rank, the out_dir lock
# ----------------------------------------------------------------------------------------

def agree(env, problem):
    """Every rank passes the problem it found (a one-line string) or None; if any rank found
    one, the first in rank order is printed once as `error: ...` and every rank exits with
    status 2. A problem only some ranks can see (a file missing on one node, a slice of the
    data) thus ends the whole job within seconds instead of hanging the others."""
    if env.world_size > 1 and dist.is_initialized():
        with LEDGER.paused():  # control traffic, not the strategy's
            found = torch.tensor([1.0 if problem else 0.0], device=env.device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # did any rank find a problem?
            if found.item():
                problems = [None] * env.world_size
                dist.all_gather_object(problems, problem)  # every rank's message
                problem = next(p for p in problems if p)
    if problem:
        if env.master:
            say(f"error: {problem}", sys.stderr)
        leave(env, 2)


def leave(env, status):
    """Release the out_dir lock, end the process group in step, exit with `status`."""
    ignore_stop_signals()
    release_out_dir()
    teardown(env)
    sys.exit(status)


def startup_problem(args, env):
    """This rank's first problem with the files of the run, or None: --data (this rank's
    slice of the token scan), and on rank 0, which writes them, --metrics, --export and
    --out_dir (created, checked writable, locked for this job and cleared of the leftovers of
    interrupted writes)."""
    problem = data_problem(args.data, model_block_size(args), env.rank, env.world_size)
    if problem or not env.master:
        return problem
    problem = output_problems(args)
    if problem is None and args.metrics:
        try:  # without blocking: a plain open of a FIFO waits for ever for a reader
            os.close(os.open(args.metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644))
        except OSError as e:
            if e.errno == errno.ENXIO:  # (a FIFO with a reader, as `--metrics >(jq .)` makes, is fine)
                return f"--metrics {args.metrics} is a FIFO that nothing reads: start its reader first, or name a file"
            return f"--metrics {args.metrics} cannot be written: {e.strerror}"
    # the other ranks wait in `agree` meanwhile: never longer than half the collective timeout
    problem = problem or lock_out_dir(args.out_dir, wait_s=min(LOCK_STALE_S, args.timeout / 2))
    if problem is None:  # ours now: remove what interrupted writes of earlier jobs left
        unfinished = unfinished_checkpoints(args.out_dir)
        if args.resume and unfinished and latest_checkpoint(args.out_dir) is None:
            return (f"--resume: {unfinished[0]} has no metadata.json: its write did not finish (the job ended "
                    "while writing it), and no committed checkpoint is there to resume from")
        for path in unfinished:
            print(f"note: removing {path}, the leftover of a checkpoint write that did not finish",
                  file=sys.stderr, flush=True)
        clean_checkpoints(args.out_dir, keep=None, committed=False)
    return problem


def output_problems(args):
    """The first reason the files this run would write cannot be written, or None, found
    without writing anything (a dry run calls it too): --metrics and --export need an
    existing, writable directory; --out_dir must be a writable directory or creatable (a
    directory is made and removed in it, or in the deepest part of its path that exists)."""
    outputs = (("--metrics", args.metrics), ("--export", getattr(args, "export", None)))
    if all(path for _, path in outputs) and os.path.realpath(args.metrics) == os.path.realpath(args.export):
        return f"--metrics and --export name the same file, {args.export}: the export would overwrite the metrics"
    for flag, path in outputs:
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return f"{flag} {path}: the directory {folder} does not exist"
        if os.path.isdir(path):
            return f"{flag} {path} is a directory"
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            return f"{flag} {path} cannot be written: permission denied"
    committed = latest_checkpoint(args.out_dir) if os.path.isdir(args.out_dir) else None
    if committed and not args.resume and not getattr(args, "overwrite", False):
        return (f"--out_dir {args.out_dir} holds the checkpoint of another run ({committed}): pass --resume to "
                "continue it, --overwrite to replace it, or give this run its own --out_dir")
    existing = os.path.abspath(args.out_dir)
    while not os.path.exists(existing):  # the deepest part of the path that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"--out_dir {args.out_dir}: {existing} exists and is not a directory"
    try:  # permission bits do not tell (root, read-only mounts): make and remove a directory there
        os.rmdir(tempfile.mkdtemp(prefix=".probe.", dir=existing))
    except OSError as e:
        verb = "is not writable" if existing == os.path.abspath(args.out_dir) else f"cannot be created in {existing}"
        return f"--out_dir {args.out_dir} {verb}: {e.strerror}"
    return None


LOCK_NAME = "LOCK"


LOCK_HEARTBEAT_S = 10  # rank 0 touches the lock this often while the job lives


LOCK_STALE_S = 60  # a lock untouched this long, or whose process is gone from this host, is stale


_LOCK = {}  # path, the holder record, and the heartbeat's stop event, while this process holds one


def _lock_holder():
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
            "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID")}


def _started(pid):
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat's 22nd field), or
    None: with the pid, it names one process, where a pid alone is reused once it has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


LOCK_WRITE_S = 5  # an empty or unreadable lock older than this is a start that failed to write it


def _is_zombie(pid):
    """A process that has exited but not yet been reaped still answers kill(pid, 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _lock_is_stale(path, holder):
    """A dead job's lock: its process is gone, a zombie, or its pid now another process's
    (same host), its heartbeat stopped, or it was never written (a start that failed on a
    full disk)."""
    try:
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return True
    if not holder:
        return age > LOCK_WRITE_S
    if holder.get("host") == socket.gethostname():
        pid = holder.get("pid")
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, TypeError, ValueError):
            pass  # alive but another user's, or no pid recorded
        if isinstance(pid, int) and (_is_zombie(pid) or holder.get("started") not in (None, _started(pid))):
            return True  # exited (not yet reaped), or the pid was reused by a process started since
    return age > LOCK_STALE_S


def lock_out_dir(out_dir, wait_s=LOCK_STALE_S):
    """Create out_dir, check that it is writable, and take its lock (out_dir/LOCK, holding
    host, pid and scheduler job id; a daemon thread touches it every LOCK_HEARTBEAT_S).
    Returns the problem, or None. A stale lock of a dead job is replaced, with a note. A
    live-looking lock of another host may be a job killed seconds ago (a chained job starts
    right after it): this waits up to `wait_s` for its heartbeat to stop before refusing."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except FileExistsError:
        return f"--out_dir {out_dir} exists and is not a directory"
    except OSError as e:
        return f"--out_dir {out_dir} cannot be created: {e.strerror}"
    if not os.path.isdir(out_dir):
        return f"--out_dir {out_dir} exists and is not a directory"
    path = os.path.join(out_dir, LOCK_NAME)
    me = _lock_holder()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # atomic: one job wins
        except FileExistsError:
            try:
                holder = json.load(open(path))
            except (OSError, ValueError):
                holder = {}
            holder = holder if isinstance(holder, dict) else {}
            if not _lock_is_stale(path, holder) and holder.get("host") != socket.gethostname() and wait_s > 0:
                print(f"note: --out_dir {out_dir} is locked by job {holder.get('job')} on host {holder.get('host')}; "
                      f"waiting up to {wait_s:.0f} s to see whether its heartbeat stops (a killed job's)",
                      file=sys.stderr, flush=True)
                deadline = time.time() + wait_s
                while time.time() < deadline and os.path.exists(path) and not _lock_is_stale(path, holder):
                    time.sleep(min(1.0, max(0.0, deadline - time.time())))
                wait_s = 0
                if not os.path.exists(path):
                    continue  # released while we waited: take it
            if not _lock_is_stale(path, holder):
                age = time.time() - os.path.getmtime(path)
                return (f"--out_dir {out_dir} is in use by another job (host {holder.get('host')}, "
                        f"pid {holder.get('pid')}, job {holder.get('job')}; its lock {path} was renewed "
                        f"{age:.0f} s ago): give this run its own --out_dir, or wait for that job to end")
            print(f"note: removing the stale lock of a job that is gone ({path}: {holder})", file=sys.stderr, flush=True)
            stale = f"{path}.stale.{os.getpid()}"
            try:
                os.replace(path, stale)  # only one of two racing jobs moves it away
                os.remove(stale)
            except FileNotFoundError:
                pass
            continue
        except OSError as e:
            return f"--out_dir {out_dir} is not writable: {e.strerror}"
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as e:  # a full disk: leave no empty lock for the next job to wait on
            os.remove(path)
            return f"--out_dir {out_dir}: cannot write its lock {path}: {e.strerror or e}"
        stop = threading.Event()

        def heartbeat():
            while not stop.wait(LOCK_HEARTBEAT_S):
                try:
                    os.utime(path)
                except OSError:
                    return
        threading.Thread(target=heartbeat, daemon=True, name="out_dir lock heartbeat").start()
        _LOCK.update(path=path, holder=me, stop=stop)
        atexit.register(release_out_dir)
        return None
    return f"--out_dir {out_dir}: could not take its lock {path} (another job keeps taking it)"


def release_out_dir():
    """Remove this job's lock (if it is still ours); safe to call more than once."""
    if not _LOCK:
        return
    _LOCK["stop"].set()
    try:
        if json.load(open(_LOCK["path"])) == _LOCK["holder"]:
            os.remove(_LOCK["path"])
    except (OSError, ValueError):
        pass
    _LOCK.clear()


# ----------------------------------------------------------------------------------------
# Fitting: this rank's costs() against the memory it can have, before anything is built
# ----------------------------------------------------------------------------------------

# What a rank needs beyond its costs() (model state + activations saved for backward): the
# transients autograd does not save (an op's output before the next consumes it, gradients
# in flight in backward, AdamW's temporaries) and what the allocator keeps. Measured on CPU
# for every script (peak RSS less the runtime less costs(): tests/benchmarks/bench_fit.py,
# docs/memory.md): up to 670 MiB at dropout 0, and 1.1-1.5 GiB for the default model's bare
# commands (dropout 0.2, 24-48 sequences); most of it is glibc's heap keeping freed memory.
# FIT_SHARE of costs() + FIT_MIB covers every case measured. On GPUs, where the caching
# allocator reuses freed blocks, the allowance is an estimate, unmeasured (no GPU was lent).
FIT_SHARE, FIT_MIB = 0.5, 768  # CPU
FIT_SHARE_GPU, FIT_MIB_GPU = 0.25, 128  # CUDA, ROCm, XPU (unmeasured)


def fit_allowance(device_type):
    """(share of costs(), MiB) that a rank needs beyond its costs() on this device type."""
    return (FIT_SHARE, FIT_MIB) if device_type == "cpu" else (FIT_SHARE_GPU, FIT_MIB_GPU)


def allowance_text(device_type):
    share, mib = fit_allowance(device_type)
    return f"costs()'s peak + {share:.0%} + {mib} MiB"

# What a GPU of known size leaves for a rank's tensors when only its size is known (a dry run
# or plan.py for a named machine): the CUDA / ROCm / Level Zero context, the communicators'
# buffers and the caching allocator's fragmentation take the rest. A launch reads the free
# memory itself instead.
GPU_USABLE = 0.9


def peak_numbers(cost):
    """{phase: bytes} of costs()'s step peak ("peak": forward, backward, optimizer) and its
    start-up peak ("startup"), or None where the cost states no peak."""
    if "peak" not in cost:
        return None
    return {**{phase: v for phase, (_, v) in cost["peak"].items()},
            **({"startup": cost["startup"][1]} if "startup" in cost else {})}


def fit_base(cost, device_type):
    """costs()'s own bytes on this rank's device at their most: the largest of its step's
    peaks by phase ("peak": forward, backward, optimizer; the state held, the gathered units,
    the saved activations and the transients of each phase) and its start-up peak
    ("startup": building, initialising, sharding the model); on GPUs less the state that
    --offload keeps in host memory. A cost without a peak: its state, gathered units and
    activations."""
    host = sum(v for kind, (_, v) in cost["held"].items() if "host" in kind) if device_type != "cpu" else 0
    if "peak" in cost:
        return max(peak_numbers(cost).values()) - host
    held = sum(v for _, v in cost["held"].values()) - host
    return held + sum(cost[k][1] for k in ("gathered", "activations") if k in cost)


def fit_need(cost, device_type):
    """Bytes this rank needs on its device: fit_base(), plus the transients' allowance."""
    base = fit_base(cost, device_type)
    share, mib = fit_allowance(device_type)
    return base + int(share * base) + mib * 2**20


# The memory a job may use on this host is bounded three ways, and the fit check takes the least:
# the host's MemAvailable; the job's memory cgroup (Slurm's --mem, PBS's mem=, a shared node),
# whose limit the kernel enforces with the OOM killer long before the host runs out; and the
# process's own address-space limit (ulimit -v, RLIMIT_AS), which makes an allocation fail.
CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup file systems are mounted (tests point it elsewhere)
PROC_SELF_CGROUP = "/proc/self/cgroup"


def _read_int(path):
    """The integer in a one-value file (a cgroup's limit or usage), or None ("max", missing)."""
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def cgroup_room():
    """The bytes this process's memory cgroup still allows (its limit less its usage), or None
    without a limit: cgroup v2 (memory.max, memory.current) or v1 (memory.limit_in_bytes,
    memory.usage_in_bytes; v1's "no limit" is a huge number, larger than any host)."""
    try:
        with open(PROC_SELF_CGROUP) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    rooms = []
    for _, controllers, path in lines:
        if controllers == "":  # v2: one unified hierarchy
            folder, files = os.path.join(CGROUP_ROOT, path.lstrip("/")), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            folder = os.path.join(CGROUP_ROOT, "memory", path.lstrip("/"))
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        limit, usage = _read_int(os.path.join(folder, files[0])), _read_int(os.path.join(folder, files[1]))
        if limit is not None and limit < 2**60:
            rooms.append(max(0, limit - (usage or 0)))
    return min(rooms) if rooms else None


def address_space_room():
    """The bytes this process may still map under its RLIMIT_AS (ulimit -v) less what it has
    mapped (VmSize), or None without a limit."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        size = 0
    return max(0, soft - size)


def host_available():
    """The bytes the ranks of this job on this host may still take, together: the least of
    MemAvailable and the memory cgroup's room (None where neither is known)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = None
    known = [room for room in (available, cgroup_room()) if room is not None]
    return min(known) if known else None


def host_room(local_ranks):
    """One rank's room on this host: its share of host_available(), within its own
    address-space limit."""
    available = host_available()
    share = available and available // max(1, local_ranks)
    known = [room for room in (share, address_space_room()) if room is not None]
    return min(known) if known else None


def memory_room(env):
    """Bytes this rank can have: the device's free memory, or on CPU host_room(): the host's
    available memory within the job's cgroup, shared by the ranks on this node (each one's
    runtime is already resident), within the rank's address-space limit."""
    if env.device.type == "cuda":
        return torch.cuda.mem_get_info(env.device)[0]
    if env.device.type == "xpu" and hasattr(torch.xpu, "mem_get_info"):
        return torch.xpu.mem_get_info(env.device)[0]
    return host_room(env.launch.local_world_size or 1) if env.device.type == "cpu" else None  # mps: unknown


def planned_room(args):
    """The room a dry run (and plan.py) plans for, per rank: GPU_USABLE of --gpu_mem_gb or of
    --machine's GPU; with neither and --device cpu, host_room() for --ranks_per_node ranks
    on this host; else None (no verdict: the GPU is not named)."""
    gb = args.gpu_mem_gb or GPU_MEMORY_GB.get(args.machine)
    if gb:
        return int(gb * 1e9 * GPU_USABLE)
    return host_room(args.ranks_per_node) if args.device == "cpu" else None


def rank_need(args, costs, world_size, dtype, device_type, ranks=(0,), **changes):
    """The largest fit_need() of the script's costs() over `ranks` (where the ranks differ: a
    pipeline's stages), with the flags in `changes` changed."""
    changed = argparse.Namespace(**{**vars(args), **changes})
    key = (costs, repr(sorted(vars(changed).items())), world_size, dtype, device_type, tuple(ranks))
    if key not in _RANK_NEEDS:  # remembered: the fit's search asks again for the layouts it tried
        config = model_config(args, Data.vocab_size_of(args.data))
        by_rank = "rank" in inspect.signature(costs).parameters
        _RANK_NEEDS[key] = max(fit_need(costs(changed, config, world_size, dtype,
                                              **({"rank": r} if by_rank else {})), device_type) for r in ranks)
    return _RANK_NEEDS[key]


_RANK_NEEDS = {}


def fit_problem(args, env, costs, room=None):
    """None if this rank's costs() fit its memory_room() (or `room`); else one line with the
    need, the room and the cheapest change that fits: the largest smaller micro-batch,
    --recompute, or, when the model state alone does not fit, sharding it."""
    room = memory_room(env) if room is None else room
    if room is None:
        return None

    def need(**changes):
        return rank_need(args, costs, env.world_size, env.dtype, env.device.type, (env.rank,), **changes)
    needed = need()
    if needed <= room:
        return None
    local = env.launch.local_world_size or 1
    where = (f" x {local} rank(s) on this node = {format_bytes(needed * local)}, {format_bytes(room * local)} "
             "available" if env.device.type == "cpu" else f", {format_bytes(room)} free on {env.device}")
    return (f"rank {env.rank} needs {format_bytes(needed)} ({allowance_text(env.device.type)} for "
            f"transients){where}: {fit_fixes(args, need, room, env.device.type)} (--no_fit_check skips this check)")


@contextmanager
def recording_groups(made):
    """Inside, every process group dist.new_group makes that has this rank is appended to
    `made` (in the order made: the same on every rank)."""
    new_group = dist.new_group

    @wraps(new_group)
    def recorded(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if isinstance(group, dist.ProcessGroup):  # not GroupMember.NON_GROUP_MEMBER
            made.append(group)
        return group
    dist.new_group = recorded
    try:
        yield made
    finally:
        dist.new_group = new_group


def warm_groups(env, made):
    """One 4-byte all-reduce on the world and on every group in `made`, in the order they
    were made (the same on every rank, so no rank waits in one group for a rank waiting in
    another): on NCCL, RCCL and XCCL a communicator allocates its buffers at its first
    collective, and the fit check must see them gone from the room. Returns how many groups
    this rank is in (the world included)."""
    if env.world_size == 1:
        return 1
    with LEDGER.paused():  # control traffic, not a step's
        for group in [dist.group.WORLD, *made]:
            dist.all_reduce(torch.zeros(1, device=env.device), group=group)
    return 1 + len(made)


def _proc_status(key):
    """A /proc/self/status value in bytes (VmRSS, VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def memory_mark(env):
    """Where the room stands when the fit check has read it, for memory_taken() after step 0:
    on CUDA / XPU the free device memory and the allocator's reservation; on CPU the resident
    memory, with the peak (VmHWM) reset to it (/proc/self/clear_refs, Linux)."""
    module = torch.get_device_module(env.device) if env.device.type in ("cuda", "xpu") else None
    if module is not None and hasattr(module, "mem_get_info"):
        return {"free": module.mem_get_info(env.device)[0], "reserved": module.memory_reserved(env.device)}
    if env.device.type == "cpu":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
            reset = True
        except OSError:
            reset = False
        return {"rss": _proc_status("VmRSS"), "reset": reset}
    return {}


def memory_taken(env, mark):
    """(bytes, parts) that the run took from the room since memory_mark(), at its peak: on
    CUDA / XPU parts are (the allocator's peak reservation less its reservation at the mark,
    its peak allocation (mem_peak_bytes), the memory taken outside it); on CPU (whether VmHWM
    was reset at the mark, 0, 0). None where the device says nothing."""
    module = torch.get_device_module(env.device) if "free" in mark else None
    if module is not None:
        grown = module.max_memory_reserved(env.device) - mark["reserved"]
        outside = max(0, (mark["free"] - module.mem_get_info(env.device)[0])
                      - (module.memory_reserved(env.device) - mark["reserved"]))
        return grown + outside, (grown, module.max_memory_allocated(env.device), outside)
    hwm = _proc_status("VmHWM")
    if mark.get("rss") is None or hwm is None:
        return None, (0, 0, 0)
    return max(0, hwm - mark["rss"]), (int(mark["reset"]), 0, 0)


def fit_fixes(args, need, room, device_type="cpu"):
    """The cheapest changes that fit, each checked by evaluating costs() at the changed flags
    (`need`): the largest smaller micro-batch, --recompute, or both. When none fits, what is
    too big, so that the advice is one that could help:

        room < the allowance (768 MiB on CPU)         -> no model fits: more memory, fewer ranks
        the state (need at b = 1, recompute, less one
          sequence's activations) is over the room    -> shard the state or split the model
        else one sequence's activations are           -> a shorter context, or split the
                                                         sequence (09) or the layers (06-08)"""
    fixes, micro = [], args.micro_batch_size
    smaller = next((m for m in range(micro - 1, 0, -1) if micro % m == 0 and need(micro_batch_size=m) <= room), None)
    if smaller:
        fixes.append(f"--micro_batch_size {smaller} fits ({micro // smaller}x the accumulation steps)")
    if not args.recompute and need(recompute=True) <= room:
        fixes.append("--recompute fits")
    if not fixes and not args.recompute:
        both = next((m for m in range(micro - 1, 0, -1)
                     if micro % m == 0 and need(micro_batch_size=m, recompute=True) <= room), None)
        if both:
            fixes.append(f"--micro_batch_size {both} --recompute fits ({micro // both}x the accumulation steps)")
    if fixes:
        return ", or ".join(fixes)
    _, mib = fit_allowance(device_type)
    if room <= mib * 2**20:
        more = ("ask the scheduler for more memory (Slurm --mem, PBS mem=) or run fewer ranks per node"
                if device_type == "cpu" else "free the device: other processes hold its memory")
        return (f"the room, {format_bytes(room)}, is less than the {mib} MiB every rank needs for transients "
                f"whatever the model: {more}")
    least, two = need(micro_batch_size=1, recompute=True), need(micro_batch_size=2, recompute=True)
    state = least - (two - least) - mib * 2**20  # (activations grow with the micro-batch, the state does not)
    if state > room - mib * 2**20:
        return ("the model state alone does not fit: shard it (04_zero.py --stage 3, 05_fsdp.py), split the "
                "model (06-08), or use more nodes (the ranks of one host share its memory)")
    return (f"one sequence's activations do not fit (--micro_batch_size 1 --recompute needs {format_bytes(least)}): "
            "a shorter --block_size, or split the sequence (09_context_parallel.py) or the layers (06-08)")


# ----------------------------------------------------------------------------------------
# Stopping: non-finite loss or gradients, walltime and signals, agreed by every rank
# ----------------------------------------------------------------------------------------

# what PBS and Slurm send at walltime or preemption, and a terminal's Ctrl-C
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


NONFINITE_EXIT = 3  # the exit status of a run stopped by a non-finite loss or gradient


def ignore_stop_signals():
    """On the way out: the copies of a stop signal still in flight (the launcher's forward
    of the scheduler's SIGTERM, a second Ctrl-C) must not kill a rank that is already
    ending well; an ignored signal stays ignored through the interpreter's shutdown, where
    Python's own handlers are reset to the default action (death by the signal)."""
    for name in STOP_SIGNALS:
        try:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        except ValueError:  # not the main thread: nothing was installed from it either
            pass


class HostSyncs:
    """With GPTPAR_COUNT_SYNCS=1 (tests): counts, inside each training step's window, the calls
    that make a GPU run wait for its device: a device-wide synchronize, and reading a
    tensor's value on the host (.item(), .tolist(), .cpu(), .numpy(), bool(), int(),
    float()), and making a device tensor from Python values (torch.tensor(data, device=...):
    a copy from pageable host memory, which CUDA makes the host wait for; torch.full makes
    one on the device without a copy). On CPU they cost nothing, so a CPU run is where a
    test can count what a GPU run of the same code would pay (checked on an H200 with
    torch.cuda.set_sync_debug_mode: tests/gpu/smoke.sh). The count is each metrics row's
    `host_syncs`."""

    READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")

    def __init__(self, device):
        self.count, self.counting = 0, False
        for name in self.READS:
            setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        module = torch.get_device_module(device)
        module.synchronize = self._counted(module.synchronize)
        made, copying = torch.tensor, self._counted(torch.tensor)
        torch.tensor = lambda data, *args, **kwargs: (copying if kwargs.get("device") is not None
                                                      and not isinstance(data, torch.Tensor) else made)(
            data, *args, **kwargs)

    def _counted(self, fn):
        @wraps(fn)
        def counted(*args, **kwargs):
            if self.counting:
                self.count += 1
                self.counting = False  # a read inside a read (.tolist() calling .item()) is one sync
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.counting = True
            return fn(*args, **kwargs)
        return counted

    def exempt(self, optimizer):
        """Not counted inside optimizer.step(): on GPUs the scripts' AdamW is torch's fused
        kernel, which reads nothing back; its CPU path reads the step counters, which it keeps
        on the host (not a device sync on a GPU either)."""
        step = optimizer.step

        @wraps(step)
        def uncounted(*args, **kwargs):
            counting, self.counting = self.counting, False
            try:
                return step(*args, **kwargs)
            finally:
                self.counting = counting
        optimizer.step = uncounted

    def start(self):
        self.count, self.counting = 0, True

    def stop(self):
        self.counting = False
        return self.count


def by_device(tensors):
    """`tensors` grouped by device, for torch's fused multi-tensor ops (one device each)."""
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


GUARD_BYTES = 12  # the guard's flags, all-reduced every step: 3 fp32


class Guard:
    """Before each optimizer step every rank must know two things, and the guard learns both
    without making a rank wait for another:

    (1) Does a loss or gradient hold a non-finite number? Clipping's gradient norm says so (it
        is non-finite exactly when a gradient is) and is already the same number on every rank
        (the script all-reduced its pieces to clip), so every rank reads the same answer and
        no message is needed. Then one `error:` line naming the step, and every rank exits
        with NONFINITE_EXIT before the optimizer step, so no non-finite weights exist and no
        checkpoint of them is written; the last good checkpoint is untouched. Without clipping
        (--grad_clip 0) there is no global norm: the flags below then carry this rank's
        verdict and are waited for at once, before the update.
    (2) Has any rank been asked to stop (a SIGTERM / SIGUSR1, or --time_limit near: elapsed
        time + three times the slowest step seen, i.e. this step, one more and a checkpoint,
        would pass it), or failed a write? This is host state, agreed in one 12-byte
        all-reduce (3 flags, counted by the ledger as all_reduce[guard]) posted at step t and
        read at step t+1: it travels while step t+1 runs, and the stop, on every rank, comes
        after step t+1's checkpoint. A rank's own loss that is non-finite while the norm is
        finite (it never reached a gradient) travels with these flags too.

    One read on the host per step: the norm and the flags that arrived, together. The flags
    have a group of their own (the world's ranks, named "guard"), so that they are never
    matched with one of the script's collectives (a rank that skips one hangs right there),
    and the script's numbering of its world collectives is the same with this layer or without."""

    group = None  # the world under its own name (multi-rank runs), so the ledger counts all_reduce[guard]
    posted = None  # (flags, work): the flags in flight, read at the next check

    def __init__(self, args, env):
        self.args, self.env = args, env
        self.group = dist.new_group(list(range(env.world_size)), group_desc="guard") \
            if env.world_size > 1 and dist.is_initialized() else None
        self.signal = None
        self.last, self.slowest = time.monotonic(), 0.0
        for name in STOP_SIGNALS:
            signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, frame):
        # Repeated stop signals are one request: PBS and Slurm signal every process of the
        # job while mpiexec / srun forward the same signal to the ranks, and Ctrl-C reaches
        # both the ranks and the launcher. A scheduler that insists sends SIGKILL.
        self.signal = self.signal or signal.Signals(signum).name  # acted on at the next check

    def _time_is_up(self):
        if not self.args.time_limit:
            return False
        now = time.monotonic()
        self.slowest, self.last = max(self.slowest, now - self.last), now  # a step, with its eval and saves
        return now - STARTED + 3 * self.slowest > self.args.time_limit * 60

    def check(self, step, loss, grads, norm=None):
        """Call after backward (and clipping), right before optimizer.step(), with this rank's
        loss and its gradient tensors, or the global gradient norm clipping took. Returns True
        when every rank should stop after this step."""
        env, rank = self.env, self.env.rank
        agreed = norm is not None  # clipping's global norm: the same on every rank
        if norm is None:  # one norm per device in one fused call (with --offload the gradient
            # shards live in host memory); their sum is non-finite exactly when a value is
            grads = [g.detach() for g in grads if g is not None]
            norm = sum(torch.stack(torch._foreach_norm(group)).sum().to(env.device) for group in by_device(grads))
        norm = torch.as_tensor(norm, device=env.device).detach().float().reshape(1)
        asked = 2 if self.signal else 1 if self._time_is_up() else 0
        # (first rank with a non-finite value, counted down so MAX finds the lowest; why stop;
        # a failed write), made on the device (torch.full fills there: torch.tensor(x,
        # device=...) would copy from the host, a sync)
        flags = torch.stack([(~torch.isfinite(loss.detach().float().reshape(()) + norm[0])).float()
                             * float(env.world_size - rank),
                             torch.full((), float(asked), device=env.device),
                             torch.full((), 1.0 if WRITE_FAILURES else 0.0, device=env.device)])
        if self.group is not None and not agreed:  # no global norm: agree on this step's flags now
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)  # counted: all_reduce[guard]
        arrived, self.posted = self.posted, None  # step t-1's flags, all-reduced while this step ran
        if arrived is not None:
            arrived[1].wait()
        earlier = arrived[0] if arrived is not None else torch.zeros(3, device=env.device)
        values = torch.cat([norm, flags, earlier]).tolist()  # the step's one host read for the guard
        if agreed and not math.isfinite(values[0]):
            self.nonfinite(step, "every rank: the global gradient norm", step)
        # the flags every rank holds alike: step t-1's that arrived, or this step's where they
        # were agreed at once (no global norm) or need no agreeing (one rank)
        seen, (first_bad, why, failed) = (step - 1, values[4:7]) if self.group is not None and agreed \
            else (step, values[1:4])
        if failed:  # one line, every rank exits 2, before this step's update
            agree(env, f"{WRITE_FAILURES[0]}; stopped before step {step}'s update, the last checkpoint "
                       f"({latest_checkpoint(self.args.out_dir)}) is intact" if WRITE_FAILURES else None)
        if first_bad:
            self.nonfinite(seen, f"rank {env.world_size - int(first_bad)}", step)
        if self.group is not None and agreed:  # posted now, read at the next check
            self.posted = (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group,
                                                        async_op=True))  # counted: all_reduce[guard]
        self.reason = {1: f"--time_limit {self.args.time_limit or 0:g} min is near",
                       2: self.signal or "a SIGTERM, SIGUSR1 or SIGINT on another rank"}.get(int(why))
        return bool(why) and step + 1 < self.args.max_iters

    def nonfinite(self, step, where, before):
        """One `error:` line, every rank exits NONFINITE_EXIT before step `before`'s update."""
        update = "the optimizer step" if before == step else f"step {before}'s update"
        if self.env.master:
            say(f"error: non-finite loss or gradient at step {step} (first seen on {where}): stopped before "
                f"{update}; the last checkpoint in {self.args.out_dir} is untouched (lower --lr, or raise "
                f"--warmup_iters)", sys.stderr)
        leave(self.env, NONFINITE_EXIT)

    def settle(self):
        """Wait for the flags in flight (before the process group ends)."""
        if self.posted is not None:
            self.posted[1].wait()
            self.posted = None

    def stop(self, step):
        """After this step's checkpoint: say where the run stopped and how to continue, then
        end every rank with status 0 (the run is healthy; a chained job resumes it)."""
        log(self.env, f"stopped after step {step} of {self.args.max_iters} ({self.reason}): checkpoint in "
                      f"{self.args.out_dir}; continue with the same command and --resume")
        self.settle()
        leave(self.env, 0)


# ----------------------------------------------------------------------------------------
# The ledger: bytes sent by operation, model-state bytes held, next to the formulas
# ----------------------------------------------------------------------------------------

def _nbytes(t):
    return t.numel() * t.element_size()


class CommLedger:
    """Counts the bytes each torch.distributed collective moves on this rank, by operation,
    by wrapping the functions of the torch.distributed module (scripts keep calling
    `dist.all_reduce` literally). The count is the message size in nccl-tests' convention:
    the tensor for all_reduce / broadcast / reduce / send / recv, the *input* for
    reduce_scatter and all_to_all, the *output* for all_gather; not the wire traffic of the
    algorithm (a ring all-reduce puts 2(N-1)/N of it on every link)."""

    # op: the argument whose size is counted (a tensor, or a list of tensors)
    COUNTED = {
        "all_reduce": "tensor", "reduce": "tensor", "broadcast": "tensor",
        "all_gather": "tensor_list", "all_gather_into_tensor": "output_tensor",
        "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
        "all_to_all": "input_tensor_list", "all_to_all_single": "input",
        "gather": "tensor", "scatter": "tensor",
        "send": "tensor", "isend": "tensor", "recv": "tensor", "irecv": "tensor",
        # torch >= 2.13's names for all_gather_into_tensor and reduce_scatter_tensor
        "all_gather_single": "output_tensor", "reduce_scatter_single": "input",
    }

    # every argument that hands tensors to a collective (checked against the run's device)
    TENSOR_ARGUMENTS = {"tensor", "tensor_list", "output_tensor", "input_tensor", "output", "input", "input_list",
                        "output_tensor_list", "input_tensor_list", "gather_list", "scatter_list"}

    def __init__(self):
        self.bytes, self.installed, self.group_names, self.counting = {}, False, {}, True
        self.device = None  # the run's device: every tensor handed to a collective must be on it
        # where this rank is, for the line a failed or timed-out collective prints: the step
        # and phase (Run sets them), and how many collectives it has posted on each group
        self.step, self.phase, self.posted, self.reported = None, "setup", {}, False

    def position(self, op, group):
        """This call's place in the rank's sequence of collectives: (op, group, its number
        on that group, step, phase). Ranks that disagree on it are the usual cause of a hang."""
        if group is None or group is dist.group.WORLD:  # named or implied, the same group
            name = "world"
        else:
            name = self.group_name(group)
            if name is None:
                try:
                    name = "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
                except Exception:
                    name = "a subgroup"
        self.posted[name] = self.posted.get(name, 0) + 1
        phase = self.phase
        if phase == "step":  # inside autograd's backward, or the forward
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        self.leave_trail(name, group, phase)
        return f"{op} #{self.posted[name]} on group {name}, step {self.step}, {phase}"

    def report(self, where, error):
        """Once per rank: the collective it was in when one failed or timed out."""
        if not self.reported:
            self.reported = True
            rank = dist.get_rank() if dist.is_initialized() else 0
            first = (str(error).strip().splitlines() or [""])[0][:200]
            say(f"rank {rank} was in {where} when it failed: {first}", sys.stderr)
            dump_flight_recorder()  # what NCCL's watchdog writes at its timeout; gloo writes none by itself

    # The trail beside the Flight Recorder's dumps. torch records every collective of every
    # process group (NCCL, XCCL and, in torch 2.13, gloo) in a ring buffer, and NCCL's watchdog
    # writes it to TORCH_FR_DUMP_TEMP_FILE<rank> when a collective times out: operation, group,
    # sequence number, state, the time it was posted. The step and phase are not in it; this
    # trail adds them, as a few JSON lines per micro-batch, never one per collective.
    trail = None  # this rank's open trail file; False when there is none to write
    trail_at = None  # the (step, phase) of its last line
    trail_groups = frozenset()  # the groups it has described

    def leave_trail(self, name, group, phase):
        """One line `{"t_ns", "step", "phase"}` each time the step or phase of this rank's
        collectives changes, stamped with the recorder's clock (CLOCK_REALTIME, ns): the entry
        posted at time t belongs to the last line before t. One line `{"group", "name",
        "ranks"}` the first time a group is used (gloo's dumps do not list their ranks).
        `python plot.py --hangs DIR` reads both beside the dumps."""
        if self.trail is None:
            self.trail = open_trail()
        if not self.trail:
            return
        group = group if group is not None else dist.group.WORLD
        lines = []
        key = getattr(group, "group_name", None)
        if key is not None and key not in self.trail_groups:
            self.trail_groups = self.trail_groups | {key}
            lines.append({"group": key, "name": name, "ranks": dist.get_process_group_ranks(group)})
        if (self.step, phase) != self.trail_at:
            self.trail_at = (self.step, phase)
            lines.append({"t_ns": time.time_ns(), "step": self.step, "phase": phase})
        try:
            for line in lines:
                self.trail.write(json.dumps(line) + "\n")
        except OSError:  # a full or vanished disk must not stop training: no trail from here on
            self.trail = False

    def watched(self, where, result):
        """Run a collective's result through `report` if waiting on it fails (async work)."""
        if isinstance(result, list):
            return [self.watched(where, r) for r in result]
        return _Watched(result, where, self) if hasattr(result, "wait") else result

    @contextmanager
    def paused(self):
        """Collectives inside are not counted (control messages: agreement, stop flags)."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def name_group(self, group, name):
        """Count this process group's collectives as "op[name]" (e.g. all_reduce[tp])."""
        self.group_names[group] = name
        return group

    def group_name(self, group):
        """The name a group's collectives are counted under: the one name_group gave it, or
        its `group_desc` (dist.new_group(ranks, group_desc="tp")); None for the world."""
        if group is None or group is dist.group.WORLD:
            return None
        desc = self.group_names.get(group) or getattr(group, "group_desc", None)
        return None if desc in (None, "", "undefined", "default_pg") else desc

    def add(self, op, nbytes):
        op = {"isend": "send", "irecv": "recv"}.get(op, op)  # p2p: by direction
        self.bytes[op] = self.bytes.get(op, 0) + nbytes

    def on_device(self, op, tensors):
        """NCCL and XCCL take only tensors on the rank's own device (gloo takes any CPU or
        CUDA tensor, so a CPU run would never notice a host tensor handed to a collective):
        refuse any other here, on every backend, naming the operation."""
        for t in tensors:  # (a HostTensor's device is HOST: refused too)
            if self.device is not None and torch.is_tensor(t) and t.device != self.device:
                where = "in host memory (GPTPAR_FAKE_HOST=1)" if isinstance(t, HostTensor) else \
                    f"on {t.device}"
                raise RuntimeError(f"{op} was handed a tensor {where}, but this run's device is "
                                   f"{self.device}: NCCL and XCCL take only tensors on the rank's device")

    def install(self, device=None):
        """Wrap torch.distributed's collectives and point-to-point calls: count their bytes
        and check that their tensors are on `device` (the run's)."""
        self.device = torch.device(device) if device is not None else None
        if self.installed:
            return
        self.installed = True
        for op, argument in self.COUNTED.items():
            if hasattr(dist, op):
                setattr(dist, op, self._wrap(op, getattr(dist, op), argument))
        class P2POp(dist.P2POp):
            """P2POp checks that its op *is* torch's isend/irecv: hand it the unwrapped ones."""

            def __new__(cls, op, *args, **kwargs):
                return super().__new__(cls, getattr(op, "__wrapped__", op), *args, **kwargs)

            def __init__(self, op, *args, **kwargs):
                super().__init__(getattr(op, "__wrapped__", op), *args, **kwargs)
        dist.P2POp = P2POp
        original = dist.batch_isend_irecv

        @wraps(original)
        def batch_isend_irecv(p2p_ops):
            for p2p in p2p_ops:
                self.on_device(p2p.op.__name__, [p2p.tensor])
                if self.counting:
                    self.add(p2p.op.__name__, _nbytes(p2p.tensor))
            where = self.position(f"batch_isend_irecv of {len(p2p_ops)}", p2p_ops[0].group if p2p_ops else None)
            try:
                return self.watched(where, original(p2p_ops))
            except Exception as e:
                self.report(where, e)
                raise
        dist.batch_isend_irecv = batch_isend_irecv

    def _wrap(self, op, fn, argument):
        signature = inspect.signature(fn)

        @wraps(fn)
        def counted(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            value = bound[argument]
            self.on_device(op, [t for key, v in bound.items() if key in self.TENSOR_ARGUMENTS
                                for t in (v if isinstance(v, (list, tuple)) else [v])])
            if self.counting:
                name = self.group_name(bound.get("group"))
                self.add(f"{op}[{name}]" if name else op,
                         sum(map(_nbytes, value)) if isinstance(value, (list, tuple)) else _nbytes(value))
            where = self.position(op, bound.get("group"))
            try:
                return self.watched(where, fn(*args, **kwargs))
            except Exception as e:  # a timeout (--timeout), a peer gone: say where this rank was
                self.report(where, e)
                raise
        return counted

    def take(self):
        """The bytes counted since the last take (one optimizer step's worth)."""
        counted, self.bytes = self.bytes, {}
        return counted


def flight_recorder_prefix():
    """The path prefix torch's Flight Recorder writes this job's dumps to (the rank is
    appended): TORCH_FR_DUMP_TEMP_FILE, torch 2.13's name, or TORCH_NCCL_DEBUG_INFO_TEMP_FILE,
    the name it still reads; None when neither is set (NCCL's default, /tmp/nccl_trace_rank_,
    is node-local: jobs/*.sh put it on the shared file system)."""
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or None


def trail_path(prefix, rank):
    """Where rank `rank` leaves its trail: `ledger.<rank>.jsonl` in the dumps' folder. The name
    holds no dump prefix and does not end in the rank, so torch's fr_trace skips it."""
    return os.path.join(os.path.dirname(prefix) or ".", f"ledger.{rank}.jsonl")


def open_trail():
    """This rank's trail file, line-buffered (each line is on disk before the collective it
    stamps is posted, so a process the watchdog ends keeps it), or False when no dump
    prefix is set or the file cannot be written (one note, then training goes on)."""
    prefix = flight_recorder_prefix()
    if not prefix:
        return False
    path = trail_path(prefix, dist.get_rank() if dist.is_initialized() else 0)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "w", buffering=1, encoding="utf-8")
    except OSError as e:
        say(f"note: no Flight Recorder trail ({path}: {e.strerror or e}); hangs will be reported without "
            f"their step and phase", sys.stderr)
        return False


def dump_flight_recorder():
    """Write this rank's Flight Recorder buffer where NCCL's watchdog writes it at a timeout
    (the prefix + the rank), unless a dump is there already; the path, or None. NCCL's
    watchdog and its monitor thread dump every rank of a stalled job themselves (the ranks
    that wait, and, told through the store, the one that stalled); gloo has no watchdog, so
    a rank whose collective fails calls this. Never raises: the failure it reports matters more."""
    prefix = flight_recorder_prefix()
    if not prefix or not dist.is_initialized():
        return None
    path = f"{prefix}{dist.get_rank()}"
    try:
        if not os.path.exists(path):
            folder = os.path.dirname(path) or "."
            os.makedirs(folder, exist_ok=True)
            # written aside and renamed, under a name without the prefix (fr_trace reads every
            # file that contains it): a reader never sees half a dump
            fd, partial = tempfile.mkstemp(dir=folder, prefix=".partial-")
            with os.fdopen(fd, "wb") as f:
                f.write(torch._C._distributed_c10d._dump_fr_trace())
            os.replace(partial, path)
        return path
    except Exception as e:  # noqa: BLE001 (a dump is help, never a second failure)
        say(f"note: no Flight Recorder dump written to {path}: {e}", sys.stderr)
        return None


class _Watched:
    """An async collective's work handle whose wait() reports where a failure happened."""

    def __init__(self, work, where, ledger):
        self._work, self._where, self._ledger = work, where, ledger

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as e:
            self._ledger.report(self._where, e)
            raise

    def __getattr__(self, name):
        return getattr(self._work, name)


LEDGER = CommLedger()


def storage_key(storage):
    """A storage's identity: its StorageImpl, which views and tied weights share (a fake
    tensor's, in a rehearsal, has no data pointer to tell it apart)."""
    return storage._cdata


def tensor_bytes(tensors):
    """Bytes of distinct storages among `tensors` (a tied weight counts once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        key = (storage_key(t.untyped_storage()), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer):
    return [v for state in optimizer.state.values() for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0]


def state_bytes(params, optimizer):
    """Model-state bytes this rank holds, counted from the live tensors: parameters,
    gradients, optimizer state (AdamW: exp_avg and exp_avg_sq)."""
    params = list(params)
    return {"params": tensor_bytes(params),
            "grads": tensor_bytes([p.grad for p in params]),
            "optim": tensor_bytes(optimizer_state_tensors(optimizer))}


def print_ledger(env, held, comm, cost, activations=None):
    """Once, after the first step: what this rank holds and sends, measured next to the
    strategy's formula (`cost` is the script's costs(): each value is (formula, bytes));
    `activations`: the ActivationMeter's peak over the step."""
    lines = [f"ledger (rank {env.rank}): measured | theory"]
    for kind in cost["held"]:  # params, grads, optim (and with --offload their host parts)
        formula, value = cost["held"][kind]
        lines.append(f"  held {kind:<24} {format_bytes(held[kind]):>11} | {formula} = {format_bytes(value)}")
    if "activations" in cost:
        formula, value = cost["activations"]
        measured = format_bytes(activations) if activations is not None else "-"
        lines.append(f"  held {'activations (peak)':<24} {measured:>11} | {formula} = {format_bytes(value)}")
    for op in sorted(set(comm) | set(cost["sent"])):
        formula, value = cost["sent"].get(op, ("0", 0))
        lines.append(f"  sent {op:<24} {format_bytes(comm.get(op, 0)):>11} | {formula} = {format_bytes(value)} per step")
    if not comm and not cost["sent"]:
        lines.append("  communication: none")
    log(env, "\n".join(lines))
    # rank 0 prints its ledger; every rank checks its own (a pipeline's last stage, a 3D
    # mesh's other coordinates hold and send other amounts) and says where it differs
    measured = {**{f"held {k}": held[k] for k in cost["held"]}, **{f"sent {op}": comm.get(op, 0) for op in comm}}
    theory = {**{f"held {k}": v for k, (_, v) in cost["held"].items()},
              **{f"sent {op}": v for op, (_, v) in cost["sent"].items()}}
    if "activations" in cost and activations is not None:  # what autograd saved, on every rank too
        measured["held activations"], theory["held activations"] = activations, cost["activations"][1]
    differ = [f"{key} {measured.get(key, 0)} B, formula {theory.get(key, 0)} B"
              for key in sorted(set(measured) | set(theory)) if measured.get(key, 0) != theory.get(key, 0)]
    if differ:
        say(f"ledger mismatch on rank {env.rank}: {'; '.join(differ)}", sys.stderr)


def theory_bytes(cost):
    """The byte values of a costs() result, keyed as the metrics' measured columns."""
    return ({kind: value for kind, (_, value) in cost["held"].items()},
            {op: value for op, (_, value) in cost["sent"].items()})


# ----------------------------------------------------------------------------------------
# Activation memory: the meter, and what this model saves for backward
# ----------------------------------------------------------------------------------------

# a saved tensor reached from a parameter through these (views, transposes, autocast's
# casts) is the parameter, not an activation
_PARAMETER_VIEWS = {"TBackward0", "ToCopyBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                    "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0", "SliceBackward0"}


def _is_parameter(t):
    if isinstance(t, nn.Parameter):
        return True
    fn = t.grad_fn
    while fn is not None and fn.name() in _PARAMETER_VIEWS:
        fn = fn.next_functions[0][0]
    return fn is not None and isinstance(getattr(fn, "variable", None), nn.Parameter)


class _Saved:
    """What the meter hands autograd for a saved tensor; its end (autograd drops it when the
    node that saved it has run its backward) releases the storage's count."""
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


PHASES = ("forward", "backward", "optimizer")


class LiveStorage:
    """Every tensor storage alive on this rank, counted op by op, and its high-water mark in
    each phase of a step: a TorchDispatchMode sees every aten op (factories, autograd's
    gradients, the collectives' outputs, the optimizer's temporaries) and keeps a weak
    reference to each new storage until it is freed; after each op that made a storage or
    grew one (04's and FSDP's gathered units, refilled in place), and where a phase begins,
    it sums the present sizes of those alive: between, storages are only freed, so the
    peaks are exact. A CPU has no allocator statistics, so this is how the tests measure
    the peak (GPTPAR_COUNT_LIVE=1: every op pays a Python call; for tests and tiny models).

        phase      the ops counted in it
        forward    the step's ops outside autograd's backward, up to the end of `with run.meter`
        backward   the ops autograd's engine runs (torch._C._current_graph_task_id() >= 0)
        optimizer  from the end of `with run.meter` to end_step: clipping, the update, gathers
        startup    every op before the first step: building, initialising and sharding the
                   model, the optimizer, a resume's loaded pieces (not reset after)

    Not seen: memory that is no tensor's (the allocator's slack, gloo's buffers, Python),
    and tensors made outside the dispatcher (torch.from_numpy: the batch's token ids)."""

    def __init__(self, meter):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves
        live = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                grew = False
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        storage = t.untyped_storage()
                        ref = live.storages.get(storage._cdata)
                        if ref is None or ref.expired():  # new (its address may be a freed one's)
                            live.storages[storage._cdata], grew = StorageWeakRef(storage), True
                        elif storage.nbytes() > live.sizes.get(storage._cdata, 0):  # refilled in place
                            grew = True
                # the total can rise only where an op made or grew a storage: the sum is taken
                # there (and where a phase begins); between, storages are only freed
                if grew or meter.phase() != live.phase:
                    live.count(meter)
                return out
        self.storages, self.sizes, self.now, self.peak, self.startup = {}, {}, 0, dict.fromkeys(PHASES, 0), 0
        self.phase = None
        self.mode = Mode()
        self.mode.__enter__()  # from the start: the model's state is made under it too

    def count(self, meter):
        self.now, sizes = 0, {}
        for key, ref in list(self.storages.items()):
            if ref.expired():
                del self.storages[key]
            else:
                sizes[key] = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                self.now += sizes[key]
        self.sizes = sizes
        phase = self.phase = meter.phase()
        if phase is not None:
            self.peak[phase] = max(self.peak[phase], self.now)
        elif not meter.stepped:  # before the first step: building, initialising, sharding, resuming
            self.startup = max(self.startup, self.now)

    def reset(self):
        self.peak = dict.fromkeys(PHASES, 0)


class ActivationMeter:
    """The activation bytes autograd holds for backward on this rank, measured with
    torch.autograd.graph.saved_tensors_hooks: every tensor an op saves is packed through
    here; a storage counts once (its whole size) however many ops save views of it, from the
    first save until autograd has dropped the last one. `peak` is the maximum over what ran
    inside the `with` (one training step); a step with `measured` False runs without the
    hooks (each saved tensor's Python call costs ~1.6% of a step's CPU at 2 ranks: Run
    measures the steps whose figures it reads) and its `peak` is None. Not activations, so not counted: parameters
    (and their views and autocast copies) and integer tensors (token ids and targets: the
    batch itself). Pipelines keep their received inputs as saved tensors: counted."""

    def __init__(self):
        self.live, self.current, self.peak = {}, 0, 0
        # every live tensor byte, by phase: counted op by op on CPU under GPTPAR_COUNT_LIVE=1
        # (LiveStorage); on GPUs the allocator's high-water mark (see live_peaks)
        self.storage = LiveStorage(self) if os.environ.get("GPTPAR_COUNT_LIVE") == "1" else None
        self.active, self.after, self.window_peak, self.stepped = False, False, None, False
        self.measured, self._hooks = True, None

    def phase(self):
        """The phase of a step the op now running belongs to (LiveStorage), or None."""
        if torch._C._current_graph_task_id() >= 0:
            return "backward"
        return "forward" if self.active else "optimizer" if self.after else None

    def live_peaks(self, env):
        """{phase: the most bytes of live tensors in it} this step, and end the step's count:
        counted (LiveStorage) where it runs; on GPUs the allocator's high-water mark since
        the step began, through the forwards and backwards (one figure: the allocator cannot
        tell them apart) and through the whole step; else None."""
        self.after = False
        if self.storage is not None:  # and the start-up's peak, before the first step
            peaks, _ = {**self.storage.peak, "startup": self.storage.startup}, self.storage.reset()
            return peaks
        step_peak = peak_memory(env)
        if step_peak is None:
            return None
        return {"forward": None, "backward": self.window_peak, "optimizer": step_peak}

    def _pack(self, t):
        if not (t.is_floating_point() or t.dtype == torch.bool) or _is_parameter(t):
            return t
        storage = t.untyped_storage()
        key = (storage_key(storage), t.device)
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.current -= entry[0]

    def start(self):
        """Count what autograd saves from here on (one training step's forwards and backwards)."""
        self.peak, self._hooks = None, None
        if self.measured or self.storage is not None:  # LiveStorage counts every step
            self.peak = self.current
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        self.active, self.after, self.stepped = True, False, True

    def stop(self):
        """Stop counting; the peak bytes held since start()."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
        self.active, self.after = False, True  # what follows, to end_step, is the optimizer's phase
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.window_peak = torch.cuda.max_memory_allocated()
        return self.peak

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


# ----------------------------------------------------------------------------------------
# Cost formulas: one expression gives both the text printed beside a number and the number
# ----------------------------------------------------------------------------------------

class Formula(tuple):
    """(text, bytes), the pair every reader of costs() takes; `expr` (Python) and `symbols`
    (the values of the letters left in the text) say where both came from."""


def formula(expr, show="", **symbols):
    """One cost, written once: `expr` is Python arithmetic over named symbols (Ψ, b, s, h,
    ...), evaluated exactly for the number (fractions; a result that is not whole is an
    error) and written as the papers write it for the text: 4*b*s*h -> 4bsh, s**2 -> s²,
    ceil(x) -> ⌈x⌉. A symbol keeps its letter unless `show` names it (e=2 bytes, m=4
    micro-batches): then its value is printed. A symbol may be a Formula: by name it stands
    for its bytes ("n·layer"); shown, its expression is written in place.
        formula("4*Ψ + 4*loss", Ψ=10, loss=1)             -> ("4Ψ + 4·loss", 44)
        formula("m*2*e*b*s*h", show="m e", m=3, e=2, ...)  -> ("3·2·2bsh", 12·b·s·h)
    Remembered: plan.py and the fit check ask for the same formula at the same values
    thousands of times (every rank of every layout, every micro-batch tried)."""
    key = (expr, show, tuple(sorted((name, (v, v.expr, tuple(sorted(v.symbols.items())))
                                     if isinstance(v, Formula) else v) for name, v in symbols.items())))
    if key not in _FORMULAS:
        if len(_FORMULAS) > 200_000:
            _FORMULAS.clear()
        _FORMULAS[key] = _formula(expr, show, symbols)
    return _FORMULAS[key]


_FORMULAS = {}


def _formula(expr, show, symbols):
    shown, kept = set(show.split()), {}

    def inline(node):  # shown symbols by their value (a shown Formula: its own expression)
        if isinstance(node, ast.Name) and node.id in shown:
            value = symbols[node.id]
            if isinstance(value, Formula):
                for name, v in value.symbols.items():
                    if kept.setdefault(name, v) != v:
                        raise ValueError(f"{expr}: symbol {name} is {kept[name]} and {v}")
                return ast.parse(value.expr, mode="eval").body
            return ast.Constant(value, kind="shown")
        if isinstance(node, ast.Name) and node.id not in ("max", "min", "ceil"):
            value = int(symbols[node.id][1] if isinstance(symbols[node.id], Formula) else symbols[node.id])
            if kept.setdefault(node.id, value) != value:
                raise ValueError(f"{expr}: symbol {node.id} is {kept[node.id]} and {value}")
        for field, child in ast.iter_fields(node):
            if isinstance(child, ast.AST):
                setattr(node, field, inline(child))
            elif isinstance(child, list):
                setattr(node, field, [inline(c) for c in child])
        if not isinstance(node, ast.BinOp):
            return node
        # shown values as the papers would write them: k - 1 at k = 3 is 2, 1·x is x, 0·x + y is y
        left, right = (c.value if getattr(c, "kind", None) == "shown" else None for c in (node.left, node.right))
        if isinstance(node.op, (ast.Add, ast.Sub)) and (left, right) != (None, None) and \
                isinstance(node.left, ast.Constant) and isinstance(node.right, ast.Constant):
            return ast.Constant(int(_evaluate(node, {})), kind="shown")
        if isinstance(node.op, ast.Mult) and 0 in (left, right):
            return ast.Constant(0, kind="shown")
        if isinstance(node.op, ast.Mult) and 1 in (left, right):
            return node.right if left == 1 else node.left
        if isinstance(node.op, (ast.Add, ast.Sub)) and right == 0 or isinstance(node.op, ast.Add) and left == 0:
            return node.left if right == 0 else node.right
        return node

    tree = inline(ast.parse(expr, mode="eval").body)
    value = _evaluate(tree, kept)
    if value.denominator != 1:
        raise ValueError(f"cost formula {expr} = {value} at {symbols}: not a whole number of bytes")
    out = Formula((_written(tree)[0], int(value)))
    out.expr, out.symbols = ast.unparse(tree), kept
    return out


def plus(*terms):
    """The sum of some formulas (None: a term that does not apply), each written in place."""
    terms = {f"t{i}": t for i, t in enumerate(terms) if t is not None}
    return formula(" + ".join(terms) or "0", show=" ".join(terms), **terms)


def _evaluate(tree, symbols):
    """The exact value of an expression tree: its symbols as fractions, so that / is exact."""
    code = compile(ast.fix_missing_locations(ast.Expression(tree)), "<formula>", "eval")
    scope = {"max": max, "min": min, "ceil": lambda x: Fraction(math.ceil(x)), "__builtins__": {}}
    return Fraction(eval(code, scope, {name: Fraction(v) for name, v in symbols.items()}))


def _written(node):
    """(text, precedence, first atom, last atom) of an expression tree: products juxtaposed
    where the papers would (4bsh, 2(...), L·layer), a quotient's divisor always a single atom."""
    if isinstance(node, ast.Constant):
        return str(node.value), 9, "num", "num"
    if isinstance(node, ast.Name):
        atom = "short" if len(node.id) == 1 else "psi" if node.id.startswith("Ψ") else "long"
        return node.id, 9, atom, "long" if atom == "psi" else atom
    if isinstance(node, ast.Call):
        inner = ", ".join(_written(a)[0] for a in node.args)
        return (f"⌈{inner}⌉", 9, "paren", "paren") if node.func.id == "ceil" else (
            f"{node.func.id}({inner})", 9, "long", "paren")
    op = type(node.op)
    prec = {ast.Add: 1, ast.Sub: 1, ast.Mult: 2, ast.Div: 2, ast.Pow: 3}[op]
    left, right = _written(node.left), _written(node.right)
    lt = f"({left[0]})" if left[1] < prec else left[0]
    rt = f"({right[0]})" if right[1] < prec + (op in (ast.Sub, ast.Div, ast.Pow)) else right[0]
    first = "paren" if left[1] < prec else left[2]
    last = "paren" if right[1] < prec + (op in (ast.Sub, ast.Div)) else right[3]
    if op is ast.Pow:
        return lt + rt.translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")), prec, first, "long"
    if op is ast.Mult:
        juxtapose = (left[3] if left[1] >= prec else "paren") in ("num", "short", "paren") and \
            (right[2] if right[1] >= prec else "paren") in ("short", "psi", "paren")
        return lt + ("" if juxtapose else "·") + rt, prec, first, last
    return f"{lt}{' + ' if op is ast.Add else ' - ' if op is ast.Sub else '/'}{rt}", prec, first, \
        "long" if op is ast.Div else last


def activation_device_type(args):
    """The device whose kernels decide what is saved: --device, or for auto the GPU a dry
    run plans for, and in a live run the device this machine has."""
    if args.device != "auto":
        return args.device
    return "cuda" if args.dry_run else pick_device("auto", 0)[0].type


def sdpa_logsumexp(heads, tokens, dtype, device_type):
    """The expression of the fp32 logsumexp SDPA's flash / memory-efficient kernels save for
    backward, b x heads x tokens; in fp32 on GPUs the memory-efficient kernel pads the tokens
    to a multiple of 32."""
    padded = device_type in ("cuda", "xpu") and torch.tensor([], dtype=dtype).element_size() == 4
    return f"4*b*{heads}*" + (f"32*ceil({tokens}/32)" if padded else tokens)


def activation_terms(config, b, s, dtype, device_type, tp=1, sp=False, param_dtype=torch.float32,
                     attention=None, expert_rows=None):
    """Bytes this model's ops save for backward for one micro-batch of b sequences of s
    tokens (h = n_embd, a = n_head, V = vocab), counted op by op for common.py's model and
    PyTorch's kernels, with tensor parallelism over tp ranks (Megatron's split: the
    attention heads and the MLP's 4h are sharded, LayerNorms and the residual stream are
    not) and sequence parallelism (the replicated parts are sharded along s instead, and the
    column-parallel Linears keep only their input's sequence shard: every term of a block is
    /T, so a block holds 1/T of what it holds without tensor parallelism).
    Returns {term: formula (text, bytes)} with `layer` (one transformer block), `block_input`
    (what --recompute keeps of a block), `embedding` (dropout's mask) and `head` (ln_f,
    the head's input, the log-softmax of the logits; with tp the caller adds its own
    vocabulary-parallel head). Per block, with e = bytes of the compute dtype (fp32 or
    bf16 under autocast; LayerNorm, the residual stream and softmax stay fp32). Where the
    parameters themselves are stored in the compute dtype (`param_dtype`: ZeRO-3's and
    FSDP's gathered bf16 units) the residual stream is bf16 too: the LayerNorms save it as
    it is on CPU (input and mean, rstd in bf16) and an fp32 copy on GPUs (autocast's fp32 list):

      LayerNorm x2: input 4bsh + mean, rstd 8bs each; its output, the next Linear's input, ebsh
      attention:    q, k, v (one storage, c_attn's output) 3ebsh, output ebsh (also c_proj's
                    input), logsumexp 4bas (flash / CPU flash: no s x s scores)
      MLP:          GELU input 4ebsh, c_proj input 4ebsh
      dropout p>0:  a mask per dropout (residual x2, embedding): bool on GPUs (1 byte), the
                    input's dtype on CPU; attention dropout on CPU falls back to the math
                    kernel: q, k, v copies 12bsh and three s x s tensors 12bas^2 (softmax,
                    mask, dropped) instead of q, k, v, output and logsumexp
      fp32, dropout 0:  64bsh + 16bs + 4bas   (Korthikanti et al.'s 34sbh + 5as^2b in 16 bits)
      bf16, dropout 0:  36bsh + 16bs + 4bas
    `attention`, a formula over these symbols, replaces the attention term where a script
    runs another attention than common's (09's ring attention and Ulysses, which also apply no dropout
    to the attention probabilities)."""
    h, a, V = config.n_embd, config.n_head, config.vocab_size
    e = torch.tensor([], dtype=dtype).element_size()
    gpu = device_type in ("cuda", "xpu")
    dropout = config.dropout > 0
    r = torch.tensor([], dtype=param_dtype).element_size()  # the residual stream's bytes
    n = 4 if gpu else r  # what a LayerNorm saves of its input, and of its mean and rstd
    d = 1 if gpu else e  # a dropout mask: bool on GPUs, the input's dtype on CPU
    sp_T = "/T" if sp else ""  # sequence parallelism: the replicated parts are /T too

    def term(expr, **more):
        return formula(expr, show="e r n d R", b=b, s=s, h=h, a=a, V=V, T=tp, e=e, r=r, n=n, d=d, **more)

    # with sequence parallelism the LayerNorms work on sequence shards, and the
    # column-parallel Linears after them keep only that shard of their input (they gather
    # it again in backward), so the whole term is /T
    terms = {"layernorms": term(f"2*(n*b*s*h + 2*n*b*s + e*b*s*h){sp_T}")}
    if attention is not None:
        terms["attention"] = attention
    elif dropout and not gpu:  # CPU's math kernel
        terms["attention"] = term("(12*b*s*h + 12*b*a*s**2 + e*b*s*h)/T")
    else:
        terms["attention"] = term(f"(4*e*b*s*h + {sdpa_logsumexp('a', 's', dtype, device_type)})/T")
    terms["mlp"] = term("8*e*b*s*h/T")
    if dropout:  # residual dropouts: after c_proj (compute dtype) in attention and MLP
        terms["dropout masks"] = term(f"2*d*b*s*h{sp_T}")
    if config.n_expert:  # a mixture of experts (no tp): R rows through the experts (k·b·s, or
        # `expert_rows`: those a rank's experts received), each an MLP's 9e·h (its input cast,
        # GELU's and c_proj's inputs); the combine keeps the k·b·s outputs and the fp32 weights;
        # the router its probabilities (bsE), the top-k (2bsk), their sum (bs), f_e (bE)
        k, E = config.top_k, config.n_expert
        R = expert_rows if expert_rows is not None else k * b * s
        terms["mlp"] = term("9*e*R*h + e*k*b*s*h + 4*b*s*(E + 2*k + 1) + 4*b*E", k=k, E=E, R=R)
        if dropout:  # each expert's output dropout, instead of the MLP's
            terms["dropout masks"] = term("d*b*s*h + d*R*h", R=R)
    return {"layer": plus(*terms.values()),
            "block_input": term(f"r*b*s*h{sp_T}"),
            "embedding": term(f"{'d' if gpu else 'r'}*b*s*h{sp_T}" if dropout else "0"),
            "head": term("n*b*s*h + 2*n*b*s + e*b*s*h + 4*b*s*V + 4")}


def activation_phases(terms, n_layers, recompute, first=True, last=True):
    """(kept, during_backward): the bytes one micro-batch through n_layers blocks (with the
    embedding if first, the head if last) holds from the end of its forward until its
    backward, and the most it holds while its backward runs. Without recompute backward
    only frees: during = kept. With --recompute only block inputs are kept, and the
    backward of the last block holds the other inputs and that block's internals."""
    emb = terms["embedding"][1] if first else 0
    head = terms["head"][1] if last else 0
    layer, block_in = terms["layer"][1], terms["block_input"][1]
    if not recompute:
        kept = emb + n_layers * layer + head
        return kept, kept
    return emb + n_layers * block_in + head, emb + (n_layers - 1) * block_in + layer


def activations_of_layers(terms, n_layers, recompute, first=True, last=True, in_flight=1):
    """The formula of the peak this rank holds for backward: `in_flight` micro-batches through
    n_layers blocks have run their forward, and the oldest runs its backward (see
    activation_phases; 1F1B's stage holds min(p - stage, m) of them)."""
    emb, head = "embedding + " * first, " + head" * last
    if not recompute:  # backward only frees
        expr = f"k*({emb}L*layer{head})"
    else:  # the others keep their block inputs; the oldest's backward holds a whole layer
        expr = f"(k - 1)*({emb}L*input{head}) + {emb}max(L*input{head}, (L - 1)*input + layer)"
    return formula(expr, show="k L", k=in_flight, L=n_layers, layer=terms["layer"], input=terms["block_input"],
                   embedding=terms["embedding"], head=terms["head"])


def transient_terms(config, b, s, dtype, device_type, optimizer="adamw", update=None, matrix=None, tp=1, last=True,
                    casts=None, kept=True):
    """The model's own short-lived tensors (common's GPT, one micro-batch of b sequences of s
    tokens, V = vocab (V/T where the head is vocabulary-parallel), e the compute dtype's
    bytes), each a formula: what a step's peak holds besides the model state, the gathered
    units and the saved activations (activation_terms), and what start-up holds besides the
    state it keeps. Counted against every live tensor (LiveStorage) by tests/test_peaks.py.

      logits     forward, on the last stage: the head's logits e·bsV, in bf16 the loss's fp32
                 copy (cross_entropy runs in fp32 under autocast), and where the loop still
                 names the previous micro-batch's logits (`_, loss = model(x, y)`: `kept`)
                 those too; the last micro-batch's stay into the optimizer step
                     (e + c + k·e)·bsV,  c = 4 in bf16, 0 in fp32, k = 1 if kept
      casts      bf16 only: autocast's copies of the weights its matmuls use (`casts`
                 elements: every Linear's weight and the tied head, not wpe), made in forward
                 and kept by autograd for backward (the meter leaves them out of the
                 activations, as parameters)
                     e·Ψ_c
      gradients  backward: the logits' fp32 gradient (last stage) and an MLP-wide (4h/T)
                 gradient in flight (GELU's input and output gradients overlap the block's
                 saved tensors, which backward frees as it goes)
                     4bsV + 4ebsh/T
      update     the optimizer step: AdamW on CPU (torch's single-tensor loop) makes √v̂ and its
                 quotient `denom` for each tensor, while the previous tensor's `denom` is still
                 named: three temporaries of the largest tensor it updates (`update`
                 elements); fused AdamW (GPUs) none. Muon orthogonalises its largest matrix (`matrix`:
                 (M, r), M = m·n elements, r = min(m, n)): the fp32 Nesterov update 4M, X and the
                 next X in the Newton-Schulz dtype 2eM, the Gram matrix and its product 2er².
                 Unsharded (None): the model's largest parameter and hidden matrix
                     AdamW (CPU): 3·4·P     Muon: max(AdamW's, 4M + 2eM + 2er²)
      init       start-up: param_init draws each parameter whole in fp32 before it is copied
                 or sliced into place: the largest parameter's 4·P_max
    Remembered, as formula() is: plan.py asks for every rank of thousands of layouts."""
    key = (repr(config), b, s, dtype, device_type, optimizer, update, matrix, tp, last, casts, kept)
    if key not in _TRANSIENTS:
        if len(_TRANSIENTS) > 100_000:
            _TRANSIENTS.clear()
        _TRANSIENTS[key] = _transient_terms(config, b, s, dtype, device_type, optimizer, update, matrix, tp, last,
                                            casts, kept)
    return _TRANSIENTS[key]


_TRANSIENTS = {}


def _transient_terms(config, b, s, dtype, device_type, optimizer, update, matrix, tp, last, casts, kept):
    T, h, e = tp, config.n_embd, dtype.itemsize
    V = math.ceil(config.vocab_size / T) * T  # a vocabulary-parallel head pads it to a multiple of T (06, 08)
    c = 4 if e == 2 else 0
    fused = device_type in ("cuda", "xpu")  # common.make_adamw: fused on GPUs
    largest, (M, r), model_casts = model_sizes(config)
    update = largest if update is None else update
    M, r = (M, r) if matrix is None else matrix
    casts = model_casts if casts is None else casts

    def term(expr, **more):
        return formula(expr.replace("/T", "/T" if T > 1 else ""), show="e c k adamw", b=b, s=s, h=h, V=V, T=T, e=e,
                       c=c, k=int(kept), **more)
    adamw = term("0" if fused else "3*4*P", P=update)
    return {"logits": term("(e + c + k*e)*b*s*V/T" if last else "0"),
            "casts": term("e*Ψ_c" if e == 2 else "0", Ψ_c=casts),
            "gradients": term(("4*b*s*V/T + " if last else "") + "4*e*b*s*h/T"),
            "last logits": term("e*b*s*V/T" if last and kept else "0"),
            "update": adamw if optimizer == "adamw" else
            term("max(adamw, 4*M + 2*e*M + 2*e*r**2)", adamw=adamw, M=M, r=r),
            "init": term("4*P_max", P_max=largest)}


def model_sizes(config):
    """(the largest parameter's elements, largest_matrix() of Muon's matrices, matmul_weights())
    of the whole model, from its shapes; remembered per config (plan.py asks for every rank
    of thousands of layouts)."""
    from common import is_hidden_matrix, param_shapes
    key = repr(config)
    if key not in _MODEL_SIZES:
        shapes = param_shapes(config)
        _MODEL_SIZES[key] = (max(map(math.prod, shapes.values())),
                             largest_matrix(s for name, s in shapes.items() if is_hidden_matrix(name, s)),
                             matmul_weights(shapes))
    return _MODEL_SIZES[key]


_MODEL_SIZES = {}


def matmul_weights(named_shapes):
    """The elements of the weights autocast casts for matmuls: every 2-D parameter but the
    position embedding (wte is the tied head's weight)."""
    return sum(math.prod(shape) for name, shape in named_shapes.items()
               if len(shape) == 2 and not name.endswith("wpe.weight"))


def largest_matrix(shapes):
    """(m·n, min(m, n)) of the largest 2-D shape in `shapes` (Muon's work), or (0, 0)."""
    return max(((math.prod(shape), min(shape)) for shape in shapes if len(shape) == 2), default=(0, 0))


def phase_peaks(cost, t, forward=None, backward=None, optimizer=None):
    """costs()'s "peak": the most bytes of live tensors on this rank in each phase of a step,
    each one formula of named terms: the model state held (all of costs()'s `held`, kept
    through the step), 05's and ZeRO-3's gathered units, the saved activations at their high
    point (`activations`), the model's transients (transient_terms `t`) and the strategy's
    own (`forward`, `backward`, `optimizer`: {name: formula}, the script's communication
    buffers and the like; a name of the model's replaces its term).

        forward    held + gathered + activations + casts + logits + ...
        backward   held + gathered + activations + casts + gradients + ...
        optimizer  held + the last logits + update + ...   (the units were given back)"""
    held, gathered = ("", sum(v for _, v in cost["held"].values())), cost.get("gathered")
    by_name = ("held", "gathered", "activations")

    def phase(**terms):  # the state and the saved activations by name (their bytes), the transients written out
        terms = {k: v[1] if k in by_name else v for k, v in terms.items() if v is not None and v[1]}
        return formula(" + ".join(terms), show=" ".join(sorted(set(terms) - set(by_name))), **terms)
    return {"forward": phase(**{"held": held, "gathered": gathered, "activations": cost["activations"],
                                "casts": t["casts"], "logits": t["logits"], **(forward or {})}),
            "backward": phase(**{"held": held, "gathered": gathered, "activations": cost["activations"],
                                 "casts": t["casts"], "gradients": t["gradients"], **(backward or {})}),
            "optimizer": phase(**{"held": held, "logits": t["last logits"], "update": t["update"],
                                  **(optimizer or {})})}


# ----------------------------------------------------------------------------------------
# Metrics and logging: tokens/s, MFU, memory, JSONL
# ----------------------------------------------------------------------------------------

# Dense peak FLOP/s per device (one GCD of an MI250X, one tile of a Max 1550), for MFU:
# (bf16/fp16 tensor-core peak, fp32 peak). From the vendors' data sheets.
PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),  # SXM; the PCIe card is lower (756e12)
    "A100": (312e12, 19.5e12),
    "MI250X": (191.5e12, 47.9e12 / 2),
    "MAX 1550": (419e12, 52.4e12 / 2),
}


def peak_flops(env):
    """The device's peak for env.dtype, or None where unknown (CPU, unlisted devices)."""
    if env.device.type == "cuda":
        name = torch.cuda.get_device_name(env.device)
    elif env.device.type == "xpu":
        name = torch.xpu.get_device_name(env.device)
    else:
        return None
    for key, (half, single) in PEAK_FLOPS.items():
        if key in name.upper():
            return single if env.dtype == torch.float32 else half
    return None


def reset_peak_memory(env):
    """Start a new high-water mark, so that each step's mem_peak_bytes is that step's."""
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    elif env.device.type == "xpu":
        torch.xpu.reset_peak_memory_stats(env.device)


def peak_memory(env):
    if env.device.type == "cuda":
        return torch.cuda.max_memory_allocated(env.device)
    if env.device.type == "xpu":
        return torch.xpu.max_memory_allocated(env.device)
    return None


def host_bytes(state):
    """The model-state bytes this rank keeps in host memory (--offload's "(host)" kinds, which
    mem_peak_bytes, the device's, leaves out), or None when it keeps none there."""
    return sum(v for kind, v in state.items() if kind.endswith("(host)")) or None


STRAGGLER = 1.5  # a rank this many times slower than the median is named on the console


class Metrics:
    """Rank-0 console lines and the JSONL metrics file (schema in docs/design.md)."""

    def __init__(self, args, env, flops_per_tok, cost, config=None):
        self.env, self.flops_per_tok = env, flops_per_tok
        self.wandb = start_wandb(args, env, config or {}) if args.wandb else None  # rank 0's run, or None
        self.theory(cost)
        self.tokens_per_step = args.global_batch_size * model_block_size(args)
        self.micro_batch_size = args.micro_batch_size
        self.peak = peak_flops(env)
        self.path, self.file = args.metrics, open(args.metrics, "a") if (args.metrics and env.master) else None

    def theory(self, cost):
        """The theory columns, from the script's costs() for this rank."""
        self.state_theory, self.comm_theory = theory_bytes(cost)
        # None where a cost gives no activation formula (every training script now gives one)
        self.activation_theory = cost["activations"][1] if "activations" in cost else None
        self.live_theory = peak_numbers(cost)

    def step(self, step, loss, lr, dt, state, comm, extra=None, activations=None, live=None):
        """Log one optimizer step; `dt` in seconds; `state`, `comm`, `activations` (the
        ActivationMeter's peak) and `live` (its peaks of every live tensor by phase) from
        this rank."""
        tokens_per_s = self.tokens_per_step / dt
        mfu = None
        if self.peak is not None:
            # flops of the whole step divided among the ranks, against one device's peak
            mfu = tokens_per_s * self.flops_per_tok / (self.peak * self.env.world_size)
        row = dict(step=step, loss=loss, lr=lr, dt_ms=dt * 1e3, tokens_per_s=tokens_per_s, mfu=mfu,
                   mem_peak_bytes=peak_memory(self.env), mem_host_bytes=host_bytes(state),
                   state_bytes=state, comm_bytes=comm,
                   state_bytes_theory=self.state_theory, comm_bytes_theory=self.comm_theory,
                   activation_bytes=activations, activation_bytes_theory=self.activation_theory,
                   micro_batch_size=self.micro_batch_size)
        if live is not None:  # every live tensor's bytes by phase, where counted (GPTPAR_COUNT_LIVE=1, GPUs)
            row["live_bytes"], row["live_bytes_theory"] = live, self.live_theory
            if os.environ.get("GPTPAR_COUNT_LIVE") == "1":  # a test's count: every rank's, one gather
                row["live_bytes_ranks"] = self.live_ranks(live)
        ranks = self.over_ranks(row["dt_ms"], row["mem_peak_bytes"])
        straggler = ranks.pop("straggler", "")  # for the console line, not a metrics key
        row.update(ranks)
        row.update(extra or {})
        self.write(row)
        mfu_s = f", mfu {mfu * 100:.1f}%" if mfu is not None else ""
        log(self.env, f"step {step}: loss {loss:.4f}, lr {lr:.2e}, {dt * 1e3:.0f} ms, "
                      f"{tokens_per_s:,.0f} tok/s{mfu_s}{straggler}")
        return row

    def over_ranks(self, dt_ms, mem_peak):
        """Step time and peak memory over the ranks: min, max, mean, and the rank and host of
        the maximum, from one small gather per logged step (outside the ledger's step: the
        step's traffic was taken before). A straggler is named when the slowest rank took
        more than STRAGGLER times the median."""
        mine = (dt_ms, mem_peak, socket.gethostname())
        everyone = [mine]
        if self.env.world_size > 1 and dist.is_initialized():
            everyone = [None] * self.env.world_size
            dist.all_gather_object(everyone, mine)
        return rank_stats(everyone)


    def live_ranks(self, live):
        """[{"live": .., "theory": ..}] of every rank, in rank order (one gather, only where
        live bytes are counted: a pipeline's stages, 08's mesh, hold different things)."""
        mine = {"live": live, "theory": self.live_theory}
        if self.env.world_size == 1 or not dist.is_initialized():
            return [mine]
        everyone = [None] * self.env.world_size
        with LEDGER.paused():  # a measurement's own traffic, not a step's
            dist.all_gather_object(everyone, mine)
        return everyone

    def write(self, row):
        if self.file:
            try:
                self.file.write(json.dumps(finite_or_null(row), allow_nan=False) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk, a file system gone read-only: the guard stops the run
                self.file = None
                WRITE_FAILURES.append(f"cannot write --metrics {self.path}: {e.strerror or e}")
        if self.wandb:  # the same keys, nested ones flattened: state_bytes/params by state_bytes_theory/params
            flat = flat_row(finite_or_null(row))
            self.wandb.log({k: v for k, v in flat.items() if v is not None}, step=row["step"])

    def close(self):
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


def start_wandb(args, env, config):
    """--wandb PROJECT: rank 0 opens a Weights & Biases run in that project, with the command
    line and the run's configuration (model, layout) as its config, in --out_dir unless
    WANDB_DIR says where. Offline (WANDB_MODE=offline, for compute nodes without internet) it
    writes only there; `wandb sync` uploads it later. A run that cannot start (online without
    an API key) is one agreed line. Returns the run on rank 0, None elsewhere."""
    run, problem = None, None
    if env.master:
        import wandb
        try:
            run = wandb.init(project=args.wandb, config={**vars(args), **config, "world_size": env.world_size},
                             dir=None if os.environ.get("WANDB_DIR") else args.out_dir,
                             settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # wandb's own errors (no API key, no server) are not one class
            why = (str(e).strip() or type(e).__name__).splitlines()[0]
            problem = f"--wandb {args.wandb}: wandb could not start a run: {why}"
    agree(env, problem)
    if run is not None:
        offline = run.settings.mode == "offline"
        log(env, f"wandb: run {run.name or run.id} in project {args.wandb}, " + (
            f"offline in {run.dir} (upload with `wandb sync {os.path.dirname(run.dir)}`)" if offline else run.url))
    return run


def flat_row(row):
    """{"comm_bytes": {"all_reduce": n}} -> {"comm_bytes/all_reduce": n}, and a list's items
    numbered ({"expert_tokens": [a, b]} -> expert_tokens/0, expert_tokens/1): the metrics row's
    keys, flattened for loggers that take one level."""
    flat = {}
    for key, value in row.items():
        if isinstance(value, (list, tuple)):
            value = dict(enumerate(value))
        if isinstance(value, dict):
            flat.update({f"{key}/{sub}": v for sub, v in flat_row(value).items()})
        else:
            flat[key] = value
    return flat


def rank_stats(everyone):
    """[(dt_ms, mem_peak_bytes or None, host)] of every rank -> the metrics' over-ranks keys,
    and a 'straggler' note for the console when the slowest rank is far behind the median."""
    stats = {}
    for i, key in enumerate(("dt_ms", "mem_peak_bytes")):
        values = [r[i] for r in everyone]
        if any(v is None for v in values):
            continue
        worst = max(range(len(values)), key=values.__getitem__)
        stats.update({f"{key}_min": min(values), f"{key}_max": values[worst], f"{key}_mean": sum(values) / len(values),
                      f"{key}_max_rank": worst, f"{key}_max_host": everyone[worst][2]})
    times = sorted(r[0] for r in everyone)
    median = times[(len(times) - 1) // 2]
    if len(times) > 1 and stats["dt_ms_max"] > STRAGGLER * median:
        stats["straggler"] = (f"; straggler: rank {stats['dt_ms_max_rank']} on {stats['dt_ms_max_host']}, "
                              f"{stats['dt_ms_max'] / median:.1f}x the median step time")
    return stats


WRITE_FAILURES = []  # writes that failed outside an agreed path (metrics rows): the guard acts on them


def finite_or_null(value):
    """A metrics row with every non-finite float replaced by None (JSON null, never NaN)."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def spans(ranks):
    """A sorted list of ranks in short: [0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(out)


def log_node_map(env):
    """Once at start: which ranks run on which host (one small gather)."""
    hosts = [socket.gethostname()]
    if env.world_size > 1 and dist.is_initialized():
        hosts = [None] * env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
    nodes = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    log(env, f"nodes: {len(nodes)}; " + "; ".join(f"{host}: ranks {spans(r)}" for host, r in nodes.items()))


def format_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


# ----------------------------------------------------------------------------------------
# The dry run: validate and price a layout without launching it
# ----------------------------------------------------------------------------------------

def launch_for(args):
    """Who this process is: from the launcher's environment, or, for --dry_run, rank 0 of
    the --world_size ranks being planned (no launcher, network or accelerator is touched)."""
    if args.dry_run:
        return Launch("dry_run", 0, 0, args.world_size, args.ranks_per_node)
    if args.rehearse:  # the rank being rehearsed (the rehearsal section), rank 0 before
        rank = REHEARSING.rank if REHEARSING else 0
        return Launch("rehearse", rank, rank % args.ranks_per_node, args.world_size, args.ranks_per_node)
    return detect_launcher(os.environ)


def planned_device_type(args):
    """The device type a dry run plans for: --device, and for auto a GPU's (cuda)."""
    return "cuda" if args.device == "auto" else args.device


def planned_dtype(args):
    """The dtype a dry run plans for: --dtype, and for auto the GPUs' bfloat16 (a login node
    has no GPU to ask), unless --device cpu."""
    if args.dtype == "auto":
        return torch.float32 if args.device == "cpu" else torch.bfloat16
    return getattr(torch, args.dtype)


def dry_run(args, script, config, cost, layout_lines=()):
    """--dry_run: the configuration has been validated for args.world_size ranks; print
    the layout and what one rank holds and sends per step, from the same cost function the
    live ledger checks, then exit 0."""
    problem = data_problem(args.data, config.block_size) or output_problems(args)  # a launch checks these in setup()
    check(problem is None, problem)
    if args.resume:  # the newest checkpoint, opened and checked against this run as a launch would
        try:
            ckpt = open_checkpoint(args.out_dir, run_config(args, config, None), args.unverified)
            ranks = {piece["rank"] for entry in ckpt.meta["tensors"].values() for piece in entry["pieces"]}
            for rank in sorted(ranks):  # a launch opens the files it reads: every one must be there
                path = os.path.join(ckpt.directory, f"rank{rank}.pt")
                if not os.path.isfile(path):
                    raise CheckpointError(f"checkpoint file {path} is missing")
        except CheckpointError as e:
            fail(str(e))
    n, per_node = args.world_size, args.ranks_per_node
    psi, nano = count_params(config)
    held = sum(value for _, value in cost["held"].values())
    lines = [f"dry run: {script} on {n} rank(s), {per_node} per node ({math.ceil(n / per_node)} node(s)); "
             f"model {args.model}: {nano / 1e6:,.2f}M parameters (nanoGPT's count), Ψ = {psi:,}; "
             f"{str(planned_dtype(args)).replace('torch.', '')}",
             *layout_lines, "per rank:"]
    for kind, (formula, value) in cost["held"].items():
        lines.append(f"  holds {kind:<26} {format_bytes(value):>11}   {formula}")
    lines.append(f"  holds {'model state in all':<26} {format_bytes(held):>11}")
    if "gathered" in cost:  # ZeRO-3's and FSDP's working parameters, gathered at the peak
        formula, value = cost["gathered"]
        lines.append(f"  holds {'gathered params (peak)':<26} {format_bytes(value):>11}   {formula}")
    if "activations" in cost:
        formula, value = cost["activations"]
        lines.append(f"  holds {'activations (peak)':<26} {format_bytes(value):>11}   {formula}")
    for phase, (formula, value) in {**cost.get("peak", {}), **({"start-up": cost["startup"]} if "startup" in cost
                                                                 else {})}.items():
        lines.append(f"  peak  {phase + ' (all live)':<26} {format_bytes(value):>11}   {formula}")
    for op, (formula, value) in sorted(cost["sent"].items()):
        lines.append(f"  comm  {op:<26} {format_bytes(value):>11}   per step: {formula}")
    if not cost["sent"]:
        lines.append("  sends nothing")
    if cost.get("muon_flops", ("", 0))[1]:  # --optimizer muon: the matrices this rank orthogonalises
        formula, value = cost["muon_flops"]
        lines.append(f"  Muon  {'Newton-Schulz':<26} {value / 1e9:>7.4g} GFLOP per step: {formula}")
    print("\n".join(lines), flush=True)
    sys.exit(0)


# ----------------------------------------------------------------------------------------
# Checkpoint files
# ----------------------------------------------------------------------------------------

# One format for every script, resharded on load. Written by hand rather than with
# torch.distributed.checkpoint (DCP): DCP describes shards through DTensor/ShardedTensor
# metadata that these hand-written layouts do not have (ZeRO's flat shards of a padded
# buffer, Megatron's [Q_t; K_t; V_t] rows, a vocabulary padded to a multiple of T), it would
# be a second way of saying where a piece lives, and reading its files needs DCP itself. Here
# a piece is said once, as a box and an optional flat range (below), and the files are plain
# torch.save dicts of tensors plus one JSON file, readable with nothing but torch and json.
#
#   out_dir/ckpt/step_<N>/rank<r>.pt      every rank's pieces: {key: tensor}, its RNG states
#   out_dir/ckpt/step_<N>/metadata.json   written last, by rank 0: the commit
#
# metadata.json: format, step, optimizer step, run configuration, layout, time, and per
# tensor ("model/<nanoGPT name>", "optim/exp_avg/<name>", "optim/exp_avg_sq/<name>") its
# global shape, dtype and pieces {rank, key, box, flat}. A piece is the region `box` of the
# global tensor (per dimension [start, stop): TP, PP and FSDP shards), or, with `flat`, the
# elements [a, b) of that box flattened row-major (ZeRO's flat shards). A set without
# metadata.json is never read; the previous set is removed only after the new one is
# committed; leftovers of interrupted writes are removed at the next save or resume.

CHECKPOINT_FORMAT = "gpt-parallel-by-hand checkpoint v1"


class CheckpointError(Exception):
    """A wrong, damaged or missing checkpoint: reported in one line, exit 2 on every rank."""


@dataclass
class Piece:
    """One rank's piece of one global tensor: `tensor` holds the region `box` of the tensor
    `name` (global shape `shape`), or with `flat` = (a, b) the elements [a, b) of that box
    flattened. `write`: this rank stores it (one of the replicas does); every rank reads."""
    name: str
    shape: tuple
    box: list
    flat: tuple
    tensor: torch.Tensor
    write: bool = True


def param_pieces(name, shape, param, optimizer=None, box=None, flat=None, index=None, write=True, model=True):
    """The pieces of parameter `name` (nanoGPT's name, global shape `shape`) that this rank
    holds in `param` (or in param[index]): its value and, given the optimizer, its AdamW
    moments (Muon's matrices: its momentum), under the same box/flat. AdamW state is created
    (zeros) if it does not exist yet, so that a resumed run has somewhere to load it into."""
    shape = tuple(shape)
    box = [list(b) for b in box] if box is not None else [[0, s] for s in shape]
    flat = tuple(flat) if flat is not None else None
    pick = (lambda t: t[index]) if index is not None else (lambda t: t)
    pieces = [Piece(f"model/{name}", shape, box, flat, pick(param.data), write)] if model else []
    if optimizer is not None:
        state = optimizer.state[param]
        if "momentum_buffer" in state:  # a Muon matrix (common.Muon makes its buffer at once)
            return pieces + [Piece(f"optim/momentum/{name}", shape, box, flat, pick(state["momentum_buffer"]), write)]
        if "exp_avg" not in state:
            fused = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        for moment in ("exp_avg", "exp_avg_sq"):
            pieces.append(Piece(f"optim/{moment}/{name}", shape, box, flat, pick(state[moment]), write))
    return pieces


def _flat_boxes(box, flat):
    """The region `box`, or the elements [a, b) of it flattened row-major, as boxes of the
    global tensor, each with the offset of its first element in the piece's (flattened)
    data. A flat range is at most 2·ndim + 1 boxes: partial rows around whole ones."""
    sizes = [stop - start for start, stop in box]
    if flat is None:
        return [(box, 0)]
    a0, b0 = flat
    out = []

    def split(a, b, dims, prefix, base):  # [a, b) of the sub-tensor `dims` at flat `base`
        if a >= b:
            return
        if not dims:
            out.append((prefix, base - a0))
            return
        inner = math.prod(dims[1:])
        rest = [[0, d] for d in dims[1:]]
        first, last = a // inner, (b - 1) // inner
        if a % inner:  # a partial first row
            split(a - first * inner, min(b, (first + 1) * inner) - first * inner, dims[1:],
                  prefix + [[first, first + 1]], base + first * inner)
            first += 1
        whole_to = last + 1 if b % inner == 0 else last  # rows [first, whole_to) are whole
        if whole_to > first:
            out.append((prefix + [[first, whole_to]] + rest, base + first * inner - a0))
        if b % inner and last >= first:  # a partial last row
            split(0, b - last * inner, dims[1:], prefix + [[last, last + 1]], base + last * inner)

    split(a0, b0, sizes, [], 0)
    return [([[s + o, e + o] for (s, e), (o, _) in zip(sub, box)], offset) for sub, offset in out]


def _copy_overlap(dst, dst_regions, src, src_regions):
    """Copy every element that the two pieces share from src to dst (both flattened data);
    returns how many."""
    copied = 0
    for dbox, doff in dst_regions:
        dshape = [e - s for s, e in dbox]
        for sbox, soff in src_regions:
            inter = [[max(d[0], s[0]), min(d[1], s[1])] for d, s in zip(dbox, sbox)]
            if any(s >= e for s, e in inter):
                continue
            sshape = [e - s for s, e in sbox]
            d = dst[doff:doff + math.prod(dshape)].view(dshape)[tuple(slice(s - o[0], e - o[0]) for (s, e), o in zip(inter, dbox))]
            s_ = src[soff:soff + math.prod(sshape)].view(sshape)[tuple(slice(s - o[0], e - o[0]) for (s, e), o in zip(inter, sbox))]
            d.copy_(s_)
            copied += math.prod(e - s for s, e in inter)
    return copied


def atomic_save(obj, path):
    """Write atomically: a temporary file in the same directory, flushed to disk, then
    renamed over the old one; a crash mid-write leaves the previous file intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if isinstance(obj, (bytes, str)):
                f.write(obj.encode() if isinstance(obj, str) else obj)
            else:
                try:
                    torch.save(obj, f)
                except RuntimeError as e:  # a full disk reads "enforce fail at inline_container.cc ..."
                    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
                    raise OSError(f"the write failed ({format_bytes(free)} free on that file system; "
                                  f"torch: {(str(e).splitlines() or [''])[0][:120]})") from e
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX file systems
    finally:
        if os.path.exists(tmp):  # the write failed: leave no half-written file behind
            os.remove(tmp)


def tensor_checksum(t):
    """CRC-32 of a CPU tensor's bytes: cheap next to the I/O, and a flipped bit changes it."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _agreed(env, action):
    """Run `action` on every rank; a CheckpointError (or any error reading a file) on any
    rank becomes one line and exit 2 on every rank (`agree`)."""
    result, problem = None, None
    try:
        result = action()
    except CheckpointError as e:
        problem = str(e)
    agree(env, problem)
    return result


def checkpoint_root(out_dir):
    return os.path.join(out_dir, "ckpt")


DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def _is_int(value, low=0, high=None):
    """A JSON whole number in [low, high) (True and 3.0 are not one)."""
    return type(value) is int and value >= low and (high is None or value < high)


def _metadata_problems(meta):
    """What is wrong with a parsed metadata.json of this format (a list, empty when nothing
    is): every field the reader relies on has its kind and its range, so that a damaged or
    hand-edited file is one line naming the fields, never a KeyError or a TypeError deep in a
    resume. The checksums are checked here for their shape only (a list of one {key: CRC-32}
    per rank file); a set without them cannot be verified (Checkpoint says so)."""
    found = []
    for key, kind in {"step": int, "optimizer_step": int, "run": dict, "layout": dict, "tensors": dict}.items():
        if type(meta.get(key)) is not kind or kind is int and meta[key] < 0:
            found.append(f'{key} is missing or not a{"" if kind is dict else " non-negative"} {kind.__name__}')
    stamp = meta.get("time")
    if type(stamp) not in (int, float) or not math.isfinite(stamp):
        found.append(f"time is {json.dumps(stamp)[:40]}, not the commit's time in seconds")
    world = meta["layout"].get("world_size") if isinstance(meta.get("layout"), dict) else None
    if isinstance(meta.get("layout"), dict) and not _is_int(world, 1):
        found.append(f"layout/world_size is {json.dumps(world)[:40]}, not a positive whole number of rank files")
    world = world if _is_int(world, 1) else None
    sums = meta.get("checksums")
    if sums is not None and world is not None:
        if not isinstance(sums, list) or len(sums) != world:
            found.append(f'checksums is {"a list of " + str(len(sums)) if isinstance(sums, list) else "a " + type(sums).__name__}'
                         f", not a list of one {{key: CRC-32}} table per rank file (the layout has {world})")
        else:
            found += [f"checksums[{rank}] is not a {{key: CRC-32}} table of rank{rank}.pt"
                      for rank, table in enumerate(sums) if not isinstance(table, dict)
                      or not all(isinstance(k, str) and _is_int(v, 0, 2**32) for k, v in table.items())]
    tensors = meta.get("tensors") if isinstance(meta.get("tensors"), dict) else {}
    for name, entry in tensors.items():
        problem = _tensor_entry_problem(entry, world)
        if problem:
            found.append(f"tensors/{name[:120]}: {problem}")
    return found


def _tensor_entry_problem(entry, world):
    """What is wrong with one tensor's entry {shape, dtype, pieces}, or None: every piece on
    a rank file that exists, its box inside the shape, its flat range inside its box."""
    if not isinstance(entry, dict) or not isinstance(entry.get("pieces"), list):
        return "no list of pieces"
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
        return "its shape is not a list of whole numbers"
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in {f"torch.{d}" for d in DTYPES}:
        return f"its dtype {json.dumps(entry.get('dtype'))[:40]} is not a tensor type"
    for piece in entry["pieces"]:
        if not (isinstance(piece, dict) and isinstance(piece.get("key"), str) and isinstance(piece.get("box"), list)):
            return "a piece without its key or box"
        if not _is_int(piece.get("rank"), 0, world):
            return (f"a piece on rank {json.dumps(piece.get('rank'))[:20]}, not one of the "
                    + (f"{world} rank files" if world else "layout's rank files"))
        box = piece["box"]
        if len(box) != len(shape) or not all(isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and _is_int(b[1])
                                             and b[0] <= b[1] <= s for b, s in zip(box, shape)):
            return f"the box {json.dumps(box)[:60]} of {piece['key'][:80]} is not inside the shape {shape}"
        flat = piece.get("flat")
        if flat is not None and not (isinstance(flat, list) and len(flat) == 2 and _is_int(flat[0]) and _is_int(flat[1])
                                     and flat[0] <= flat[1] <= math.prod(b - a for a, b in box)):
            return f"the flat range {json.dumps(flat)[:60]} of {piece['key'][:80]} is not inside its box"
    return None


def _read_metadata(path):
    """metadata.json parsed and checked (`_metadata_problem`); a CheckpointError naming the
    file and what is wrong with it otherwise."""
    if not os.path.isfile(path):  # a link to a device (/dev/zero is read for ever) or a dangling one
        raise CheckpointError(f"checkpoint metadata {path} is not a regular file (a link to a device, or to "
                              "nothing?): not a checkpoint's metadata")
    try:
        with open(path) as f:
            meta = json.load(f)
    except RecursionError:  # [[[[...]]]]: JSON nested deeper than the parser's recursion
        raise CheckpointError(f"checkpoint metadata {path} is not a checkpoint's metadata: "
                              "its JSON is nested thousands of levels deep") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint metadata {path} is unreadable (truncated or corrupt?): "
                              f"{type(e).__name__}: {str(e)[:150]}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not the metadata of a checkpoint of these scripts "
                              f"(no \"format\": \"{CHECKPOINT_FORMAT}\")")
    problems = _metadata_problems(meta)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint metadata {path} is damaged: {'; '.join(problems[:3])}{more}")
    return meta


def _commit_time(path):
    """The "time" a committed set's metadata.json records, else the file's modification time
    (an unreadable or damaged file: refused, with its name, if it is the set chosen)."""
    if not os.path.isfile(path):
        return os.lstat(path).st_mtime  # not read: refused, with its name, if it is the set chosen
    stamp = os.path.getmtime(path)
    try:
        with open(path) as f:
            recorded = json.load(f).get("time")
    except (OSError, ValueError, AttributeError, RecursionError):
        return stamp
    return float(recorded) if type(recorded) in (int, float) and math.isfinite(recorded) else stamp


def latest_checkpoint(out_dir):
    """The directory of the newest committed set (the one whose metadata was written last),
    or None. Sets without metadata.json (a write that did not finish) are ignored."""
    root, best = checkpoint_root(out_dir), (None, -1.0)
    if not os.path.isdir(root):
        return None
    for name in os.listdir(root):
        meta = os.path.join(root, name, "metadata.json")
        if name.startswith("step_") and os.path.lexists(meta):  # (a link to a device: refused when read)
            stamp = _commit_time(meta)
            if stamp > best[1]:
                best = (os.path.join(root, name), stamp)
    return best[0]


def unfinished_checkpoints(out_dir):
    """The sets in out_dir without metadata.json (writes that did not finish), and the
    temporary files of killed writes."""
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if ".tmp." in name or name.startswith("step_") and not os.path.lexists(os.path.join(path, "metadata.json")):
            found.append(path)
        elif os.path.isdir(path):
            found += [os.path.join(path, f) for f in sorted(os.listdir(path)) if ".tmp." in f]
    return found


def clean_checkpoints(out_dir, keep, committed=True):
    """Rank 0: remove the leftovers of interrupted writes (sets without metadata, temporary
    files) and the committed sets `committed` names but `keep`: True, every one (after the
    first commit of an --overwrite run), or a list of directories (after a commit: the set it
    replaces). At start-up committed sets are never removed (a user may have copied an older
    one back to roll back)."""
    for path in unfinished_checkpoints(out_dir):
        if keep is None or os.path.abspath(path) != os.path.abspath(keep):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    root = checkpoint_root(out_dir)
    if committed and os.path.isdir(root):
        named = None if committed is True else {os.path.abspath(p) for p in committed if p}
        for name in os.listdir(root):
            path = os.path.abspath(os.path.join(root, name))
            if (name.startswith("step_") and (keep is None or path != os.path.abspath(keep))
                    and (named is None or path in named)):
                shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(args, step, env, pieces, run, optimizer, extra_rng=None):
    """Write the checkpoint of `step`: every rank its pieces (those with write=True) and its
    RNG states to rank<r>.pt, atomically; then, once every rank has succeeded, rank 0 writes
    metadata.json (the commit) and only then removes the previous set. With --export, the
    final checkpoint is also written consolidated into one file. Returns nothing; a failed
    write on any rank is one line and exit 2 on every rank, the previous set intact."""
    directory, previous = [None], None
    if env.master:
        previous = latest_checkpoint(args.out_dir)  # the set this one replaces: resumed, or written last
        clean_checkpoints(args.out_dir, keep=previous, committed=False)
        directory[0], n = os.path.join(checkpoint_root(args.out_dir), f"step_{step}"), 1
        while os.path.exists(directory[0]):  # a committed set of the same step stays until this one is
            directory[0], n = os.path.join(checkpoint_root(args.out_dir), f"step_{step}.{n}"), n + 1
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(directory, src=0)  # rank 0's choice of directory, to every rank
    directory = directory[0]
    tensors, described, count = {}, [], {}
    for piece in pieces:
        if piece.write:
            n = count[piece.name] = count.get(piece.name, -1) + 1
            key = f"{piece.name}#{n}"
            tensors[key] = piece.tensor.detach().to("cpu", copy=True).contiguous()
            described.append(dict(name=piece.name, shape=list(piece.shape), dtype=str(piece.tensor.dtype),
                                  key=key, box=piece.box, **({"flat": list(piece.flat)} if piece.flat else {})))
    tensors.update({f"rng/{k}": v for k, v in rng_state(env).items()})
    tensors.update({f"extra_rng/{k}": v for k, v in (extra_rng or {}).items()})
    checksums = {key: tensor_checksum(t) for key, t in tensors.items()}  # verified when read
    problem, written, t0 = None, 0, time.perf_counter()
    bad = next((key for key, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:  # never replace the last good checkpoint with a diverged one
        problem = (f"not writing the checkpoint of step {step}: {bad.split('#')[0]} holds non-finite values "
                   f"on rank {env.rank}; the last good checkpoint, {latest_checkpoint(args.out_dir)}, is kept")
    else:
        try:
            path = os.path.join(directory, f"rank{env.rank}.pt")
            atomic_save(tensors, path)
            written = os.path.getsize(path)
        except OSError as e:
            problem = f"cannot write checkpoint {directory}/rank{env.rank}.pt: {e}"
    everyone = [(problem, described, written, checksums)]
    if dist.is_initialized() and env.world_size > 1:
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, (problem, described, written, checksums))  # who wrote what
    agree(env, next((p for p, *_ in everyone if p), None))  # the same verdict on every rank
    if env.master:
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "time": time.time(),
                "optimizer_step": _optimizer_step(optimizer, step), "run": run,
                "layout": {**run["layout"], "world_size": env.world_size},
                "bytes_per_rank": [w for _, _, w, _ in everyone], "tensors": {},
                "checksums": [c for *_, c in everyone],  # per rank file: {key: CRC-32}
                "data_files": data_fingerprint(run["data"])}  # to know the data again if it moves
        for rank, (_, described, _, _) in enumerate(everyone):
            for d in described:
                entry = meta["tensors"].setdefault(d["name"], {"shape": d["shape"], "dtype": d["dtype"], "pieces": []})
                assert entry["shape"] == d["shape"], f"ranks disagree on the shape of {d['name']}"
                entry["pieces"].append({"rank": rank, **{k: d[k] for k in ("key", "box", "flat") if k in d}})
        for name, entry in meta["tensors"].items():  # the pieces tile the tensor exactly once
            held = sum(p["flat"][1] - p["flat"][0] if "flat" in p else math.prod(e - s for s, e in p["box"])
                       for p in entry["pieces"])
            assert held == math.prod(entry["shape"]), f"{name}: the written pieces hold {held} of {math.prod(entry['shape'])} elements"
        try:
            atomic_save(json.dumps(meta, indent=1), os.path.join(directory, "metadata.json"))  # the commit
            # only now: the previous set; every other committed set only if --overwrite said so
            # (an older set a user copied back stays: it was named when the run resumed)
            replaced = True if getattr(args, "overwrite", False) and not args.resume else [previous]
            clean_checkpoints(args.out_dir, keep=directory, committed=replaced)
            problem = None
        except OSError as e:
            problem = f"cannot write checkpoint metadata {directory}/metadata.json: {e}"
    agree(env, problem if env.master else None)
    sizes = [w for _, _, w, _ in everyone]
    log(env, f"checkpoint step {step} committed to {directory}: {format_bytes(min(sizes))} to "
             f"{format_bytes(max(sizes))} per rank, {format_bytes(sum(sizes))} in all, {time.perf_counter() - t0:.2f} s")
    if getattr(args, "export", None) and step == args.max_iters:
        export_agreed(args, env, step)


def export_agreed(args, env, step):
    """--export: rank 0 writes the newest committed set consolidated; a failure is one
    agreed line (the checkpoint itself is committed)."""
    problem = None
    if env.master:
        try:
            export_checkpoint(args.out_dir, args.export)
            log(env, f"exported step {step}, consolidated, to {args.export} (nanoGPT's ckpt.pt format)")
        except OSError as e:  # checked at start; the disk may have filled since
            problem = (f"cannot write --export {args.export}: {e}; the checkpoint "
                       f"{latest_checkpoint(args.out_dir)} is committed")
    agree(env, problem)


def _optimizer_step(optimizer, default):
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return default


class Checkpoint:
    """A committed set, opened for reading: `read(name, box, flat)` assembles any region of
    any tensor from the pieces that overlap it, opening only the rank files that hold them
    (memory-mapped, weights_only: nothing is unpickled but tensors)."""

    def __init__(self, directory, unverified=False):
        self.directory = directory
        self.meta = _read_metadata(os.path.join(directory, "metadata.json"))
        self.files, self.verified = {}, set()
        # a set whose metadata records no checksums (written before they were, or edited)
        # cannot be verified: refused, unless --unverified says to read it all the same
        self.unverified = unverified and self.meta.get("checksums") is None
        if self.meta.get("checksums") is None and not unverified:
            raise CheckpointError(f"checkpoint metadata {os.path.join(directory, 'metadata.json')} records no "
                                  "checksums of its rank files, so what they hold cannot be verified (a set "
                                  "written before checksums were, or an edited one): resume it with --unverified "
                                  "to read it unchecked, or from a copy that has them")

    def verify(self, rank, key, stored):
        """The tensor read back is the one written: its CRC-32 against metadata.json's. A
        tensor the checksums do not list cannot be verified, and is refused like a wrong one
        (only a set without any checksums may be read, with --unverified)."""
        if self.unverified or (rank, key) in self.verified:
            return
        path = os.path.join(self.directory, f"rank{rank}.pt")
        expected = self.meta["checksums"][rank].get(key)
        if expected is None:
            raise CheckpointError(f"checkpoint metadata {os.path.join(self.directory, 'metadata.json')} lists no "
                                  f"checksum for {key.split('#')[0]} in {path}, so it cannot be verified "
                                  "(an edited or foreign metadata.json?)")
        if tensor_checksum(stored) != expected:
            raise CheckpointError(f"checkpoint file {path}: "
                                  f"{key.split('#')[0]} fails its checksum (the file changed after it was "
                                  "written: a damaged disk or copy); resume from another copy of this set")
        self.verified.add((rank, key))

    def file(self, rank):
        if rank not in self.files:
            path = os.path.join(self.directory, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise CheckpointError(f"checkpoint file {path} is missing")
            data, problem = load_tensors(path, mmap=True)
            if problem:
                raise CheckpointError(f"checkpoint file {path} {problem}")
            if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
                raise CheckpointError(f"checkpoint file {path} is not a rank file of these scripts "
                                      f"(it holds a {type(data).__name__}, not a dict of tensors)")
            self.files[rank] = (path, data)
        return self.files[rank]

    def read(self, name, shape, box, flat=None):
        entry = self.meta["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name}")
        if list(entry["shape"]) != list(shape):
            raise CheckpointError(f"checkpoint {self.directory} holds {name} of shape {entry['shape']}, "
                                  f"this run needs {list(shape)}")
        numel = (flat[1] - flat[0]) if flat else math.prod(e - s for s, e in box)
        out = torch.empty(numel, dtype=getattr(torch, entry["dtype"].replace("torch.", "")))
        wanted, copied = _flat_boxes(box, flat), 0
        for piece in entry["pieces"]:
            regions = _flat_boxes(piece["box"], piece.get("flat"))
            if not any(all(max(d[0], s[0]) < min(d[1], s[1]) for d, s in zip(w, r))
                       for w, _ in wanted for r, _ in regions):
                continue  # no overlap: its file is not opened
            path, data = self.file(piece["rank"])
            stored = data.get(piece["key"])
            size = (piece["flat"][1] - piece["flat"][0]) if piece.get("flat") else math.prod(e - s for s, e in piece["box"])
            if stored is None or stored.numel() != size:
                raise CheckpointError(f"checkpoint file {path} does not hold {piece['key']} as its metadata says")
            self.verify(piece["rank"], piece["key"], stored)
            copied += _copy_overlap(out, wanted, stored.reshape(-1), regions)
        if copied != numel:
            raise CheckpointError(f"checkpoint {self.directory} covers {copied} of the {numel} elements "
                                  f"of {name} this rank needs")
        return out


DATA_SAMPLES, DATA_SAMPLE_BYTES = 16, 1 << 16  # a token file's fingerprint: 16 windows of 64 KiB, 1 MiB read


def data_fingerprint(spec):
    """What identifies a --data directory's files whatever its path: per file (train.bin,
    val.bin, meta.pkl) its size and a CRC-32 of DATA_SAMPLES windows spread evenly over it,
    first and last bytes included (1 MiB read, whatever the file's size). Recorded in every
    checkpoint, so that a run whose data moved ($HOME to $SCRATCH) is recognised as the same
    run. None for the embedded corpora (their name says it)."""
    if not os.path.isdir(spec):
        return None
    found = {}
    for name in ("train.bin", "val.bin", "meta.pkl"):
        path = os.path.join(spec, name)
        if os.path.isfile(path):
            stat = os.stat(path)
            version = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
            if version not in _FINGERPRINTS:  # once per file and version in a process (every save asks)
                _FINGERPRINTS[version] = [stat.st_size, _sampled_crc(path, stat.st_size)]
            found[name] = _FINGERPRINTS[version]
    return found


_FINGERPRINTS = {}


def _sampled_crc(path, size):
    crc, span = 0, max(0, size - DATA_SAMPLE_BYTES)
    with open(path, "rb") as f:
        for i in range(DATA_SAMPLES):
            f.seek(span * i // (DATA_SAMPLES - 1))
            crc = zlib.crc32(f.read(DATA_SAMPLE_BYTES), crc)
    return crc


def _moved_data(ckpt, written, now):
    """None if --data `now` holds the same files as `written`, the data the checkpoint was
    written with (moved or linked elsewhere): compared by the fingerprint the checkpoint
    recorded, or by both directories' when it recorded none and `written` still exists.
    Else why the two cannot be taken for the same data."""
    recorded = ckpt.meta.get("data_files")
    if not isinstance(recorded, dict):
        if not (isinstance(written, str) and os.path.isdir(written)):
            return (f"{written} is gone and this set records no fingerprint of its files to compare {now}'s "
                    "with (written before fingerprints were): put the data back at that path to resume")
        recorded = data_fingerprint(written)
    return None if os.path.isdir(now) and data_fingerprint(now) == recorded else (
        f"the files in {now} are not those it was written with (their sizes and checksums differ)")


def open_checkpoint(out_dir, run, unverified=False):
    """The newest committed set in out_dir, checked against this run; one line if there is
    none, or if what is there is not a checkpoint of this run. Data that moved is the same
    run (a note says so: `ckpt.notes`) when its files are the same (`_moved_data`)."""
    directory = latest_checkpoint(out_dir)
    if directory is None:
        single = [f for f in ("ckpt.pt", "zero_ckpt.pt", "fsdp_ckpt.pt", "tp_ckpt.pt", "pp_ckpt.pt", "3d_ckpt.pt")
                  if os.path.exists(os.path.join(out_dir, f))]
        if single:
            raise CheckpointError(f"{os.path.join(out_dir, single[0])} is not a checkpoint of this format "
                                  f"(expected {checkpoint_root(out_dir)}/step_<N>/metadata.json); "
                                  "to start from a one-file model, use 01_single_gpu.py --init_from")
        raise CheckpointError(f"no checkpoint in {checkpoint_root(out_dir)} to resume from")
    ckpt = Checkpoint(directory, unverified)
    ckpt.notes = []
    saved = ckpt.meta.get("run") or {}
    for key in run:
        if key == "layout":
            continue
        value = saved.get(key)
        if key == "model" and isinstance(value, dict):  # written before a field existed: its default
            value = {**asdict(GPTConfig()), **value}
        if key == "optimizer" and value is None:  # written before --optimizer existed: AdamW's
            value = "adamw"
        if key == "data" and isinstance(value, str) and os.path.isdir(value):
            value = os.path.normpath(value)  # written before run_config normalised it
        recorded = ckpt.meta.get("data_files")
        if key == "data" and value == run[key] and isinstance(recorded, dict) and os.path.isdir(value):
            if data_fingerprint(value) != recorded:  # the same path, other files: not the same run
                raise CheckpointError(f"checkpoint {directory} was written with data={value}, whose files have "
                                      "changed since (their sizes or checksums differ): restore them, or start a "
                                      "new run (--overwrite, or another --out_dir)")
            continue
        if key == "data" and value != run[key] and os.path.isdir(run[key]):  # the same files elsewhere?
            why = _moved_data(ckpt, value, run[key])
            if why:
                raise CheckpointError(f"checkpoint {directory} holds another run: it was written with data="
                                      f"{value}, this run has data={run[key]}, and {why}")
            ckpt.notes.append(f"note: the data moved: {directory} was written with --data {value}; {run[key]} "
                              "holds the same files (sizes and checksums): resuming on it")
            continue
        if value != run[key]:
            what = "another model" if key == "model" else "another run"
            hint = (f" (to train on with the same schedule, pass --lr_decay_iters {saved.get(key)}: "
                    "its default is --max_iters)") if key == "lr_decay_iters" else ""
            raise CheckpointError(f"checkpoint {directory} holds {what}: it was written with {key}="
                                  f"{str(value)[:200]}, this run has {key}={run[key]}{hint}")
    return ckpt


def other_committed_sets(out_dir, directory):
    """The committed sets in out_dir other than `directory`: an older set a user copied back,
    or one a job ended before removing. A resumed run keeps them (it replaces only the set
    it resumed from) and names them."""
    root = checkpoint_root(out_dir)
    return [os.path.join(root, name) for name in sorted(os.listdir(root))
            if name.startswith("step_") and os.path.lexists(os.path.join(root, name, "metadata.json"))
            and os.path.abspath(os.path.join(root, name)) != os.path.abspath(directory)]


def resume_checkpoint(out_dir, env, pieces, run, optimizer, unverified=False):
    """Load every piece this rank holds from the newest committed set in out_dir, whatever
    the layout (and script) that wrote it; the RNG states too when the layout is the same
    (then the run continues bit for bit). Returns (step, the extra RNG states or None).
    `unverified` (--unverified): a set without checksums is read, with a warning."""
    t0 = time.perf_counter()  # (setup() removed the leftovers of interrupted writes)

    def load():
        ckpt = open_checkpoint(out_dir, run, unverified)
        if env.master:
            for note in ckpt.notes:
                log(env, note)
            if ckpt.unverified:
                log(env, f"warning: --unverified: {ckpt.directory} records no checksums; its files are read "
                         "unchecked (a damaged file would be trained on)")
            others = other_committed_sets(out_dir, ckpt.directory)
            if others:
                log(env, f"note: kept: {', '.join(others)}, committed set(s) besides {ckpt.directory}, the newest, "
                         "resumed (this run replaces only the set it resumes; to resume an older set, remove "
                         "the newer ones)")
        with torch.no_grad():
            for piece in pieces:
                value = ckpt.read(piece.name, piece.shape, piece.box, piece.flat)
                piece.tensor.copy_(value.view(piece.tensor.shape))
        same = ckpt.meta["layout"] == {**run["layout"], "world_size": env.world_size}
        rng = None
        if same:
            _, data = ckpt.file(env.rank)
            for key in data:
                if key.startswith(("rng/", "extra_rng/")):
                    ckpt.verify(env.rank, key, data[key])
            rng = {k[4:]: v.clone() for k, v in data.items() if k.startswith("rng/")}
            extra = {k[10:]: v.clone() for k, v in data.items() if k.startswith("extra_rng/")}
        return ckpt.meta, same, rng, (extra if same else None)

    meta, same, rng, extra = _agreed(env, load)
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(meta["optimizer_step"])
    log(env, f"resumed step {meta['step']} from {latest_checkpoint(out_dir)} in {time.perf_counter() - t0:.2f} s")
    if same:
        set_rng_state(env, rng)
    else:
        log(env, f"resuming step {meta['step']} written by {meta['layout']} as {run['layout']} on "
                 f"{env.world_size} rank(s): parameters and AdamW state resharded; the dropout streams start "
                 "afresh: they cannot carry across layouts (the same layout resumes bit for bit)")
    return meta["step"], extra


def export_checkpoint(out_dir, path):
    """The newest committed set, consolidated into one file in nanoGPT's ckpt.pt format
    (model state dict with the tied lm_head.weight, model_args, iter_num, config): for
    nanoGPT's sample.py, 01_single_gpu.py --init_from, or any user."""
    ckpt = Checkpoint(latest_checkpoint(out_dir))
    state = {}
    for name, entry in ckpt.meta["tensors"].items():
        if name.startswith("model/"):
            shape = entry["shape"]
            state[name[6:]] = ckpt.read(name, shape, [[0, s] for s in shape]).view(shape)
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied, as in nanoGPT
    run = ckpt.meta["run"]
    atomic_save({"model": state, "model_args": run["model"], "iter_num": ckpt.meta["step"],
                 "config": {**{k: v for k, v in run.items() if k != "model"}, "dataset": run["data"]}}, path)


def load_tensors(path, mmap=False):
    """torch.load(path) of tensors and plain containers only (weights_only: nothing else is
    unpickled, so a malicious pickle runs nothing), quietly: (what it holds, None), or (None,
    why not) in a few words. torch's own refusal is a paragraph about weights_only and its
    warnings (an old pickle protocol) print lines with their source: the cause is kept."""
    import pickle
    import re
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap), None
    except pickle.UnpicklingError as e:
        found = re.search(r"(Unsupported global: GLOBAL \S+|unsupported GLOBAL \S+|Unsupported operand \d+)", str(e))
        cause = found.group(1) if found else "objects other than tensors"
        return None, (f"holds more than tensors ({cause}): refused unread (only tensors are ever unpickled; "
                      "a pickle of code or of other objects is not a checkpoint of these scripts)")
    except Exception as e:  # a zip torch cannot read, a short file, a directory
        first = re.sub(r"\x1b\[[0-9;]*m", "", (str(e).splitlines() or [""])[0])[:150]
        return None, f"is unreadable (truncated, corrupt, or not a torch file?): {type(e).__name__}: {first}"


def load_model_file(path, config):
    """A one-file model (--export's, or nanoGPT's own ckpt.pt) for --init_from: its state
    dict, after checking that it is one and that it is this model; one line otherwise."""
    check(os.path.exists(path), f"--init_from {path}: no such file")
    check(os.path.isfile(path), f"--init_from {path} is {'a directory' if os.path.isdir(path) else 'not a regular file'}"
          ", not a one-file model (--export's, or nanoGPT's ckpt.pt)")  # /dev/zero would be read for ever
    obj, problem = load_tensors(path)
    check(problem is None, f"--init_from {path} {problem}")
    check(isinstance(obj, dict) and isinstance(obj.get("model"), dict) and isinstance(obj.get("model_args"), dict),
          f"--init_from {path} is not a one-file model (expected a dict with 'model' and 'model_args', as "
          f"--export and nanoGPT write; it holds a {type(obj).__name__}"
          + (f" with keys {sorted(obj)[:6]}" if isinstance(obj, dict) else "") + ")")
    architecture = lambda cfg: {**{k: cfg.get(k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias",  # noqa: E731
                                                          "vocab_size")}, "n_expert": cfg.get("n_expert", 0)}
    check(architecture(obj["model_args"]) == architecture(asdict(config)), f"--init_from {path} holds another "
          f"model: {architecture(obj['model_args'])}, this run builds {architecture(asdict(config))}")
    state = {k.removeprefix("_orig_mod."): v for k, v in obj["model"].items()}  # nanoGPT's compiled names
    return {k: v for k, v in state.items() if not (k.endswith(".attn.bias") and v.dim() == 4)}  # nanoGPT's mask


def run_config(args, config, world_layout):
    """What a checkpoint must agree on to be resumed (all but the layout, which may change),
    and the layout that wrote it (the same layout resumes bit for bit, RNG included)."""
    keys = ("data", "global_batch_size", "seed", "lr", "min_lr", "warmup_iters",
            "lr_decay_iters", "weight_decay", "grad_clip", "optimizer")
    run = {"model": asdict(config), "layout": world_layout, **{k: getattr(args, k) for k in keys}}
    if os.path.isdir(run["data"]):  # the same directory however it is spelled (a trailing slash)
        run["data"] = os.path.normpath(run["data"])
    return run


# ----------------------------------------------------------------------------------------
# The rehearsal: any rank of an N-rank run, its real code, in this one process
# ----------------------------------------------------------------------------------------

# `--rehearse RANKS --world_size N` runs the script's own main() once per named rank, in this
# process, as that rank of an N-rank job:
#
#   Run.start (the first call)          for rank r in RANKS:          -> RehearsedRun
#     the micro-batch: the dry run's      fake process group (rank r of N: torch's "fake"
#     choice; the ledger; the recorder    backend: every collective returns at once, moving
#                                         nothing), fake tensors (FakeTensorMode: shapes and
#                                         dtypes, no storage), the data's vocabulary only
#                                         main()  ->  two full steps, an evaluation, the
#                                                     checkpoint's pieces; every collective and
#                                                     send/recv counted (ledger) and recorded
#     the report: per rank, held / activations / sent next to costs(); --metrics: one row
#     per rank; every rank's posting order (with fewer than `all`, the others' from their
#     roles', symmetry below) replayed under NCCL's rules (replay below)
#
# A 175B model's stage needs no memory: its tensors have shapes and no storage. What depends
# on the data gets a stand-in, said in the report (STAND_INS): every value read on the host
# (.item(), .tolist()) reads 0 (the loss, the evaluation, the guard's flags: finite, no stop);
# a bincount (MoE routing) is balanced; small integer tensors and scalars made from no fake
# tensor (token ids, rank tables, routing counts, AdamW's step count) stay real, and a
# collective over real integers acts as if every rank held what this one holds.
#
# What it cannot see: the allocator's fragmentation and caching, the network's speed, the
# kernels' speed and workspaces, a GPU's own kernels (it runs the CPU's, whose saved tensors
# can differ: costs() is asked for the CPU's), the values themselves (docs/planning.md).

REHEARSAL_STEPS = 2  # the first step builds the optimizer state; the second is the steady state
STAND_INS = ("the data: token id 0 everywhere (only the vocabulary size is read)",
             "every value read on the host (.item(), .tolist()) is 0: the loss, the evaluation's losses, "
             "the guard's flags (finite, nobody asked to stop)",
             "MoE routing: balanced (a bincount gives every expert an equal share)",
             "the evaluation: --eval_iters 1; the checkpoint: its pieces listed, nothing written",
             "--micro_batch_size auto: the dry run's choice")
REHEARSING = None  # the Rehearsal under way (the rank being rehearsed), else None


@dataclass
class Rehearsal:
    ranks: list
    micro_batch_size: int
    dtype: str
    rank: int = None
    posts: dict = None  # rank -> its posted operations, in posting order (replay's entries)
    results: dict = None  # rank -> {"rows": [...], "cost": costs(), "pieces": (n, bytes)}
    interned: dict = None  # one tuple per distinct group membership
    made: dict = None  # rank -> every group it made: (name, ranks, desc), the world first (symmetry)


def rehearsal_ranks(spec, world_size, roles):
    """RANKS of --rehearse as a sorted list: `all`; `roles`: the ranks whose costs differ as
    the script says (run.start's `ranks`: each pipeline stage's first rank) and the first
    and last rank (the first and last data-parallel replica); or a list `0,17,511`."""
    if spec == "all":
        return list(range(world_size))
    if spec == "roles":
        return sorted({0, world_size - 1, *roles})
    try:
        ranks = sorted({int(r) for r in spec.split(",")})
    except ValueError:
        fail(f"--rehearse {spec}: expected ranks (0,17,511), roles or all")
    check(all(0 <= r < world_size for r in ranks), f"--rehearse {spec}: ranks run from 0 to {world_size - 1} "
          f"(--world_size {world_size})")
    return ranks


def rehearsal_start(run, costs, dp_size, aim, multiple, roles, caller, groups=None):
    """Run.start under --rehearse. The first call (the script's own main()) drives the
    rehearsal and exits; inside it, each rank's main() calls here again and gets its fake
    process group, as setup() would give it a real one."""
    if REHEARSING is None:
        rehearse(run, costs, dp_size, aim, multiple, roles, caller.f_globals[caller.f_code.co_name])
    args, state = run.args, REHEARSING
    args.micro_batch_size, args.device, args.dtype = state.micro_batch_size, "cpu", state.dtype
    args.eval_iters, args.resume = 1, False
    for flag in ("compile", "sample_tokens"):  # 01's: no compiler for fake tensors; no sample
        if hasattr(args, flag):
            setattr(args, flag, 0)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=state.rank, world_size=args.world_size)
    state.made[state.rank].append((dist.group.WORLD.group_name, tuple(range(args.world_size)), "world"))
    run.env = Env(run.launch, torch.device("cpu"), "fake", getattr(torch, state.dtype))
    LEDGER.install(run.env.device)
    LEDGER.take()
    LEDGER.step, LEDGER.phase, LEDGER.posted = None, "setup", {}
    run.__class__, run.rows, run.pieces_count = RehearsedRun, [], None
    run.meter = ActivationMeter()
    run.groups = groups(run.env) if groups else None  # the script's process groups, as start() makes them
    run.guard = Guard(args, run.env)
    return run.env, check_batch(args, dp_size)


def rehearse(run, costs, dp_size, aim, multiple, roles, main):
    """Drive the rehearsal: the micro-batch as the dry run chooses it, then `main()` once per
    rank, then the report and the replay of every rank's posting order (the ranks not
    rehearsed: by the mesh's symmetry, where it holds). Exits: 0, or 1 when the replay finds a
    deadlock or a mismatch."""
    global REHEARSING
    args = run.args
    ranks = rehearsal_ranks(args.rehearse, args.world_size, roles)
    # one thread: no OpenMP team is ever started, so the forked workers (rehearse_ranks) never
    # wait on one that only the parent had (libgomp's teams do not survive fork)
    torch.set_num_threads(1)
    dtype = str(planned_dtype(args)).replace("torch.", "")
    if args.micro_batch_size == "auto":
        args.dry_run = True  # the choice a dry run makes, for the device it plans for
        run.choose_micro_batch(costs, dp_size, aim, multiple, roles)
        args.dry_run = False
    check_batch(args, dp_size)
    REHEARSING = state = Rehearsal(ranks, args.micro_batch_size, dtype, posts={}, results={}, interned={}, made={})
    record_posts(lambda entry: state.posts[state.rank].append(entry), state.interned)
    t0, c0 = time.perf_counter(), cpu_seconds()
    workers = rehearse_ranks(state, ranks, main)
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    lines = [f"rehearsal: {run.script} as rank(s) {spans(ranks)} of {args.world_size} ({args.ranks_per_node} per "
             f"node), {dtype}, micro-batch {args.micro_batch_size}: {REHEARSAL_STEPS} steps, an evaluation and the "
             f"checkpoint's pieces each, on the fake backend with fake tensors, in {elapsed:.1f} s ({cpu:.1f} s of CPU"
             + (f", {workers} processes" if workers > 1 else "") + ")",
             *(f"  stand-in: {s}" for s in STAND_INS)]
    if run.chose:
        lines.append(f"  {run.chose}")
    differ = []
    for rank in ranks:
        result = state.results[rank]
        text, problems = rehearsal_lines(rank, result)
        lines += text
        differ += problems
    lines.append("costs(): every rehearsed rank holds and sends what its formulas say" if not differ else
                 f"costs(): {len(differ)} difference(s): " + "; ".join(differ[:8]))
    if args.metrics:
        with open(args.metrics, "a") as f:
            for rank in ranks:
                f.write(json.dumps(finite_or_null(state.results[rank]["rows"][-1]), allow_nan=False) + "\n")
    status, posts, how, t1 = 0, state.posts, None, time.perf_counter()
    gc.disable()  # from here on millions of small objects and no cycles (see replay)
    if len(ranks) < args.world_size:  # the others' orders from their roles' (the symmetry section)
        posts, how = symmetric_posts(state.posts, state.made, args.world_size, roles)
    if os.environ.get("GPTPAR_REHEARSAL_POSTS"):  # every rank's posting order, as replayed (tests read it)
        with open(os.environ["GPTPAR_REHEARSAL_POSTS"], "w") as f:
            json.dump({"rehearsed": ranks, "posts": {rank: list(order) for rank, order in posts.items()}}, f)
    if posts is None:
        lines.append(f"replay: not done: {how} ({len(ranks)} of {args.world_size} ranks rehearsed; --rehearse all "
                     "replays every rank's own posting order under NCCL's rules)")
    else:
        if how:
            lines.append(f"symmetry: {how}")
        result = replay(posts)
        status = 0 if result.ok else 1
        if not result.ok:
            lines.append(result.report())
        lines.append(replay_verdict(result, posts))
    import resource
    resident = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    lines[0] += (f"; the symmetry and the replay {time.perf_counter() - t1:.1f} s; {resident // 1024:,} MiB resident "
                 "at most (the largest process)")
    print("\n".join(lines), flush=True)
    REHEARSING = None
    gc.enable()
    sys.exit(status)


def cpu_seconds():
    """CPU time of this process and of its workers that have ended."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def rehearse_one(state, rank, main):
    """`main()` as rank `rank`: its posts, the groups it made and its result land in `state`."""
    state.rank, state.posts[rank], state.made[rank] = rank, [], []
    with recording_every_group(state.made[rank]), rehearsal_tensors(), data_stand_in(), \
            redirect_stdout(io.StringIO()):
        main()


def rehearse_ranks(state, ranks, main):
    """Rehearse `ranks`: the first here (a layout the script refuses is refused once, here; and
    FakeTensorMode's cache of operations' outputs is warm after it), the others shared among
    forked workers, one per CPU this process may use (GPTPAR_REHEARSAL_WORKERS=K: K), each
    handing back its ranks' posts, groups and results in a file. Returns the processes used."""
    rehearse_one(state, ranks[0], main)
    rest = ranks[1:]
    workers = min(int(os.environ.get("GPTPAR_REHEARSAL_WORKERS") or len(os.sched_getaffinity(0))), len(rest))
    if workers <= 1:
        for rank in rest:
            rehearse_one(state, rank, main)
        return 1
    import pickle
    import traceback
    children = []
    for w in range(workers):
        share = rest[w::workers]
        fd, path = tempfile.mkstemp(prefix="gptpar-rehearsal-")
        os.close(fd)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # a worker: its ranks, then their records to `path`, then out without cleanup
            code = 0
            try:
                for rank in share:
                    rehearse_one(state, rank, main)
                with open(path, "wb") as f:
                    pickle.dump({key: {rank: getattr(state, key)[rank] for rank in share}
                                 for key in ("posts", "made", "results")}, f)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children.append((pid, path, share))
    status = 0
    for pid, path, share in children:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code == 0:
            with open(path, "rb") as f:
                records = pickle.load(f)
            for key, by_rank in records.items():
                getattr(state, key).update(by_rank)
        elif code < 0:
            print(f"error: the rehearsal's worker for rank(s) {spans(share)} was killed by signal {-code}",
                  file=sys.stderr, flush=True)
        if code:
            status = status or (code if code > 0 else 1)
        os.unlink(path)
    if status:
        sys.exit(status)  # (the worker said why)
    return workers


def rehearsal_lines(rank, result):
    """One rank's report: held, activation peak and bytes sent by operation, each next to
    costs(); the differences, as the ledger's check names them."""
    row, cost = result["rows"][-1], result["cost"]
    held, sent = row["state_bytes"], row["comm_bytes"]
    measured = {**{f"held {k}": v for k, v in held.items()}, "held activations": row["activation_bytes"],
                **{f"sent {op}": v for op, v in sent.items()}}
    theory = {**{f"held {k}": v for k, (_, v) in cost["held"].items()},
              **{f"sent {op}": v for op, (_, v) in cost["sent"].items()}}
    if "activations" in cost:
        theory["held activations"] = cost["activations"][1]
    problems = [f"rank {rank} {key} {measured.get(key, 0)} B, formula {theory.get(key, 0)} B"
                for key in sorted(set(measured) | set(theory)) if measured.get(key, 0) != theory.get(key, 0)]
    first, steady = result["rows"][0]["comm_bytes"], sent
    if first != steady:
        problems.append(f"rank {rank} sends differently in step 0 ({first}) and step 1 ({steady})")
    pieces, nbytes = result["pieces"]
    lines = [f"rank {rank}: {cost['layout'] if 'layout' in cost else ''}",
             "  holds " + ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items())
             + f"; activations (peak) {format_bytes(row['activation_bytes'])}"
             + (f" | costs() {format_bytes(theory['held activations'])}" if "held activations" in theory else ""),
             "  sends per step " + (", ".join(f"{op} {format_bytes(v)}" for op, v in sorted(sent.items())) or "nothing"),
             f"  checkpoint: {pieces} piece(s), {format_bytes(nbytes)} written by this rank",
             "  = costs()" if not problems else "  differs from costs(): " + "; ".join(p.split(" ", 2)[2]
                                                                               for p in problems)]
    return lines, problems


class RehearsedRun(Run):
    """The run protocol of a rehearsed rank (Run.start turns the script's Run into one):
    two steps, then an evaluation and the checkpoint's pieces; the ledger and the meter as in
    a real run; nothing written, nothing resumed, no metrics file of its own (the driver
    writes one row per rank)."""

    def begin(self, config, optimizer, costs, layout, pieces, evaluate, describe, held=None, extra_rng=None,
              after_resume=None):
        self.config, self.costs, self.optimizer, self.pieces = config, costs, optimizer, pieces
        self.cost = self.costs_of()
        self.held = held or (lambda: state_bytes([p for g in optimizer.param_groups for p in g["params"]], optimizer))
        self._evaluate, self.start_step = evaluate, 0
        LEDGER.take()  # the set-up's traffic is not a step's (it is in the posting order)
        return None

    def steps(self):
        for step in range(REHEARSAL_STEPS):
            self.step = LEDGER.step = step
            LEDGER.phase, self.stopping, self.t0 = "step", False, time.perf_counter()
            yield step
        self.evaluate(REHEARSAL_STEPS)
        LEDGER.phase = "checkpoint"
        pieces = [piece for piece in self.pieces() if piece.write]
        self.pieces_count = (len(pieces), sum(_nbytes(piece.tensor) for piece in pieces))
        LEDGER.take()

    def logged(self, step):
        """Whether `step` writes a metrics row: at --log_interval, and the last step."""
        return step % self.args.log_interval == 0 or step == self.args.max_iters - 1

    def evaluate(self, step):
        LEDGER.step, LEDGER.phase = step, "evaluation"
        losses = self._evaluate()
        LEDGER.take()
        return losses

    def end_step(self, loss, extra=None, **step_costs):
        comm = LEDGER.take()
        if step_costs:
            self.cost = self.costs_of(**step_costs)
        extra = extra() if callable(extra) else extra
        held, (state_theory, comm_theory) = self.held(), theory_bytes(self.cost)
        args, dt = self.args, time.perf_counter() - self.t0
        row = dict(step=self.step, loss=float(loss.item()), lr=self.optimizer.param_groups[0]["lr"], dt_ms=None,
                   tokens_per_s=None, mfu=None, mem_peak_bytes=None, mem_host_bytes=host_bytes(held),
                   state_bytes=held, comm_bytes=comm, state_bytes_theory=state_theory, comm_bytes_theory=comm_theory,
                   activation_bytes=self.meter.peak,
                   activation_bytes_theory=self.cost["activations"][1] if "activations" in self.cost else None,
                   micro_batch_size=args.micro_batch_size, **{f"dt_ms_{k}": None for k in
                                                              ("min", "max", "mean", "max_rank", "max_host")},
                   rank=self.env.rank, rehearsal_s=dt)
        self.rows.append({**row, **(extra or {})})

    def save(self, step):
        pass  # the checkpoint's pieces are listed after the steps; nothing is written

    def log(self, message):
        pass

    def finish(self):
        ignore_stop_signals()
        dist.destroy_process_group()
        REHEARSING.results[self.env.rank] = {"rows": self.rows, "cost": self.cost, "pieces": self.pieces_count}


@contextmanager
def data_stand_in():
    """common.Data, reading nothing but the vocabulary size: every batch is token 0."""
    init, batch, decode = Data.__init__, Data.batch, Data.decode

    def stand_in_init(self, spec, seed, block_size):
        self.seed, self.block_size, self.itos, self.splits = seed, block_size, None, None
        self.vocab_size = Data.vocab_size_of(spec)

    def stand_in_batch(self, split, step, global_batch_size, dp_rank=0, dp_size=1, eval_split=False):
        rows = torch.zeros(global_batch_size // dp_size, self.block_size, dtype=torch.long)
        return rows, rows.clone()
    Data.__init__, Data.batch, Data.decode = stand_in_init, stand_in_batch, lambda self, ids: ""
    try:
        yield
    finally:
        Data.__init__, Data.batch, Data.decode = init, batch, decode


SMALL_REAL = 1 << 20  # integer tensors made from no fake tensor stay real up to this many elements


def _rehearsal_mode_class():
    from torch._subclasses.fake_tensor import (_DISPATCH_META_HANDLERS as METADATA_QUERIES,
                                               DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                               FakeTensorMode, in_kernel_invocation_manager)
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._pytree import tree_leaves, tree_map_only
    aten = torch.ops.aten
    GROWING = {aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided, aten.repeat,
               aten.repeat_interleave, aten.expand_copy, aten.one_hot}  # outputs larger than their inputs

    def stays_real(t):
        """Small integer tensors and scalars: what a rehearsal keeps real (STAND_INS)."""
        return t.dim() == 0 if t.is_floating_point() or t.is_complex() else t.numel() <= SMALL_REAL

    memos = {f"_{name}{suffix}": None for name in ("nonzero_memo", "item_memo", "unique_memo",
                                                     "unique_consecutive_memo", "nested_int_memo")
             for suffix in ("", "_vc", "_epoch")}

    def new_fake(mode, elem, device):
        """FakeTensor(mode, elem, device) for a meta `elem` and a device already in torch's
        normal form (a fake tensor's, or a real CPU tensor's): what the constructor sets, without
        the checks and conversions of its general forms."""
        t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                        device_for_backend_keys=device)
        if mode._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        else:
            torch._C._set_throw_on_mutable_data_ptr(t)
        t.__dict__.update(memos, _fake_device=device, fake_mode=mode, constant=None, pytype=None, dispatch_keys=None,
                          real_tensor=None)
        return t

    class RehearsalTensors(FakeTensorMode):
        """FakeTensorMode with the rehearsal's stand-ins (see STAND_INS)."""

        # Every operation of a rehearsed rank passes here, ~1,000 a layer's step (forward,
        # backward): torch's per-mode wrapper that turns TorchDynamo off, and FakeTensorMode's own
        # entry (a counter, a check), are skipped: nothing is compiled in a rehearsal.
        _should_skip_dynamo = classmethod(lambda cls: False)

        def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
            """FakeTensorMode's cache key (an op's output metadata is a function of its inputs'),
            with a fake tensor's metadata as one tuple: torch's general form, which allows for
            symbolic sizes and sparse layouts, took 40% of a rehearsal."""
            if isinstance(args, (list, tuple, dict)):
                result += (type(args), len(args))
            if isinstance(args, dict):
                self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
                self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
                return
            for arg in args:
                if type(arg) is FakeTensor and arg.fake_mode is self and arg.constant is None \
                        and arg.layout == torch.strided:
                    result.append((arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                                   arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                                   arg.is_inference()))
                elif isinstance(arg, (list, tuple, dict)):
                    self._prep_args_for_hash(result, arg, state, id_hashed_objects)
                elif isinstance(arg, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                                      torch.memory_format)):
                    result += (type(arg), arg)
                else:  # tensors of other kinds, symbolic values, functions: torch's own rules
                    super()._prep_args_for_hash(result, [arg], state, id_hashed_objects)

        def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
            """FakeTensorMode's output for a cache hit, made directly where it is plain (sizes
            without symbols, strided, not in place): torch's general form, with its checks for
            symbolic sizes and its FakeTensor constructor's, took a third of a rehearsed op."""
            out = entry.metadata
            if out is None or entry.inplace_idx is not None or self.shape_env is not None \
                    or out.layout is not torch.strided or out.is_conj or out.is_neg:
                return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
            empty = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device="meta",
                                        requires_grad=out.requires_grad)
            if isinstance(func, torch._ops.OpOverload) and func.is_view:  # a view shares its input's storage
                empty.set_(args[entry.view_idx].untyped_storage(), out.storage_offset, out.shape, out.stride)
            return new_fake(self, empty, out.device)

        def faked_token_ids(self, func, inputs, args, kwargs):
            """An op of fake tensors and real integer ones (token ids, targets, positions): the
            real ones as fresh fakes of their shape, so that the op's output comes from the
            cache. FakeTensorMode would convert them itself, by its general converter, and not
            cache the op: ~1 ms each, once per micro-batch and layer. Not for an op that writes
            to its inputs, nor for a one-element tensor (torch keeps its value: a constant)."""
            reals = {id(t): t for t in inputs if type(t) is torch.Tensor and t.layout == torch.strided
                     and not (t.is_floating_point() or t.is_complex()) and t.numel() > 1}
            if not reals or getattr(getattr(func, "_schema", None), "is_mutable", True):
                return args, kwargs
            fakes = {i: new_fake(self, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
                                 t.device) for i, t in reals.items()}
            return tree_map_only(torch.Tensor, lambda t: fakes.get(id(t), t), (args, kwargs))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            query = METADATA_QUERIES.get(func)
            if query is not None:  # a fake tensor's device, size or stride: two in three calls, answered first
                return query(args)
            kwargs = kwargs or {}
            inputs = []  # an aten op's tensors: arguments, or in a list argument (Tensor[])
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    inputs.append(a)
                elif isinstance(a, (list, tuple)):
                    inputs += [t for t in a if isinstance(t, torch.Tensor)]
            fake = any(isinstance(t, FakeTensor) for t in inputs)
            if inputs and not fake and getattr(func, "overloadpacket", None) not in GROWING \
                    and all(map(stays_real, inputs)):
                # small real tensors only (a mesh's rank table, token ids, routing counts): run the
                # op for real first, skipping the fake conversion that costs ~1 ms an op (08's
                # describe() indexed its rank table 384 times for 7 s at 1,024 ranks)
                with no_dispatch():
                    out = func(*args, **kwargs)
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                if all(map(stays_real, outs)):
                    return out
                return tree_map_only(torch.Tensor, self.from_tensor, out)  # a real float result: fake on
            if fake and func.namespace == "c10d":
                # a collective or send/recv of fake tensors, on the fake process group (which moves
                # nothing): run on their meta tensors, as FakeTensorMode runs a tensor's metadata
                # queries; its general path for an operator it has no rule for took ~1 ms
                with in_kernel_invocation_manager(self):
                    return func(*args, **kwargs)
            if func is aten._local_scalar_dense.default and fake:  # a value read on the host
                t = args[0]
                return False if t.dtype == torch.bool else 0.0 if t.dtype.is_floating_point else 0
            if func is aten.bincount.default and fake:  # routing counts: balanced
                n, bins = args[0].numel(), max(kwargs.get("minlength", args[2] if len(args) > 2 else 0), 1)
                with no_dispatch():
                    return torch.tensor([n // bins + (e < n % bins) for e in range(bins)], dtype=torch.long)
            if fake and not all(isinstance(t, FakeTensor) for t in inputs):
                args, kwargs = self.faked_token_ids(func, inputs, args, kwargs)
            try:
                out = self.dispatch(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException):
                if fake:
                    raise
                with no_dispatch():  # a real tensor's value or shape: read it for real
                    return func(*args, **kwargs)
            if not fake:  # made from real tensors only: small integer results and scalars stay real
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                if outs and all(map(stays_real, outs)):
                    with no_dispatch():
                        return func(*args, **kwargs)
            return out
    return RehearsalTensors


@contextmanager
def rehearsal_tensors():
    """Fake tensors for everything made inside (shapes and dtypes, no storage), with the
    stand-ins; real tensors met inside are taken as fakes (allow_non_fake_inputs)."""
    to, to_empty = nn.Module.to, nn.Module.to_empty

    # Module.to() and to_empty() swap every fake parameter for its copy (swap_tensors), which a
    # tied weight refuses. To the device it is on, .to() is a no-op for real parameters: so
    # here too; to_empty() gives each parameter (each tied one once) an empty one.
    @wraps(to)
    def same_device_to(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and all(device is None or t.device == device
                                 for t in [*module.parameters(), *module.buffers()]):
            return module
        return to(module, *args, **kwargs)

    @wraps(to_empty)
    def fake_to_empty(module, *, device, recurse=True):
        new = {}
        for m in module.modules() if recurse else [module]:
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is not None:
                        if id(t) not in new:
                            empty = torch.empty_like(t, device=device)
                            new[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                        table[name] = new[id(t)]
        return module
    nn.Module.to, nn.Module.to_empty = same_device_to, fake_to_empty
    try:
        with _rehearsal_mode_class()(allow_non_fake_inputs=True):
            yield
    finally:
        nn.Module.to, nn.Module.to_empty = to, to_empty


def _symmetric(op, bound, group_size):
    """A collective over real integer tensors on the fake backend (which moves nothing), as
    if every rank of the group held what this one holds (the rehearsal's stand-in)."""
    if op == "all_to_all_single" and bound.get("output_split_sizes") is None:
        out, inp = bound["output"], bound["input"]
        me = dist.get_rank(bound.get("group"))
        chunk = inp.view(group_size, -1)[me]
        out.view(group_size, -1).copy_(chunk.expand(group_size, -1))
    elif op == "all_reduce" and bound.get("op", dist.ReduceOp.SUM) == dist.ReduceOp.SUM:
        bound["tensor"].mul_(group_size)


RECORDED = {"installed": False, "write": None}


def pair_bytes(op, bound, group_size):
    """An all-to-all's bytes to and from each member of its group, in group order."""
    if op == "all_to_all":
        return ([t.numel() * t.element_size() for t in bound["input_tensor_list"]],
                [t.numel() * t.element_size() for t in bound["output_tensor_list"]])

    def split(tensor, sizes):
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() else tensor.element_size()
        if sizes is None:
            return [tensor.numel() * tensor.element_size() // group_size] * group_size
        return [int(n) * row for n in sizes]
    return split(bound["input"], bound.get("input_split_sizes")), split(bound["output"], bound.get("output_split_sizes"))


def record_posts(write, interned=None):
    """Wrap torch.distributed so that every operation this process posts is handed to
    `write` as one replay entry, in posting order: a batch_isend_irecv as {"kind": "batch",
    "group", "ops": [{"op": "send" | "recv", "peer" (global rank), "bytes", "tag"}]}; a lone
    isend / irecv / send / recv as {"kind": "send" | "recv", "group", "peer", "bytes", "tag"};
    a collective as {"kind": "all_reduce", ..., "group", "ranks", "bytes"}. "group" is the
    communicator (torch's group_name: two groups of the same ranks are two communicators);
    "desc" its name in the ledger, "where" the step and phase. Install before the ledger
    (CommLedger.install), once per process; a later call changes only `write`."""
    RECORDED["write"] = write
    if RECORDED["installed"]:
        return
    RECORDED["installed"] = True
    interned = {} if interned is None else interned

    def emit(entry, group):
        entry["desc"] = LEDGER.group_name(group) or "world"
        phase = LEDGER.phase
        if phase == "step":  # inside autograd's backward, or the forward (as CommLedger.position says)
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        entry["where"] = sys.intern(f"step {LEDGER.step}, {phase}")  # one string per step and phase, shared
        RECORDED["write"](entry)

    def group_of(group):
        group = group if group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        return group.group_name, interned.setdefault(ranks, ranks)

    def nbytes(value):
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
            return sum(nbytes(v) for v in value)
        return None  # Python objects (all_gather_object, ...): their pickles' size is not known here

    def collective(name, fn):
        signature = inspect.signature(fn)

        @wraps(fn)
        def recorded(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            group = bound.get("group")
            if group == dist.GroupMember.NON_GROUP_MEMBER:  # not a member: torch posts nothing
                return fn(*args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()), None)
            name_, ranks = group_of(group)
            entry = {"kind": name, "group": name_, "ranks": ranks, "bytes": nbytes(first)}
            if name in ("all_to_all", "all_to_all_single"):  # the sizes may differ per pair (10, 04's Muon)
                entry["sent"], entry["received"] = pair_bytes(name, bound, len(ranks))
            emit(entry, group)
            result = fn(*args, **kwargs)
            if REHEARSING is not None:
                tensors = [t for v in bound.values() for t in (v if isinstance(v, (list, tuple)) else [v])
                           if torch.is_tensor(t)]
                if tensors and not any(t.is_floating_point() or type(t) is not torch.Tensor for t in tensors):
                    _symmetric(name, bound, len(ranks))
            return result
        return recorded

    def point_to_point(name, fn):
        @wraps(fn)
        def recorded(tensor, peer=None, group=None, tag=0, **kwargs):
            emit({"kind": "send" if name in ("send", "isend") else "recv", "group": group_of(group)[0],
                  "peer": peer, "bytes": nbytes(tensor), "tag": tag}, group)
            return fn(tensor, peer, group, tag, **kwargs)
        return recorded

    for name in RECORDED_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, collective(name, getattr(dist, name)))
    for name in ("send", "recv", "isend", "irecv"):
        setattr(dist, name, point_to_point(name, getattr(dist, name)))

    class P2POp(dist.P2POp):
        """torch's P2POp accepts only its own isend/irecv: hand it the unwrapped ones."""

        @staticmethod
        def _unwrap(op):
            while hasattr(op, "__wrapped__"):
                op = op.__wrapped__
            return op

        def __new__(cls, op, *args, **kwargs):
            return super().__new__(cls, cls._unwrap(op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(self._unwrap(op), *args, **kwargs)
    dist.P2POp = P2POp
    original = dist.batch_isend_irecv

    @wraps(original)
    def batch_isend_irecv(p2p_ops):
        emit({"kind": "batch", "group": group_of(p2p_ops[0].group)[0] if p2p_ops else None,
              "ops": [{"op": "send" if p.op.__name__ == "isend" else "recv", "peer": p.peer,
                       "bytes": nbytes(p.tensor), "tag": p.tag} for p in p2p_ops]},
             p2p_ops[0].group if p2p_ops else None)
        return original(p2p_ops)
    dist.batch_isend_irecv = batch_isend_irecv


RECORDED_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                        "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
                        "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


# ----------------------------------------------------------------------------------------
# The symmetry: every rank's posting order from its role's
# ----------------------------------------------------------------------------------------

# A `roles` rehearsal executes one rank per role; the replay needs every rank's posting order.
# The others come from the mesh, the way a reader sees them: in 08 at dp 8 x pp 16 x tp 8,
# rank 517 (dp 4, pp 0, tp 5) is rank 0 moved 4 replicas over and 5 places along its TP group:
#
#   the groups every rank made, in order     families (runs of disjoint groups, one desc):
#   tp {0..7} {8..15} ...  dp {0,128,..}       tp, model, dp, pp, embedding, guard, world
#   ...                                        a family's rotation: each member of each of its
#                                              groups moves k places along its own group
#
# A rotation is a symmetry of the mesh when it maps every group onto a group of the same desc
# (tp by 1: yes; dp by 1 with cp 2: no, a CP ring breaks; pp by 1: no, the embedding group
# breaks), and it is taken only if it leaves apart the ranks the script says differ (Run.start's
# `ranks`: the pipeline stages; 07's stages share the world group, and its rotation would merge
# them). Rotations found: each rank's order is its rehearsed role-mate's with every rank id and
# group mapped through them (the same position in another replica posts the same sequence on
# its own replica's groups). Where two rehearsed ranks share a role (`roles` rehearses the last
# rank, which is its stage's first rank moved), one is mapped and compared with the other: an
# order that is not symmetric (04's Muon owners, whose all-to-all sizes differ per rank) shows
# there, and then the replay is not done; nor where a role has no rehearsed rank.


@contextmanager
def recording_every_group(made):
    """Inside, every dist.new_group call appends (name, sorted ranks, desc) to `made`, whether
    or not this rank is a member (torch names a group by a counter every rank advances)."""
    new_group, c10d = dist.new_group, dist.distributed_c10d

    @wraps(new_group)
    def recorded(ranks=None, *args, **kwargs):
        before = c10d._world.group_count
        group = new_group(ranks, *args, **kwargs)
        members = tuple(sorted(ranks)) if ranks is not None else tuple(range(dist.get_world_size()))
        name = group.group_name if isinstance(group, dist.ProcessGroup) else \
            str(before) if c10d._world.group_count == before + 1 else None
        made.append((name, members, kwargs.get("group_desc")))
        return group
    dist.new_group = recorded
    try:
        yield made
    finally:
        dist.new_group = new_group


def mesh_rotations(made, world_size, roles):
    """The rotations of the mesh the groups in `made` describe that keep `roles` apart: a list of
    (permutation of the ranks, {group name: its image's name}, "family by k")."""
    families, current = [], []
    for group in made:
        if current and (group[2] != current[-1][2] or any(set(group[1]) & set(g[1]) for g in current)):
            families.append(current)
            current = []
        current.append(group)
    families.append(current)
    families.sort(key=lambda family: len(family[0][1]) == world_size)  # named axes first, the world's last
    index = {}
    for name, ranks, desc in made:
        index.setdefault((desc, frozenset(ranks)), []).append(name)
    ordinal = {name: names.index(name) for names in index.values() for name in names}
    parent = list(range(world_size))

    def root(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r
    found = []
    for family in families:
        size = len(family[0][1])
        if size < 2 or any(len(g[1]) != size for g in family):
            continue
        for k in (d for d in range(1, size) if size % d == 0):
            perm = list(range(world_size))
            for _, ranks, _ in family:
                for i, r in enumerate(ranks):
                    perm[r] = ranks[(i + k) % size]
            names = {}
            for name, ranks, desc in made:
                image = index.get((desc, frozenset(perm[r] for r in ranks)))
                if image is None or len(image) <= ordinal[name]:
                    break
                names[name] = image[ordinal[name]]
            else:
                merged = parent[:]
                for r in range(world_size):
                    a, b = root(r), root(perm[r])
                    parent[a] = b
                if len({root(r) for r in roles}) < len(set(roles)):
                    parent = merged  # it would make two of the script's roles one
                    continue
                if all(perm != other for other, _, _ in found):  # (the world's by dp·... is dp's)
                    found.append((perm, names, f"{family[0][2] or f'groups of {size}'} by {k}"))
                break  # the rotations by multiples of k are its powers
    return found


def moved_entry(entry, perm, names, members):
    """One posted operation moved by a mesh rotation: every peer and every group mapped."""
    e = dict(entry)
    if entry.get("group") is not None:
        e["group"] = names[entry["group"]]
    if "ranks" in entry:
        e["ranks"] = members[e["group"]]
    if "sent" in entry:  # per member, in group order: each to its image's place
        places = [e["ranks"].index(perm[m]) for m in entry["ranks"]]
        for key in ("sent", "received"):
            e[key] = [None] * len(places)
            for i, j in enumerate(places):
                e[key][j] = entry[key][i]
    if "peer" in entry:
        e["peer"] = perm[entry["peer"]]
    if "ops" in entry:
        e["ops"] = [dict(op, peer=perm[op["peer"]]) for op in entry["ops"]]
    return e


class MovedOrder(collections.abc.Sequence):
    """A rehearsed rank's posting order moved by a mesh rotation (or by several, composed into
    one), made as it is read: 959 ranks' orders of 4,216 operations each (GPT-3 175B, pp 64 x
    cp 4 x tp 4) were 6 GiB as dicts; as views they are a permutation of the ranks and a map
    of the few groups the order posts on.

        order[i] = moved_entry(source[i], perm, names, members)"""

    __slots__ = ("source", "perm", "names", "members")

    def __init__(self, source, perm, names, members):
        if isinstance(source, MovedOrder):  # a moved order moved again: one rotation, composed
            self.source, self.perm = source.source, [perm[r] for r in source.perm]
            self.names = {g: names[h] for g, h in source.names.items()}
        else:
            used = {e["group"] for e in source if e.get("group") is not None}
            self.source, self.perm, self.names = source, perm, {g: names[g] for g in used}
        self.members = members

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [moved_entry(e, self.perm, self.names, self.members) for e in self.source[i]]
        return moved_entry(self.source[i], self.perm, self.names, self.members)

    def __iter__(self):
        perm, names, members = self.perm, self.names, self.members
        return (moved_entry(e, perm, names, members) for e in self.source)


REPLAYED = ("kind", "group", "ranks", "bytes", "peer", "tag", "ops", "sent", "received")


def symmetric_posts(posts, made, world_size, roles):
    """Every rank's posting order from the rehearsed ones (`posts`, rank -> entries) through
    the mesh's rotations (`made`: rank -> the groups it made, the world first). Returns (every
    rank's posts, the line saying how), or (None, why not)."""
    groups = made[min(made)]
    if any(made[r] != groups for r in made):
        return None, "the rehearsed ranks made different process groups"
    if any(name is None for name, _, _ in groups):
        return None, "a process group has a hashed name (use_local_synchronization)"
    rotations = mesh_rotations(groups, world_size, roles)
    members = {name: ranks for name, ranks, _ in groups}
    full, queue, checked = dict(posts), collections.deque(sorted(posts)), {}
    origin = {rank: rank for rank in posts}  # the rehearsed rank each order was moved from
    while queue:
        rank = queue.popleft()
        for perm, names, _ in rotations:
            other = perm[rank]
            if other in full and (other not in posts or other in checked or origin[rank] == other
                                  or checked.get(origin[rank]) == other):  # (each pair compared once)
                continue
            moved = MovedOrder(full[rank], perm, names, members)
            if other not in full:
                full[other], origin[other] = moved, origin[rank]
                queue.append(other)
                continue
            checked[other] = origin[rank]  # a rehearsed rank reached from its role-mate: the symmetry checked
            mine, theirs = ([tuple(e.get(k) for k in REPLAYED) for e in order] for order in (posts[other], moved))
            if mine != theirs:
                at = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
                return None, (f"rank {other}'s rehearsed posting order is not rank {rank}'s moved through the mesh "
                              f"(they differ at operation {at}): the ranks of a role do not post alike")
    missing = [r for r in range(world_size) if r not in full]
    if missing:
        return None, f"rank(s) {spans(missing)} have no rehearsed rank of their role"
    how = ", ".join(desc for _, _, desc in rotations) or "none needed"
    return full, (f"replayed {world_size:,} ranks: {len(posts):,} rehearsed, {world_size - len(posts):,} by symmetry "
                  f"(the mesh's rotations: {how}" + "".join(f"; rank {r} rehearsed and also moved from rank {o}: "
                                                             "the same order" for r, o in sorted(checked.items())) + ")")


# ----------------------------------------------------------------------------------------
# The replay: would these posting orders complete under NCCL's semantics?
# ----------------------------------------------------------------------------------------

# The posting orders are what record_posts() writes: a rehearsal's (every rank's, in this
# process) or a real CPU run's (tests/nccl_replay.py records each rank to a file). gloo, which
# the CPU runs use, buffers a send whatever the receiver is doing, so an order that hangs on
# GPUs passes every CPU run.
#
# The model (NCCL's point-to-point and collective semantics, taken strictly):
#
#  1. A rank's operations complete in the order it posts them. NCCL runs every operation of a
#     communicator on one CUDA stream, in posting order; and in these scripts each operation
#     waits for the one before it through the compute stream (a received input is computed
#     on before the next send is posted), so one queue per rank is the model: a rank works
#     on the first of its operations that has not completed (its head), and on nothing later.
#  2. A batch_isend_irecv is one NCCL group (ncclGroupStart/End): its sends and receives are
#     posted together, progress independently, and the batch completes when all of them have;
#     only then does the rank move on. A lone send or receive is a batch of one.
#  3. A send completes only when its matching receive is posted, and vice versa
#     (rendezvous: NCCL does not buffer a send for a receiver that has not posted). Posted
#     means: in the head batch of its rank.
#  4. Matching is FIFO per (communicator, sender, receiver): the k-th send from a to b is
#     received by b's k-th receive from a. NCCL ignores tags, so a pair whose tags or sizes
#     differ is a mismatch (the wrong tensor would arrive), reported as an error.
#  5. A collective completes when every member of its communicator has it at its head; the
#     k-th collective of a communicator must be the same operation (and size) on every member;
#     an all-to-all's sizes may differ per pair (10's routing, 04's Muon owners): there, what
#     member i sends member j must be what j receives from i.
#
# Deadlock: no rule can move any rank and some rank has operations left. The report lists,
# for every blocked rank, its head operation and, for each of its unmatched sends and
# receives, where the counterpart is (a later operation of the peer, or never posted).


@dataclass
class Replay:
    ok: bool
    blocked: dict = dataclasses.field(default_factory=dict)  # rank -> what it waits on (lines)
    mismatches: list = dataclasses.field(default_factory=list)  # matched pairs whose tag or size differ
    completed: dict = dataclasses.field(default_factory=dict)  # rank -> operations completed
    operations: int = None  # when ok: how many operations were replayed, and on which groups (their descs)
    groups: set = None

    def report(self):
        if self.ok:
            return "no deadlock: every rank completed every operation"
        lines = [f"mismatch: {m}" for m in self.mismatches]
        if self.blocked:
            lines.append("DEADLOCK under NCCL's semantics; blocked ranks:")
            for rank, waits in sorted(self.blocked.items()):
                lines.append(f"  rank {rank} (after {self.completed[rank]} completed operations):")
                lines += [f"    {w}" for w in waits]
        return "\n".join(lines)


def _describe(entry):
    def op(o, kind):
        return f"{kind} {'to' if kind == 'send' else 'from'} {o['peer']} tag {o['tag']}"
    if entry["kind"] == "batch":
        return "batch_isend_irecv[" + ", ".join(op(o, o["op"]) for o in entry["ops"]) + "]"
    if entry["kind"] in ("send", "recv"):
        return op(entry, entry["kind"])
    return f"{entry['kind']} on group {entry['group']} {entry.get('ranks')}"


def replay(posts):
    """posts: {rank: [entry, ...]} in posting order (the recorded JSON lines, or orders
    computed the same way). Returns a Replay: ok, or the deadlock / mismatches found."""
    # Millions of small tuples for a 1,024-rank mesh: the cycle collector, run as they are
    # made, would walk every one of them (and every posted entry) many times over (half of
    # the time at 512 ranks); nothing here makes a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _replay(posts)
    finally:
        if collecting:
            gc.enable()


def _records(rank, entries):
    """A rank's posting order as the replay's records, made as the replay reaches them: (True,
    entry, [(message, side), ...], None) for a batch (a lone send or receive is a batch of one),
    a message being (communicator, sender, receiver, k) for the k-th on that channel (rule 4),
    side 0 its send and 1 its receive; (False, entry, None, n) for the n-th collective of its
    communicator on this rank. Each channel has this rank at one end, so counting its messages
    needs this rank's order alone."""
    count, seq = {}, {}
    for entry in entries:
        kind = entry["kind"]
        if kind == "batch" or kind == "send" or kind == "recv":
            group, keyed = entry.get("group"), []
            for op in entry["ops"] if kind == "batch" else (entry,):
                side = 1 if (op["op"] if kind == "batch" else kind) == "recv" else 0
                channel = (group, op["peer"], rank, side) if side else (group, rank, op["peer"], side)
                k = count.get(channel, 0)
                count[channel] = k + 1
                keyed.append((channel[:3] + (k,), side, op))
            yield True, entry, keyed, None
        else:
            n = seq.get(entry["group"], 0)
            seq[entry["group"]] = n + 1
            yield False, entry, None, n


def _replay(posts):
    # The ranks' orders are read as the replay goes, each rank's head (the first operation it
    # has not completed) its only record held (rule 1): a 1,024-rank rehearsal's 4 million
    # operations are never all in memory at once, nor are the orders of the ranks filled in by
    # symmetry (symmetric_posts: they are made as they are read). A send or a receive of the
    # head is matched when its counterpart is the head of its peer's (rule 3).
    orders = {rank: _records(rank, entries) for rank, entries in posts.items()}
    heads, pos = {}, {}
    operations, groups = 0, set()

    def advance(rank):
        nonlocal operations
        head = heads[rank] = next(orders[rank], None)
        if head is not None:
            operations += 1
            entry = head[1]
            groups.add(entry["desc"] if "desc" in entry else entry["group"])
    for rank in orders:
        pos[rank] = 0
        advance(rank)

    def counterpart(key, side):
        """The head record of the peer holding `key`'s other end, or None."""
        peer = key[2] if side == 0 else key[1]
        head = heads.get(peer)
        if head is None or not head[0]:
            return None
        for other, other_side, op in head[2]:
            if other == key and other_side != side:
                return peer, op
        return None

    # A worklist, not passes over every rank: a rank is looked at again only when its head
    # changed or a send/receive of its head was matched, the only events that can let it move
    # (a match from either side is found by whichever of the two ranks reaches it last).
    done, mismatches = {}, []  # done: message -> its ends still at their ranks' heads (both posted together)
    arrived, counted = {}, {}  # (group, n) -> how many members have it at their head; rank -> its counted head
    ready, queued = collections.deque(orders), set(orders)

    def wake(rank):
        if rank not in queued:
            queued.add(rank)
            ready.append(rank)

    def step(rank):
        """Complete rank's head; a message both of whose ends have moved on is forgotten."""
        for key, _, _ in heads[rank][2] or ():
            done[key] -= 1
            if not done[key]:
                del done[key]
        pos[rank] += 1
        advance(rank)
        wake(rank)
    while ready:
        rank = ready.popleft()
        queued.discard(rank)
        head = heads[rank]
        if head is None:
            continue
        p2p, entry, keyed, n = head
        if p2p:
            complete = True
            for key, side, mine in keyed:
                if key in done:
                    continue
                found = counterpart(key, side)
                if found is None:
                    complete = False
                    continue  # the counterpart is not posted (yet): its rank finds this one when it is
                peer, theirs = found
                done[key] = 2
                wake(peer)  # its batch may be complete now
                if mine.get("tag") != theirs.get("tag") or mine.get("bytes") != theirs.get("bytes"):
                    send, recv = (theirs, mine) if side else (mine, theirs)
                    mismatches.append(f"channel {key[1]}->{key[2]} message {key[3]}: sent tag "
                                      f"{send.get('tag')} ({send.get('bytes')} bytes), received as tag "
                                      f"{recv.get('tag')} ({recv.get('bytes')} bytes)")
            if complete:
                step(rank)
        else:
            members, group = entry["ranks"], entry["group"]
            if counted.get(rank) != pos[rank]:
                counted[rank] = pos[rank]
                arrived[(group, n)] = arrived.get((group, n), 0) + 1
            if arrived[(group, n)] < len(members):
                continue  # the last member to reach it completes it
            member_heads = []
            for member in members:
                head = heads.get(member)
                if head is None or head[0] or head[1]["group"] != group or head[3] != n:
                    break
                member_heads.append(head[1])
            else:
                if any(h["kind"] != entry["kind"] or "sent" not in h and h.get("bytes") != entry.get("bytes")
                       or "sent" in h and any(h["sent"][j] != member_heads[j]["received"][i]
                                              for j in range(len(member_heads)))
                       for i, h in enumerate(member_heads)):  # an all-to-all: what i sends j, j receives from i
                    mismatches.append(f"collective {n} of group {group}: "
                                      + ", ".join(f"rank {m} {h['kind']} ({h.get('bytes')} bytes)"
                                                  for m, h in zip(members, member_heads)))
                del arrived[(group, n)]
                for member in members:
                    step(member)
    return _blocked(posts, orders, heads, pos, done, mismatches, operations, groups)


def _blocked(posts, orders, heads, pos, done, mismatches, operations, groups):
    """The Replay: for every rank with operations left, its head and, for each unmatched send
    or receive, where its counterpart is (the peer's operations left are read for it)."""
    rest = {}

    def left(rank):  # rank's records from its head on
        if rank not in rest:
            rest[rank] = [heads[rank], *orders[rank]] if heads.get(rank) is not None else []
        return rest[rank]

    def head(rank):
        return _describe(heads[rank][1]) if heads.get(rank) is not None else "done"

    blocked = {}
    for rank in orders:
        if heads[rank] is None:
            continue
        p2p, entry, keyed, _ = heads[rank]
        waits = [f"head: {_describe(entry)}"]
        for key, side, _ in keyed or ():
            if key in done:
                continue
            peer = key[2] if side == 0 else key[1]
            at = next((i for i, record in enumerate(left(peer) if peer in orders else ()) if record[0]
                       and any(k == key and s != side for k, s, _ in record[2])), None)
            (src, dst), k = key[1:3], key[3]
            what = (f"{'recv' if side else 'send'} {'from ' + str(src) if side else 'to ' + str(dst)} "
                    f"(message {k} of {src}->{dst})")
            other = "send" if side else "recv"
            if at is None:
                waits.append(f"{what}: its {other} is never posted")
            else:
                waits.append(f"{what}: its {other} is rank {peer}'s operation {pos[peer] + at}, which waits "
                             f"behind {at} operation(s) of its own: {head(peer)}")
        if not p2p:
            waits.append("members' heads: " + "; ".join(f"rank {m}: {head(m)}" for m in entry["ranks"]))
        blocked[rank] = waits
    ok = not blocked and not mismatches
    return Replay(ok=ok, blocked=blocked, mismatches=mismatches, completed=dict(pos),
                  operations=operations if ok else None, groups=groups if ok else None)


def replay_verdict(result, posts):
    """The replay in one line: no deadlock and every collective matched on every group, or
    the first rank (lowest) that would block, its group and operation, or the first mismatch."""
    if result.ok:
        groups, n = result.groups, result.operations
        if groups is None:  # (a Replay made by hand)
            groups = {e["desc"] if "desc" in e else e["group"] for entries in posts.values() for e in entries}
            n = sum(len(entries) for entries in posts.values())
        return (f"replay under NCCL's rules: no deadlock; every collective and send/recv matched on every group "
                f"({n} operations of {len(posts)} ranks on {len(groups)} group(s): {', '.join(sorted(map(str, groups)))})")
    if result.blocked:
        rank = min(result.blocked)
        entry = posts[rank][result.completed[rank]]
        op = _describe(entry) if entry["kind"] in ("batch", "send", "recv") else \
            f"{entry['kind']} of {entry.get('bytes')} bytes over ranks {spans(list(entry['ranks']))}"
        return (f"replay under NCCL's rules: DEADLOCK: rank {rank} blocks first, at its operation "
                f"{result.completed[rank]}: {op} on group {entry.get('desc', entry['group'])} "
                f"({entry.get('where', 'where unknown')}); {len(result.blocked)} rank(s) blocked")
    return f"replay under NCCL's rules: mismatch: {result.mismatches[0]}"
