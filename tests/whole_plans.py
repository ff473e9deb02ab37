"""Whole plans, made once per test session and shared by the tests that read them.

A whole plan (plan.plan: every candidate of every script validated by its dry run and
priced by its costs()) of a 1,024-GPU cluster takes seconds to tens of seconds on this
machine, and several tests ask about the same one: tests/test_plan.py checks that
GPT-3 175B on 1,024 Polaris GPUs gets a fitting 3D layout, tests/test_doc_numbers.py that
docs/planning.md quotes that plan's recommendation. Each asks `whole_plan(flags)` for it:

    whole_plan("--model gpt3-175b --gpus 1024 --machine polaris")
        -> (Ψ, scored, refused, choice, why), as plan.plan returns them, computed once

Under pytest-xdist those tests run in different worker processes (`--dist loadfile` gives
each file to one worker), so a plan is also kept as a JSON file in the session's temporary
folder (tests/conftest.py names it in WHOLE_PLANS_DIR), named by the flags and by the
content of every file plan.py reads (plan.py, common.py, the numbered scripts, infra/): the
first worker to ask makes it under a file lock and the other waits for it, then reads it,
instead of making it again. Without that folder (one process) the in-process cache alone
serves.

The answer is shared: a test must not change the candidates' dicts (copy one first)."""

import fcntl
import functools
import glob
import hashlib
import json
import os

import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sources():
    """A digest of every file a whole plan depends on: a plan kept by a session whose code
    differed is never read back."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "infra", "*.py"))):
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def make(flags):
    args, machine = plan.parse(flags.split())
    return plan.plan(args, machine)


@functools.lru_cache(maxsize=None)
def whole_plan(flags):
    """plan.py's whole plan for `flags` (plan.py's command line as one string)."""
    folder = os.environ.get("WHOLE_PLANS_DIR")
    if not folder:
        return make(flags)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, hashlib.sha256(f"{sources()}\0{flags}".encode()).hexdigest()[:32] + ".json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while the plan is made: the other worker waits, then reads it
        if os.path.exists(path):
            with open(path) as f:
                psi, scored, refused, choice, why = json.load(f)
            return psi, scored, [tuple(r) for r in refused], choice, why  # JSON has no tuples: as plan.plan gives them
        made = make(flags)
        with open(path + ".part", "w") as f:
            json.dump(made, f)
        os.replace(path + ".part", path)  # whole or absent, never half-written
        return made


def plan_args(flags):
    """plan.py's parsed arguments for `flags` (the model flags its candidates' commands start with)."""
    return plan.parse(flags.split())[0]
