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
