"""Stopping: a non-finite loss or gradient, the walltime (--time_limit) and the stop signals
(SIGTERM, SIGUSR1, SIGINT), agreed by every rank through the Guard before the optimizer step; and
HostSyncs, which counts the host synchronisations a step makes (GPTPAR_COUNT_SYNCS=1, tests)."""

import math
import signal
import sys
import time
from functools import wraps

import torch
import torch.distributed as dist

from common import log, say
from infra.checkpoint_format import latest_checkpoint
from infra.start import NONFINITE_EXIT, STOP_SIGNALS, agree, leave
from infra.metrics import WRITE_FAILURES


STARTED = time.monotonic()  # --time_limit counts from here (the job's walltime runs since about then)


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


def with_guard(cost, world_size):
    """A rank's costs() with the run protocol's own traffic added, the guard's flags
    (all_reduce[guard], every step of a run of 2 ranks or more): the ledger's theory column,
    and what plan.py prices, to the byte what a run measures."""
    if world_size <= 1:
        return cost
    calls = {"calls": {**cost["calls"], "all_reduce[guard]": ("1", 1)}} if "calls" in cost else {}
    return {**cost, "sent": {**cost["sent"], "all_reduce[guard]": ("3 flags x 4 B", GUARD_BYTES)}, **calls}


class Guard:
    """Before each optimizer step every rank must know two things, and the guard learns both
    without making a rank wait for another:

    (1) Does a loss or gradient hold a non-finite number? Clipping's gradient norm says so (it
        is non-finite exactly when a gradient is) and is already the same number on every rank
        (the script all-reduced its pieces to clip), so every rank reads the same answer and
        no message is needed. Then one `error:` line naming the step, and every rank exits
        with NONFINITE_EXIT before the optimizer step; the last good checkpoint is untouched.
        An update that overflows by itself (finite gradients, too large an --lr) is seen by
        the next step's loss, or by the checkpoint, which refuses to write non-finite weights
        (infra.checkpoint, the same status). Without clipping
        (--grad_clip 0) there is no global norm: the flags below then carry this rank's
        verdict and are waited for at once, before the update.
    (2) Has any rank been asked to stop (a SIGTERM / SIGUSR1, or --time_limit near: elapsed
        time + three times the slowest step seen, i.e. this step, one more and a checkpoint,
        would pass it), or failed a write? This is host state, agreed in one 12-byte
        all-reduce (3 flags, counted by the ledger as all_reduce[guard]) posted at step t and
        read at step t+1, and the stop, on every rank, comes after step t+1's checkpoint. On
        gloo it travels while step t+1 runs. On NCCL, RCCL and XCCL its work is waited for
        right after posting (that orders the device's stream behind it; the host does not
        block), so that the guard's communicator never runs beside the world's: NCCL's user
        guide says concurrent communicators "might work ... but could break at any time", and
        RCCL deadlocks with two or three of them on MI250X (ROCm/rccl #2191). A rank's own loss
        that is non-finite while the norm is finite (it never reached a gradient) travels with
        these flags too.

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
            if self.env.backend != "gloo":  # one communicator at a time on the device (see (2) above)
                self.posted[1].wait()
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
