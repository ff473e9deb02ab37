"""--profile STEPS: torch.profiler around the named optimizer steps on every rank, one Chrome
trace per rank (OUT_DIR/profile/rank<r>.json: chrome://tracing, Perfetto, TensorBoard's profiler
plugin read it), each step a range "step N", each collective under the ledger's name for it
("all_reduce[dp] #37", infra.ledger's traced); on GPUs also a CUDA memory snapshot of the same
steps (OUT_DIR/profile/rank<r>_memory.pickle: pytorch.org/memory_viz reads it). Off, nothing
is imported or started."""

import os

import torch

from common import log
from infra.ledger import LEDGER


class Profiler:
    """The window of --profile: opened at the first named step this run reaches (a resumed run
    may start inside it), closed after the last, its traces written then (or at the end of a
    run stopped inside it)."""

    def __init__(self, window, out_dir, env):
        self.first, self.last = window
        self.directory, self.env, self.profile, self.mark = os.path.join(out_dir, "profile"), env, None, None

    def begin_step(self, step):
        if self.profile is None and self.first <= step <= self.last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.env.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profile.start()
            LEDGER.profiling = True
        if self.profile is not None:
            self.mark = torch.profiler.record_function(f"step {step}")
            self.mark.__enter__()

    def end_step(self, step):
        if self.mark is not None:
            self.mark.__exit__(None, None, None)
            self.mark = None
        if self.profile is not None and step >= self.last:
            self.close()

    def close(self):
        """Stop recording and write this rank's trace (and memory snapshot)."""
        if self.profile is None:
            return
        LEDGER.profiling = False
        self.profile.stop()
        os.makedirs(self.directory, exist_ok=True)
        rank = self.env.rank
        self.profile.export_chrome_trace(os.path.join(self.directory, f"rank{rank}.json"))
        if self.env.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(os.path.join(self.directory, f"rank{rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.profile = None
        log(self.env, f"--profile: steps {self.first}-{self.last} traced, one file per rank in {self.directory} "
                      "(chrome://tracing, ui.perfetto.dev or TensorBoard; GPU memory: pytorch.org/memory_viz)")
