"""The run infrastructure's shape, read from the source (no process started): infra/ is a
package of one module per concern, layered in the order infra/__init__.py's docstring states
(a module imports only modules below it, so no change can quietly close a circle), no module
over MAX_LINES lines, the single-file module gone, common.py importing nothing from infra, and every numbered
script tied to it by exactly one top-level line, `from infra import Run`."""

import ast
import glob
import os

from harness import ROOT

PACKAGE = os.path.join(ROOT, "infra")
MAX_LINES = 720
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "[01][0-9]_*.py")))


def layers():
    """The modules of the package, lowest first, as the docstring of infra/__init__.py lists
    them (top first) under "Layers, top first:"."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGE, "__init__.py")).read()))
    lines = doc.split("Layers, top first:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [line.split()[0] for line in lines][::-1]


def infra_imports(path):
    """(line, module) of every import of an infra module in the file at `path`, at any depth
    (a function's own imports count): `from infra.x import y` and `import infra.x` name x;
    `from infra import x` names x when x is a module, else the package itself ("__init__")."""
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(PACKAGE, "*.py"))}
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "infra":
            if node.module == "infra":
                found += [(node.lineno, a.name if a.name in modules else "__init__") for a in node.names]
            else:
                found.append((node.lineno, node.module.split(".")[1]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1] if "." in a.name else "__init__")
                      for a in node.names if a.name.split(".")[0] == "infra"]
    return found


def test_every_module_is_in_the_stated_order():
    order = layers()
    on_disk = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(PACKAGE, "*.py"))
                     if not p.endswith("__init__.py"))
    assert sorted(order) == on_disk, "infra/__init__.py's layers and the package's modules differ"
    assert len(set(order)) == len(order)


def test_a_module_imports_only_modules_below_it():
    order = layers()
    wrong = [f"infra/{module}.py:{line} imports infra.{other}"
             for level, module in enumerate(order)
             for line, other in infra_imports(os.path.join(PACKAGE, f"{module}.py"))
             if other == "__init__" or order.index(other) >= level]
    assert not wrong, "imports at or above their own layer (a circle, or one about to close):\n" + "\n".join(wrong)


def test_the_package_hands_on_run_alone():
    assert [module for _, module in infra_imports(os.path.join(PACKAGE, "__init__.py"))] == ["run"]
    tree = ast.parse(open(os.path.join(PACKAGE, "__init__.py")).read())
    names = [a.asname or a.name for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
             for a in node.names]
    assert names == ["Run"]


def test_no_module_is_over_the_limit():
    long = {os.path.basename(p): n for p in glob.glob(os.path.join(PACKAGE, "*.py"))
            if (n := len(open(p).read().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_infra_py_is_gone_and_common_imports_nothing_from_infra():
    assert not os.path.exists(os.path.join(ROOT, "infra.py"))
    assert infra_imports(os.path.join(ROOT, "common.py")) == []


def test_every_script_has_one_top_level_run_line():
    """Every training script; 02 (the collectives, no training loop) has no run protocol."""
    assert len(SCRIPTS) == 10
    for script in SCRIPTS:
        tree = ast.parse(open(os.path.join(ROOT, script)).read())
        top = [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
               and "infra" in ast.unparse(node)]
        if script == "02_collectives.py":  # no training loop, no run protocol
            assert top == [], f"{script}: {top}"
            continue
        assert top == ["from infra import Run"], f"{script}: its top-level ties to infra are {top}"
        # before torch: a Ctrl-C while torch is imported is infra's one line, not a traceback (infra/__init__.py)
        line = {ast.unparse(node): node.lineno for node in reversed(tree.body)
                if isinstance(node, (ast.Import, ast.ImportFrom))}
        assert line["from infra import Run"] < line["import torch"], f"{script}: import infra before torch"
