"""Activation memory as measured: the ActivationMeter counts the bytes autograd saves for
backward (saved-tensor hooks), LiveStorage every tensor alive on the rank by phase of the step
(GPTPAR_COUNT_LIVE=1, for tests), and the device allocator's own high-water mark."""

import os

import torch
import torch.nn as nn

from infra.ledger import storage_key


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
