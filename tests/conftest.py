import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The big tier (`@pytest.mark.big`: rehearsals of big meshes, whole 1,024-GPU plans, and slow repeats of
# checks the suite makes at a smaller size) is the second CI
# step, `python -m pytest -q -m big tests`; the README's `python -m pytest -q -n 2 --dist loadfile tests`
# skips it. Any -m expression is pytest's own selection.
BIG = ("big: a rehearsal of a big mesh, a whole plan, or a slow repeat of a check the suite makes at a smaller size "
       "(tens of seconds); skipped unless selected with `-m big`")


def pytest_configure(config):
    config.addinivalue_line("markers", BIG)


def pytest_collection_modifyitems(config, items):
    if config.getoption("markexpr"):
        return
    import pytest
    skip = pytest.mark.skip(reason="the big tier: python -m pytest -m big tests")
    for item in items:
        if "big" in item.keywords:
            item.add_marker(skip)
