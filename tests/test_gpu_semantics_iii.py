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
