"""08_3d.py restates the pieces of 06, 07, 09 and 10 it needs word for word: every block fenced

    # ---- restated from <source>: <name>, <name>, ... (word for word; tests/test_restated.py checks it) ----
    ...
    # ---- end restated ----

holds exactly the top-level definitions its header names, and each is, character for
character, the same-named top-level definition of <source> (a function or class with its
docstring and comments, or an assignment). Where 08 needs a piece to differ, the difference is
a named parameter of the source's code, never a second version."""

import ast
import os
import re

import pytest

from harness import ROOT

HEADER = re.compile(r"^# ---- restated from (\S+\.py): (.+) \(word for word; tests/test_restated\.py checks it\) ----$")
END = "# ---- end restated ----"


def definitions(text):
    """{name: source text} of the module's top-level functions, classes and assignments."""
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        else:
            continue
        for name in names:
            found[name] = ast.get_source_segment(text, node)
    return found


def fenced_blocks(path):
    """[(source file, names in the header, the block's text)] of every fence in `path`."""
    lines, blocks, i = open(path).read().splitlines(), [], 0
    while i < len(lines):
        header = HEADER.match(lines[i])
        if header:
            end = lines.index(END, i + 1)
            names = [n.strip() for n in header.group(2).split(",")]
            blocks.append((header.group(1), names, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        else:
            assert "restated from" not in lines[i] or not lines[i].startswith("# ----"), \
                f"{os.path.basename(path)}:{i + 1}: a fence header not in the checked form: {lines[i]}"
        i += 1
    return blocks


BLOCKS = fenced_blocks(os.path.join(ROOT, "08_3d.py"))


def test_08_restates_06_07_09_and_10():
    sources = {source for source, _, _ in BLOCKS}
    assert sources == {"06_tensor_parallel.py", "07_pipeline.py", "09_context_parallel.py",
                       "10_expert_parallel.py"}, sources
    names = [n for _, header, _ in BLOCKS for n in header]
    assert len(names) == len(set(names)), "a piece restated twice"
    for needed in ("TP_PLAN", "shard_boxes", "TPBlock", "ShardedRNG", "Pipeline", "schedule_rounds",
                   "exchanges", "chunk_layers", "RingAttention", "ulysses_attention", "ContextParallel",
                   "AllToAll", "ExpertParallelMoE"):
        assert needed in names, needed


@pytest.mark.parametrize("source, names, block", BLOCKS, ids=[", ".join(n) for _, n, _ in BLOCKS])
def test_each_restated_block_is_word_for_word_its_source(source, names, block):
    inside = definitions(block)
    assert list(inside) == names, f"the fence's header names {names}, it holds {list(inside)}"
    original = definitions(open(os.path.join(ROOT, source)).read())
    for name in names:
        assert name in original, f"{name} is not a top-level definition of {source}"
        assert inside[name] == original[name], f"08_3d.py's {name} differs from {source}'s"


def test_08_defines_no_restated_name_outside_its_fences():
    """08's own code does not keep a second version of a piece it restates."""
    text = open(os.path.join(ROOT, "08_3d.py")).read()
    fenced = "".join(block for _, _, block in BLOCKS)
    own = definitions(text)
    restated = definitions(fenced)
    for name in restated:
        assert own[name] == restated[name], f"{name} is defined again outside its fence"
    assert sum(1 for node in ast.parse(text).body
               if getattr(node, "name", None) in restated) == sum(
        1 for node in ast.parse(fenced).body if getattr(node, "name", None) in restated)


SCRIPTS = sorted(f for f in os.listdir(ROOT) if f[:2].isdigit() and f.endswith(".py") and f != "08_3d.py")
OTHER_BLOCKS = [(script, *block) for script in SCRIPTS for block in fenced_blocks(os.path.join(ROOT, script))]


def test_other_scripts_restate_muons_pieces_from_04():
    """05 and 06 move whole matrices for Muon as 04 does: its owners, and 05 its FlatMuon; 05
    stages --offload's copies as 04 does (HostCopies). 03 gives each matrix an owner among the
    replicas with 04's owners, and 09 and 10 restate 03's ReplicatedMuon."""
    assert {(script, source) for script, source, _, _ in OTHER_BLOCKS} == {
        ("05_fsdp.py", "04_zero.py"), ("06_tensor_parallel.py", "04_zero.py"), ("03_ddp.py", "04_zero.py"),
        ("09_context_parallel.py", "03_ddp.py"), ("10_expert_parallel.py", "03_ddp.py")}


@pytest.mark.parametrize("script, source, names, block", OTHER_BLOCKS,
                         ids=[f"{script}: {', '.join(n)}" for script, _, n, _ in OTHER_BLOCKS])
def test_restated_blocks_of_other_scripts_are_word_for_word(script, source, names, block):
    inside = definitions(block)
    assert list(inside) == names, f"{script}: the fence's header names {names}, it holds {list(inside)}"
    original = definitions(open(os.path.join(ROOT, source)).read())
    own = definitions(open(os.path.join(ROOT, script)).read())
    for name in names:
        assert inside[name] == original[name] == own[name], f"{script}'s {name} differs from {source}'s"
