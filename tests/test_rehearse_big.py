"""The big tier of --rehearse (`python -m pytest -m big tests`, the second CI step; the plain
suite skips these, tests/conftest.py): the meshes issue 42 names, rehearsed on this machine
at the sizes users run them, each with no deadlock under NCCL's rules.

  * GPT-3 175B on 1,024 ranks, 08 at tp 8 x pp 16 x dp 8 (docs/planning.md's rehearsed
    layout): `roles` (17 ranks executed, 1,007 filled in by the mesh's symmetry), every
    rehearsed rank equal to its costs(), under 4 GiB resident;
  * GPT-3 175B on 1,024 ranks as plan.py recommends it when the test runs, rehearsed by
    `plan.py --rehearse` itself (dp 1 x pp 64 x cp 4 x tp 4 when written, dp 2 x pp 32 x cp 4 since the
    step is simulated from the schedule; then: 65 ranks executed,
    959 by symmetry, 4.3 million operations replayed), equal to costs(), under 4 GiB. The
    fixed layout above stays: it pins a mesh with more data parallelism than the plan's, its
    per-stage parameter bytes, and runs in a tenth of the time;
  * 07 interleaved at p 16, v 2, m 64 and 07 zero bubble at p 16, m 64: `all`;
  * 03 at 65,536 ranks (Frontier has 75k GCDs), `roles`: under a 6 GiB address-space cap and
    1 GiB resident (the symmetry was quadratic in the world: 16,384 ranks 2.5 GB, 65,536 a
    MemoryError; issue 59).

The issue's other two big meshes (08 at pp 16 x cp 4 x tp 8 on 512 ranks, 10 at ep 16) are in
the plain suite, tests/test_rehearse.py, as fast as these are slow."""

import os
import re
import subprocess
import sys

import pytest

from harness import ROOT
from test_rehearse import rehearsed

pytestmark = pytest.mark.big


def test_gpt3_175b_on_1024_ranks_roles_equal_costs_under_4_gib(tmp_path):
    """A stage of GPT-3 175B holds 5.1 GiB of parameters and 10.1 GiB of AdamW state, all fake:
    the 17 ranks and the replay of 861,952 operations stay under 4 GiB (the report's resident
    peak, the largest of the driver and its workers)."""
    flags = ["--model", "gpt3-175b", "--tp", "8", "--pp", "16", "--global_batch_size", "64",
             "--micro_batch_size", "1", "--recompute", "--ranks_per_node", "4"]
    out, rows = rehearsed(tmp_path, "08_3d.py", flags, "roles", 1024)
    assert len(rows) == 17 and {0, 1023} <= set(rows), sorted(rows)  # each stage's first rank, and the last
    assert "symmetry: replayed 1,024 ranks: 17 rehearsed, 1,007 by symmetry" in out, out[-4000:]
    resident = int(re.search(r"([\d,]+) MiB resident", out).group(1).replace(",", ""))
    assert resident < 4096, out.splitlines()[0]
    params = rows[0]["state_bytes"]["params"]
    assert 5 << 30 < params < 6 << 30, params  # 1/128 of 174.6B fp32 parameters: 5.1 GiB


def test_the_plans_gpt3_175b_layout_on_1024_ranks_rehearsed_by_plan_py_equal_costs_under_4_gib():
    """`python plan.py --model gpt3-175b --gpus 1024 --machine polaris --rehearse`: whatever
    layout the plan recommends when this runs (dp 1 x pp 64 x cp 4 ring x tp 4 + SP + ZeRO-1 at
    micro-batch 1 when written: 65 ranks executed, 959 by symmetry, 4.3 million operations
    replayed), rehearsed by plan.py itself: REHEARSED, no deadlock, every rehearsed rank equal
    to its costs(), and the rehearsal's resident peak (the largest of its processes) under 4 GiB."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "plan.py"), "--model", "gpt3-175b", "--gpus", "1024",
                           "--machine", "polaris", "--rehearse"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=900)
    out = done.stdout
    assert done.returncode == 0, (out[-4000:], done.stderr[-4000:])
    lines = out.splitlines()
    assert any(line.startswith("plan: REHEARSED") and "replays under NCCL's rules" in line for line in lines), out[-4000:]
    assert any(line.startswith("replay under NCCL's rules: no deadlock") for line in lines), out[-4000:]
    assert "costs(): every rehearsed rank holds and sends what its formulas say" in lines, out[-4000:]
    head = next(line for line in lines if line.startswith("rehearsal: "))
    ranks = [line for line in lines if re.match(r"rank \d+: ", line)]
    assert len(ranks) > 2 and sum(line == "  = costs()" for line in lines) == len(ranks), out[-4000:]
    assert "1,024 ranks" in next(line for line in lines if line.startswith("symmetry: replayed")), out[-4000:]
    resident = int(re.search(r"([\d,]+) MiB resident", head).group(1).replace(",", ""))
    assert resident < 4096, head


@pytest.mark.parametrize("schedule", [["--schedule", "interleaved", "--virtual_stages", "2"], ["--schedule", "zb"]],
                         ids=["interleaved-v2", "zb"])
def test_07_at_p16_m64_every_rank(tmp_path, schedule):
    """64 micro-batches through 16 stages (m > p, where 07's old interleaved order hung), every
    rank executed and replayed."""
    flags = ["--n_layer", "32", "--global_batch_size", "64", "--micro_batch_size", "1", *schedule]
    _, rows = rehearsed(tmp_path, "07_pipeline.py", flags, "all", 16)
    assert sorted(rows) == list(range(16))


def test_03_at_65536_ranks_roles_in_linear_memory():
    """2 ranks executed, 65,534 filled in by symmetry, 3.9 million operations replayed, in the
    memory 1,024 ranks took, or near it (0.44 GB resident when written; 0.33 GB at 1,024)."""
    import resource

    def capped():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    n = 65536
    done = subprocess.run([sys.executable, os.path.join(ROOT, "03_ddp.py"), "--model", "tiny", "--device", "cpu",
                           "--global_batch_size", str(n), "--rehearse", "roles", "--world_size", str(n)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900, preexec_fn=capped,
                          env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    out = done.stdout
    assert done.returncode == 0, (out[-3000:], done.stderr[-3000:])
    assert "symmetry: replayed 65,536 ranks: 2 rehearsed, 65,534 by symmetry" in out, out[-3000:]
    assert out.splitlines()[-1].startswith("replay under NCCL's rules: no deadlock"), out[-3000:]
    resident = int(re.search(r"([\d,]+) MiB resident", out).group(1).replace(",", ""))
    assert resident < 1024, out.splitlines()[0]
