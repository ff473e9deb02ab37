"""The shape of a script, the lesson first (docs/design.md, "The shape of a script"):
a learner reads a numbered training script from the top and stops at main(), and everything
the strategy is sits above that point and nothing else does. Counted from the AST, for 03-10
(01 for what applies to it: a short docstring, one banner, nothing extra above main(); 02 is
the collectives' alphabet and has a shape of its own):

    module docstring         at most 60 lines, its quotes included
    the lesson               line 1 to the last line of main(): at most 500 lines (07: 650)
    main()                   at most 60 lines, its def line included: the training loop
    the first collective     at most 150 lines below the imports, counted from the last line
                             of the last top-level import that comes before the first def or
                             class, to the first line that calls a collective (below)
    one banner               the line `# ---- Beyond the lesson ----`, once, after main()
    nothing extra above it   no top-level def or class above main() named for accounting or
                             extras (costs*, *Muon*, HostCopies, table*, draw*, ...)

A collective call is `dist.<op>(...)` for op in COLLECTIVES (P2POp included, whose ops
batch_isend_irecv posts), or a call of a module-level function that makes one (directly or
through another such function), or `X.apply(...)` of a torch.autograd.Function subclass X of
the script whose forward or backward makes one. The first is the smallest line number of them
all, wherever it is in the file (a restated piece below the banner that main() calls counts
where main() calls it). Pure AST: fast, launches nothing."""

import ast
import fnmatch
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BANNER = "# ---- Beyond the lesson ----"
DOCSTRING_LINES = 60
LESSON_LINES = {"07_pipeline.py": 650}  # the rest: 500
DEFAULT_LESSON_LINES = 500
MAIN_LINES = 60
FIRST_COLLECTIVE_LINES = 150
COLLECTIVES = {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all_single", "all_to_all",
               "broadcast", "reduce", "P2POp"}
EXTRAS = ["costs*", "*_costs", "*Muon*", "muon_*", "HostCopies", "table*", "*_table", "simulate", "draw*",
          "timeline*", "checkpoint_pieces", "layout_lines", "held_bytes", "describe", "plan"]

TRAINING = sorted(f for f in os.listdir(ROOT) if re.fullmatch(r"(0[3-9]|10)_\w+\.py", f))
WITH_01 = ["01_single_gpu.py"] + TRAINING


def parse(script):
    text = open(os.path.join(ROOT, script), encoding="utf-8").read()
    return text, ast.parse(text)


def main_of(tree):
    mains = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"]
    assert len(mains) == 1, "no top-level main()" if not mains else "more than one top-level main()"
    return mains[0]


def docstring_lines(tree):
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        return 0
    return first.end_lineno - first.lineno + 1


def imports_end(tree):
    """The last line of the last top-level import before the first top-level def or class."""
    end = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            end = node.end_lineno
    return end


def is_direct_collective(call):
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and isinstance(f.value, ast.Name)
            and f.value.id == "dist") or (isinstance(f, ast.Name) and f.id == "P2POp")


def collective_lines(tree):
    """The line of every collective call in the module: direct, or through a module-level
    function or an autograd Function (its apply) that makes one."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    autograd = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)
                and any((isinstance(b, ast.Attribute) and b.attr == "Function") or
                        (isinstance(b, ast.Name) and b.id == "Function") for b in node.bases)}

    def calls(node):
        return [n for n in ast.walk(node) if isinstance(n, ast.Call)]

    def is_collective(call, doing_functions, doing_autograd):
        f = call.func
        return (is_direct_collective(call)
                or (isinstance(f, ast.Name) and f.id in doing_functions)
                or (isinstance(f, ast.Attribute) and f.attr == "apply" and isinstance(f.value, ast.Name)
                    and f.value.id in doing_autograd))

    doing_functions, doing_autograd = set(), set()
    while True:  # to a fixed point: a function that calls one that makes a collective makes one
        functions_now = {name for name, node in functions.items()
                         if any(is_collective(c, doing_functions, doing_autograd) for c in calls(node))}
        autograd_now = {name for name, node in autograd.items()
                        if any(is_collective(c, doing_functions, doing_autograd)
                               for method in node.body if isinstance(method, ast.FunctionDef)
                               and method.name in ("forward", "backward") for c in calls(method))}
        if (functions_now, autograd_now) == (doing_functions, doing_autograd):
            break
        doing_functions, doing_autograd = functions_now, autograd_now
    return sorted(c.lineno for c in calls(tree) if is_collective(c, doing_functions, doing_autograd))


def extras_above_main(tree):
    main = main_of(tree)
    return [(node.lineno, node.name) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.lineno < main.lineno
            and any(fnmatch.fnmatchcase(node.name, pattern) for pattern in EXTRAS)]


def banner_lines(text):
    return [number for number, line in enumerate(text.splitlines(), 1) if line.rstrip() == BANNER]


@pytest.mark.parametrize("script", WITH_01)
def test_the_docstring_is_short(script):
    _, tree = parse(script)
    lines = docstring_lines(tree)
    assert 0 < lines <= DOCSTRING_LINES, (
        f"{script}: its docstring is {lines} lines, at most {DOCSTRING_LINES}: the strategy, its picture, the run "
        "lines and what one rank holds and sends; derivations and variants go to docs/strategies.md")


@pytest.mark.parametrize("script", WITH_01)
def test_one_banner_after_main(script):
    text, tree = parse(script)
    found, main = banner_lines(text), main_of(tree)
    assert len(found) == 1, f"{script}: the line `{BANNER}` appears {len(found)} times, once wanted"
    assert found[0] > main.end_lineno, \
        f"{script}: the banner is at line {found[0]}, above the end of main() (line {main.end_lineno})"


@pytest.mark.parametrize("script", WITH_01)
def test_the_lesson_is_short(script):
    _, tree = parse(script)
    limit, end = LESSON_LINES.get(script, DEFAULT_LESSON_LINES), main_of(tree).end_lineno
    assert end <= limit, f"{script}: from the top to the end of main() is {end} lines, at most {limit}"


@pytest.mark.parametrize("script", WITH_01)
def test_main_is_short(script):
    _, tree = parse(script)
    main = main_of(tree)
    lines = main.end_lineno - main.lineno + 1
    assert lines <= MAIN_LINES, (
        f"{script}: main() is {lines} lines, at most {MAIN_LINES}: the training loop with the run protocol at a "
        "handful of points; what is not the strategy goes to a function below the banner")


@pytest.mark.parametrize("script", TRAINING)
def test_the_first_collective_comes_early(script):
    _, tree = parse(script)
    lines, start = collective_lines(tree), imports_end(tree)
    assert lines, f"{script}: no collective call found"
    assert lines[0] - start <= FIRST_COLLECTIVE_LINES, (
        f"{script}: the first collective is at line {lines[0]}, {lines[0] - start} lines below the imports "
        f"(line {start}); at most {FIRST_COLLECTIVE_LINES}: the strategy's own code comes first")


@pytest.mark.parametrize("script", WITH_01)
def test_nothing_extra_above_main(script):
    _, tree = parse(script)
    found = extras_above_main(tree)
    assert not found, f"{script}: defined above main(), but not the lesson (move it below the banner): " + \
        ", ".join(f"{name} (line {line})" for line, name in found)


SAMPLE = '''"""A docstring."""

import torch.distributed as dist
from infra import Run


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return helper(x)


def helper(x):
    dist.all_reduce(x, group=None)
    return x


def costs(args):
    return {}


def main():
    y = AllReduce.apply(x)


# ---- Beyond the lesson ----
'''


def test_the_rules_on_a_small_script():
    """The counting above, on a script small enough to count by hand: the Function's apply in
    main() (line 23), helper's all_reduce (line 14) and helper's call (line 10) are collective
    calls; the imports end on line 4; costs() above main() is an extra."""
    tree = ast.parse(SAMPLE)
    assert docstring_lines(tree) == 1
    assert imports_end(tree) == 4
    assert collective_lines(tree) == [10, 14, 23]
    assert extras_above_main(tree) == [(18, "costs")]
    assert banner_lines(SAMPLE) == [26] and main_of(tree).end_lineno == 23
