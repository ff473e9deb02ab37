"""Run a training script with one rank that freezes once training is under way: SIGSTOP,
as a process stuck in the kernel, in a debugger, or on a node that stops answering. Unlike a
dead rank, a frozen one keeps its sockets open, so its peers see no error: only --timeout
can end their wait.

    python tests/frozen_rank.py RANK STEP PIDDIR SCRIPT [script flags...]

Rank RANK stops itself right after run.end_step of step STEP (the others go on into step
STEP+1's first collective or send/recv and wait there), or with STEP written `N:gather`, inside
step N's end_step just before the metrics' gather of every rank's step time (the others wait
in that all_gather_object), having written its pid to PIDDIR/frozen. Every rank writes PIDDIR/rank<r> (its pid) at start, so that a test can watch
the others end, then SIGKILL the frozen one (tests/test_frozen.py)."""

import os
import runpy
import signal
import sys

import infra.ledger
import infra.metrics
import infra.run

frozen_rank, (frozen_step, _, where), piddir, script = \
    int(sys.argv[1]), sys.argv[2].partition(":"), sys.argv[3], sys.argv[4]
frozen_step = int(frozen_step)
rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
with open(os.path.join(piddir, f"rank{rank}"), "w") as f:
    f.write(str(os.getpid()))


def freeze_at(step):
    if rank == frozen_rank and step == frozen_step:
        with open(os.path.join(piddir, "frozen.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(piddir, "frozen.tmp"), os.path.join(piddir, "frozen"))
        os.kill(os.getpid(), signal.SIGSTOP)


end_step, over_ranks = infra.run.Run.end_step, infra.metrics.Metrics.over_ranks


def end_step_then_freeze(self, loss, extra=None, **step_costs):
    step = infra.ledger.LEDGER.step
    result = end_step(self, loss, extra, **step_costs)
    freeze_at(step)
    return result


def freeze_then_gather(self, *args, **kwargs):
    freeze_at(infra.ledger.LEDGER.step)
    return over_ranks(self, *args, **kwargs)


if where == "gather":
    infra.metrics.Metrics.over_ranks = freeze_then_gather
else:
    infra.run.Run.end_step = end_step_then_freeze
sys.argv = [script] + sys.argv[5:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
