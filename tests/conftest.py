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
# 2-core host, 2026-11-29, after this stop's changes to test_failures, test_copy and test_collectives;
# the files the fourth stop made cheaper scaled by their measured CPU, until a full run's refresh);
# a file not listed counts as a few seconds. The two workers take whole files, the next file when
# they run low: handed out heaviest first, the files left at the end are the small ones, and the
# workers finish together instead of one waiting on a long file taken last. (pytest-xdist itself
# orders files by their number of tests; a parametrised file of dry runs is not a long one.)
# Refresh from a full run's `--durations=0`; the order changes only the schedule, never a result.
FILE_SECONDS = {
    "test_bitwise.py": 93, "test_rehearse.py": 134, "test_real_conditions.py": 105, "test_3d.py": 97,
    "test_jobs.py": 76, "test_zero.py": 82, "test_memory.py": 72, "test_failures.py": 35, "test_muon.py": 66,
    "test_launch.py": 41, "test_pipeline.py": 64, "test_expert_parallel.py": 59, "test_peaks.py": 59,
    "test_grad_oracle.py": 59, "test_bug_zoo.py": 57, "test_doc_numbers.py": 56, "test_plan.py": 52,
    "test_hostile.py": 48, "test_reliability.py": 46, "test_context_parallel.py": 40, "test_tensor_parallel.py": 34,
    "test_vschedules.py": 33, "test_hostile_iv.py": 30, "test_fsdp.py": 29, "test_copy.py": 48,
    "test_restated.py": 26, "test_host_syncs.py": 25, "test_ddp.py": 25, "test_checkpoints.py": 25,
    "test_routing.py": 22, "test_rehearse_hostile.py": 20, "test_3d_experts.py": 18, "test_single_gpu.py": 18,
    "test_formulas.py": 17, "test_fake_host.py": 17, "test_frozen.py": 16, "test_forkserver.py": 16,
    "test_plot.py": 16, "test_collectives.py": 15, "test_doctor.py": 13, "test_schedules.py": 12,
    "test_hostile_v.py": 11,
}


def pytest_configure(config):
    config.addinivalue_line("markers", BIG)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


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
