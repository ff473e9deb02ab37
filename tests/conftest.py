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


# Seconds each file takes under `-n 2 --dist loadfile` (the sum of its tests' --durations=0 on a
# 2-core host, 2026-11-29, 1,429 tests in 12 min 41 s with every branch of the fifth stop merged);
# a file not listed counts as a few seconds. The two workers take whole files, the next file when
# they run low: handed out heaviest first, the files left at the end are the small ones, and the
# workers finish together instead of one waiting on a long file taken last. (pytest-xdist itself
# orders files by their number of tests; a parametrised file of dry runs is not a long one.)
# Refresh from a full run's `--durations=0`; the order changes only the schedule, never a result.
FILE_SECONDS = {
    "test_rehearse.py": 98, "test_real_conditions.py": 95, "test_3d.py": 84, "test_bitwise.py": 72,
    "test_jobs.py": 48, "test_peaks.py": 59, "test_zero.py": 56, "test_muon.py": 51, "test_bug_zoo.py": 51,
    "test_copy.py": 49, "test_memory.py": 44, "test_expert_parallel.py": 40, "test_launch.py": 38,
    "test_pipeline.py": 35, "test_hostile.py": 35, "test_grad_oracle.py": 34, "test_reliability.py": 33,
    "test_doc_numbers.py": 32, "test_host_syncs.py": 29, "test_vschedules.py": 29,
    "test_context_parallel.py": 26, "test_3d_experts.py": 25, "test_checkpoints.py": 24,
    "test_tensor_parallel.py": 22, "test_routing.py": 22, "test_rehearse_hostile.py": 22,
    "test_restated.py": 22, "test_failures.py": 20, "test_plan.py": 19, "test_hostile_iv.py": 19,
    "test_collectives.py": 9, "test_fsdp.py": 18, "test_ddp.py": 17, "test_frozen.py": 16,
    "test_forkserver.py": 16, "test_formulas.py": 15, "test_single_gpu.py": 14, "test_plot.py": 12,
    "test_wandb.py": 12,
}


def pytest_configure(config):
    config.addinivalue_line("markers", BIG)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False
    if hasattr(config, "workerinput") and config.option.basetemp:  # a pytest-xdist worker: its basetemp is
        # <the session's basetemp>/popen-gwN, so the parent is one folder every worker of this session sees
        # (and pytest removes with the session's other old temporary folders)
        os.environ["WHOLE_PLANS_DIR"] = os.path.join(os.path.dirname(config.option.basetemp), "whole_plans")


def file_seconds(item):
    return FILE_SECONDS.get(os.path.basename(str(item.path)), 5)


def pytest_collection_modifyitems(config, items):
    items.sort(key=file_seconds, reverse=True)  # stable: each file's tests keep their order
    if config.getoption("markexpr"):
        return
    import pytest
    skip = pytest.mark.skip(reason="the big tier: python -m pytest -m big tests")
    for item in items:
        if "big" in item.keywords:
            item.add_marker(skip)
