"""A fork server for the tests: import torch once, then start every rank of every test job
by fork() instead of a fresh interpreter, which spends about 2 s per rank importing torch
(and the torch._dynamo that torch.optim's first step pulls in) on a 2-core machine.

    python tests/forkserver.py SOCKET_PATH

tests/harness.py starts one per pytest session (lazily, at the first launch) with
OMP_NUM_THREADS=1 in its environment, waits for the line `ready <pid>` on its stdout, sends
one JSON request per job over a connection to the unix socket SOCKET_PATH and reads one JSON
line back. The server ends when its stdin reaches end of file (the harness, or the pytest
process that holds the pipe, is gone).

Request: {"script", "args", "nprocs", "world" (export torchrun's variables), "env", "cwd",
"timeout" (seconds), "stdout", "stderr" (files the ranks append to), and optionally "grace"
(seconds, GRACE_S by default), "port" (the job's MASTER_PORT; a free one picked by the
kernel otherwise), "isolated" (a copied script run as in an empty directory: the
repository's modules dropped from sys.modules and its directories off sys.path, so that
only what lies beside the script can be imported) and "announce" (a first reply line,
{"pids": [rank pids], "pgid": int}, once every rank is forked: a test that signals ranks)}.
Reply: {"returncode": int or "timeout", "statuses": [rank exit statuses], "pgid": int} or
{"error": "..."}.

For each request the server forks a job supervisor, which forks the ranks and behaves as
torchrun and mpiexec do: it waits for every rank; once one exits non-zero the others get
GRACE_S to end on their own (every rank of a refused job prints and exits by itself), then
SIGTERM, then after KILL_S SIGKILL. The job's status is the one all ranks exited with, else
the first non-zero status in time (the cause, not the ranks ended because of it). A rank
ended by a signal counts as 128 + the signal (as mpiexec and a shell report it); a one-process
job (no launcher) as -signal (as subprocess reports a plain `python script`). On timeout, or
when the client goes away, the job's process group is killed.

Each rank: its own process group for the job (the first rank leads it), the job's cwd and
environment (plus RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and a free
MASTER_PORT chosen per job when "world"), stdout and stderr appended to the job's files,
stdin from /dev/null, the signal dispositions of a fresh interpreter, infra.stop.STARTED reset
(--time_limit counts from it), torch.set_num_threads from OMP_NUM_THREADS, sys.argv and
sys.path as `python script args` would have them, then the script run as __main__. It ends
as the interpreter would (non-daemon threads joined, atexit handlers run, streams flushed)
with os._exit: it never returns into this server's code.

Safety of fork: the server imports modules and reads the default corpus (warm()), nothing more.
It never runs a torch op, so no OpenMP or intra-op thread pool exists when it forks; it checks
that it holds exactly one thread (threading and /proc/self/task) at start and before every
fork, and refuses jobs otherwise.
Repository modules imported here (common.py, the modules of infra/) are dropped from sys.modules
in the rank, all of them, when any has changed on disk since, and the rank imports the files as
they are now. The numbered scripts are compiled here once; a rank runs its script's compiled code
unless the file has changed since (then it compiles it, as `python script` does).

What fork cannot give: every rank of every job shares the server's string-hash seed
(PYTHONHASHSEED is fixed at interpreter start), so ranks iterate a set of strings in the same
order here, where fresh interpreters may not. A bug of that kind shows only through a real
launcher: run the suite with GPTPAR_TEST_LAUNCHER=mpiexec now and then (as CI can)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a rank of these scripts imports, and what the first training step imports lazily
# (measured with `python -X importtime`): torch.optim's first AdamW step pulls in
# torch._dynamo, which is most of the cost after torch itself.
PRELOAD = [
    "numpy", "torch", "torch.distributed", "torch.nn", "torch.nn.functional", "torch.optim",
    "torch._dynamo", "torch.autograd.variable", "torch.distributed.distributed_c10d",
    "torch.distributed.rendezvous", "torch.utils.checkpoint", "torch.profiler._cupti_monitor",
    "multiprocessing.synchronize", "tqdm", "common", "infra",
]

# The weakref finalizers alive in the server once it has imported everything: torch.library's
# `_del_library` of each of torch's ~170 operator libraries, which the interpreter runs at exit
# (weakref.finalize's atexit hook) to deregister every kernel of every library, one dispatch
# table at a time. In a forked rank that walk writes to pages the rank shares with the server,
# so the kernel copies each of them first: a third of a tiny rank's page faults (8,000 of
# 23,000) and 0.07 s of its CPU, for tables that os._exit frees a moment later anyway. A rank
# therefore detaches these before its atexit handlers run; the finalizers the script itself
# registered (a TemporaryDirectory's cleanup...) and every atexit handler still run.
SERVER_FINALIZERS = []

# The numbered scripts, compiled once here: `python script` (and runpy.run_path) compiles its
# script's source before the first line runs, in every rank (08_3d.py 0.05 s, 07 0.03 s).
# {path: (its file_stamp, code)}; a rank whose script was edited since compiles it afresh.
SCRIPTS = {}

GRACE_S = 10.0  # after a rank exits non-zero, the others may end on their own for this long
KILL_S = 5.0  # then SIGTERM; SIGKILL this long after


def threads():
    """Threads of this process, as Python and as the kernel count them."""
    import threading
    return threading.active_count(), len(os.listdir("/proc/self/task"))


def preload():
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    extra = [name for name in os.environ.get("GPTPAR_FORKSERVER_PRELOAD", "").split(",") if name]
    for name in extra:
        importlib.import_module(name)


def repo_modules():
    """{module name: (file, mtime_ns, size)} of the modules imported from this repository."""
    found = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or not os.path.abspath(path).startswith(ROOT + os.sep) or os.sep + ".venv" + os.sep in path:
            continue
        stamp = file_stamp(path)
        if stamp is not None:
            found[name] = stamp
    return found


def file_stamp(path):
    """(path, mtime_ns, size) of a file, None if it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_mtime_ns, st.st_size


def compile_scripts():
    import glob
    for path in sorted(glob.glob(os.path.join(ROOT, "[0-9][0-9]_*.py"))):
        stamp = file_stamp(path)  # before the read: an edit in between shows as a changed stamp
        with open(path, "rb") as f:
            SCRIPTS[path] = (stamp, compile(f.read(), path, "exec", dont_inherit=True))


def warm():
    """What every rank of every job makes the same way before its first step, made once here and
    inherited: the default corpus's vocabulary and token ids (common.shakespeare_tokens, which
    every model_config and Data asks for: about 50 ms of a rank's CPU, a tenth of a tiny rank's
    run). Pure Python and numpy, no torch op. A rank that imports common afresh (an edited
    repository module, a copied script) makes its own."""
    import common
    try:
        common.shakespeare_tokens()
    except SystemExit:  # no data/: each rank says so itself
        pass


def edited(loaded):
    """Whether a repository module the server imported has changed on disk since. Only those
    files are stat'ed: walking sys.modules again in a rank touches every module object of the
    server's ~2,000, and so copies their pages (some 3,800 page faults, 0.03 s of CPU a rank)."""
    return any(file_stamp(stamp[0]) != stamp for stamp in loaded.values())


# ----------------------------------------------------------------------------------------
# The rank: becomes `python script args` and never returns
# ----------------------------------------------------------------------------------------

def fresh_signals():
    """The dispositions a fresh interpreter starts with, and nothing blocked."""
    import signal
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig == signal.SIGINT:
            handler = signal.default_int_handler
        elif sig in (signal.SIGPIPE, signal.SIGXFSZ):
            handler = signal.SIG_IGN
        else:
            handler = signal.SIG_DFL
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def std_streams(encoding, out_errors, err_errors):
    """sys.stdin/stdout/stderr over fds 0, 1 and 2, unbuffered as PYTHONUNBUFFERED=1 makes them."""
    import io
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding=encoding)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding,
                                                   errors=out_errors, write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                                   errors=err_errors, write_through=True)


def exit_status(exc):
    """What the interpreter exits with for this SystemExit."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def run_rank(job, rank, pgid, port, close_fds, base_path, loaded):
    """In the forked child: set up `python script` and run it; os._exit at the end."""
    code = 1
    try:
        os.setpgid(0, pgid or 0)
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        fresh_signals()
        encoding, out_errors, err_errors = sys.stdout.encoding, sys.stdout.errors, sys.stderr.errors
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        std_streams(encoding, out_errors, err_errors)
        os.chdir(job["cwd"])
        env = dict(job["env"])
        if job["world"]:
            n = job["nprocs"]
            env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.clear()
        os.environ.update(env)
        script = os.path.abspath(job["script"])
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script)] + extra + [p for p in base_path if p not in extra]
        sys.argv = [job["script"]] + list(job["args"])
        import importlib
        importlib.invalidate_caches()
        if job.get("isolated"):  # a copied script: nothing of this repository importable, as in an empty directory
            sys.path[:] = [p for p in sys.path if p != os.path.dirname(script)
                           and os.path.abspath(p or ".") not in (ROOT, os.path.join(ROOT, "tests"))]
            sys.path.insert(0, os.path.dirname(script))
        if job.get("isolated") or edited(loaded):
            for name in loaded:
                sys.modules.pop(name, None)
        import time
        stop = sys.modules.get("infra.stop")  # (the guard's clock: infra.stop reads its own STARTED)
        if stop is not None:
            stop.STARTED = time.monotonic()  # as if imported now: --time_limit counts from here
        import torch
        threads_wanted = env.get("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(threads_wanted) if threads_wanted.isdigit() and int(threads_wanted) > 0 else 1)
    except BaseException:  # the set-up itself failed: say so on the job's stderr
        try:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(1)

    interrupted = False
    try:
        import runpy
        cached = SCRIPTS.get(script)
        if cached is not None and not job.get("isolated") and file_stamp(script) == cached[0]:
            runpy._run_module_code(cached[1], None, "__main__", pkg_name="", script_name=script)  # as run_path would
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:
        kind, value, tb = sys.exc_info()
        interrupted = isinstance(value, KeyboardInterrupt)  # the interpreter then ends by SIGINT
        start = tb
        while start is not None and os.path.abspath(start.tb_frame.f_code.co_filename) != script:
            start = start.tb_next  # the traceback as `python script` prints it: from the script's frame
        try:
            if start is not None and value is not None:
                value = value.with_traceback(start)  # what the default hook prints
            sys.excepthook(kind, value, start or tb)  # infra.launch's abort hook may end the process here
        except BaseException:
            pass
        code = 1
    finally:
        try:
            import threading
            threading._shutdown()  # as the interpreter does at exit: join non-daemon threads
        except BaseException:
            pass
        for finalizer in SERVER_FINALIZERS:
            finalizer.detach()  # torch's operator libraries: the process ends, and they with it
        try:
            import atexit
            atexit._run_exitfuncs()
        except BaseException:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        if interrupted:
            import signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        try:
            os._exit(code)
        except BaseException:
            os._exit(1)


# ----------------------------------------------------------------------------------------
# The job supervisor: what torchrun / mpiexec do for the job's ranks
# ----------------------------------------------------------------------------------------

def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervise(conn, job, base_path, loaded):
    import json
    import select
    import signal
    import time

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    n, world = int(job["nprocs"]), bool(job["world"])
    port = (job.get("port") or free_port()) if world else None
    start = time.monotonic()
    deadline = start + float(job["timeout"])
    grace = float(job.get("grace", GRACE_S))
    pids, pgid = [], 0
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            run_rank(job, rank, pgid, port, [conn.fileno()], base_path, loaded)
            os._exit(1)  # not reached
        try:
            os.setpgid(pid, pgid or pid)  # also done in the child: whichever runs first
        except OSError:
            pass
        pgid = pgid or pid
        pids.append(pid)
    if job.get("announce"):  # a job the client signals while it runs: its ranks' pids first
        conn.sendall((json.dumps({"pids": pids, "pgid": pgid}) + "\n").encode())

    def signal_job(sig):
        try:
            os.killpg(pgid, sig)  # the group exists: every rank is kept unreaped until the end
        except OSError:
            pass

    pidfds = {}
    for pid in pids:
        try:
            pidfds[os.pidfd_open(pid)] = pid
        except (AttributeError, OSError):
            pidfds = None
            break
    status, order = {}, []  # rank pid -> exit status; pids in the order they ended
    failed_at = termed_at = None
    timed_out = gone = False
    while len(status) < n:
        now = time.monotonic()
        if now >= deadline:
            timed_out, deadline = True, float("inf")
            signal_job(signal.SIGKILL)
        if failed_at is not None and termed_at is None and now >= failed_at + grace:
            termed_at = now
            signal_job(signal.SIGTERM)
        if termed_at is not None and now >= termed_at + KILL_S:
            signal_job(signal.SIGKILL)
            termed_at = float("inf")
        wake = min(deadline, failed_at + grace if failed_at is not None and termed_at is None else deadline,
                   termed_at + KILL_S if termed_at is not None else deadline)
        wait = max(0.0, min(wake - now, 3600.0))
        watch = ([] if gone else [conn]) + (list(pidfds) if pidfds is not None else [])
        ready, _, _ = select.select(watch, [], [], wait if pidfds is not None else min(wait, 0.05))
        if conn in ready:
            try:
                alive = bool(conn.recv(1))
            except OSError:
                alive = False
            if not alive:  # the client went away (the test was interrupted): end the job
                gone = True
                signal_job(signal.SIGKILL)
        candidates = [pidfds[fd] for fd in ready if fd != conn] if pidfds is not None else [p for p in pids if p not in status]
        for pid in candidates:
            if pid in status:
                continue
            try:  # WNOWAIT: the zombie keeps the process group alive until the job is over
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
            if info is None:
                continue
            if info.si_code == os.CLD_EXITED:
                code = info.si_status
            else:  # killed or dumped core
                code = (128 + info.si_status) if world else -info.si_status
            status[pid] = code
            order.append(pid)
            if pidfds is not None:
                fd = next(fd for fd, p in pidfds.items() if p == pid)
                os.close(fd)
                del pidfds[fd]
            if code != 0 and failed_at is None:
                failed_at = time.monotonic()
    signal_job(signal.SIGKILL)  # whatever the ranks started and left behind
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    codes = [status[p] for p in pids]
    if timed_out:
        returncode = "timeout"
    elif len(set(codes)) == 1:
        returncode = codes[0]
    else:
        returncode = next(status[p] for p in order if status[p] != 0)
    reply = {"returncode": returncode, "statuses": codes, "pgid": pgid, "seconds": time.monotonic() - start}
    try:
        conn.sendall((json.dumps(reply) + "\n").encode())
    except OSError:
        pass


# ----------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------

def read_request(conn):
    import json
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def serve(path):
    import gc
    import json
    import select
    import socket
    import weakref

    base_path = list(sys.path[1:])  # without this file's directory, which a rank replaces by its script's
    loaded = repo_modules()
    compile_scripts()
    warm()
    SERVER_FINALIZERS[:] = list(weakref.finalize._registry)
    # The server's ~285,000 objects into the collector's permanent generation: a rank's full
    # collection would otherwise walk them all, writing to each object's header, and so copy
    # the server's heap page by page (18,000 page faults and 0.3 s of CPU for one gc.collect()
    # in a rank). Nothing of the server's is garbage; the rank's own objects are collected as usual.
    gc.collect()
    gc.freeze()
    counted = threads()
    if counted != (1, 1):
        print(f"refused: {counted[0]} Python threads and {counted[1]} kernel threads after the imports; "
              "fork is only safe with one", flush=True)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print(f"ready {os.getpid()}", flush=True)
    stdin = sys.stdin.fileno()
    children = set()
    while True:
        ready, _, _ = select.select([listener, stdin], [], [], 1.0)
        for pid in list(children):  # reap the supervisors of finished jobs
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    children.discard(pid)
            except ChildProcessError:
                children.discard(pid)
        if stdin in ready and not os.read(stdin, 4096):
            break  # the harness is gone
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            conn.settimeout(30)
            job = read_request(conn)
            conn.settimeout(None)
            if job is None:
                conn.close()
                continue
            counted = threads()
            if counted != (1, 1):
                conn.sendall((json.dumps({"error": f"the fork server holds {counted} threads: fork is unsafe"}) + "\n").encode())
                conn.close()
                continue
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    listener.close()
                    supervise(conn, job, base_path, loaded)
                    code = 0
                except BaseException:
                    import traceback
                    traceback.print_exc()
                    try:
                        conn.sendall((json.dumps({"error": "the job supervisor failed:\n" + traceback.format_exc()}) + "\n").encode())
                    except BaseException:
                        pass
                finally:
                    os._exit(code)
            children.add(pid)
        except (OSError, ValueError) as e:
            try:
                conn.sendall((json.dumps({"error": f"bad request: {e}"}) + "\n").encode())
            except OSError:
                pass
        conn.close()
    listener.close()
    try:
        os.unlink(path)
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, in case the caller forgot
    if ROOT not in sys.path:
        sys.path.insert(1, ROOT)
    preload()
    sys.exit(serve(sys.argv[1]))
