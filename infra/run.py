"""The run protocol: Run extends common.Run at the same calls with the infrastructure (the flags,
the start-up checks and the out_dir lock, the fit check and --micro_batch_size auto, the guard,
the ledger and the activation meter, metrics, checkpoints, the dry run, the rehearsal), composing
the modules below it; RehearsedRun is the run of a rehearsed rank."""

import inspect
import os
import sys
import time

import torch
import torch.distributed as dist

import common
from common import (Data, Launch, check_batch, count_params, detect_launcher, log, micro_batch_sizes, model_config,
                    synchronize, teardown)
from infra.launch import setup
from infra.cli import parse_args
from infra.formulas import flops_per_token, format_bytes
from infra.ledger import LEDGER, _nbytes, print_ledger, state_bytes, theory_bytes, theory_calls
from infra.activations import ActivationMeter, reset_peak_memory
from infra.profiling import Profiler
from infra.fit import (GPU_USABLE, after_step_problem, allowance_text, fit_base, fit_fixes, fit_need, fit_problem,
                       memory_mark, memory_room, memory_taken, planned_room, rank_need, recording_groups, warm_groups)
from infra.start import agree, agree_on_startup, ignore_stop_signals, release_out_dir
from infra.metrics import Metrics, WRITE_FAILURES, host_bytes, log_node_map
from infra.stop import Guard, HostSyncs, with_guard
from infra.checkpoint import export_agreed, resume_checkpoint, run_config, save_checkpoint
from infra.numerics import GradientOracle
from infra.dry_run import dry_run, planned_device_type, planned_dtype
from infra import rehearsal
from infra.rehearsal import REHEARSAL_STEPS, rehearsal_start


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
        """The processes started (infra.launch.setup) with the ledger installed, the run's files
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
            started = rehearsal_start(self, costs, dp_size, aim, multiple, ranks, sys._getframe(1), groups)
            self.__class__ = RehearsedRun  # this rank's run, from here on: a rehearsed one
            return started
        if not args.dry_run:
            self.env = setup(args, self.launch)
            LEDGER.install(self.env.device)
            self.profiler = Profiler(args.profile, args.out_dir, self.env) if args.profile else None
            if os.environ.get("GPTPAR_COUNT_SYNCS") == "1":
                self.syncs = HostSyncs(self.env.device)
            log_node_map(self.env)
            agree_on_startup(args, self.env)
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
            self.room = memory_room(self.env) if self.room is None else self.room
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

    room = None  # the memory the micro-batch was chosen for, or the fit check read (None: unknown)
    step_costs = None  # the step's own inputs run.cost was last evaluated for (end_step)
    profiler = None  # --profile's Profiler
    groups, groups_up, before_step, oracle = None, 0, None, None  # the script's groups; how many this rank is in; memory_mark()

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
        return with_guard(cost, env.world_size)  # the protocol's own traffic: the guard's flags (Guard)

    def keep(self, config, optimizer, costs, pieces, evaluate, held):
        """What begin() keeps of the script's strategy, in a real run and in a rehearsed one."""
        self.config, self.costs, self.optimizer, self.pieces = config, costs, optimizer, pieces
        self._evaluate = evaluate
        self.cost = self.costs_of()
        # what the optimizer updates, unless the script counts its own (host copies, flat shards)
        self.held = held or (lambda: state_bytes([p for g in optimizer.param_groups for p in g["params"]], optimizer))

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
        self.keep(config, optimizer, costs, pieces, evaluate, held)
        if self.syncs:
            self.syncs.exempt(optimizer)
        self.extra_rng = extra_rng
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
                if args.export or args.export_hf:
                    export_agreed(args, env, self.start_step)
        self.oracle = GradientOracle(args, env, self.script, self.run_config, pieces()) \
            if args.check_gradients else None  # --check_gradients: REF read (or 01's measures) now
        self.log_model(config, describe)
        self.metrics = Metrics(args, env, flops_per_token(config, count_params(config)[1]), self.cost,
                               config={"script": self.script, "preset": args.model, **self.run_config})
        setup_traffic = LEDGER.take()  # the set-up's traffic (weights broadcast, groups made) is not a step's
        if setup_traffic:
            log(env, f"set-up traffic (not a step's): {setup_traffic}")
        return extra

    def steps(self):
        """The plain one's steps (from the resumed one to --max_iters, evaluations at --eval_interval
        and after the last step), each opening the ledger's window and restarting the clock."""
        for step in super().steps():
            LEDGER.step, LEDGER.phase = step, "step"
            # the meter's hooks cost ~1.6% of a step's CPU: they run on the steps whose figures
            # are read (the ledger's first, the logged ones), not on the others
            self.meter.measured = step == self.start_step or self.logged(step)
            reset_peak_memory(self.env)  # mem_peak_bytes: this step's, not since the start
            self.stopping, self.t0 = False, time.perf_counter()
            if self.syncs:
                self.syncs.start()
            if self.profiler:  # --profile: its window opens at its first step
                self.profiler.begin_step(step)
            yield step

    def logged(self, step):
        """Whether `step` writes a metrics row: at --log_interval, and the last step."""
        return step % self.args.log_interval == 0 or step == self.args.max_iters - 1

    def evaluate(self, step):
        LEDGER.step, LEDGER.phase = step, "evaluation"
        losses = super().evaluate(step)  # the plain one's evaluation and line
        self.metrics.write({"step": step, "val_loss": losses["val"], "train_loss": losses["train"]})
        LEDGER.take()  # evaluation traffic is not a training step's
        return losses

    def check(self, loss, grads, norm=None):
        """Right before the optimizer step, with this rank's loss and gradient tensors (and the
        global gradient norm where clipping took it: then read instead of the gradients): a
        non-finite value ends the run here, before the update, on every rank; a stop asked of
        any rank (a signal, --time_limit) ends it after the next step's checkpoint (Guard)."""
        LEDGER.phase = "optimizer"  # the guard's flags, the update and what follows it
        if self.oracle:  # --check_gradients: the gradient against 01's, then exit (infra.numerics)
            self.oracle.verdict(self.args, self.config, self.run_config["layout"], self.pieces())
        self.stopping = self.guard.check(self.step, loss, grads, norm)
        self.grad_norm = norm  # the global gradient norm clipping took (logged: the oracle compares it with 01's)

    def end_step(self, loss, extra=None, **step_costs):
        """After the optimizer step, with the global batch's mean loss (a tensor, read only
        when logged): the ledger (printed once, next to the formulas), the metrics row at
        --log_interval (`extra`: the script's own keys, a dict or a function making one), the
        checkpoint at --ckpt_interval, and the stop when one was agreed. `step_costs`: what
        this step's costs() depend on besides the layout (10's routing)."""
        args, env, step = self.args, self.env, self.step
        if self.profiler:  # the step's range ends with its optimizer step; after the last, the traces
            self.profiler.end_step(step)
        comm, calls = LEDGER.take(calls=True)
        syncs = self.syncs.stop() if self.syncs else None  # the step's own, before the logging's
        logged = self.logged(step)
        # costs() that depend on the step (10's routing) are evaluated only where they are read
        # (the ledger's first step, a logged step), and only when the step's inputs changed
        if step_costs and (step == self.start_step or logged) and step_costs != self.step_costs:
            self.cost, self.step_costs = self.costs_of(**step_costs), step_costs
            self.metrics.theory(self.cost)
        live = self.meter.live_peaks(env)  # every live tensor's bytes at their most, by phase (or None)
        if step == self.start_step:
            print_ledger(env, self.held(), comm, self.cost, self.meter.peak, calls)
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
                              self.held(), comm, extra, activations=self.meter.peak, live=live, calls=calls)
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
        activations saved for backward. A rank that took more than the room its fit check read
        gets a warning naming the micro-batch that fits (after_step_problem)."""
        env = self.env
        if self.before_step is None:
            return
        device_type = env.device.type
        took, parts = memory_taken(env, self.before_step)
        counted = sum(v for kind, v in self.held().items() if device_type == "cpu" or "host" not in kind) \
            + (self.meter.peak or 0)
        mine = torch.tensor([fit_need(self.cost, device_type), -1 if took is None else took, counted,
                             fit_base(self.cost, device_type), -1 if self.room is None else self.room, *parts],
                            dtype=torch.float64, device=env.device)
        everyone = [torch.empty_like(mine) for _ in range(env.world_size)] if env.world_size > 1 else [mine]
        if env.world_size > 1:
            with LEDGER.paused():  # control traffic, once
                dist.all_gather(everyone, mine, group=dist.group.WORLD)
        rows = [[int(value) for value in row.tolist()] for row in everyone]
        if all(row[1] < 0 for row in rows):
            log(env, "fit after step 0: not measured (the device reports no memory)")
            return
        rank = max(range(len(rows)), key=lambda r: rows[r][1] / max(rows[r][0], 1))
        estimate, took, counted, base, _, *parts = rows[rank]
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
        over = [(r, row) for r, row in enumerate(rows) if row[4] >= 0 and row[1] > row[4]]
        if over and env.master:  # the rank furthest past its room: the micro-batch that fits it fits the others
            r, (estimate, took, _, _, room, *_) = max(over, key=lambda item: item[1][1] / item[1][4])
            need = lambda **changes: rank_need(self.args, self.costs, env.world_size, env.dtype, device_type, (r,),
                                               **changes)
            log(env, f"warning: fit after step 0: rank {r}'s {after_step_problem(self.args, need, took, estimate, room)}")

    def save(self, step):
        LEDGER.phase = "checkpoint"
        save_checkpoint(self.args, step, self.env, self.pieces(), self.run_config, self.optimizer,
                        extra_rng=self.extra_rng() if self.extra_rng else None)
        LEDGER.take()  # checkpoint traffic is not a training step's

    def finish(self):
        """Release out_dir and end the process group in step (common's teardown)."""
        ignore_stop_signals()
        if self.profiler:  # a run stopped inside --profile's window: what it traced
            self.profiler.close()
        self.guard.settle()  # the last step's flags, in flight
        agree(self.env, WRITE_FAILURES[0] if WRITE_FAILURES else None)  # a metrics row lost at the end
        self.metrics.close()  # --wandb: the run finished, its files complete
        release_out_dir()
        teardown(self.env)


def launch_for(args):
    """Who this process is: from the launcher's environment, or, for --dry_run, rank 0 of
    the --world_size ranks being planned (no launcher, network or accelerator is touched)."""
    if args.dry_run:
        return Launch("dry_run", 0, 0, args.world_size, args.ranks_per_node)
    if args.rehearse:  # the rank being rehearsed (infra.rehearsal), rank 0 before
        rank = rehearsal.REHEARSING.rank if rehearsal.REHEARSING else 0
        return Launch("rehearse", rank, rank % args.ranks_per_node, args.world_size, args.ranks_per_node)
    return detect_launcher(os.environ)


class RehearsedRun(Run):
    """The run protocol of a rehearsed rank (Run.start turns the script's Run into one):
    two steps, then an evaluation and the checkpoint's pieces; the ledger and the meter as in
    a real run; nothing written, nothing resumed, no metrics file of its own (the driver
    writes one row per rank)."""

    def begin(self, config, optimizer, costs, layout, pieces, evaluate, describe, held=None, extra_rng=None,
              after_resume=None):
        self.keep(config, optimizer, costs, pieces, evaluate, held)
        self.start_step = 0
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

    def evaluate(self, step):
        LEDGER.step, LEDGER.phase = step, "evaluation"
        losses = self._evaluate()
        LEDGER.take()
        return losses

    def end_step(self, loss, extra=None, **step_costs):
        comm, calls = LEDGER.take(calls=True)
        if step_costs:
            self.cost = self.costs_of(**step_costs)
        extra = extra() if callable(extra) else extra
        held, (state_theory, comm_theory) = self.held(), theory_bytes(self.cost)
        args, dt = self.args, time.perf_counter() - self.t0
        row = dict(step=self.step, loss=float(loss.item()), lr=self.optimizer.param_groups[0]["lr"], dt_ms=None,
                   tokens_per_s=None, mfu=None, mem_peak_bytes=None, mem_host_bytes=host_bytes(held),
                   state_bytes=held, comm_bytes=comm, state_bytes_theory=state_theory, comm_bytes_theory=comm_theory,
                   comm_calls=calls, comm_calls_theory=theory_calls(self.cost),
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
        rehearsal.stop_on_signals()  # the next rank's rehearsal, or the replay, follows: Ctrl-C still ends it
        dist.destroy_process_group()
        rehearsal.REHEARSING.results[self.env.rank] = {"rows": self.rows, "cost": self.cost, "pieces": self.pieces_count}
