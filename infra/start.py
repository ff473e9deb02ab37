"""Starting and leaving: the start-up checks of the run's files (--data, --metrics, --export,
--out_dir) agreed by every rank, one job at a time in an out_dir (its lock, a stale lock of a dead
job recognised), and the way out: `agree` turns a problem any rank found into one line and exit 2
on every rank, `leave` ends the process group in step, ignoring the stop signals still in flight."""

import atexit
import errno
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from common import model_block_size, say, teardown
from infra.data_check import data_problem
from infra.ledger import LEDGER
from infra.checkpoint_format import clean_checkpoints, latest_checkpoint, unfinished_checkpoints


class Interrupted(str):
    """A problem that is a Ctrl-C (SIGINT) during start-up: agreed like any other, but every
    rank exits with 130, the shell's status for a job its user interrupted."""
    status = 130


NONFINITE_EXIT = 3  # the exit status of a run stopped by a non-finite loss, gradient or weight


class Diverged(str):
    """A problem that is a model gone non-finite (a checkpoint that would hold such weights):
    agreed like any other, but every rank exits with NONFINITE_EXIT, as the guard's stop does."""
    status = NONFINITE_EXIT


def agree(env, problem):
    """Every rank passes the problem it found (a one-line string) or None; if any rank found
    one, the first in rank order is printed once as `error: ...` and every rank exits with
    status 2 (130 for an Interrupted one, 3 for a Diverged one). A problem only some ranks can see (a file missing
    on one node, a slice of the data) thus ends the whole job within seconds instead of
    hanging the others."""
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
        leave(env, getattr(problem, "status", 2))


def leave(env, status):
    """Release the out_dir lock, end the process group in step, exit with `status`."""
    ignore_stop_signals()
    release_out_dir()
    teardown(env)
    sys.exit(status)


def agree_on_startup(args, env):
    """startup_problem, agreed by every rank. Rank 0 may wait there for another host's lock
    (up to half the timeout) while the others wait in `agree`: a Ctrl-C meanwhile, which
    reaches every rank, ends the wait and the job in one line with status 130, instead of a
    KeyboardInterrupt traceback on every rank and a wait that goes on (a rank inside a
    collective cannot be interrupted). A SIGINT during the other checks is delivered as usual
    once they are agreed."""
    def defer(signum, frame):
        _INTERRUPTED.append(signum)
    previous = signal.signal(signal.SIGINT, defer)
    agree(env, startup_problem(args, env))  # on a problem, every rank leaves: the stop signals ignored
    signal.signal(signal.SIGINT, previous)
    if _INTERRUPTED:
        _INTERRUPTED.clear()
        signal.raise_signal(signal.SIGINT)  # not during a wait for a lock: as if it came now


_INTERRUPTED = []  # the SIGINTs received during start-up's checks (agree_on_startup)


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
        problem = opened_problem("--metrics", args.metrics)
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
    without writing anything (a dry run calls it too): --metrics, --export and a script's own
    output file (07's --write_schedule) need an existing, writable directory; --out_dir must
    be a writable directory or creatable (a directory is made and removed in it, or in the
    deepest part of its path that exists)."""
    outputs = (("--metrics", args.metrics), ("--export", getattr(args, "export", None)),
               ("--write_schedule", getattr(args, "write_schedule", None)))
    directory = getattr(args, "export_hf", None)
    if directory and (os.path.exists(directory) and not os.path.isdir(directory)
                      or not os.path.isdir(os.path.dirname(os.path.abspath(directory)))):
        return f"--export_hf {directory}: not a directory, nor one that can be made in an existing directory"
    if args.metrics and getattr(args, "export", None) and os.path.realpath(args.metrics) == os.path.realpath(args.export):
        return f"--metrics and --export name the same file, {args.export}: the export would overwrite the metrics"
    for flag, path in outputs:
        problem = path and output_problem(flag, path)
        if problem:
            return problem
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


def output_problem(flag, path):
    """Why the file `path` (named by `flag`: an option, or an environment variable) cannot be
    written, or None, found without writing: its directory must exist and be writable, and the
    path must not be a directory."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag} {path}: the directory {folder} does not exist"
    if os.path.isdir(path):
        return f"{flag} {path} is a directory"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path} cannot be written: permission denied"
    return None


def opened_problem(flag, path):
    """Why `path` cannot be opened for appending, or None: it is opened (created if need be)
    without blocking, since a plain open of a FIFO waits for ever for a reader."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644))
    except OSError as e:
        if e.errno == errno.ENXIO:  # (a FIFO with a reader, as `--metrics >(jq .)` makes, is fine)
            return f"{flag} {path} is a FIFO that nothing reads: start its reader first, or name a file"
        return f"{flag} {path} cannot be written: {e.strerror}"
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
                    if _INTERRUPTED:  # Ctrl-C: the lock is not ours, nothing was written
                        return Interrupted(f"interrupted (SIGINT) while waiting for --out_dir {out_dir}'s lock, "
                                           f"held by job {holder.get('job')} on host {holder.get('host')}: "
                                           "nothing was started")
                    time.sleep(min(0.2, max(0.0, deadline - time.time())))
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


# what PBS and Slurm send at walltime or preemption, and a terminal's Ctrl-C
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")


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
