"""docs/course.md cites only what exists: the course walks every numbered script, 01 to 10, in
order; every name on a "Read:" line is a top-level function, class or table of the section's
script, or a method written Class.method ("Read in common.py:" names common.py's); every bug
it breaks a script with is in tests/bug_zoo.py, and its edits still apply, exactly once, to
the script the course applies it to (08 carries a bug of 06 in its restated block).

    ## 6. Tensor parallel: `06_tensor_parallel.py`    a section: its script
    Read: `TP_PLAN`, `CopyToTP`, `TPBlock.forward`    names that must exist in that script
    Break it: `sp_layernorm_grads_not_all_reduced`    a bug of the zoo
    break_it tp_vocab_not_divisible 08_3d.py          applied to that script by the course

And every command it gives is a valid run: each is dry-run in process at its rank count (the
script's own main() with --dry_run, through plan.dry_run), so a renamed flag or a layout that
no longer divides fails here. Nothing is launched; the file takes a few seconds."""

import ast
import glob
import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bug_zoo import BUGS  # noqa: E402

COURSE = os.path.join(ROOT, "docs", "course.md")
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "[0-9][0-9]_*.py")))
ZOO = {bug.name: bug for bug in BUGS}

SECTION = re.compile(r"^## .*`(\d\d_\w+\.py)`")
NAME = re.compile(r"`([A-Za-z_][\w.]*)`")
BREAK_IT = re.compile(r"\bbreak_it (\w+)(?: (\d\d_\w+\.py))?")


def sections():
    """[(script, [lines of its section])] in the order the course gives them."""
    found = []
    for line in open(COURSE, encoding="utf-8").read().splitlines():
        match = SECTION.match(line)
        if match:
            found.append((match.group(1), []))
        elif line.startswith("## "):
            found.append((None, []))  # a section about no one script ("Where next")
        elif found:
            found[-1][1].append(line)
    return [(script, lines) for script, lines in found if script]


def cited(lines, label):
    """The backquoted names of the section's lines that start with `label`."""
    return [name for line in lines if line.startswith(label) for name in NAME.findall(line)]


def defined(path):
    """Every name a course may cite in a file: top-level functions, classes and assigned names
    (TP_PLAN), and each class's methods as Class.method."""
    names = set()
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{item.name}" for item in node.body
                             if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def test_the_course_walks_every_script_in_order():
    assert [script for script, _ in sections()] == SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_cited_name_exists(script):
    lines = dict(sections())[script]
    names = cited(lines, "Read:")
    assert names, f"docs/course.md's section on {script} has no Read: line"
    missing = sorted(set(names) - defined(os.path.join(ROOT, script)))
    assert not missing, f"docs/course.md cites {', '.join(missing)} in {script}, which defines no such name"
    shared = cited(lines, "Read in common.py:")
    missing = sorted(set(shared) - defined(os.path.join(ROOT, "common.py")))
    assert not missing, f"docs/course.md cites {', '.join(missing)} in common.py, which defines no such name"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_section_runs_its_script(script):
    text = "\n".join(dict(sections())[script])
    assert re.search(rf"python {re.escape(script)}\b", text), f"docs/course.md gives no command running {script}"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if not s.startswith("02_")])  # 02 has no zoo bug
def test_every_strategy_is_broken_with_a_bug_of_the_zoo(script):
    bugs = cited(dict(sections())[script], "Break it:")
    assert bugs, f"docs/course.md's section on {script} breaks it with no bug"
    unknown = [name for name in bugs[:1] if name not in ZOO]
    assert not unknown, f"docs/course.md breaks {script} with {unknown[0]}, which tests/bug_zoo.py does not hold"


def test_every_bug_the_course_applies_still_applies():
    """Each `break_it BUG [SCRIPT]` names a bug of the zoo whose edits occur exactly once in
    the script it is applied to (the bug's own, unless the course names another)."""
    applied = BREAK_IT.findall(open(COURSE, encoding="utf-8").read())
    applied = [(name, script) for name, script in applied if name != "BUG"]  # the function's own usage line
    assert applied
    for name, script in applied:
        assert name in ZOO, f"docs/course.md applies {name}, which tests/bug_zoo.py does not hold"
        bug = ZOO[name]
        script = script or bug.script
        source = open(os.path.join(ROOT, script), encoding="utf-8").read()
        for old, _ in bug.edits:
            assert source.count(old) == 1, \
                f"docs/course.md applies {name} to {script}, which holds {source.count(old)} copies of {old!r}"


COMMAND = re.compile(r"(?:mpiexec -n (\d+) )?python (\d\d_\w+\.py)([^;&\n]*)")


def commands():
    """Each training command the course gives, as (script, ranks, flags) with $F expanded;
    02 (no dry run) and the resumes (they need the checkpoint written before) left out."""
    text = open(COURSE, encoding="utf-8").read()
    flags = re.search(r'^F="([^"]*)"', text, re.M).group(1)
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for ranks, script, rest in COMMAND.findall(block):
            if script.startswith("02_") or "--resume" in rest:
                continue
            found.append((script, int(ranks or 1), rest.replace("$F", flags).split()))
    return found


def test_every_command_the_course_gives_is_valid():
    """Each command, dry-run in process for its rank count (the script's own main() with
    --dry_run, as plan.py asks it): a flag renamed or a layout that no longer divides fails
    here, not in a learner's terminal."""
    sys.path.insert(0, ROOT)
    import plan
    given = commands()
    assert {script for script, _, _ in given} == set(SCRIPTS) - {"02_collectives.py"}
    for script, ranks, flags in given:
        verdict = plan.dry_run(script, flags, ranks, ranks)
        assert not isinstance(verdict, str), f"docs/course.md: {script} {' '.join(flags)} at {ranks} rank(s): {verdict}"
