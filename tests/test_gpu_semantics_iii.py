"""GPU semantics III, the parts a CPU can see (issue 58).

- G7: a torch older than 2.6 (no group-numbered peers) is refused in setup, in one line naming
  what to load, before it can fail mid-run with a TypeError.
"""

import argparse

import pytest
import torch

import common


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
