"""Run a training script with every live tensor byte counted: `python tests/live_bytes.py
SCRIPT ARGS...` runs SCRIPT (a path in the repository, or absolute) as __main__ under LiveBytes, a TorchDispatchMode that sees every
aten op (factory functions, autograd's gradients, the collectives' outputs included) and
records each new storage it returns, with a weak reference, until that storage is freed; after
every op it sums the present sizes of those alive (a storage resized in place counts at its
new size).

    live(t)  = the bytes of every storage made by an op and not yet freed, at op t
    start-up = every op before the model's first forward (building it, the optimizer, ...)
    run      = every op, to the end

What it does not see: memory that is not a tensor's storage (the allocator's slack, gloo's
own buffers, the Python heap), and tensors made outside the dispatcher (torch.from_numpy).
So it is the count the model's state and its transients are made of, free of glibc's
retention, which blurs RSS (docs/memory.md).

Environment:
    LIVE_BYTES_OUT            a directory: each rank writes rank<r>.json there at exit with
                              {"startup_peak", "startup_end", "run_peak"} in bytes
    LIVE_BYTES_STARTUP_LIMIT  bytes a rank may have live during start-up: past it, the op
                              that allocates raises MemoryError (what a device out of memory
                              does), so a script that needs more cannot start
    LIVE_BYTES_RUN_LIMIT      the same for the whole run
"""

import json
import os
import runpy
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self, startup_limit=None, run_limit=None):
        super().__init__()
        self.storages = {}  # storage id -> weak reference
        self.live = self.startup_peak = self.run_peak = 0
        self.startup_end = None  # live bytes when the first forward began
        self.startup_limit, self.run_limit = startup_limit, run_limit

    def starting(self):
        return self.startup_end is None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = self.storages.get(storage._cdata)
                if ref is None or ref.expired():  # new (its address may be a freed one's)
                    self.storages[storage._cdata] = StorageWeakRef(storage)
        # every storage's size now: freed ones dropped, and resized ones (stage 3's gathered
        # units give their memory back in place, with no op) at their present size
        self.live = 0
        for key, ref in list(self.storages.items()):
            if ref.expired():
                del self.storages[key]
            else:
                self.live += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        self.run_peak = max(self.run_peak, self.live)
        if self.starting():
            self.startup_peak = max(self.startup_peak, self.live)
        limit = self.startup_limit if self.starting() else self.run_limit
        if limit is not None and self.live > limit:
            raise MemoryError(f"live tensor bytes {self.live:,} > {limit:,} allowed "
                              f"{'at start-up' if self.starting() else 'in the run'} (after {func})")
        return out


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, sys.argv[1])  # relative to the repository (or absolute)
    sys.argv = [script] + sys.argv[2:]
    limit = lambda name: int(os.environ[name]) if os.environ.get(name) else None
    mode = LiveBytes(limit("LIVE_BYTES_STARTUP_LIMIT"), limit("LIVE_BYTES_RUN_LIMIT"))

    def first_forward(module, args):
        if mode.starting():
            mode.startup_end = mode.live
    hook = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)

    def report():
        if os.environ.get("LIVE_BYTES_OUT"):
            rank = int(os.environ.get("RANK", "0"))
            with open(os.path.join(os.environ["LIVE_BYTES_OUT"], f"rank{rank}.json"), "w") as f:
                json.dump({"startup_peak": mode.startup_peak, "startup_end": mode.startup_end,
                           "run_peak": mode.run_peak}, f)
    with mode:
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            hook.remove()
            report()


if __name__ == "__main__":
    main()
