"""The dry run: validate and price a layout without launching it (--dry_run --world_size N):
the layout, and what one rank holds and sends per step from the script's costs(), with the
checks a launch makes, for the device and dtype it plans for."""

import math
import os
import sys

import torch

from common import check, count_params, fail
from infra.formulas import format_bytes, formula
from infra.data_check import data_problem
from infra.checkpoint_format import CheckpointError
from infra.start import output_problems
from infra.checkpoint import open_checkpoint, run_config


def planned_device_type(args):
    """The device type a dry run plans for: --device, and for auto a GPU's (cuda)."""
    return "cuda" if args.device == "auto" else args.device


def planned_dtype(args):
    """The dtype a dry run plans for: --dtype, and for auto the GPUs' bfloat16 (a login node
    has no GPU to ask), unless --device cpu."""
    if args.dtype == "auto":
        return torch.float32 if args.device == "cpu" else torch.bfloat16
    return getattr(torch, args.dtype)


def dry_run(args, script, config, cost, layout_lines=()):
    """--dry_run: the configuration has been validated for args.world_size ranks; print
    the layout and what one rank holds and sends per step, from the same cost function the
    live ledger checks, then exit 0."""
    problem = data_problem(args.data, config.block_size) or output_problems(args)  # a launch checks these in setup()
    check(problem is None, problem)
    if args.resume:  # the newest checkpoint, opened and checked against this run as a launch would
        try:
            ckpt = open_checkpoint(args.out_dir, run_config(args, config, None), args.unverified)
            ranks = {piece["rank"] for entry in ckpt.meta["tensors"].values() for piece in entry["pieces"]}
            for rank in sorted(ranks):  # a launch opens the files it reads: every one must be there
                path = os.path.join(ckpt.directory, f"rank{rank}.pt")
                if not os.path.isfile(path):
                    raise CheckpointError(f"checkpoint file {path} is missing")
        except CheckpointError as e:
            fail(str(e))
    n, per_node = args.world_size, args.ranks_per_node
    psi, nano = count_params(config)
    held = sum(value for _, value in cost["held"].values())
    lines = [f"dry run: {script} on {n} rank(s), {per_node} per node ({math.ceil(n / per_node)} node(s)); "
             f"model {args.model}: {nano / 1e6:,.2f}M parameters (nanoGPT's count), Ψ = {psi:,}; "
             f"{str(planned_dtype(args)).replace('torch.', '')}",
             *layout_lines, "per rank:"]
    for kind, (formula, value) in cost["held"].items():
        lines.append(f"  holds {kind:<26} {format_bytes(value):>11}   {formula}")
    lines.append(f"  holds {'model state in all':<26} {format_bytes(held):>11}")
    if "gathered" in cost:  # ZeRO-3's and FSDP's working parameters, gathered at the peak
        formula, value = cost["gathered"]
        lines.append(f"  holds {'gathered params (peak)':<26} {format_bytes(value):>11}   {formula}")
    if "activations" in cost:
        formula, value = cost["activations"]
        lines.append(f"  holds {'activations (peak)':<26} {format_bytes(value):>11}   {formula}")
    for phase, (formula, value) in {**cost.get("peak", {}), **({"start-up": cost["startup"]} if "startup" in cost
                                                                 else {})}.items():
        lines.append(f"  peak  {phase + ' (all live)':<26} {format_bytes(value):>11}   {formula}")
    for op, (formula, value) in sorted(cost["sent"].items()):
        lines.append(f"  comm  {op:<26} {format_bytes(value):>11}   per step: {formula}")
    if not cost["sent"]:
        lines.append("  sends nothing")
    if cost.get("muon_flops", ("", 0))[1]:  # --optimizer muon: the matrices this rank orthogonalises
        formula, value = cost["muon_flops"]
        lines.append(f"  Muon  {'Newton-Schulz':<26} {value / 1e9:>7.4g} GFLOP per step: {formula}")
    print("\n".join(lines), flush=True)
    sys.exit(0)
