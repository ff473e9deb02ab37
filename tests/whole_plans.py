"""Whole plans, made once per test session and shared by the tests that read them.

A whole plan (plan.plan: every candidate of every script validated by its dry run and
priced by its costs()) of a 1,024-GPU cluster takes seconds to tens of seconds on this
machine, and several tests ask about the same one: tests/test_plan.py checks that
GPT-3 175B on 1,024 Polaris GPUs gets a fitting 3D layout, tests/test_doc_numbers.py that
docs/planning.md quotes that plan's recommendation. Each asks `whole_plan(flags)` for it:

    whole_plan("--model gpt3-175b --gpus 1024 --machine polaris")
        -> (Ψ, scored, refused, choice, why), as plan.plan returns them, computed once

The answer is shared: a test must not change the candidates' dicts (copy one first)."""

import functools

import plan


@functools.lru_cache(maxsize=None)
def whole_plan(flags):
    """plan.py's whole plan for `flags` (plan.py's command line as one string)."""
    args, machine = plan.parse(flags.split())
    return plan.plan(args, machine)


def plan_args(flags):
    """plan.py's parsed arguments for `flags` (the model flags its candidates' commands start with)."""
    return plan.parse(flags.split())[0]
