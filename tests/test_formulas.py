"""Every cost formula is written once: the text printed beside a number is the number.

Each script's costs() is evaluated, without launching, at layouts that exercise its every
branch: the first, a middle and the last pipeline stage (07, 08), sequence parallelism on
and off (06, 08), fp32 and bf16 on CPU and GPU, with and without dropout, ZeRO stages 1-3
and offload (04), FSDP's resharding, prefetch and replicas (05), ring and Ulysses (08, 09),
expert parallelism with balanced and uneven routing (10), --recompute. Every term must come
from infra.formulas.formula, and its text, read back by the small parser below (which knows nothing
of how infra.formulas.formula writes: juxtaposition and · multiply, x² is a power, ⌈x⌉ a ceiling,
names are the formula's own symbols), must evaluate to the number beside it."""

import importlib.util
import os
import re
from fractions import Fraction

import pytest

import common
import infra.cli
import infra.dry_run
from infra.formulas import Formula, formula, plus
from harness import ROOT

COMMON = ["--model", "tiny", "--global_batch_size", "24", "--dry_run"]
DEVICES = (["--device", "cpu", "--dtype", "float32"], ["--device", "cuda", "--dtype", "bfloat16"],
           ["--device", "cpu", "--dtype", "bfloat16", "--dropout", "0.1"],
           ["--device", "cuda", "--dtype", "float32", "--dropout", "0.1"])
LAYOUTS = {  # script: [(world size, flags)]; 07 and 08 at every rank
    "01_single_gpu.py": [(1, []), (1, ["--recompute"]), (1, ["--n_expert", "4", "--top_k", "2"])],
    "03_ddp.py": [(2, []), (4, ["--recompute"])],
    "04_zero.py": [(n, ["--stage", str(z)] + extra) for n in (2, 3) for z in (1, 2, 3)
                   for extra in ([], ["--offload"], ["--recompute"])],
    "05_fsdp.py": [(4, []), (4, ["--replicate", "2"]), (2, ["--no_reshard"]), (2, ["--no_prefetch", "--offload"]),
                   (4, ["--reduce_dtype", "bfloat16", "--recompute"])],
    "06_tensor_parallel.py": [(2, []), (4, ["--sequence_parallel"]), (2, ["--recompute"]),
                              (2, ["--sequence_parallel", "--recompute"])],
    # interleaved: 2 chunks a rank, so 2n layers (07 refuses an empty chunk)
    "07_pipeline.py": [(n, ["--schedule", kind] + (["--n_layer", str(2 * n)] if kind == "interleaved" else []) + extra)
                       for n in (1, 3, 4) for kind in ("gpipe", "1f1b", "interleaved", "zb")
                       for extra in ([], ["--recompute"]) if not (n == 1 and kind == "interleaved")],
    "08_3d.py": [(8, ["--tp", "2", "--pp", "2"]), (8, ["--tp", "2", "--pp", "2", "--sequence_parallel"]),
                 (8, ["--tp", "2", "--pp", "2", "--recompute"]), (12, ["--tp", "2", "--pp", "3", "--zero1"]),
                 (12, ["--pp", "3", "--sequence_parallel", "--tp", "2", "--recompute", "--zero1"]),
                 (8, ["--tp", "1", "--pp", "4"]), (8, ["--tp", "2", "--cp", "2", "--pp", "2"]),
                 (8, ["--cp", "2", "--cp_impl", "ulysses", "--pp", "2", "--recompute"]),
                 (8, ["--cp", "2", "--pp", "2", "--recompute", "--zero1"]), (2, [])],
    "09_context_parallel.py": [(2, ["--cp", "2"]), (4, ["--cp", "2", "--cp_impl", "ulysses"]),
                               (4, ["--cp", "4", "--recompute"]), (2, ["--cp", "1"]),
                               (4, ["--cp", "2", "--cp_impl", "ulysses", "--recompute"])],
    "10_expert_parallel.py": [(n, ["--n_expert", "4", "--top_k", "2"] + extra) for n in (2, 4)
                              for extra in ([], ["--ep", "2"], ["--recompute"])],
}
PIPELINES = ("07_pipeline.py", "08_3d.py")


def load(name):
    """The script as a module, as plan.py loads it (its main() does not run)."""
    spec = importlib.util.spec_from_file_location("formulas_" + name[:2], os.path.join(ROOT, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def costs_at(name, world, flags):
    """[(rank, costs())] of script `name` at a layout: every rank of a pipeline, else rank 0."""
    module = load(name)
    argv = COMMON + ["--world_size", str(world), "--micro_batch_size", "2"] + flags
    parser = module.add_flags(common.make_parser(module.__doc__, experts=name in ("01_single_gpu.py",
                                                                                   "10_expert_parallel.py")))
    args = infra.cli.parse_args(parser, argv)
    config = common.model_config(args, common.Data.vocab_size_of(args.data))
    dtype = infra.dry_run.planned_dtype(args)
    if name in PIPELINES:
        return [(rank, module.costs(args, config, world, dtype, rank)) for rank in range(world)]
    if name == "10_expert_parallel.py":  # also a step whose routing was uneven
        L, b = config.n_layer, args.micro_batch_size
        m = args.global_batch_size // (b * world)
        uneven = [[(l + i) * 37 % (4 * b * config.block_size) for i in range(m)] for l in range(L)]
        return [(0, module.costs(args, config, world, dtype)), (0, module.costs(args, config, world, dtype, uneven))]
    return [(0, module.costs(args, config, world, dtype))]


def terms_of(cost):
    """(key, term) of every formula in a costs() result."""
    for kind in ("held", "sent"):
        for op, term in cost[kind].items():
            yield f"{kind} {op}", term
    for key in ("activations", "gathered"):
        if key in cost:
            yield key, cost[key]


# ----------------------------------------------------------------------------------------
# Reading a formula's text back, independently of how infra.formulas.formula writes it
# ----------------------------------------------------------------------------------------

SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")


def tokens(text, names):
    """Numbers, superscript powers, operators, and names (longest first among `names`)."""
    names = sorted(set(names) | {"max", "min"}, key=len, reverse=True)
    out, i = [], 0
    while i < len(text):
        if text[i] == " ":
            i += 1
            continue
        number = re.match(r"\d+|[⁰¹²³⁴⁵⁶⁷⁸⁹]+", text[i:])
        if number:
            kind = "pow" if number.group()[0] in "⁰¹²³⁴⁵⁶⁷⁸⁹" else "num"
            out.append((kind, number.group().translate(SUPERSCRIPTS)))
            i += len(number.group())
        elif text[i] in "+-·/(),⌈⌉":
            out.append(("op", text[i]))
            i += 1
        else:
            name = next((n for n in names if text.startswith(n, i)), None)
            assert name, f"{text!r}: no symbol at {text[i:]!r} (symbols {sorted(names)})"
            out.append(("name", name))
            i += len(name)
    return out


def read(text, symbols):
    """The exact value of a formula's text, its letters at `symbols`' values."""
    toks = tokens(text, symbols)
    pos = [0]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else (None, None)

    def take(expected=None):
        tok = peek()
        assert expected is None or tok[1] == expected, f"{text!r}: expected {expected!r}, got {tok}"
        pos[0] += 1
        return tok

    def atom():
        kind, value = take()
        if kind == "num":
            return Fraction(int(value))
        if kind == "name" and value in ("max", "min"):
            take("(")
            args = [expr()]
            while peek()[1] == ",":
                take(",")
                args.append(expr())
            take(")")
            return (max if value == "max" else min)(args)
        if kind == "name":
            return Fraction(symbols[value])
        if value == "(":
            inner = expr()
            take(")")
            return inner
        assert value == "⌈", f"{text!r}: unexpected {value!r}"
        inner = expr()
        take("⌉")
        return Fraction(-((-inner.numerator) // inner.denominator))

    def power():
        base = atom()
        if peek()[0] == "pow":
            return base ** int(take()[1])
        return base

    def product():
        value = power()
        while True:
            kind, tok = peek()
            if tok in ("·", "/"):
                take()
                right = power()
                value = value * right if tok == "·" else value / right
            elif kind == "name" or tok in ("(", "⌈"):  # juxtaposition: 4bsh, 2(...)
                value *= power()
            else:
                return value

    def expr():
        value = product()
        while peek()[1] in ("+", "-"):
            sign = take()[1]
            value = value + product() if sign == "+" else value - product()
        return value

    value = expr()
    assert pos[0] == len(toks), f"{text!r}: unread {toks[pos[0]:]}"
    return value


def check(term, where):
    """The term came from infra.formulas.formula, and its text reads back as its number."""
    assert isinstance(term, Formula), f"{where}: {term!r} was written by hand, not by infra.formulas.formula"
    text, number = term
    assert read(text, term.symbols) == number, \
        f"{where}: {text!r} = {read(text, term.symbols)} at {term.symbols}, but the number is {number}"


# ----------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_term_reads_as_its_number(name):
    checked = 0
    for world, flags in LAYOUTS[name]:
        for device in DEVICES:
            for rank, cost in costs_at(name, world, flags + device):
                for key, term in terms_of(cost):
                    check(term, f"{name} {' '.join(flags + device)} at {world} ranks, rank {rank}, {key}")
                    checked += 1
    assert checked > 20


def test_08_stage_0_prints_no_loss_term():
    """The drift this test was written for: stage 0 computes no loss, so its TP all-reduce
    neither counts nor prints the 3·4bs of loss statistics; the last stage does both."""
    ranks = dict(costs_at("08_3d.py", 8, ["--tp", "2", "--pp", "2"] + DEVICES[0]))  # rank = dp·4 + pp·2 + tp
    stage0, stage1 = ranks[0]["sent"]["all_reduce[tp]"], ranks[2]["sent"]["all_reduce[tp]"]
    assert "3·4bs" not in stage0[0] and "3·4bs" in stage1[0]
    check(stage0, "stage 0")
    # the old text beside the same number (a loss term the number omits) does not read back
    drifted = Formula((stage0[0][:-1] + " + 3·4bs)", stage0[1]))
    drifted.expr, drifted.symbols = stage0.expr, stage0.symbols
    with pytest.raises(AssertionError, match="but the number is"):
        check(drifted, "the old stage-0 text")


def test_formula_writes_as_the_papers_and_counts_exactly():
    f = formula("m*(L*(2*e + 2*4)*b*s*h + 3*4*b*s)", show="m e", m=6, e=2, L=2, b=2, s=64, h=64)
    assert f == ("6(L(2·2 + 2·4)bsh + 3·4bs)", 6 * (2 * 12 * 2 * 64 * 64 + 12 * 2 * 64))
    assert formula("4*Ψ/N + 12*b*a*s**2", Ψ=10, N=5, b=1, a=2, s=3) == ("4Ψ/N + 12bas²", 8 + 216)
    assert formula("k*x + (k - 1)*y", show="k", k=1, x=3, y=5) == ("x", 3)  # 1·x is x, 0·y is gone
    layer = formula("2*b", b=3)
    assert formula("L*layer + head", show="L", L=4, layer=layer, head=formula("b", b=1)) == ("4·layer + head", 25)
    assert plus(layer, None, formula("4*Ψ", Ψ=2)) == ("2b + 4Ψ", 14)
    assert formula("4*b*a*32*ceil(s/32)", b=1, a=2, s=40)[1] == 4 * 2 * 64
    with pytest.raises(ValueError, match="not a whole number"):
        formula("b*s/T", b=1, s=3, T=2)
    with pytest.raises(ValueError, match="symbol b is"):
        plus(formula("b", b=1), formula("b", b=2))
