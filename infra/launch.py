"""The processes started, hardened: common.setup with what a plain launch can do without. Under
Slurm (and MPI's fallback to MASTER_ADDR/PORT) rank 0's store carries the job's ids, so a rank
that finds another job's store on its port says so at once; a rank that cannot join says why in
one line and ends the job; an uncaught exception on any rank ends the job, not leaving the
others blocked in a collective until --timeout."""

import datetime
import os
import sys
import time

import torch.distributed as dist

import common


def setup(args, launch=None):
    """common.setup, hardened as the module docstring says: an Env."""
    env = common.setup(args, launch, distributed=False)
    where = common._rendezvous(env.launch)
    try:
        common.join(env, args.timeout, **(dict(store=_job_store(env.launch, where, args.timeout))
                                          if env.launch.kind in ("slurm", "env") else dict(init_method=where)))
    except Exception as e:  # a taken port, an unreachable rank 0, a rank that never came
        _could_not_join(env.launch, where, args.timeout, e)
    _install_abort_hook(env.launch)  # after init_process_group, whose own hook it wraps
    return env


def _job_store(launch, where, timeout):
    """Rank 0's store, marked with the job's ids: another job's mark fails at once, not at --timeout."""
    addr, port = where.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(addr, int(port), launch.world_size, launch.rank == 0, datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)
    job = " ".join(f"{v}={os.environ[v]}" for v in ("SLURM_JOB_ID", "SLURM_STEP_ID", "PBS_JOBID", "FLUX_JOB_ID")
                   if os.environ.get(v)) or "no scheduler job"
    if launch.rank == 0:
        store.set("gptpar/job", job)
    elif (theirs := store.get("gptpar/job").decode()) != job:
        raise RuntimeError(f"that port is another job's ({theirs}; this is {job}): export MASTER_PORT=<a free port>")
    return store


def _could_not_join(launch, init_method, timeout, error):
    """One line from the rank that failed to join, then the job ends (MPI_Abort, or the launcher)."""
    text = " ".join(str(error).split())
    where = init_method.removeprefix("tcp://") if init_method.startswith("tcp://") else \
        f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if "another job's" in text:
        cause = text
    elif "address already in use" in text.lower() or "EADDRINUSE" in text:
        cause = (f"port {where.rsplit(':', 1)[-1]} on {where.rsplit(':', 1)[0]} is already taken (another job "
                 "on this node, or a stray listener): set MASTER_PORT to a free port")
    elif "timeout" in text.lower() or "timed out" in text.lower():
        cause = (f"rank 0's store at {where} did not answer, or not every one of the {launch.world_size} ranks "
                 f"joined, within --timeout {timeout:g} s (check MASTER_ADDR, the rank count, and that no rank died)")
    else:
        cause = f"{type(error).__name__}: {text[:200]}"
    print(f"error: rank {launch.rank} could not join the process group at {where}: {cause}", file=sys.stderr, flush=True)
    if common.mpi_comm() is not None:
        time.sleep(1)  # MPI_Abort tears the job down at once: let mpiexec's proxy forward the line first
        common.mpi_comm().Abort(2)
    os._exit(2)


def _install_abort_hook(launch):
    """An uncaught exception on any rank ends the job, not leaving the others blocked in a
    collective: the traceback, then MPI_Abort under MPI, else exit (the launcher ends the rest)."""
    if launch.world_size == 1:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        message = (str(value).strip().splitlines() or [""])[0][:300]
        sys.stderr.write(f"[rank {launch.rank}] uncaught {kind.__name__}: {message}; ending the job\n")
        previous(kind, value, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(1.0)  # let the launcher forward the traceback before the job is torn down
        if common.mpi_comm() is not None:
            common.mpi_comm().Abort(1)
        os._exit(1)

    sys.excepthook = hook
