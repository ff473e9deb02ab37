"""GPU semantics III, the parts a CPU can see (issue 58).

- G7: a torch older than 2.6 (no group-numbered peers) is refused in setup, in one line naming
  what to load, before it can fail mid-run with a TypeError.
- G13: the guard's flags wait at once on NCCL, RCCL and XCCL (one communicator at a time on
  the device), and a step later on gloo.
- G2: 09's (and 08's) memory-efficient backward gets the log-sum-exp at its forward's length
  (ROCm's is not padded), and a block SDPA's own checks refuse runs explicitly.
- G4: a step 0 that took more than its room warns with the micro-batch that fits.
- G9: a rank's own dump on NCCL is ProcessGroupNCCL's recorder (test_flight_recorder.py: an
  empty dump is named so).
- G3: the explicit ring block (XPU's, and wherever no fused kernel applies) takes its queries in
  chunks whose fp32 scores are bounded, equals the whole block, holds what costs() says it
  holds (counted op by op), and is counted exactly where block_forward chooses it; plan.py
  prices Aurora as xpu. (tests/cp_units.py: the chunked ring equals SDPA on 2 and 4 ranks.)
- G5: the rehearsal says how many process groups a layout makes, and what making them costs
  under device_id (one world-wide ncclCommSplit each) by a stated model (test_rehearse.py:
  08 at dp 2 x pp 2 x tp 2 makes 19).
"""

import argparse
import importlib

import pytest
import torch

import common

ring_modules = [importlib.import_module("09_context_parallel"), importlib.import_module("08_3d")]


def test_a_torch_older_than_2_6_is_refused_in_setup_naming_what_to_load(monkeypatch, capsys):
    assert common.torch_too_old(torch.__version__) is None
    assert common.torch_too_old("2.6.0a0+git1234") is None and common.torch_too_old("2.10.1+rocm7.1") is None
    line = common.torch_too_old("2.3.0+cu121")  # Polaris's conda/2024-04-29
    assert "torch 2.3.0+cu121 is older than 2.6" in line and "module load conda" in line, line
    assert "module load frameworks" in line and "\n" not in line
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(SystemExit) as stop:
        common.setup(argparse.Namespace(device="cpu", dtype="float32", timeout=5), distributed=False)
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: torch 2.5.1 is older than 2.6")


@pytest.mark.parametrize("backend", ["gloo", "nccl", "xccl"])
def test_the_guards_flags_wait_at_once_on_device_backends_and_a_step_later_on_gloo(backend, monkeypatch):
    """G13: the guard's communicator is a second one over the world's ranks. On NCCL, RCCL and
    XCCL its all-reduce is waited for right after posting (the device stream waits, the host
    does not), so it never runs beside the next step's collectives; on gloo it travels while
    the next step runs and is waited for at the next check."""
    import types

    import infra.stop
    events = []

    class Work:
        def __init__(self, step):
            self.step = step

        def wait(self):
            events.append(("wait", self.step))
            return True

    def all_reduce(tensor, op=None, group=None, async_op=False):
        events.append(("post", step))
        return Work(step)

    monkeypatch.setattr(infra.stop.dist, "all_reduce", all_reduce)
    env = types.SimpleNamespace(device=torch.device("cpu"), backend=backend, world_size=1, rank=0, master=True)
    guard = infra.stop.Guard(types.SimpleNamespace(time_limit=0, max_iters=10, out_dir="unused"), env)
    guard.group = "guard"  # as on two ranks
    for step in range(2):
        assert guard.check(step, torch.ones(()), [], norm=torch.ones(())) is False
    lag = [("post", 0), ("wait", 0), ("post", 1)]
    at_once = [("post", 0), ("wait", 0), ("wait", 0), ("post", 1), ("wait", 1)]
    assert events == (lag if backend == "gloo" else at_once), events


class EfficientKernel:
    """aten's memory-efficient attention as CUDA (its log-sum-exp padded to 32 queries) or
    ROCm's AOTriton (compact) returns it; the backward views L at the forward's length, as
    AOTriton does, and fails on any other."""

    def __init__(self, padded):
        self.padded, self.calls = padded, []

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, lse, p, causal):
        self.calls.append("forward")
        t = q.size(2)
        return q.clone(), torch.zeros(q.shape[:2] + ((t + 31) // 32 * 32 if self.padded else t,)), 1, 2

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, *rest):
        self.calls.append("backward")
        t = q.size(2)
        lse.view(q.shape[:2] + ((t + 31) // 32 * 32 if self.padded else t,))
        return q, k, v, None


@pytest.mark.parametrize("module", ring_modules, ids=["09", "08"])
@pytest.mark.parametrize("padded", [True, False], ids=["cuda", "rocm"])
def test_the_efficient_backward_gets_the_log_sum_exp_at_its_forwards_length(module, padded, monkeypatch):
    """G2: the ring merges each block's L over its own t queries; the memory-efficient
    backward is handed it at the length its forward returned (CUDA: padded to 32; ROCm: t)."""
    fake = EfficientKernel(padded)
    monkeypatch.setattr(module, "aten", fake)
    monkeypatch.setattr(module, "fused_kernel", lambda device_type, dtype, head_dim: "efficient")
    monkeypatch.setattr(module, "sdpa_accepts", lambda kernel, q, k, v, causal: True)
    q = torch.randn(1, 2, 12, 8)
    out, lse, state = module.block_forward(q, q, q, True)
    assert lse.shape == (1, 2, 12) and state[0] == "efficient"
    module.block_backward(q, q, q, q, out, lse, True, state)
    assert fake.calls == ["forward", "backward"]


@pytest.mark.parametrize("module", ring_modules, ids=["09", "08"])
def test_a_block_sdpa_refuses_runs_explicitly_forward_and_backward(module, monkeypatch):
    """G2: where SDPA's own checks refuse the kernel the head-dim rules picked (a GPU or
    setting it does not support), the block runs explicitly, and so does its backward."""
    fake, asked, accepts = EfficientKernel(True), [], module.sdpa_accepts
    monkeypatch.setattr(module, "aten", fake)
    monkeypatch.setattr(module, "fused_kernel", lambda device_type, dtype, head_dim: "efficient")
    monkeypatch.setattr(module, "sdpa_accepts", lambda kernel, q, k, v, causal: asked.append(kernel))
    q, dout = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    out, lse, state = module.block_forward(q, q, q, True)
    assert asked == ["efficient"] and state == ("explicit",) and fake.calls == []
    grads = module.block_backward(dout, q, q, q, out, lse, True, state)
    for a, b in zip(grads, module.explicit_block_backward(dout, q, q, q, out, lse, True)):
        torch.testing.assert_close(a, b)
    # on this CPU build torch's SDPA checks refuse both CUDA kernels; the CPU kernel needs none
    assert not accepts("efficient", q, q, q, True) and accepts("flash_cpu", q, q, q, True)


def test_a_step_0_past_the_room_is_a_warning_with_the_micro_batch_that_fits():
    """G4: step 0 that took more than the room the fit check read says so, with the largest
    smaller micro-batch whose estimate, scaled by how far step 0 was from it, fits."""
    from infra.fit import after_step_problem
    args = argparse.Namespace(micro_batch_size=8)
    need = lambda micro_batch_size=8: 1000 + 100 * micro_batch_size  # noqa: E731  (bytes, as costs() says)
    assert after_step_problem(args, need, 1500, 1800, 2000) is None  # within the room
    assert after_step_problem(args, need, 1500, 1800, None) is None  # the room unknown (MPS)
    line = after_step_problem(args, need, 3600, 1800, 3000)  # 2x the estimate: b = 4 needs 2x1400 <= 3000
    assert "step 0 took 3.5 KiB, more than the 2.9 KiB" in line and "(2.00x costs()' estimate" in line, line
    assert "restart with --micro_batch_size 4 (2x the accumulation steps)" in line, line
    line = after_step_problem(args, need, 9000, 1800, 3000)  # 5x: not even b = 1 (5 x 1100)
    assert "no smaller micro-batch fits at that rate: restart with --recompute" in line, line


def test_fit_after_step_0_warns_for_the_rank_past_its_room(monkeypatch, capsys):
    """G4's glue: Run.fit_after_step compares what step 0 took with the room the fit check
    read, and names the micro-batch from the script's own costs()."""
    import types

    import infra.run
    script = importlib.import_module("01_single_gpu")
    parser = script.add_flags(common.make_parser(script.__doc__, experts=True))
    args = infra.run.parse_args(parser, ["--model", "tiny", "--device", "cpu", "--micro_batch_size", "8",
                                         "--global_batch_size", "8"])
    config = common.model_config(args, common.Data.vocab_size_of(args.data))
    env = common.Env(common.Launch("single"), torch.device("cpu"), "gloo", torch.float32)
    cost = script.costs(args, config, 1, torch.float32)
    estimate = infra.run.fit_need(cost, "cpu")
    run = types.SimpleNamespace(args=args, env=env, cost=cost, costs=script.costs, room=estimate * 2, groups_up=1,
                                before_step={}, meter=types.SimpleNamespace(peak=0), held=lambda: {})
    monkeypatch.setattr(infra.run, "memory_taken", lambda env, mark: (int(estimate * 3), (1, 0, 0)))
    infra.run.Run.fit_after_step(run)
    out = capsys.readouterr().out
    assert "the estimate was 200% low" in out and "warning: fit after step 0: rank 0's step 0 took" in out, out
    need = lambda **changes: infra.run.rank_need(args, script.costs, 1, torch.float32, "cpu", (0,), **changes)  # noqa
    assert infra.run.after_step_problem(args, need, int(estimate * 3), estimate, estimate * 2) in out
    run.room = estimate * 4
    infra.run.Run.fit_after_step(run)
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["nccl", "gloo", "xccl"])
def test_the_dump_is_the_recorder_the_backend_writes_to(backend, monkeypatch):
    """G9: on NCCL and RCCL a rank's own dump comes from ProcessGroupNCCL's recorder
    (_dump_nccl_trace, what the watchdog writes under the same name); torch's generic one
    (_dump_fr_trace) holds none of its entries. gloo and XCCL record in the generic one."""
    import infra.ledger
    c10d = torch._C._distributed_c10d
    nccl_dump = lambda: b"nccl's"  # noqa: E731  (a CUDA build's function; this CPU build has none)
    monkeypatch.setattr(c10d, "_dump_nccl_trace", nccl_dump, raising=False)
    monkeypatch.setattr(infra.ledger.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(infra.ledger.dist, "get_backend", lambda group=None: backend)
    chosen = infra.ledger.flight_recorder_dump()
    assert chosen is (nccl_dump if backend == "nccl" else c10d._dump_fr_trace)
    monkeypatch.delattr(c10d, "_dump_nccl_trace")
    assert infra.ledger.flight_recorder_dump() is c10d._dump_fr_trace  # a build without it


def blocks(dtype, M, N, b=2, heads=4, d=16):
    torch.manual_seed(0)
    return [torch.randn(b, heads, n, d, dtype=dtype) for n in (M, N, N, M)]  # q, k, v, dO


@pytest.mark.parametrize("module", ring_modules, ids=["09", "08"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_explicit_block_in_chunks_is_the_whole_block(module, dtype, monkeypatch):
    """G3: chunks of 5 queries (the last one short) give the whole block's O and L and its dQ,
    dK, dV, to rounding: a causal block (the mask shifted to each chunk's first query) and the
    two halves a ring step computes without the mask."""
    for M, N, causal in ((12, 12, True), (12, 6, False), (6, 12, False)):
        q, k, v, dout = blocks(dtype, M, N)
        whole = module.explicit_block_forward(q, k, v, causal)
        grads = module.explicit_block_backward(dout, q, k, v, *whole, causal)
        monkeypatch.setattr(module, "EXPLICIT_SCORES", 2 * 4 * N * 5)
        assert module.query_chunk(2, 4, N) == 5
        chunked = module.explicit_in_chunks(q, k, v, causal)
        for a, b in zip(chunked + module.explicit_backward_in_chunks(dout, q, k, v, *whole, causal), whole + grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        monkeypatch.undo()


def live_peak(fn, inputs):
    """The most bytes of tensor storage alive at once while fn() runs, beyond `inputs`'s,
    counted op by op (infra.activations.LiveStorage's way)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    known = {t.untyped_storage()._cdata: StorageWeakRef(t.untyped_storage()) for t in inputs}
    base = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in inputs}.values())
    peak = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (t.untyped_storage()._cdata not in known
                                                    or known[t.untyped_storage()._cdata].expired()):
                    known[t.untyped_storage()._cdata] = StorageWeakRef(t.untyped_storage())
            now = 0
            for key, ref in list(known.items()):
                if ref.expired():
                    del known[key]
                else:
                    now += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            peak[0] = max(peak[0], now)
            return out
    with Count():
        fn()
    return peak[0] - base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, s, d, chunk", [(4, 64, 16, 64), (4, 64, 16, 8), (4, 64, 16, 5), (2, 128, 8, 128),
                                                 (2, 128, 8, 8)])
def test_the_explicit_blocks_memory_is_what_costs_counts(dtype, heads, s, d, chunk, monkeypatch):
    """G3: a rank's own block (s queries over s keys, causal: the largest a ring step runs),
    whole or in chunks, holds at its most exactly explicit_block_terms' bytes, forward and
    backward, fp32 and bf16, counted op by op (as GPTPAR_COUNT_LIVE counts a run's)."""
    from infra.formulas import formula
    module, b = ring_modules[0], 2
    q, k, v, dout = blocks(dtype, s, s, b, heads, d)
    monkeypatch.setattr(module, "EXPLICIT_SCORES", b * heads * s * chunk)
    out, lse = module.explicit_in_chunks(q, k, v, True)
    measured = (live_peak(lambda: module.explicit_in_chunks(q, k, v, True), (q, k, v)),
                live_peak(lambda: module.explicit_backward_in_chunks(dout, q, k, v, out, lse, True),
                          (dout, q, k, v, out, lse)))
    c = min(s, module.query_chunk(b, heads, s))
    stated = [formula(expr, b=b, a=heads, s=s, h=heads * d, c=c)[1]
              for expr in module.explicit_block_terms("a", "h", c < s, dtype.itemsize)]
    assert list(measured) == stated, (measured, stated)


def cp_costs(module, device, dtype, model="gpt2-xl", block=8192, cp=2, micro=1):
    import infra.run
    parser = module.add_flags(common.make_parser(module.__doc__))
    args = infra.run.parse_args(parser, ["--model", model, "--block_size", str(block), "--cp", str(cp),
                                         "--device", device, "--micro_batch_size", str(micro),
                                         "--global_batch_size", str(micro), "--dry_run", "--world_size", str(cp)])
    config = common.model_config(args, 50304)
    return module.costs(args, config, cp, dtype)


@pytest.mark.parametrize("module", ring_modules, ids=["09", "08"])
def test_costs_count_the_explicit_block_where_block_forward_chooses_it(module, monkeypatch):
    """G3: costs() adds the explicit block's scores exactly where fused_kernel (the rule
    block_forward follows) picks the explicit block: on XPU, not on CUDA or on this CPU's
    fused kernel, and on CPU too where the explicit block is forced. At a block of 8192 on cp 2
    (GPT-2 XL, 25 heads of 64) its forward holds a chunk's scores, 256 MiB at most, not the
    whole block's 1.6 GiB (3.1 GiB in backward)."""
    def scores(device, dtype=torch.bfloat16):
        peak = cp_costs(module, device, dtype)["peak"]
        return [peak[phase][1] - cp_costs(module, "cuda", dtype)["peak"][phase][1] for phase in ("forward", "backward")]
    mask = "max(2"  # the explicit block's causal mask against its output rows, in its forward term
    assert mask not in cp_costs(module, "cuda", torch.bfloat16)["peak"]["forward"][0]  # flash on CUDA
    assert mask not in cp_costs(module, "cuda", torch.float32)["peak"]["forward"][0]  # memory-efficient
    forward, backward = scores("xpu")
    s, b, a, h = 4096, 1, 25, 1600
    c = module.query_chunk(b, a, s)
    assert c == 655 and 4 * b * a * c * s <= module.EXPLICIT_SCORES * 4 < 4 * b * a * s * s
    assert 4 * b * a * c * s < forward < 4 * b * a * c * s + 24 * b * s * h  # the chunk, and linear terms
    assert 8 * b * a * c * s < backward < 8 * b * a * c * s + 48 * b * s * h
    base = cp_costs(module, "cpu", torch.float32, model="gpt2", block=1024)["peak"]
    monkeypatch.setattr(module, "fused_kernel", lambda device_type, dtype, head_dim: "explicit")
    forced = cp_costs(module, "cpu", torch.float32, model="gpt2", block=1024)["peak"]
    assert mask not in base["forward"][0] and mask in forced["forward"][0]  # CPU's flash kernel, or forced
    assert forced["forward"][1] > base["forward"][1] and forced["backward"][1] > base["backward"][1]


def test_plan_prices_aurora_as_xpu():
    """G3: plan.py asks the scripts for Aurora's device kind (xpu), whose kernels decide what
    costs() counts (09's explicit ring block); a machine described by hand stays CUDA's."""
    import plan
    args, machine = plan.parse(["--machine", "aurora", "--gpus", "24", "--model", "gpt2"])
    assert machine["device"] == "xpu" and args.model_flags[-2:] == ["--device", "xpu"]
    args, machine = plan.parse(["--machine", "polaris", "--gpus", "8", "--model", "gpt2"])
    assert "--device" not in args.model_flags


def test_the_group_count_and_its_start_up_cost():
    """G5: from the groups a rank made (the world first): how many new_group calls, of how many
    kinds, how many this rank is in, and the start-up they cost under device_id: each a
    bootstrap all-gather around the whole world, and a communicator's initialisation for each
    group the rank is in. 08's GPT-3 175B at dp 8 x pp 16 x tp 8 (1,024 ranks) makes 393
    (rehearsed: 128 TP, 64 PP, 128 DP, 64 embedding groups, the model's 8 and the guard's):
    about 20 s, of which one split_group per axis would save all but 6 all-gathers."""
    from infra.replay import BOOT_HOP_S, INIT_S, groups_line
    world = 1024
    made = [("0", tuple(range(world)), "world")]
    for desc, size in (("tp", 8), ("pp", 16), ("dp", 8)):
        stride = {"tp": 1, "pp": 64, "dp": 8}[desc]
        for start in range(world // size):
            first = (start // stride) * stride * size + start % stride
            made.append((str(len(made)), tuple(first + i * stride for i in range(size)), desc))
    assert len(made) == 1 + 128 + 64 + 128
    line = groups_line(made, 0)
    seconds = 320 * (world - 1) * BOOT_HOP_S + 3 * INIT_S
    assert line.startswith("process groups: 320 new_group calls on every rank (3 kind(s); rank 0 is in 3)"), line
    assert f"about {seconds:.1f} s of start-up" in line and "ncclCommSplit of the 1,024-rank world" in line, line
    assert groups_line(made[:1], 0).startswith("process groups: 0 new_group calls")
