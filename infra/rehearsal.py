"""The rehearsal: any rank of an N-rank run, its real code, in this one process
(--rehearse RANKS --world_size N): the fake process group and fake tensors, the stand-ins for
what depends on the data, every operation a rank posts recorded (record_posts, which a real CPU
run's test uses too), and the report next to costs(). The rehearsed rank's run protocol is
infra.run's RehearsedRun."""

import gc
import inspect
import io
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from functools import wraps

import torch
import torch.distributed as dist
import torch.nn as nn

from common import Data, Env, check, check_batch, fail
from infra.formulas import format_bytes
from infra.ledger import LEDGER, calls_differ
from infra.activations import ActivationMeter
from infra.metrics import finite_or_null, spans
from infra.stop import Guard
from infra.start import opened_problem, output_problem
from infra.dry_run import planned_dtype
from infra.replay import groups_line, pair_bytes, posts_json, recording_every_group, replay, replay_verdict, symmetric_posts


# `--rehearse RANKS --world_size N` runs the script's own main() once per named rank, in this
# process, as that rank of an N-rank job:
#
#   Run.start (the first call)          for rank r in RANKS:          -> RehearsedRun
#     the micro-batch: the dry run's      fake process group (rank r of N: torch's "fake"
#     choice; the ledger; the recorder    backend: every collective returns at once, moving
#                                         nothing), fake tensors (FakeTensorMode: shapes and
#                                         dtypes, no storage), the data's vocabulary only
#                                         main()  ->  two full steps, an evaluation, the
#                                                     checkpoint's pieces; every collective and
#                                                     send/recv counted (ledger) and recorded
#     the report: per rank, held / activations / sent next to costs(); --metrics: one row
#     per rank; every rank's posting order (with fewer than `all`, the others' from their
#     roles', infra.replay's symmetry) replayed under NCCL's rules (infra.replay)
#
# A 175B model's stage needs no memory: its tensors have shapes and no storage. What depends
# on the data gets a stand-in, said in the report (STAND_INS): every value read on the host
# (.item(), .tolist()) reads 0 (the loss, the evaluation, the guard's flags: finite, no stop);
# a bincount (MoE routing) is balanced; small integer tensors and scalars made from no fake
# tensor (token ids, rank tables, routing counts, AdamW's step count) stay real, and a
# collective over real integers acts as if every rank held what this one holds.
#
# What it cannot see: the allocator's fragmentation and caching, the network's speed, the
# kernels' speed and workspaces, a GPU's own kernels (it runs the CPU's, whose saved tensors
# can differ: costs() is asked for the CPU's), the values themselves (docs/planning.md).

REHEARSAL_STEPS = 2  # the first step builds the optimizer state; the second is the steady state


STAND_INS = ("the data: token id 0 everywhere (only the vocabulary size is read)",
             "every value read on the host (.item(), .tolist()) is 0: the loss, the evaluation's losses, "
             "the guard's flags (finite, nobody asked to stop)",
             "MoE routing: balanced (a bincount gives every expert an equal share)",
             "the evaluation: --eval_iters 1; the checkpoint: its pieces listed, nothing written",
             "--micro_batch_size auto: the dry run's choice")


REHEARSING = None  # the Rehearsal under way (the rank being rehearsed), else None


@dataclass
class Rehearsal:
    ranks: list
    micro_batch_size: int
    dtype: str
    rank: int = None
    posts: dict = None  # rank -> its posted operations, in posting order (replay's entries)
    results: dict = None  # rank -> {"rows": [...], "cost": costs(), "pieces": (n, bytes)}
    interned: dict = None  # one tuple per distinct group membership
    made: dict = None  # rank -> every group it made: (name, ranks, desc), the world first (symmetry)
    parent: int = None  # the process that drives the rehearsal (the others are its forked workers)


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) or SIGTERM during a rehearsal: raised in the process driving it."""


def rehearsal_ranks(spec, world_size, roles):
    """RANKS of --rehearse as a sorted list: `all`; `roles`: the ranks whose costs differ as
    the script says (run.start's `ranks`: each pipeline stage's first rank) and the first
    and last rank (the first and last data-parallel replica); or a list `0,17,511`."""
    if spec == "all":
        return list(range(world_size))
    if spec == "roles":
        return sorted({0, world_size - 1, *roles})
    try:
        ranks = sorted({int(r) for r in spec.split(",")})
    except ValueError:
        fail(f"--rehearse {spec}: expected ranks (0,17,511), roles or all")
    check(all(0 <= r < world_size for r in ranks), f"--rehearse {spec}: ranks run from 0 to {world_size - 1} "
          f"(--world_size {world_size})")
    return ranks


def rehearsal_start(run, costs, dp_size, aim, multiple, roles, caller, groups=None):
    """Run.start under --rehearse. The first call (the script's own main()) drives the
    rehearsal and exits; inside it, each rank's main() calls here again and gets its fake
    process group, as setup() would give it a real one."""
    if REHEARSING is None:
        rehearse(run, costs, dp_size, aim, multiple, roles, caller.f_globals[caller.f_code.co_name])
    args, state = run.args, REHEARSING
    args.micro_batch_size, args.device, args.dtype = state.micro_batch_size, "cpu", state.dtype
    args.eval_iters, args.resume = 1, False
    for flag in ("compile", "sample_tokens"):  # 01's: no compiler for fake tensors; no sample
        if hasattr(args, flag):
            setattr(args, flag, 0)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=state.rank, world_size=args.world_size)
    state.made[state.rank].append((dist.group.WORLD.group_name, tuple(range(args.world_size)), "world"))
    run.env = Env(run.launch, torch.device("cpu"), "fake", getattr(torch, state.dtype))
    LEDGER.install(run.env.device)
    LEDGER.take()
    LEDGER.step, LEDGER.phase, LEDGER.posted = None, "setup", {}
    run.rows, run.pieces_count = [], None  # (Run.start makes it a RehearsedRun)
    run.meter = ActivationMeter()
    run.groups = groups(run.env) if groups else None  # the script's process groups, as start() makes them
    run.guard = Guard(args, run.env)
    stop_on_signals()  # (the Guard's handlers wait for a step's end: a rehearsal ends at once)
    return run.env, check_batch(args, dp_size)


def stop_on_signals():
    """Ctrl-C and SIGTERM end a rehearsal at once: a worker exits (its parent says why); the
    process driving it raises Interrupted, ends its workers and exits 128 + the signal."""
    def interrupted(signum, frame):
        if REHEARSING is not None and os.getpid() != REHEARSING.parent:
            os._exit(128 + signum)  # a forked worker, quietly: the terminal's Ctrl-C reached its parent too
        raise Interrupted(signum)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupted)


def rehearsal_settings(args):
    """What the rehearsal reads besides its flags, checked before anything runs (one line, exit
    2): GPTPAR_REHEARSAL_WORKERS=K forked workers (unset or empty: one per CPU it may use);
    GPTPAR_REHEARSAL_POSTS=FILE, every rank's posting order as replayed, in JSON (tests read
    it); --metrics. Returns (the workers, the posts' file or None)."""
    text = os.environ.get("GPTPAR_REHEARSAL_WORKERS", "").strip()
    check(text == "" or (text.isascii() and text.isdigit() and int(text) > 0),
          f"GPTPAR_REHEARSAL_WORKERS={text[:40]!r}: expected a whole number of worker processes, 1 or more "
          "(unset: one per CPU)")
    posts = os.environ.get("GPTPAR_REHEARSAL_POSTS") or None
    check(not (posts and args.metrics and os.path.realpath(posts) == os.path.realpath(args.metrics)),
          f"--metrics and GPTPAR_REHEARSAL_POSTS name the same file, {args.metrics}: the posts would overwrite the rows")
    for flag, path in (("--metrics", args.metrics), ("GPTPAR_REHEARSAL_POSTS", posts)):
        if path:
            problem = output_problem(flag, path) or opened_problem(flag, path)
            check(problem is None, problem)
    return int(text) if text else len(os.sched_getaffinity(0)), posts


def rehearse(run, costs, dp_size, aim, multiple, roles, main):
    """Drive the rehearsal: the micro-batch as the dry run chooses it, then `main()` once per
    rank, then the report and the replay of every rank's posting order (the ranks not
    rehearsed: by the mesh's symmetry, where it holds). Exits: 0, or 1 when the replay finds a
    deadlock or a mismatch; Ctrl-C or SIGTERM: at once, its workers ended, one line, 128 + the
    signal (130 for Ctrl-C)."""
    global REHEARSING
    stop_on_signals()
    try:
        drive(run, costs, dp_size, aim, multiple, roles, main)
    except Interrupted as stop:
        REHEARSING = None
        signum = stop.args[0]
        print(f"error: interrupted by {signal.Signals(signum).name}: the rehearsal and its workers stopped",
              file=sys.stderr, flush=True)
        sys.exit(128 + signum)


def drive(run, costs, dp_size, aim, multiple, roles, main):
    """The rehearsal, as rehearse() says."""
    global REHEARSING
    args = run.args
    workers, posts_file = rehearsal_settings(args)
    ranks = rehearsal_ranks(args.rehearse, args.world_size, roles)
    # one thread: no OpenMP team is ever started, so the forked workers (rehearse_ranks) never
    # wait on one that only the parent had (libgomp's teams do not survive fork)
    torch.set_num_threads(1)
    dtype = str(planned_dtype(args)).replace("torch.", "")
    if args.micro_batch_size == "auto":
        args.dry_run = True  # the choice a dry run makes, for the device it plans for
        run.choose_micro_batch(costs, dp_size, aim, multiple, roles)
        args.dry_run = False
    check_batch(args, dp_size)
    REHEARSING = state = Rehearsal(ranks, args.micro_batch_size, dtype, posts={}, results={}, interned={}, made={},
                                   parent=os.getpid())
    record_posts(lambda entry: state.posts[state.rank].append(entry), state.interned)
    t0, c0 = time.perf_counter(), cpu_seconds()
    workers = rehearse_ranks(state, ranks, main, workers)
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    lines = [f"rehearsal: {run.script} as rank(s) {spans(ranks)} of {args.world_size} ({args.ranks_per_node} per "
             f"node), {dtype}, micro-batch {args.micro_batch_size}: {REHEARSAL_STEPS} steps, an evaluation and the "
             f"checkpoint's pieces each, on the fake backend with fake tensors, in {elapsed:.1f} s ({cpu:.1f} s of CPU"
             + (f", {workers} processes" if workers > 1 else "") + ")",
             *(f"  stand-in: {s}" for s in STAND_INS)]
    if run.chose:
        lines.append(f"  {run.chose}")
    lines.append(groups_line(state.made[ranks[0]], ranks[0]))
    differ = []
    for rank in ranks:
        result = state.results[rank]
        text, problems = rehearsal_lines(rank, result)
        lines += text
        differ += problems
    lines.append("costs(): every rehearsed rank holds and sends what its formulas say" if not differ else
                 f"costs(): {len(differ)} difference(s): " + "; ".join(differ[:8]))
    if args.metrics:
        written(args.metrics, "--metrics", "a",
                [json.dumps(finite_or_null(state.results[rank]["rows"][-1]), allow_nan=False) + "\n" for rank in ranks])
    status, posts, how, t1 = 0, state.posts, None, time.perf_counter()
    gc.disable()  # from here on millions of small objects and no cycles (see replay)
    if len(ranks) < args.world_size:  # the others' orders from their roles' (infra.replay's symmetry)
        posts, how = symmetric_posts(state.posts, state.made, args.world_size, roles)
    if posts_file:  # every rank's posting order, as replayed (the rehearsed ones' where the symmetry is refused)
        written(posts_file, "GPTPAR_REHEARSAL_POSTS", "w", posts_json(ranks, posts if posts is not None else state.posts))
    if posts is None:
        lines.append(f"replay: not done: {how} ({len(ranks)} of {args.world_size} ranks rehearsed; --rehearse all "
                     "replays every rank's own posting order under NCCL's rules)")
    else:
        if how:
            lines.append(f"symmetry: {how}")
        result = replay(posts)
        status = 0 if result.ok else 1
        if not result.ok:
            lines.append(result.report())
        lines.append(replay_verdict(result, posts))
    import resource
    resident = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    lines[0] += (f"; the symmetry and the replay {time.perf_counter() - t1:.1f} s; {resident // 1024:,} MiB resident "
                 "at most (the largest process)")
    print("\n".join(lines), flush=True)
    REHEARSING = None
    gc.enable()
    sys.exit(status)


def written(path, flag, mode, pieces):
    """`pieces` (strings, or made as they are read) written to `path`: a write that fails (a
    full disk) is one line naming the file, exit 2."""
    try:
        with open(path, mode) as f:
            f.writelines(pieces)
    except OSError as e:
        fail(f"cannot write {flag} {path}: {e.strerror or e}")


def cpu_seconds():
    """CPU time of this process and of its workers that have ended."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def rehearse_one(state, rank, main):
    """`main()` as rank `rank`: its posts, the groups it made and its result land in `state`."""
    state.rank, state.posts[rank], state.made[rank] = rank, [], []
    with recording_every_group(state.made[rank]), rehearsal_tensors(), data_stand_in(), \
            redirect_stdout(io.StringIO()):
        main()


def rehearse_ranks(state, ranks, main, workers):
    """Rehearse `ranks`: the first here (a layout the script refuses is refused once, here; and
    FakeTensorMode's cache of operations' outputs is warm after it), the others shared among
    `workers` forked workers (rehearsal_settings: one per CPU), each handing back its ranks'
    posts, groups and results in a file. Returns the processes used. Interrupted (Ctrl-C): the
    workers are ended (SIGKILL) and their files removed before it goes on up."""
    rehearse_one(state, ranks[0], main)
    rest = ranks[1:]
    workers = min(workers, len(rest))
    if workers <= 1:
        for rank in rest:
            rehearse_one(state, rank, main)
        return 1
    children = []
    try:
        return forked(state, rest, main, workers, children)
    except Interrupted:
        for signum in (signal.SIGINT, signal.SIGTERM):  # (a second Ctrl-C must not cut the clean-up short)
            signal.signal(signum, signal.SIG_IGN)
        for pid, path, _ in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ChildProcessError, ProcessLookupError):  # (reaped already)
                pass
            if os.path.exists(path):
                os.unlink(path)
        raise


def forked(state, rest, main, workers, children):
    """rehearse_ranks's workers: each forked with its share of `rest`, its (pid, file, share)
    appended to `children` as it starts; then waited for, their records read."""
    import pickle
    import traceback
    for w in range(workers):
        share = rest[w::workers]
        fd, path = tempfile.mkstemp(prefix="gptpar-rehearsal-")
        os.close(fd)
        sys.stdout.flush()
        sys.stderr.flush()
        # Ctrl-C held until the child is in `children` (raised in fork's callbacks, it is only printed)
        signals = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        pid = os.fork()
        if pid == 0:  # a worker: its ranks, then their records to `path`, then out without cleanup
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
            code = 0
            try:
                for rank in share:
                    rehearse_one(state, rank, main)
                with open(path, "wb") as f:
                    pickle.dump({key: {rank: getattr(state, key)[rank] for rank in share}
                                 for key in ("posts", "made", "results")}, f)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children.append((pid, path, share))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    status = 0
    for pid, path, share in children:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # a worker stopped by a signal only it had
            raise Interrupted(code - 128)
        if code == 0:
            with open(path, "rb") as f:
                records = pickle.load(f)
            for key, by_rank in records.items():
                getattr(state, key).update(by_rank)
        elif code < 0:
            print(f"error: the rehearsal's worker for rank(s) {spans(share)} was killed by signal {-code}",
                  file=sys.stderr, flush=True)
        if code:
            status = status or (code if code > 0 else 1)
        os.unlink(path)
    if status:
        sys.exit(status)  # (the worker said why)
    return workers


def rehearsal_lines(rank, result):
    """One rank's report: held, activation peak and bytes sent by operation, each next to
    costs(); the differences, as the ledger's check names them."""
    row, cost = result["rows"][-1], result["cost"]
    held, sent = row["state_bytes"], row["comm_bytes"]
    measured = {**{f"held {k}": v for k, v in held.items()}, "held activations": row["activation_bytes"],
                **{f"sent {op}": v for op, v in sent.items()}}
    theory = {**{f"held {k}": v for k, (_, v) in cost["held"].items()},
              **{f"sent {op}": v for op, (_, v) in cost["sent"].items()}}
    if "activations" in cost:
        theory["held activations"] = cost["activations"][1]
    problems = [f"rank {rank} {key} {measured.get(key, 0)} B, formula {theory.get(key, 0)} B"
                for key in sorted(set(measured) | set(theory)) if measured.get(key, 0) != theory.get(key, 0)]
    problems += [f"rank {rank} {line}" for line in calls_differ(row["comm_calls"], cost)]
    first, steady = result["rows"][0]["comm_bytes"], sent
    if first != steady:
        problems.append(f"rank {rank} sends differently in step 0 ({first}) and step 1 ({steady})")
    pieces, nbytes = result["pieces"]
    lines = [f"rank {rank}: {cost['layout'] if 'layout' in cost else ''}",
             "  holds " + ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items())
             + f"; activations (peak) {format_bytes(row['activation_bytes'])}"
             + (f" | costs() {format_bytes(theory['held activations'])}" if "held activations" in theory else ""),
             "  sends per step " + (", ".join(f"{op} {format_bytes(v)} in {row['comm_calls'].get(op, 0)} call(s)"
                                              for op, v in sorted(sent.items())) or "nothing"),
             f"  checkpoint: {pieces} piece(s), {format_bytes(nbytes)} written by this rank",
             "  = costs()" if not problems else "  differs from costs(): " + "; ".join(p.split(" ", 2)[2]
                                                                               for p in problems)]
    return lines, problems


@contextmanager
def data_stand_in():
    """common.Data, reading nothing but the vocabulary size: every batch is token 0."""
    init, batch, decode = Data.__init__, Data.batch, Data.decode

    def stand_in_init(self, spec, seed, block_size):
        self.seed, self.block_size, self.itos, self.splits = seed, block_size, None, None
        self.vocab_size = Data.vocab_size_of(spec)

    def stand_in_batch(self, split, step, global_batch_size, dp_rank=0, dp_size=1, eval_split=False):
        rows = torch.zeros(global_batch_size // dp_size, self.block_size, dtype=torch.long)
        return rows, rows.clone()
    Data.__init__, Data.batch, Data.decode = stand_in_init, stand_in_batch, lambda self, ids: ""
    try:
        yield
    finally:
        Data.__init__, Data.batch, Data.decode = init, batch, decode


SMALL_REAL = 1 << 20  # integer tensors made from no fake tensor stay real up to this many elements


def _rehearsal_mode_class():
    from torch._subclasses.fake_tensor import (_DISPATCH_META_HANDLERS as METADATA_QUERIES,
                                               DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                               FakeTensorMode, in_kernel_invocation_manager)
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._pytree import tree_leaves, tree_map_only
    aten = torch.ops.aten
    GROWING = {aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty_strided, aten.repeat,
               aten.repeat_interleave, aten.expand_copy, aten.one_hot}  # outputs larger than their inputs

    def stays_real(t):
        """Small integer tensors and scalars: what a rehearsal keeps real (STAND_INS)."""
        return t.dim() == 0 if t.is_floating_point() or t.is_complex() else t.numel() <= SMALL_REAL

    memos = {f"_{name}{suffix}": None for name in ("nonzero_memo", "item_memo", "unique_memo",
                                                     "unique_consecutive_memo", "nested_int_memo")
             for suffix in ("", "_vc", "_epoch")}

    def new_fake(mode, elem, device):
        """FakeTensor(mode, elem, device) for a meta `elem` and a device already in torch's
        normal form (a fake tensor's, or a real CPU tensor's): what the constructor sets, without
        the checks and conversions of its general forms."""
        t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                        device_for_backend_keys=device)
        if mode._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        else:
            torch._C._set_throw_on_mutable_data_ptr(t)
        t.__dict__.update(memos, _fake_device=device, fake_mode=mode, constant=None, pytype=None, dispatch_keys=None,
                          real_tensor=None)
        return t

    class RehearsalTensors(FakeTensorMode):
        """FakeTensorMode with the rehearsal's stand-ins (see STAND_INS)."""

        # Every operation of a rehearsed rank passes here, ~1,000 a layer's step (forward,
        # backward): torch's per-mode wrapper that turns TorchDynamo off, and FakeTensorMode's own
        # entry (a counter, a check), are skipped: nothing is compiled in a rehearsal.
        _should_skip_dynamo = classmethod(lambda cls: False)

        def _prep_args_for_hash(self, result, args, state, id_hashed_objects):
            """FakeTensorMode's cache key (an op's output metadata is a function of its inputs'),
            with a fake tensor's metadata as one tuple: torch's general form, which allows for
            symbolic sizes and sparse layouts, took 40% of a rehearsal."""
            if isinstance(args, (list, tuple, dict)):
                result += (type(args), len(args))
            if isinstance(args, dict):
                self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
                self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
                return
            for arg in args:
                if type(arg) is FakeTensor and arg.fake_mode is self and arg.constant is None \
                        and arg.layout == torch.strided:
                    result.append((arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                                   arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_conj(), arg.is_neg(),
                                   arg.is_inference()))
                elif isinstance(arg, (list, tuple, dict)):
                    self._prep_args_for_hash(result, arg, state, id_hashed_objects)
                elif isinstance(arg, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                                      torch.memory_format)):
                    result += (type(arg), arg)
                else:  # tensors of other kinds, symbolic values, functions: torch's own rules
                    super()._prep_args_for_hash(result, [arg], state, id_hashed_objects)

        def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
            """FakeTensorMode's output for a cache hit, made directly where it is plain (sizes
            without symbols, strided, not in place): torch's general form, with its checks for
            symbolic sizes and its FakeTensor constructor's, took a third of a rehearsed op."""
            out = entry.metadata
            if out is None or entry.inplace_idx is not None or self.shape_env is not None \
                    or out.layout is not torch.strided or out.is_conj or out.is_neg:
                return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
            empty = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device="meta",
                                        requires_grad=out.requires_grad)
            if isinstance(func, torch._ops.OpOverload) and func.is_view:  # a view shares its input's storage
                empty.set_(args[entry.view_idx].untyped_storage(), out.storage_offset, out.shape, out.stride)
            return new_fake(self, empty, out.device)

        def faked_token_ids(self, func, inputs, args, kwargs):
            """An op of fake tensors and real integer ones (token ids, targets, positions): the
            real ones as fresh fakes of their shape, so that the op's output comes from the
            cache. FakeTensorMode would convert them itself, by its general converter, and not
            cache the op: ~1 ms each, once per micro-batch and layer. Not for an op that writes
            to its inputs, nor for a one-element tensor (torch keeps its value: a constant)."""
            reals = {id(t): t for t in inputs if type(t) is torch.Tensor and t.layout == torch.strided
                     and not (t.is_floating_point() or t.is_complex()) and t.numel() > 1}
            if not reals or getattr(getattr(func, "_schema", None), "is_mutable", True):
                return args, kwargs
            fakes = {i: new_fake(self, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
                                 t.device) for i, t in reals.items()}
            return tree_map_only(torch.Tensor, lambda t: fakes.get(id(t), t), (args, kwargs))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            query = METADATA_QUERIES.get(func)
            if query is not None:  # a fake tensor's device, size or stride: two in three calls, answered first
                return query(args)
            kwargs = kwargs or {}
            inputs = []  # an aten op's tensors: arguments, or in a list argument (Tensor[])
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    inputs.append(a)
                elif isinstance(a, (list, tuple)):
                    inputs += [t for t in a if isinstance(t, torch.Tensor)]
            fake = any(isinstance(t, FakeTensor) for t in inputs)
            if inputs and not fake and getattr(func, "overloadpacket", None) not in GROWING \
                    and all(map(stays_real, inputs)):
                # small real tensors only (a mesh's rank table, token ids, routing counts): run the
                # op for real first, skipping the fake conversion that costs ~1 ms an op (08's
                # describe() indexed its rank table 384 times for 7 s at 1,024 ranks)
                with no_dispatch():
                    out = func(*args, **kwargs)
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                if all(map(stays_real, outs)):
                    return out
                return tree_map_only(torch.Tensor, self.from_tensor, out)  # a real float result: fake on
            if fake and func.namespace == "c10d":
                # a collective or send/recv of fake tensors, on the fake process group (which moves
                # nothing): run on their meta tensors, as FakeTensorMode runs a tensor's metadata
                # queries; its general path for an operator it has no rule for took ~1 ms
                with in_kernel_invocation_manager(self):
                    return func(*args, **kwargs)
            if func is aten._local_scalar_dense.default and fake:  # a value read on the host
                t = args[0]
                return False if t.dtype == torch.bool else 0.0 if t.dtype.is_floating_point else 0
            if func is aten.bincount.default and fake:  # routing counts: balanced
                n, bins = args[0].numel(), max(kwargs.get("minlength", args[2] if len(args) > 2 else 0), 1)
                with no_dispatch():
                    return torch.tensor([n // bins + (e < n % bins) for e in range(bins)], dtype=torch.long)
            if fake and not all(isinstance(t, FakeTensor) for t in inputs):
                args, kwargs = self.faked_token_ids(func, inputs, args, kwargs)
            try:
                out = self.dispatch(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException):
                if fake:
                    raise
                with no_dispatch():  # a real tensor's value or shape: read it for real
                    return func(*args, **kwargs)
            if not fake:  # made from real tensors only: small integer results and scalars stay real
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                if outs and all(map(stays_real, outs)):
                    with no_dispatch():
                        return func(*args, **kwargs)
            return out
    return RehearsalTensors


@contextmanager
def rehearsal_tensors():
    """Fake tensors for everything made inside (shapes and dtypes, no storage), with the
    stand-ins; real tensors met inside are taken as fakes (allow_non_fake_inputs)."""
    to, to_empty = nn.Module.to, nn.Module.to_empty

    # Module.to() and to_empty() swap every fake parameter for its copy (swap_tensors), which a
    # tied weight refuses. To the device it is on, .to() is a no-op for real parameters: so
    # here too; to_empty() gives each parameter (each tied one once) an empty one.
    @wraps(to)
    def same_device_to(module, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and all(device is None or t.device == device
                                 for t in [*module.parameters(), *module.buffers()]):
            return module
        return to(module, *args, **kwargs)

    @wraps(to_empty)
    def fake_to_empty(module, *, device, recurse=True):
        new = {}
        for m in module.modules() if recurse else [module]:
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is not None:
                        if id(t) not in new:
                            empty = torch.empty_like(t, device=device)
                            new[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                        table[name] = new[id(t)]
        return module
    nn.Module.to, nn.Module.to_empty = same_device_to, fake_to_empty
    try:
        with _rehearsal_mode_class()(allow_non_fake_inputs=True):
            yield
    finally:
        nn.Module.to, nn.Module.to_empty = to, to_empty


def _symmetric(op, bound, group_size):
    """A collective over real integer tensors on the fake backend (which moves nothing), as
    if every rank of the group held what this one holds (the rehearsal's stand-in)."""
    if op == "all_to_all_single" and bound.get("output_split_sizes") is None:
        out, inp = bound["output"], bound["input"]
        me = dist.get_rank(bound.get("group"))
        chunk = inp.view(group_size, -1)[me]
        out.view(group_size, -1).copy_(chunk.expand(group_size, -1))
    elif op == "all_reduce" and bound.get("op", dist.ReduceOp.SUM) == dist.ReduceOp.SUM:
        bound["tensor"].mul_(group_size)


RECORDED = {"installed": False, "write": None}


def record_posts(write, interned=None):
    """Wrap torch.distributed so that every operation this process posts is handed to
    `write` as one replay entry, in posting order: a batch_isend_irecv as {"kind": "batch",
    "group", "ops": [{"op": "send" | "recv", "peer" (global rank), "bytes", "tag"}]}; a lone
    isend / irecv / send / recv as {"kind": "send" | "recv", "group", "peer", "bytes", "tag"};
    a collective as {"kind": "all_reduce", ..., "group", "ranks", "bytes"}. "group" is the
    communicator (torch's group_name: two groups of the same ranks are two communicators);
    "desc" its name in the ledger, "where" the step and phase. Install before the ledger
    (CommLedger.install), once per process; a later call changes only `write`."""
    RECORDED["write"] = write
    if RECORDED["installed"]:
        return
    RECORDED["installed"] = True
    interned = {} if interned is None else interned

    def emit(entry, group):
        entry["desc"] = LEDGER.group_name(group) or "world"
        phase = LEDGER.phase
        if phase == "step":  # inside autograd's backward, or the forward (as CommLedger.position says)
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        entry["where"] = sys.intern(f"step {LEDGER.step}, {phase}")  # one string per step and phase, shared
        RECORDED["write"](entry)

    def group_of(group):
        group = group if group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        return group.group_name, interned.setdefault(ranks, ranks)

    def nbytes(value):
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
            return sum(nbytes(v) for v in value)
        return None  # Python objects (all_gather_object, ...): their pickles' size is not known here

    def collective(name, fn):
        signature = inspect.signature(fn)

        @wraps(fn)
        def recorded(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            group = bound.get("group")
            if group == dist.GroupMember.NON_GROUP_MEMBER:  # not a member: torch posts nothing
                return fn(*args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()), None)
            name_, ranks = group_of(group)
            entry = {"kind": name, "group": name_, "ranks": ranks, "bytes": nbytes(first)}
            if name in ("all_to_all", "all_to_all_single"):  # the sizes may differ per pair (10, 04's Muon)
                entry["sent"], entry["received"] = pair_bytes(name, bound, len(ranks))
            emit(entry, group)
            result = fn(*args, **kwargs)
            if REHEARSING is not None:
                tensors = [t for v in bound.values() for t in (v if isinstance(v, (list, tuple)) else [v])
                           if torch.is_tensor(t)]
                if tensors and not any(t.is_floating_point() or type(t) is not torch.Tensor for t in tensors):
                    _symmetric(name, bound, len(ranks))
            return result
        return recorded

    def point_to_point(name, fn):
        @wraps(fn)
        def recorded(tensor, peer=None, group=None, tag=0, **kwargs):
            emit({"kind": "send" if name in ("send", "isend") else "recv", "group": group_of(group)[0],
                  "peer": peer, "bytes": nbytes(tensor), "tag": tag}, group)
            return fn(tensor, peer, group, tag, **kwargs)
        return recorded

    for name in RECORDED_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, collective(name, getattr(dist, name)))
    for name in ("send", "recv", "isend", "irecv"):
        setattr(dist, name, point_to_point(name, getattr(dist, name)))

    class P2POp(dist.P2POp):
        """torch's P2POp accepts only its own isend/irecv: hand it the unwrapped ones."""

        @staticmethod
        def _unwrap(op):
            while hasattr(op, "__wrapped__"):
                op = op.__wrapped__
            return op

        def __new__(cls, op, *args, **kwargs):
            return super().__new__(cls, cls._unwrap(op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(self._unwrap(op), *args, **kwargs)
    dist.P2POp = P2POp
    original = dist.batch_isend_irecv

    @wraps(original)
    def batch_isend_irecv(p2p_ops):
        emit({"kind": "batch", "group": group_of(p2p_ops[0].group)[0] if p2p_ops else None,
              "ops": [{"op": "send" if p.op.__name__ == "isend" else "recv", "peer": p.peer,
                       "bytes": nbytes(p.tensor), "tag": p.tag} for p in p2p_ops]},
             p2p_ops[0].group if p2p_ops else None)
        return original(p2p_ops)
    dist.batch_isend_irecv = batch_isend_irecv


RECORDED_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                        "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
                        "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
