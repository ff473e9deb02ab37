"""Muon's Newton-Schulz FLOPs in costs() ("muon_flops", infra.formulas.newton_schulz_flops) against the
matrix products the code really runs: each script's own main() rehearsed as every rank of a
3-rank run (--rehearse all: the real steps, in one process, on torch's fake backend with fake
tensors), with the script's orthogonalize wrapped in torch.utils.flop_counter.FlopCounterMode.
04 (ZeRO-1: matrices that straddle the flat shards' boundaries, each gathered whole to its
owner) and 06 (tensor parallelism: c_attn's Q, K and V blocks split in three, put together
whole by their owner) orthogonalise on each rank exactly the FLOPs its formula says, and
together every matrix once; so does 03 (data parallel: ReplicatedMuon, each matrix's owner among
the replicas)."""

import json
import os

import pytest

from harness import ROOT, TINY, launch

# The script loaded as a module with its orthogonalize counted per rehearsed rank, and
# rehearsal_lines (the rehearsal's report, given every rank's costs()) asked for the formula's
WRAPPER = """
import importlib.util, json, sys
from torch.utils.flop_counter import FlopCounterMode
import infra.rehearsal

path = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location("script_under_test", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
measured, theory, real, report = {}, {}, module.orthogonalize, infra.rehearsal.rehearsal_lines

def counted(g, dtype):
    with FlopCounterMode(display=False) as counter:
        out = real(g, dtype)
    rank = infra.rehearsal.REHEARSING.rank
    measured[rank] = measured.get(rank, 0) + counter.get_total_flops() // infra.rehearsal.REHEARSAL_STEPS
    return out

def lines(rank, result):
    theory[rank] = result["cost"]["muon_flops"]
    return report(rank, result)

module.orthogonalize, infra.rehearsal.rehearsal_lines = counted, lines
try:
    module.main()
finally:
    print("MUON_FLOPS " + json.dumps({"measured": measured, "theory": theory}), flush=True)
"""

FLAGS = [*TINY, "--optimizer", "muon", "--n_layer", "1", "--n_head", "6", "--n_embd", "96", "--block_size", "16",
         "--global_batch_size", "6", "--micro_batch_size", "2", "--max_iters", "2", "--rehearse", "all", "--world_size", "3"]


@pytest.mark.parametrize("script, extra", [("04_zero.py", ["--stage", "1"]), ("06_tensor_parallel.py", []),
                                           ("03_ddp.py", [])])
def test_each_rank_orthogonalises_the_flops_its_formula_says(tmp_path, script, extra):
    wrapper = tmp_path / "counted.py"
    wrapper.write_text(WRAPPER)
    # every rank in this one process (no forked workers), so the counts gathered above see them all
    run = launch(str(wrapper), [os.path.join(ROOT, script), *FLAGS, *extra], metrics=False,
                 env={"GPTPAR_REHEARSAL_WORKERS": "1"})
    line = [x for x in run.stdout.splitlines() if x.startswith("MUON_FLOPS ")]
    assert run.returncode == 0 and line, run.stdout + run.stderr
    found = json.loads(line[0].removeprefix("MUON_FLOPS "))
    measured = {int(rank): flops for rank, flops in found["measured"].items()}
    theory = {int(rank): value for rank, (_, value) in found["theory"].items()}
    assert sorted(theory) == [0, 1, 2] and all(text == "5(4·Σr2c + 2·Σr3)" for text, _ in found["theory"].values())
    assert {rank: measured.get(rank, 0) for rank in theory} == theory, script
    # every matrix once: the block's 4 (c_attn 96 x 288, attn.c_proj 96 x 96, c_fc 384 x 96, mlp.c_proj 96 x 384)
    h, L = 96, 1
    per_block = sum(5 * (4 * r * r * c + 2 * r ** 3) for r, c in ((h, 3 * h), (h, h), (h, 4 * h), (h, 4 * h)))
    assert sum(theory.values()) == L * per_block and min(theory.values()) > 0
