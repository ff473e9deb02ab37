"""GPU semantics II, the parts a CPU can see (issue 41, items 3-5).

- The fit check reads the room once every process group exists and has run one collective
  (on GPUs each communicator takes its buffers at its first collective), and after step 0 a
  second check says how far the estimate was from what the step took.
- 07's --measure_bubble times F, B and W with device events read after the step, never a
  device-wide synchronize inside it (the host syncs are counted in test_host_syncs.py).
- 09's (and 08's) ring attention picks its fused kernel by SDPA's head-dim rules, falls back
  to the explicit block where none applies, and hands each kernel's backward the RNG state
  its forward returned.
- --offload's copies go through HostCopies (04_zero.py, restated in 05), and still give 01's losses
  (test_zero.py and test_fsdp.py run --offload; a CPU has no side stream to show)."""

import importlib
import re

import pytest
import torch

from harness import TINY, launch

pipeline_module = importlib.import_module("07_pipeline")
ring_modules = [importlib.import_module("09_context_parallel"), importlib.import_module("08_3d")]


def test_the_fit_check_reads_the_room_with_every_group_up_and_step_0_says_how_far_it_was():
    """07 at 2 stages makes the tied embedding's group; with the world and the guard's, three
    groups exist and have run a collective when the room is read, and after step 0 one line
    compares the estimate with the peak resident memory the step took (a CPU says so)."""
    run = launch("07_pipeline.py", TINY + ["--max_iters", "1"], nprocs=2).ok()
    lines = [line for line in run.stdout.splitlines() if line.startswith("fit after step 0:")]
    assert len(lines) == 1, run.stdout
    line = lines[0]
    assert "its room read with 3 process group(s) up" in line, line
    assert "CPU: the peak resident memory grown since the fit check" in line, line
    took, estimate = (in_bytes(text) for text in re.search(
        r"took ([\d.]+ \w+) .* against the fit check's ([\d.]+ \w+)", line).groups())
    percent, direction = re.search(r"the estimate was (\d+)% (low|high)", line).groups()
    assert direction == ("low" if took > estimate else "high"), line
    assert abs(int(percent) - abs(took / estimate - 1) * 100) <= 1, line
    assert run.stdout.index("ledger (rank 0)") < run.stdout.index("fit after step 0:") < run.stdout.index("step 0:")


def in_bytes(text):
    """"23.3 MiB" -> bytes (infra.formulas.format_bytes's units)."""
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


class FakeEvent:
    """A device event of a fake timeline: recorded at time `at`; elapsed_time in ms."""

    def __init__(self, at):
        self.at, self.synchronized = at, False

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, end):
        assert end.synchronized, "elapsed_time before the end event completed"
        return (end.at - self.at) * 1e3


def test_busy_fraction_reads_device_events_after_the_step():
    """The busy share is the events' spans over the schedule's span, each end event waited
    for on its own (never the device); on CPU the marks are the host clock."""
    spans = [(FakeEvent(1.0), FakeEvent(2.0)), (FakeEvent(3.0), FakeEvent(3.5))]
    whole = (FakeEvent(0.0), FakeEvent(5.0))
    assert pipeline_module.Pipeline.busy_fraction(spans, whole) == pytest.approx(1.5 / 5.0)
    assert all(end.synchronized for _, end in spans) and whole[1].synchronized
    assert not any(start.synchronized for start, _ in spans)
    assert pipeline_module.Pipeline.busy_fraction([(1.0, 2.0)], (0.0, 4.0)) == pytest.approx(0.25)


@pytest.mark.parametrize("module", ring_modules, ids=["09", "08"])
def test_the_ring_picks_its_kernel_by_sdpa_head_dim_rules(module):
    choose = module.fused_kernel
    assert choose("cpu", torch.float32, 25) == "flash_cpu"
    assert choose("cuda", torch.bfloat16, 64) == "flash"
    assert choose("cuda", torch.float16, 256) == "flash"
    assert choose("cuda", torch.bfloat16, 25) == "explicit"  # --n_embd 100 --n_head 4: no fused kernel
    assert choose("cuda", torch.bfloat16, 264) == "efficient"  # flash stops at 256
    assert choose("cuda", torch.float32, 64) == "efficient"
    assert choose("cuda", torch.float32, 100) == "explicit"
    assert choose("xpu", torch.bfloat16, 64) == "explicit"


@pytest.mark.parametrize("head_dim", [25, 16])
def test_the_explicit_block_is_the_fused_kernels_result(head_dim):
    """The fallback is exact: the explicit fp32 block gives the CPU flash kernel's O, L and
    gradients at a head dim no CUDA kernel takes (25) and at one they do (16)."""
    module = ring_modules[0]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 8, head_dim, generator=g) for _ in range(4))
    for causal in (True, False):
        out, lse, state = module.block_forward(q, k, v, causal)
        ref_out, ref_lse = module.explicit_block_forward(q, k, v, causal)
        assert state == ("flash_cpu",)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        grads = module.block_backward(dout, q, k, v, out, lse, causal, state)
        ref = module.explicit_block_backward(dout, q, k, v, out, lse, causal)
        for a, b in zip(grads, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


class FakeAten:
    """aten's two CUDA attention kernels, recording what the backward is handed."""

    def __init__(self):
        self.rng = (torch.tensor([7, 11]), torch.tensor(13))
        self.seen = None

    def _scaled_dot_product_flash_attention(self, q, k, v, p, causal):
        lengths = (torch.empty(0), torch.empty(0), q.size(2), k.size(2))
        return (q.clone(), q.new_zeros(q.shape[:3]), *lengths, *self.rng, torch.empty(0))

    def _scaled_dot_product_flash_attention_backward(self, *args):
        self.seen = args[-2:]
        return args[1], args[2], args[3]

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, lse, p, causal):
        return q.clone(), q.new_zeros(q.shape[:2] + (32,)), *self.rng

    def _scaled_dot_product_efficient_attention_backward(self, *args):
        self.seen = args[7:9]
        return args[1], args[2], args[3], None


@pytest.mark.parametrize("module", ring_modules, ids=["09", "08"])
@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_the_backward_gets_the_forwards_rng_state(module, kernel, monkeypatch):
    """The philox seed and offset (flash: rng_state and its companion) a forward returns are
    what its backward receives, not a placeholder (they decide dropout's mask)."""
    fake = FakeAten()
    monkeypatch.setattr(module, "aten", fake)
    monkeypatch.setattr(module, "fused_kernel", lambda device_type, dtype, head_dim: kernel)
    monkeypatch.setattr(module, "sdpa_accepts", lambda kernel, q, k, v, causal: True)  # as a GPU's SDPA would
    q = torch.randn(1, 2, 4, 8)
    out, lse, state = module.block_forward(q, q, q, True)
    module.block_backward(q, q, q, q, out, lse, True, state)
    assert fake.seen is not None and all(a is b for a, b in zip(fake.seen, fake.rng)), fake.seen


class OneRequestPerBatch:
    """torch.distributed as NCCL answers a batch_isend_irecv: one request for the whole batch
    (its work completes when every op of the batch has)."""

    class Request:
        def __init__(self):
            self.waited = 0

        def wait(self):
            self.waited += 1

        def is_completed(self):
            return False

    def __init__(self):
        self.requests = []

    def get_world_size(self, group):
        return 2

    def get_rank(self, group):
        return 0

    isend, irecv = "isend", "irecv"

    def P2POp(self, op, tensor, group=None, group_peer=None, tag=0):
        return (op, tensor, group_peer, tag)

    def batch_isend_irecv(self, ops):
        self.requests.append(self.Request())
        return self.requests[-1:]


@pytest.mark.parametrize("module", [pipeline_module, ring_modules[1]], ids=["07", "08"])
def test_a_batch_with_two_sends_keeps_nccls_one_request_for_both(module, monkeypatch):
    """Two sends and a receive posted as one batch (the interleaved steady state): the one
    request NCCL returns is waited for, once, for the whole batch, and then the sent output
    is freed (free_output) and the sent gradient kept; 08 runs 07's Pipeline word for word,
    so its 1F1B is held to the same."""
    fake = OneRequestPerBatch()
    monkeypatch.setattr(module, "dist", fake)
    env = type("Env", (), {"device": torch.device("cpu")})()
    pipeline = module.Pipeline([], env, None, 2, (1, 2, 3), timed=False)
    a, b = torch.ones(1, 2, 3), torch.zeros(1, 2, 3)
    batch, sends = [("send", 1, 10), ("send", 1, 11), ("recv", 1, 12)], {10: (a, True), 11: (b, False)}
    requests, received = pipeline.post(batch, sends)
    pipeline.complete(requests, batch, sends)
    (request,) = fake.requests
    assert set(received) == {12} and request.waited == 1
    assert a.numel() == 1 and b.numel() == 6  # the freed output, the kept one
