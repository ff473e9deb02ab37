"""Run a training script with one rank that freezes once training is under way: SIGSTOP,
as a process stuck in the kernel, in a debugger, or on a node that stops answering. Unlike a
dead rank, a frozen one keeps its sockets open, so its peers see no error: only --timeout
can end their wait.

    python tests/frozen_rank.py RANK STEP PIDDIR SCRIPT [script flags...]

Rank RANK stops itself right after run.end_step of step STEP (the others go on into step
STEP+1's first collective or send/recv and wait there), having written its pid to
PIDDIR/frozen. Every rank writes PIDDIR/rank<r> (its pid) at start, so that a test can watch
the others end, then SIGKILL the frozen one (tests/test_frozen.py)."""

import os
import runpy
import signal
import sys

import infra.ledger
import infra.run

frozen_rank, frozen_step, piddir, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
with open(os.path.join(piddir, f"rank{rank}"), "w") as f:
    f.write(str(os.getpid()))

end_step = infra.run.Run.end_step


def end_step_then_freeze(self, loss, extra=None, **step_costs):
    step = infra.ledger.LEDGER.step
    result = end_step(self, loss, extra, **step_costs)
    if rank == frozen_rank and step == frozen_step:
        with open(os.path.join(piddir, "frozen.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(piddir, "frozen.tmp"), os.path.join(piddir, "frozen"))
        os.kill(os.getpid(), signal.SIGSTOP)
    return result


infra.run.Run.end_step = end_step_then_freeze
sys.argv = [script] + sys.argv[5:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
