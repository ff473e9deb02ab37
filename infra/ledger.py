"""The ledger: the bytes each torch.distributed call moves on this rank, by operation and
process group (CommLedger wraps the functions of torch.distributed; the scripts keep calling
`dist.all_reduce` literally), the model-state bytes held, counted from the live tensors, and the
line a failed or timed-out collective prints (which one, on which group, at which step and
phase), with the trail it leaves beside torch's Flight Recorder dumps. print_ledger puts each
measured number next to the script's costs()."""

import inspect
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from functools import wraps

import torch
import torch.distributed as dist

from common import log, say
from infra.formulas import format_bytes, formula
from infra.fake_host import HostTensor


def _nbytes(t):
    return t.numel() * t.element_size()


class CommLedger:
    """Counts the bytes each torch.distributed collective moves on this rank, by operation,
    by wrapping the functions of the torch.distributed module (scripts keep calling
    `dist.all_reduce` literally). The count is the message size in nccl-tests' convention:
    the tensor for all_reduce / broadcast / reduce / send / recv, the *input* for
    reduce_scatter and all_to_all, the *output* for all_gather; not the wire traffic of the
    algorithm (a ring all-reduce puts 2(N-1)/N of it on every link). Beside the bytes, the
    calls of each key (a batch_isend_irecv: one per send or receive in it): every call pays
    the network's latency once, whatever its size, so a plan prices latency per call."""

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
        self.bytes, self.calls, self.installed, self.group_names, self.counting = {}, {}, False, {}, True
        self.device = None  # the run's device: every tensor handed to a collective must be on it
        # where this rank is, for the line a failed or timed-out collective prints: the step
        # and phase (Run sets them), and how many collectives it has posted on each group
        self.step, self.phase, self.posted, self.reported = None, "setup", {}, False

    def position(self, op, group):
        """This call's place in the rank's sequence of collectives: (op, group, its number
        on that group, step, phase). Ranks that disagree on it are the usual cause of a hang."""
        name, phase = self.where_group(group), self.where_phase()
        self.posted[name] = self.posted.get(name, 0) + 1
        self.label = f"{op}[{name}] #{self.posted[name]}"  # what a --profile trace calls it
        self.leave_trail(name, group, phase)
        return f"{op} #{self.posted[name]} on group {name}, step {self.step}, {phase}"

    def where_group(self, group):
        if group is None or group is dist.group.WORLD:  # named or implied, the same group
            return "world"
        name = self.group_name(group)
        if name is None:
            try:
                name = "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
            except Exception:
                name = "a subgroup"
        return name

    def where_phase(self):
        if self.phase == "step":  # inside autograd's backward, or the forward
            return "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        return self.phase

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
        self.calls[op] = self.calls.get(op, 0) + 1

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
        for op in self.NAMED:
            if hasattr(dist, op):
                setattr(dist, op, self._named(op, getattr(dist, op)))
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
                return self.watched(where, self.traced(original, p2p_ops))
            except Exception as e:
                self.report(where, e)
                raise
        dist.batch_isend_irecv = batch_isend_irecv

    # collectives of Python objects, and the barrier: nothing to count (a pickle's size is
    # not the call's), and not numbered (the numbers stay those of the tensor collectives), but
    # a rank that waits in one for a frozen peer (the metrics' gather of every logged step) names it
    NAMED = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "barrier")

    def _named(self, op, fn):
        signature = inspect.signature(fn)

        @wraps(fn)
        def named(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                group = signature.bind_partial(*args, **kwargs).arguments.get("group")
                self.report(f"{op} on group {self.where_group(group)}, step {self.step}, {self.where_phase()}", e)
                raise
        return named

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
                return self.watched(where, self.traced(fn, *args, **kwargs))
            except Exception as e:  # a timeout (--timeout), a peer gone: say where this rank was
                self.report(where, e)
                raise
        return counted

    profiling = False  # --profile's window is open (infra.profiling): name each call in the trace
    label = None

    def traced(self, fn, *args, **kwargs):
        """fn(*args, **kwargs); inside --profile's window under the ledger's name for it,
        "all_reduce[dp] #37" (the group's name, the call's number on that group), so that a
        trace shows which collective of the script each of its ranges is. Off, one test."""
        if not self.profiling:
            return fn(*args, **kwargs)
        with torch.profiler.record_function(self.label):
            return fn(*args, **kwargs)

    def take(self, calls=False):
        """The bytes counted since the last take (one optimizer step's worth); with calls,
        (bytes, calls) by key."""
        counted, called, self.bytes, self.calls = self.bytes, self.calls, {}, {}
        return (counted, called) if calls else counted


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


def flight_recorder_dump():
    """The dump of the recorder this run's collectives are in: on NCCL and RCCL,
    ProcessGroupNCCL's own (_dump_nccl_trace, what its watchdog writes at a timeout); torch's
    generic recorder (_dump_fr_trace, gloo's and XCCL's) holds none of their entries there."""
    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace")
    return c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace


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
                f.write(flight_recorder_dump()())
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


def print_ledger(env, held, comm, cost, activations=None, calls=None):
    """Once, after the first step: what this rank holds and sends, measured next to the
    strategy's formula (`cost` is the script's costs(): each value is (formula, bytes));
    `activations`: the ActivationMeter's peak over the step; `calls`: the step's calls by
    key, next to costs()' "calls" (each a formula of the calls a step posts)."""
    lines = [f"ledger (rank {env.rank}): measured | theory"]
    for kind in cost["held"]:  # params, grads, optim (and with --offload their host parts)
        formula, value = cost["held"][kind]
        lines.append(f"  held {kind:<24} {format_bytes(held[kind]):>11} | {formula} = {format_bytes(value)}")
    if "activations" in cost:
        formula, value = cost["activations"]
        measured = format_bytes(activations) if activations is not None else "-"
        lines.append(f"  held {'activations (peak)':<24} {measured:>11} | {formula} = {format_bytes(value)}")
    stated = cost.get("calls", {})
    for op in sorted(set(comm) | set(cost["sent"])):
        formula, value = cost["sent"].get(op, ("0", 0))
        count = f"; {calls.get(op, 0)} call(s) | {stated[op][0]} = {stated[op][1]}" \
            if calls is not None and op in stated else ""
        lines.append(f"  sent {op:<24} {format_bytes(comm.get(op, 0)):>11} | {formula} = {format_bytes(value)} per step"
                     + count)
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
    differ = calls_differ(calls, cost) if calls is not None else []
    if differ:  # a line of its own, after the bytes' (the bug zoo names a bug by the first)
        say(f"ledger mismatch on rank {env.rank}: {'; '.join(differ)}", sys.stderr)


def calls_differ(calls, cost):
    """Where a step's measured calls by key differ from costs()' "calls" (each a formula;
    a costs() without them is not checked), as "calls OP n, formula m"."""
    if "calls" not in cost:
        return []
    stated = {op: value for op, (_, value) in cost["calls"].items()}
    keys = sorted(set(stated) | set(calls))
    return [f"calls {op} {calls.get(op, 0)}, formula {stated.get(op, 0)}"
            for op in keys if calls.get(op, 0) != stated.get(op, 0)]


def theory_bytes(cost):
    """The byte values of a costs() result, keyed as the metrics' measured columns."""
    return ({kind: value for kind, (_, value) in cost["held"].items()},
            {op: value for op, (_, value) in cost["sent"].items()})


def theory_calls(cost):
    """costs()' calls per step by key (the metrics' comm_calls_theory), or None where it states none."""
    return {op: value for op, (_, value) in cost["calls"].items()} if "calls" in cost else None
