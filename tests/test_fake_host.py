"""--offload on a CPU with host memory told apart from the device (GPTPAR_FAKE_HOST=1, see
common.py's HostTensor and docs/testing.md). On a CPU run host and device are one memory, so a
host tensor that reaches a device op or a collective goes unseen until the first GPU run; under
the fake host it is refused there, as CUDA and NCCL refuse it. Here: 04 (stages 1-3) and 05
train with --offload and --resume under it with 01's losses, and it catches the two defects that
reached the GPU code before (docs: issue 27's defects 2 and 3), which CPU runs without it pass."""

import types

import pytest
import torch

from infra.stop import Guard
from infra.fake_host import HostTensor, host_tensor
from harness import ROOT, TINY, assert_losses_match, launch

FAKE_HOST = {"GPTPAR_FAKE_HOST": "1"}
FLAGS = TINY + ["--grad_clip", "0.05", "--max_iters", "4", "--lr_decay_iters", "4", "--offload"]


@pytest.fixture(scope="module")
def reference():
    return launch("01_single_gpu.py", TINY + ["--grad_clip", "0.05", "--max_iters", "4",
                                              "--sample_tokens", "0"]).ok()


@pytest.mark.parametrize("script, flags", [("04_zero.py", ["--stage", "1"]), ("04_zero.py", ["--stage", "2"]),
                                           ("04_zero.py", ["--stage", "3"]), ("05_fsdp.py", [])],
                         ids=["zero1", "zero2", "zero3", "fsdp"])
def test_offload_and_resume_under_a_fake_host_match_01(tmp_path, reference, script, flags):
    """Two steps and a checkpoint, then a resume for two more: every step's gradients down to
    the host, parameters up, AdamW on host tensors, the guard, clipping and the post-resume
    gather, with no host tensor in a device op or a collective."""
    first = launch(script, FLAGS + flags + ["--max_iters", "2", "--ckpt_interval", "2", "--out_dir", tmp_path],
                   nprocs=2, env=FAKE_HOST).ok()
    second = launch(script, FLAGS + flags + ["--resume", "--out_dir", tmp_path], nprocs=2, env=FAKE_HOST).ok()
    first.metrics += second.metrics
    assert_losses_match(reference, first, what=f"{script} {flags} --offload under GPTPAR_FAKE_HOST=1")


def test_it_catches_an_all_gather_of_the_host_master(tmp_path):
    """Defect 3: 04 gathered the parameters after a resume from its host master converted to
    the working dtype but never moved to the device (`unit.master.to(unit.dtype, copy=True)`).
    Put back into a copy of 04: CPU runs pass; under the fake host the collective refuses it."""
    source = open(f"{ROOT}/04_zero.py").read()
    fixed = "self.copies.up([unit.master], unit.dtype)"  # --offload's way up (04's HostCopies)
    assert fixed in source
    script = tmp_path / "04_zero.py"
    script.write_text(source.replace(fixed, "unit.master.to(unit.dtype, copy=True)"))
    flags = FLAGS + ["--stage", "2", "--max_iters", "2"]
    launch(str(script), flags, nprocs=2).ok()  # host and device one memory: unseen
    run = launch(str(script), flags, nprocs=2, env=FAKE_HOST)
    assert run.returncode != 0
    assert "all_gather_into_tensor was handed a tensor in host memory" in run.stderr


def test_it_catches_the_loss_stacked_with_host_gradient_norms(monkeypatch):
    """Defect 2: the guard stacked the loss (on the device) with the norms of --offload's
    gradient shards (in host memory), which torch.stack refuses on a GPU. Its old line fails
    under the fake host; the guard as it is (norms moved to the device first) passes."""
    monkeypatch.setattr(torch.Tensor, "to", torch.Tensor.to)  # host_tensor() patches it: undone after
    grads = [host_tensor(torch.randn(6)), host_tensor(torch.randn(3))]
    loss = torch.tensor(2.5)
    assert all(isinstance(g.norm(), HostTensor) for g in grads)  # host math stays on the host
    with pytest.raises(RuntimeError, match="stack mixes a tensor in host memory with one on the device"):
        # the guard's old line
        torch.stack([loss.detach().float().reshape(())] + [g.detach().float().norm() for g in grads])
    guard = Guard.__new__(Guard)  # (no signal handlers in the test process)
    guard.env = types.SimpleNamespace(device=torch.device("cpu"), world_size=1, rank=0, master=True)
    guard.args = types.SimpleNamespace(time_limit=0, max_iters=10, out_dir="unused")
    guard.signal = None
    assert guard.check(0, loss, grads) is False  # finite, nobody asked to stop
