"""The docs cite only what exists: every repository file (a .md, .py or .sh path) that
README.md, docs/*.md, jobs/README.md or a Python docstring or comment names is in the
repository, every markdown link resolves (to a heading too, when it names one), and the
README stays a front page: at most 300 lines, linking every page of docs/. Fast: reads
files, launches nothing."""

import ast
import glob
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", "out", "logs"}

# a path ending in .md, .py or .sh: directories and a file name, no spaces
CITATION = re.compile(r"(?<![\w./\-*<{$])((?:\.{1,2}/)?(?:[\w.\-]+/)*[\w.\-]*\w\.(?:md|py|sh))(?![\w/\-])")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

# files of other projects that the docs name on purpose, each with the project it belongs to;
# a citation of one counts as external only on a line that names that project
EXTERNAL = {
    "sample.py": "nanoGPT",
    "config/train_shakespeare_char.py": "nanoGPT",
    "examples/sc21/run_table_1.sh": "Megatron-LM",  # docs/planning.md's published runs
    "examples/pretrain_gpt3_175B.sh": "Megatron-LM",
}


def repo_files():
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found += [os.path.relpath(os.path.join(top, f), ROOT) for f in files]
    return found


FILES = repo_files()
BASENAMES = {}
for _path in FILES:
    BASENAMES.setdefault(os.path.basename(_path), []).append(_path)

DOCS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
MARKDOWN = ["README.md", "jobs/README.md"] + DOCS
PYTHON = sorted(p for p in FILES if p.endswith(".py"))


def exists(citation, citing_file):
    """A citation resolves relative to the repository root or to the citing file's folder,
    or, when it is a bare file name, names a file somewhere in the repository (as "lib.sh"
    in jobs/README.md or "frontier_3d.sh" in tests/test_jobs.py do), always inside the
    repository (../shared is not part of it)."""
    for base in (ROOT, os.path.join(ROOT, os.path.dirname(citing_file))):
        path = os.path.realpath(os.path.join(base, citation))
        if path.startswith(ROOT + os.sep) and os.path.exists(path):
            return True
    return "/" not in citation and citation in BASENAMES


def external(citation, line):
    owner = EXTERNAL.get(citation)
    return owner is not None and owner.lower() in line.lower()


def missing_citations(lines, citing_file):
    """(line number, citation, line) for every cited repository file that does not exist."""
    missing = []
    for number, line in lines:
        for match in CITATION.finditer(line):
            citation = match.group(1)
            if not exists(citation, citing_file) and not external(citation, line):
                missing.append((number, citation, line.strip()))
    return missing


def python_texts(path):
    """(line number, text) of every comment and docstring of a Python file."""
    source = open(os.path.join(ROOT, path), encoding="utf-8").read()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                for offset, line in enumerate(first.value.value.splitlines()):
                    yield first.value.lineno + offset, line


def markdown_lines(path):
    return list(enumerate(open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines(), 1))


def report(path, missing):
    return f"{path} cites files that are not in the repository:\n" + "\n".join(
        f"  {path}:{number}: {citation}   ({line[:100]})" for number, citation, line in missing)


@pytest.mark.parametrize("path", MARKDOWN)
def test_markdown_cites_only_files_that_exist(path):
    missing = missing_citations(markdown_lines(path), path)
    assert not missing, report(path, missing)


@pytest.mark.parametrize("path", PYTHON)
def test_python_docstrings_and_comments_cite_only_files_that_exist(path):
    missing = missing_citations(python_texts(path), path)
    assert not missing, report(path, missing)


def anchors(path):
    """GitHub's anchors for the headings of a markdown file."""
    found = set()
    fenced = False
    for line in open(os.path.join(ROOT, path), encoding="utf-8").read().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("path", MARKDOWN)
def test_markdown_links_resolve(path):
    broken = []
    for number, line in markdown_lines(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(os.path.join(ROOT, resolved)) or resolved.startswith(".."):
                broken.append(f"{path}:{number}: {target} (no file {resolved})")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{path}:{number}: {target} (no heading #{anchor} in {resolved})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_front_page():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move reference material into docs/"


def test_readme_links_every_docs_page():
    assert DOCS, "docs/ holds no .md file"
    linked = {target.partition("#")[0] for target in LINK.findall(open(os.path.join(ROOT, "README.md"),
                                                                          encoding="utf-8").read())}
    unlinked = [page for page in DOCS if page not in linked]
    assert not unlinked, f"README.md does not link {', '.join(unlinked)}"


def test_the_readme_keeps_the_test_command_that_ci_runs():
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    command = "python -m pytest -q -n 2 --dist loadfile tests"
    assert command in ci and command in readme


# ----------------------------------------------------------------------------------------
# The scripts the docs name exist, and every script is described where a reader looks
# ----------------------------------------------------------------------------------------

NUMBERED = re.compile(r"(?<![\w/.])(\d\d_\w+\.py)\b")
SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "[0-9][0-9]_*.py")))
ENTRY_POINTS = SCRIPTS + ["plan.py", "plot.py"]


def table_rows(path, heading=None):
    """{first cell: the row's other cells} of the markdown tables in `path` (under `heading`
    only, when given), the first cell's backticks removed."""
    rows, inside = {}, heading is None
    for _, line in markdown_lines(path):
        if line.startswith("#"):
            inside = heading is None or line.lstrip("#").strip() == heading
        elif inside and line.startswith("|") and not set(line) <= set("|-: "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].replace("`", "")] = cells[1:]
    return rows


def described(rows, script):
    """The row whose first cell is the script (with its flags, as `04_zero.py --stage 1/2/3`),
    if it says something."""
    for first, rest in rows.items():
        if first.split()[0] == script and any(cell and cell != "-" for cell in rest):
            return True
    return False


@pytest.mark.parametrize("path", MARKDOWN)
def test_every_numbered_script_the_docs_name_exists(path):
    """A numbered script is named by its file name alone and lives at the top of the
    repository: `07_pipeline.py`, not a renamed or planned one."""
    wrong = [f"{path}:{number}: {name}" for number, line in markdown_lines(path)
             for name in NUMBERED.findall(line) if name not in SCRIPTS]
    assert not wrong, "numbered scripts that are not in the repository:\n" + "\n".join(wrong)


@pytest.mark.parametrize("page, heading", [("README.md", "The scripts"),
                                           ("docs/strategies.md", "The strategies: what each rank holds and sends")])
def test_every_script_is_described(page, heading):
    """README.md's table of scripts and docs/strategies.md's table of costs each give every
    numbered script, plan.py and plot.py a row that describes it."""
    rows = table_rows(page, heading)
    missing = [script for script in ENTRY_POINTS if not described(rows, script)]
    assert not missing, f"{page} has no row describing {', '.join(missing)}"


def test_every_script_has_a_row_of_flags():
    """docs/strategies.md's "Strategy flags" table has a row for every numbered script."""
    rows = table_rows("docs/strategies.md", "Strategy flags")
    missing = [script for script in SCRIPTS if not described(rows, script)]
    assert not missing, f"docs/strategies.md's Strategy flags table has no row for {', '.join(missing)}"
