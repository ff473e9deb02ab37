"""Launch any script with N ranks on CPU and read back what it wrote.

How ranks start (`launch(..., launcher=...)`):
  * launcher=None (the default): through tests/forkserver.py, a server started once per
    pytest process, each pytest-xdist worker its own (at the first launch; restarted if it
    dies; stopped at exit) that has imported torch, torch._dynamo, numpy and common.py once
    and forks every rank from there, with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) for N > 1 and none for N = 1 (a plain `python script`). A rank
    thus starts in milliseconds instead of the ~2 s each fresh interpreter spends importing
    torch on two cores; the job ends, and reports its status, as under mpiexec or torchrun
    (see forkserver.py).
  * launcher="mpiexec" or "torchrun": that real launcher and a fresh interpreter per rank.
    The tests whose point is the launcher itself (its environment, mpi4py, signals sent to
    rank processes found by pid, a real `python script` start) name one.
  * GPTPAR_TEST_LAUNCHER=mpiexec|torchrun|fork overrides the default for every launch that
    names none, e.g. `GPTPAR_TEST_LAUNCHER=mpiexec python -m pytest tests` runs the whole
    suite through real launchers (some 21 minutes on 2 cores instead of about 5). `default_launcher()` is
    the real launcher the explicit tests use: that variable's, if it names one, else mpiexec
    when it is on the PATH (as on the clusters), else torchrun.

One thread per rank; stdin from /dev/null; the metrics JSONL parsed into a list of dicts.
Tests still share reference runs through module-scoped fixtures."""

import atexit
import contextlib
import io
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the shared flags of a tiny, fast, deterministic CPU run
TINY = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--eval_interval", "0",
        "--log_interval", "1", "--global_batch_size", "8", "--max_iters", "6", "--lr", "3e-3",
        "--warmup_iters", "2", "--timeout", "60"]

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "SLURM_PROCID",
                "SLURM_NTASKS")


LAUNCHERS = ("mpiexec", "torchrun", "fork")


def chosen_launcher():
    """What a launch that names no launcher uses: GPTPAR_TEST_LAUNCHER, else the fork server."""
    chosen = os.environ.get("GPTPAR_TEST_LAUNCHER", "fork") or "fork"
    if chosen not in LAUNCHERS:
        raise ValueError(f"GPTPAR_TEST_LAUNCHER={chosen}: expected one of {', '.join(LAUNCHERS)}")
    return chosen


def default_launcher():
    """The real launcher of the tests that need one: GPTPAR_TEST_LAUNCHER's if it names a real
    one, else mpiexec when it is on the PATH, else torchrun."""
    chosen = chosen_launcher()
    if chosen != "fork":
        return chosen
    return "mpiexec" if shutil.which("mpiexec") else "torchrun"


@dataclass
class Run:
    cmd: list
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    metrics: list = field(default_factory=list)
    statuses: list = None  # each rank's exit status, where the fork server ran the job

    @property
    def losses(self):
        return [row["loss"] for row in self.metrics if "loss" in row]

    @property
    def steps(self):
        return [row for row in self.metrics if "loss" in row]

    @property
    def evals(self):
        return [row for row in self.metrics if "val_loss" in row]

    @property
    def error_lines(self):
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def ok(self):
        assert self.returncode == 0, f"{' '.join(self.cmd)} failed ({self.returncode}):\n{self.stdout[-3000:]}\n{self.stderr[-5000:]}"
        return self


def command(script, nprocs, launcher):
    """The command line of a real launch (launcher None: the default real launcher, or plain
    `python script` for one process)."""
    path = script if os.path.isabs(script) else os.path.join(ROOT, script)
    if nprocs == 1 and launcher is None:
        return [sys.executable, path]
    launcher = launcher or default_launcher()
    if launcher == "mpiexec":
        return ["mpiexec", "-n", str(nprocs), sys.executable, path]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nprocs}", path]
    raise ValueError(launcher)


def launch(script, args=(), nprocs=1, launcher=None, timeout=300, metrics=True, env=None, cwd=None,
           out_dir=True, grace=None, isolated=False):
    """Run `script` with `nprocs` ranks and return a Run (metrics read from --metrics); a
    temporary --metrics file and --out_dir are added unless given (or turned off). launcher:
    None (GPTPAR_TEST_LAUNCHER, else the fork server), "fork", "mpiexec" or "torchrun".
    grace: under the fork server, how long the other ranks may go on once one has failed
    (tests/forkserver.py's GRACE_S unless given). isolated: a script copied out of the
    repository (tests/test_copy.py), forked with none of the repository's modules imported or
    importable (no PYTHONPATH, the repository off sys.path), as in an empty directory; the
    returned Run's `statuses` are then each rank's own exit status. 01 gets `--sample_tokens 0`
    unless the test gives it: its 300 tokens of sample cost four times its six tiny steps."""
    tmp = tempfile.mkdtemp(prefix="gptpar-")
    args = list(map(str, args))
    if os.path.basename(script) == "01_single_gpu.py" and not any(a.startswith("--sample_tokens") for a in args):
        args += ["--sample_tokens", "0"]  # the tests that read a sample ask for one
    metrics_path = os.path.join(tmp, "metrics.jsonl")
    if metrics and "--metrics" not in args:
        args += ["--metrics", metrics_path]
    if out_dir and "--out_dir" not in args:
        args += ["--out_dir", os.path.join(tmp, "out")]
    run_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    run_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    if isolated:
        del run_env["PYTHONPATH"]
    run_env.update(env or {})
    how = launcher or chosen_launcher()
    t0 = time.time()
    statuses = None
    if how == "fork":
        path = script if os.path.isabs(script) else os.path.join(ROOT, script)
        cmd = ["forkserver", "-n", str(nprocs), sys.executable, path] + args
        code, out, err, statuses = FORK_SERVER.run(path, args, nprocs, run_env, cwd or tmp, timeout, tmp, grace,
                                                   isolated=isolated)
    else:
        cmd = command(script, nprocs, launcher) + args  # launcher None: GPTPAR_TEST_LAUNCHER's
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=run_env,
                               cwd=cwd or tmp, stdin=subprocess.DEVNULL)
            code, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            code, out, err = "timeout", (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    run = Run(cmd, code, out, err, time.time() - t0)
    run.statuses = statuses
    path = args[args.index("--metrics") + 1] if "--metrics" in args else None
    if path and os.path.isfile(path):  # not a device (--metrics /dev/full reads zeros forever)
        ours = os.path.basename(script)[:2].isdigit()  # a numbered script (not torch's baselines)
        run.metrics = [without_guard(json.loads(line), nprocs if ours else None) for line in open(path) if line.strip()]
    return run


GUARD = "all_reduce[guard]"


def without_guard(row, nprocs):
    """A metrics row with the guard's per-step flags (infra.stop.Guard: 12 bytes on every rank of a
    multi-rank run, measured and in theory) checked and taken out of comm_bytes and
    comm_bytes_theory, so that a test compares the strategy's own traffic with its formulas.
    nprocs None: not a numbered script (torch's baselines), nothing to check."""
    if "comm_bytes" in row and isinstance(row["comm_bytes"], dict):
        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        import infra.stop
        expected = infra.stop.GUARD_BYTES if nprocs and nprocs > 1 else None
        measured = row["comm_bytes"].pop(GUARD, None)
        theory = (row.get("comm_bytes_theory") or {}).pop(GUARD, None)
        assert nprocs is None or measured == theory == expected, \
            f"the guard sent {measured} B, theory {theory}, expected {expected}"
    return row


class ForkServer:
    """The client side of tests/forkserver.py: one server per process, started at the first
    job, restarted if it has died, stopped at exit."""

    def __init__(self):
        self.proc = self.dir = self.log = None

    def start(self):
        self.stop()
        self.dir = tempfile.mkdtemp(prefix="gptpar-forkserver-")
        self.socket = os.path.join(self.dir, "socket")
        self.log = os.path.join(self.dir, "server.log")
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)  # before torch is imported
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "forkserver.py"), self.socket],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         cwd=ROOT, start_new_session=True)
        line = self.proc.stdout.readline().decode()
        if not line.startswith("ready"):
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the fork server did not start: {line.strip()}\n{open(self.log).read()[-3000:]}"
                               "\n(GPTPAR_TEST_LAUNCHER=mpiexec or torchrun runs the tests without it)")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        if self.proc is not None:
            try:
                self.proc.stdin.close()  # the server ends at end of file
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def connect(self):
        for attempt in range(2):
            if not self.alive():
                self.start()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.socket)
                return conn
            except OSError:
                conn.close()
                if attempt:
                    raise
                self.stop()

    def run(self, script, args, nprocs, env, cwd, timeout, tmp, grace=None, isolated=False):
        """Run one job; (returncode or "timeout", stdout, stderr, each rank's status or None)."""
        return fork_job(self.connect(), script, args, nprocs, env, cwd, timeout, tmp, self.log, grace,
                        isolated=isolated, statuses=True)


def fork_job(conn, script, args, nprocs, env, cwd, timeout, tmp, log=None, grace=None, isolated=False,
             statuses=False):
    """One job through a fork server connection `conn` (which it closes): (returncode or
    "timeout", stdout, stderr), and each rank's exit status (None on a timeout) with
    statuses=True, the ranks' output kept in files under `tmp` meanwhile. ForkServer.run's,
    and that of a stand-in launcher that hands its command to the session's server
    (tests/test_jobs.py, whose python lines would each import torch afresh)."""
    job = BackgroundJob(conn, script, args, nprocs, env, cwd, timeout, tmp, log, grace, isolated)
    out, err = job.communicate()
    return (job.returncode, out, err, job.statuses) if statuses else (job.returncode, out, err)


class BackgroundJob:
    """A job on the fork server that the caller may signal while it runs (`start()`): `pids`
    ({rank: pid}) once every rank is forked, `communicate()` for its output once it has ended
    (returncode and statuses then set), `kill()` ends it (closing the connection makes the
    job's supervisor kill its process group). Also fork_job's one job, not announced."""

    def __init__(self, conn, script, args, nprocs, env, cwd, timeout, tmp, log=None, grace=None, isolated=False,
                 announce=False):
        self.conn, self.log, self.timeout = conn, log, timeout
        self.out, self.err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (self.out, self.err):
            open(path, "w").close()
        job = dict(script=script, args=args, nprocs=nprocs, world=nprocs > 1, env=env, cwd=cwd,
                   timeout=timeout, stdout=self.out, stderr=self.err)
        if nprocs > 1 and (port := worker_port()):
            job["port"] = port
        if grace is not None:
            job["grace"] = grace
        if isolated:
            job["isolated"] = True
        if announce:
            job["announce"] = True
        self.returncode = self.statuses = self.pids = None
        self.data = b""
        try:
            conn.sendall((json.dumps(job) + "\n").encode())
            if announce:
                conn.settimeout(60)
                reply = self.reply()
                self.pids = dict(enumerate(reply["pids"]))
        except BaseException:
            conn.close()
            raise

    def reply(self):
        """The supervisor's next line."""
        while b"\n" not in self.data:
            chunk = self.conn.recv(1 << 16)
            if not chunk:
                raise RuntimeError("the job's supervisor ended without a reply\n"
                                   + (open(self.log).read()[-3000:] if self.log else ""))
            self.data += chunk
        line, self.data = self.data.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"fork server: {reply['error']}")
        return reply

    def communicate(self, timeout=None):
        """Wait for the job's end; (stdout, stderr)."""
        try:
            self.conn.settimeout((timeout or self.timeout) + 60)  # the supervisor ends the job at its timeout
            reply = self.reply()
            self.returncode, self.statuses = reply["returncode"], reply.get("statuses")
        except socket.timeout:  # closing the connection makes the supervisor kill the job
            self.returncode = "timeout"
        finally:
            self.conn.close()
        texts = []
        for path in (self.out, self.err):
            with open(path, errors="replace") as f:
                texts.append(f.read())
            os.remove(path)
        return texts[0], texts[1]

    def poll(self):
        return self.returncode

    def kill(self):
        self.conn.close()


def start(script, args=(), nprocs=1, env=None, cwd=None, timeout=300):
    """`script` on `nprocs` ranks forked from the fork server, returned while it runs (a
    BackgroundJob: its ranks' pids for a test to signal), with the job's environment as
    launch() gives it and no --metrics or --out_dir added."""
    tmp = tempfile.mkdtemp(prefix="gptpar-")
    run_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    run_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    run_env.update(env or {})
    path = script if os.path.isabs(script) else os.path.join(ROOT, script)
    return BackgroundJob(FORK_SERVER.connect(), path, list(map(str, args)), nprocs, run_env, str(cwd or tmp), timeout, tmp,
                         FORK_SERVER.log, announce=True)


def worker_port(_next=[0]):
    """Under pytest-xdist (`-n 2`), the MASTER_PORT of this worker's next multi-rank job; None
    without it (the kernel's free port, picked by the job's supervisor). A port the kernel calls
    free stays free only until someone takes it: with two workers' jobs starting at once, one
    job's store could find its port just handed to the other job's gloo connections. So each
    worker takes ports in turn from its own block of 1,000 below the kernel's ephemeral range
    (32768 and up on Linux), skipping any that does not bind now."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    base = 20000 + 1000 * (int(worker[2:]) % 12)
    for _ in range(1000):
        port = base + _next[0] % 1000
        _next[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    return None


FORK_SERVER = ForkServer()
atexit.register(FORK_SERVER.stop)


def dry(script, *flags):
    """`python script --dry_run flags`, run in this process (a dry run starts no process and
    touches no device; importing torch once instead of once per run keeps the tests fast; and
    the script compiled once, not at every run: 08_3d.py takes 0.06 s).
    Returns what the command would: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    argv, sys.argv = sys.argv, [script, "--dry_run", *map(str, flags)]
    path = os.path.join(ROOT, script)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy._run_module_code(compiled(path), None, "__main__", pkg_name="", script_name=path)  # as run_path would
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), err.getvalue())


_COMPILED = {}  # {path: ((mtime_ns, size), code)}


def compiled(path):
    """The code of the script at `path`, compiled once per process (again once the file changes)."""
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    if _COMPILED.get(path, (None,))[0] != stamp:
        with open(path, "rb") as f:
            _COMPILED[path] = (stamp, compile(f.read(), path, "exec", dont_inherit=True))
    return _COMPILED[path][1]


def assert_losses_match(reference, candidate, rtol=2e-5, atol=2e-6, what=""):
    """docs/design.md's oracle: the same per-step losses as 01_single_gpu.py, within a tolerance
    that allows for a different summation order only."""
    ref, got = np.asarray(reference.losses), np.asarray(candidate.losses)
    assert len(ref) > 0 and ref.shape == got.shape, f"{what}: {len(ref)} reference steps, {len(got)} here"
    worst = np.max(np.abs(ref - got) / np.abs(ref))
    assert np.allclose(got, ref, rtol=rtol, atol=atol), \
        f"{what}: losses differ from 01 (max rel {worst:.2e}):\n01:   {ref}\nhere: {got}"
    # and the global gradient norm clipping took, where both logged it: a scaled gradient
    # (an unaveraged sum, a shard clipped alone) hides from the losses under AdamW, not here
    norms = [[row.get("grad_norm") for row in getattr(run, "steps", [])] for run in (reference, candidate)]
    if all(n and None not in n for n in norms) and len(norms[0]) == len(norms[1]):
        ref_n, got_n = np.asarray(norms[0]), np.asarray(norms[1])
        assert np.allclose(got_n, ref_n, rtol=max(rtol, 1e-4), atol=atol), \
            f"{what}: gradient norms differ from 01:\n01:   {ref_n}\nhere: {got_n}"
