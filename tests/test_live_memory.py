"""Issues 40 and 48: what a rank holds, counted from every live tensor, against costs().

- common.param_shapes (the sizes every costs() and the fit check read, from the config
  alone: no model, not even on the meta device) is the model's own named_parameters().
- 04 --stage 3 counts its gathered working parameters as 05 does: the root unit, kept
  gathered all step, and the one block being run. Measured (ZeRO.track sums the storages
  of the gathered units as they are taken and given back) = costs()["gathered"], to the
  byte, in fp32 and bf16, with padding (3 ranks) and accumulation; the fit check counts it.
- Every live tensor against costs()'s peak by phase: tests/test_peaks.py (every script).
"""

import importlib.util
import os

import pytest
import torch

import infra.cli
import infra.fit
from common import GPT, GPTConfig, PRESETS, Data, count_params, make_parser, model_config, param_shapes
from harness import ROOT, TINY, launch


def script(name):
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), os.path.join(ROOT, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("changes", [{}, {"bias": False}, {"n_expert": 4, "top_k": 2}, {"n_expert": 3, "bias": False}])
def test_param_shapes_are_the_models(changes):
    config = GPTConfig(vocab_size=65, **{**PRESETS["tiny"], **changes})
    with torch.device("meta"):
        model = GPT(config)
    assert list(param_shapes(config).items()) == [(k, tuple(p.shape)) for k, p in model.named_parameters()]
    assert count_params(config) == (sum(p.numel() for p in model.parameters()), model.num_params())


@pytest.mark.parametrize("dtype, ranks", [("float32", 2), ("bfloat16", 3)])
def test_zero3_counts_its_gathered_parameters(dtype, ranks):
    flags = TINY + ["--dtype", dtype, "--stage", "3", "--global_batch_size", "12", "--micro_batch_size", "2",
                    "--max_iters", "2"]
    run = launch("04_zero.py", flags, nprocs=ranks).ok()
    zero = script("04_zero.py")
    config = GPTConfig(vocab_size=65, **PRESETS["tiny"])
    numels = zero.unit_numels(config)
    pad = lambda numel: -(-numel // ranks) * ranks
    expected = getattr(torch, dtype).itemsize * (pad(numels[0]) + max(pad(n) for n in numels[1:]))
    for step in run.steps:  # the root and one block, never two blocks: to the byte
        assert step["gathered_peak_bytes"] == step["gathered_bound_bytes"] == expected


def test_the_fit_check_counts_zero3s_gathered_parameters():
    zero = script("04_zero.py")
    args = infra.cli.parse_args(zero.add_flags(make_parser(zero.__doc__)),
                            ["--model", "gpt2", "--stage", "3", "--micro_batch_size", "1", "--global_batch_size", "8",
                             "--data", "synthetic"])
    config = model_config(args, Data.vocab_size_of(args.data))
    cost = zero.costs(args, config, 8, torch.bfloat16)
    _, gathered = cost["gathered"]
    root, block = zero.unit_numels(config)[0], zero.unit_numels(config)[1]
    assert gathered == 2 * (-(-root // 8) * 8 + -(-block // 8) * 8)
    # the fit reads costs()'s peak, whose forward and backward hold the gathered units
    assert all("gathered" in cost["peak"][phase][0] for phase in ("forward", "backward"))
    without = {k: v for k, v in cost.items() if k not in ("gathered", "peak", "startup")}  # state + activations
    assert infra.fit.fit_need(cost, "cuda") - infra.fit.fit_need(without, "cuda") >= gathered


def test_planning_quotes_the_zero_paper_figures_the_scripts_compute():
    """Issue 40 item 4: the per-GPU figures docs/planning.md quotes for the ZeRO paper's Figure 1
    (03 and 04 --stage 1/2/3, Ψ = 7.5B on 64 GPUs, bf16) and stage 3's gathered parameters are
    what the scripts' costs() give today (docs/planning.md once said 31.9 GB for stage 1, from
    before stage 1 kept its gradients in fp32)."""
    import re

    import plan
    model = ["--n_layer", "36", "--n_head", "35", "--n_embd", "4165", "--block_size", "1024",
             "--dtype", "bfloat16", "--global_batch_size", "64"]
    _, config, ddp = plan.dry_run("03_ddp.py", model, 64, 4)
    scale = 7.5e9 / plan.count_params_once(config)[0] / 1e9  # bytes to GB at the paper's Ψ
    held = lambda cost: sum(v for _, v in cost["held"].values()) * scale  # noqa: E731
    figures, gathered = [held(ddp)], None
    for stage in (1, 2, 3):
        _, _, cost = plan.dry_run("04_zero.py", model + ["--stage", str(stage)], 64, 4)
        figures.append(held(cost))
        gathered = cost.get("gathered", (None, None))[1]
    text = " ".join(open(os.path.join(ROOT, "docs", "planning.md")).read().split())
    quoted = re.search(r"scaled to 7\.5B: ([\d.]+), ([\d.]+), ([\d.]+), ([\d.]+) GB", text).groups()
    assert list(quoted) == [f"{x:.1f}" for x in figures]
    assert f"add {gathered * scale:.2f} GB at the peak" in text


def test_plan_prices_a_group_by_where_its_ranks_sit():
    """Issue 40 item 3: a collective over whole nodes has every GPU's share of the nodes' NICs
    (k rings side by side), not one GPU's; a group with one rank per node has one GPU's share;
    inside a node, the GPU links."""
    import argparse

    import plan
    polaris = plan.MACHINES["polaris"]  # 4 GPUs, 2 x 25 GB/s of NICs per node: 12.5 GB/s per GPU
    fsdp = argparse.Namespace(replicate=1)
    assert plan.group_of("05_fsdp.py", "all_gather_into_tensor[shard]", fsdp, 8, 4) == (8, 4)  # two whole nodes
    assert plan.group_of("05_fsdp.py", "all_gather_into_tensor[shard]", fsdp, 4, 4) == (4, None)  # one node
    mesh = argparse.Namespace(tp=2, pp=2, cp=1)  # 08 at 16: tp x pp fill a node, dp groups one rank per node
    assert plan.group_of("08_3d.py", "all_reduce[dp]", mesh, 16, 4) == (4, 1)
    assert plan.group_of("08_3d.py", "all_reduce[tp]", mesh, 16, 4) == (2, None)
    seconds = lambda g, k: plan.comm_seconds("reduce_scatter_tensor", 1e9, g, k, polaris)  # noqa: E731
    wire = lambda g: (g - 1) / g * 1e9  # noqa: E731  (a reduce-scatter's bus factor)
    assert seconds(8, 4) == pytest.approx(7 * polaris["alpha_inter"] + wire(8) / (4 * 12.5e9))
    assert seconds(4, 1) == pytest.approx(3 * polaris["alpha_inter"] + wire(4) / 12.5e9)
    assert seconds(4, None) == pytest.approx(3 * polaris["alpha_intra"] + wire(4) / 300e9)
