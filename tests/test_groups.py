"""Every collective and send/recv in a numbered script names its process group, even where
the group is the world (docs/design.md, "The shape of a script"). A call that leaves the
group out runs on the world, which is right in its own script and silently wrong once the
piece is copied into a bigger mesh: 06's gradient norm copied into a DP x TP program would
sum over the replicas too. So this reads every numbered script's syntax tree (no launch) and
names each `dist.<op>(...)` that does not pass `group=` (by keyword, or positionally in the
slot torch's signature gives it, as `dist.P2POp(dist.isend, t, peer, group, tag)` does), and
each `dist.new_group(...)` of a training script that passes no `group_desc` (the name the
ledger, costs() and plan.py know the group by).

`tests/ddp_units.py` (run by test_ddp_units_in_a_bigger_mesh below) shows what naming the
group buys: 03's GradientBuckets and its loss averaging, unchanged, on the sub-groups {0, 1}
and {2, 3} of a 4-rank world give the numbers they give on a 2-rank world of their own."""

import ast
import glob
import inspect
import os
import re
import tempfile

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from harness import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "[0-9][0-9]_*.py")))

# every torch.distributed call that moves data between ranks or waits for them (batch_isend_irecv
# takes P2POps, each of which names its group; new_group and the getters move nothing)
OPERATIONS = ["all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
              "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
              "scatter_object_list", "send", "recv", "isend", "irecv", "P2POp"]


def group_slot(name):
    """The position of `group` among the operation's parameters (torch's own signature, read
    from distributed_c10d, which the ledger's wrappers leave alone)."""
    parameters = [p for p in inspect.signature(getattr(c10d, name)).parameters if p != "self"]
    return parameters.index("group")


SLOTS = {name: group_slot(name) for name in OPERATIONS if hasattr(c10d, name)}


def dist_aliases(tree):
    """The names under which the module imports torch.distributed (`import torch.distributed
    as dist`), and any operation it imports by name (which would hide its calls from `dist.`)."""
    aliases, imported = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            imported += [(node.lineno, a.name) for a in node.names if a.name in SLOTS]
    return aliases, imported


def unnamed_groups(source):
    """(line, text) of every collective or send/recv call in `source` that names no group."""
    tree = ast.parse(source)
    aliases, imported = dist_aliases(tree)
    found = [(line, f"from torch.distributed import {name}: call it as dist.{name}") for line, name in imported]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases
                and node.func.attr in SLOTS):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        if "group" in keywords:
            value = keywords["group"]
            named = not (isinstance(value, ast.Constant) and value.value is None)  # group=None is the world, unnamed
        else:
            positional = [a for a in node.args if not isinstance(a, ast.Starred)]
            named = len(positional) > SLOTS[node.func.attr] and len(positional) == len(node.args)
        if not named:
            found.append((node.lineno, ast.get_source_segment(source, node).splitlines()[0]))
    return sorted(found)


def test_the_check_sees_a_missing_group():
    """The check itself: it flags what leaves the group out and passes what names it."""
    bad = """
import torch.distributed as d
from torch.distributed import all_reduce
d.all_reduce(t)
d.all_reduce(t, group=None)
d.broadcast(t, src=0)
d.P2POp(d.isend, t, peer, tag=3)
d.send(t, group_dst=1)
d.barrier()
"""
    assert [line for line, _ in unnamed_groups(bad)] == [3, 4, 5, 6, 7, 8, 9]
    good = """
import torch.distributed as dist
dist.all_reduce(t, group=g)
dist.all_reduce(t, dist.ReduceOp.MAX, g)
dist.broadcast(t, group=dist.group.WORLD, group_src=0)
dist.P2POp(dist.isend, t, peer, g, tag)
dist.P2POp(dist.irecv, t, group=g, group_peer=1)
dist.batch_isend_irecv(ops)
dist.get_world_size(g)
"""
    assert unnamed_groups(good) == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_collective_names_its_group(script):
    source = open(os.path.join(ROOT, script), encoding="utf-8").read()
    missing = unnamed_groups(source)
    assert not missing, f"{script}: collectives that name no process group (pass group=...):\n" + "\n".join(
        f"  {script}:{line}: {text.strip()}" for line, text in missing)


def nameless_groups(source):
    """(line, text) of every `new_group(...)` call in `source` whose arguments (to its closing
    parenthesis, over as many lines as they take) pass no group_desc."""
    found = []
    for match in re.finditer(r"\bnew_group\(", source):
        depth, end = 1, match.end()
        while depth:  # to the call's closing parenthesis
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        if not re.search(r"\bgroup_desc\s*=", source[match.end():end]):
            line = source.count("\n", 0, match.start()) + 1
            found.append((line, source.splitlines()[line - 1]))
    return found


def test_every_process_group_a_training_script_makes_has_a_name():
    """The ledger counts a collective on a process group under the group's group_desc
    (all_reduce[tp], all_to_all_single[ep]); on a group made without one, under the bare
    operation, as if on the world: costs() could then not say over which ranks it runs, nor
    plan.py price it there. Every training script (those with a ledger: `from infra import
    Run`) names every group it makes; 02 times links and keeps no ledger."""
    assert [line for line, _ in nameless_groups("import torch.distributed as dist\n"
                                               "g = dist.new_group([0, 1])\n"
                                               "h = dist.new_group([0, 1],\n  group_desc='tp')\n"
                                               "k = dist.new_group(list(range(2)),\n  timeout=t)\n")] == [2, 5]
    missing = []
    for script in SCRIPTS:
        source = open(os.path.join(ROOT, script), encoding="utf-8").read()
        if "from infra import Run" in source:
            missing += [f"  {script}:{line}: {text.strip()}" for line, text in nameless_groups(source)]
    assert not missing, "process groups made without a group_desc (the ledger's name for them):\n" + \
        "\n".join(missing)


@pytest.mark.parametrize("overlap", [True, False])
def test_ddp_units_in_a_bigger_mesh(overlap):
    """03's GradientBuckets and mean_over_replicas on the sub-groups {0, 1} and {2, 3} of a
    4-rank world give, bit for bit, the gradients and the mean loss they give on a 2-rank
    world: group {0, 1} works on batch A, group {2, 3} on batch B, and the 2-rank world runs
    A and then B. Summing over the wrong ranks (the world), or dividing by the world's size,
    would mix A into B."""
    with tempfile.TemporaryDirectory(prefix="gptpar-ddp-units-") as tmp:
        flags = ["--out", tmp] + ([] if overlap else ["--no_overlap"])
        launch("tests/ddp_units.py", flags + ["--mesh"], nprocs=4, metrics=False, out_dir=False,
               timeout=120).ok()
        launch("tests/ddp_units.py", flags, nprocs=2, metrics=False, out_dir=False, timeout=120).ok()
        for batch, ranks in (("A", (0, 1)), ("B", (2, 3))):
            for world_rank, group_rank in zip(ranks, (0, 1)):
                mesh = torch.load(os.path.join(tmp, f"mesh_rank{world_rank}.pt"))
                alone = torch.load(os.path.join(tmp, f"alone_{batch}_rank{group_rank}.pt"))
                assert mesh.keys() == alone.keys()
                for name in alone:
                    assert torch.equal(mesh[name], alone[name]), \
                        f"batch {batch}, rank {world_rank} in the mesh: {name} differs from the 2-rank world's " \
                        f"(max difference {(mesh[name] - alone[name]).abs().max():.3g})"
        a, b = (torch.load(os.path.join(tmp, f"alone_{batch}_rank0.pt")) for batch in "AB")
        assert not torch.equal(a["loss"], b["loss"])  # A and B differ: a mix-up could not hide


def test_the_world_named_is_still_called_world():
    """A timed-out collective names its group (docs/failures.md): `group=dist.group.WORLD`
    reads "on group world", as a call that leaves the group out did."""
    import torch.distributed as dist
    from common import _free_port
    from infra.ledger import CommLedger
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        ledger = CommLedger()
        assert ledger.position("all_reduce", None).startswith("all_reduce #1 on group world,")
        assert ledger.position("all_reduce", dist.group.WORLD).startswith("all_reduce #2 on group world,")
        other = dist.new_group([0])
        assert ledger.position("all_reduce", other).startswith("all_reduce #1 on group ranks 0,")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("script, flags", [
    ("06_tensor_parallel.py", []),  # the norm's all-reduce, on a one-rank TP group
    ("07_pipeline.py", []),  # the logged loss's broadcast, in a one-stage pipeline
    ("08_3d.py", ["--zero1"]),  # ZeRO-1's reduce-scatter and all-gather, Muon's all-reduce, at D·C = 1
    ("09_context_parallel.py", []),  # the gradients' and the loss's all-reduces, one rank holding every token
])
def test_a_one_rank_group_posts_nothing(script, flags):
    """A script at one rank posts no collective of its step (03's alone: test_muon.py's
    test_replicas_broadcast_each_matrix_from_its_owner), and costs() prices none: a collective
    on a one-rank group moves nothing, yet a copy into a bigger program would keep paying its
    launch and its buffer copies. The ledger's line per operation is empty on both sides."""
    from harness import TINY
    run = launch(script, TINY + flags + ["--max_iters", "1", "--optimizer", "muon"]).ok()
    row = run.steps[-1]
    assert not any(row["comm_bytes"].values()) and not any(row["comm_bytes_theory"].values()), row
    assert "ledger mismatch" not in run.stdout + run.stderr
