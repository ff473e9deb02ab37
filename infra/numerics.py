"""--check_gradients REF, the gradient oracle: bug or noise? At step 0 a run reassembles its
whole gradient per parameter under nanoGPT's names, from the checkpoint pieces every script
already has (each optimizer piece knows the tensor whose .grad the optimizer reads), and
compares it with 01_single_gpu.py's, tensor by tensor, against a bound derived from the
arithmetic: the standard forward error bound of a sum, |fl(Σx) − Σx| <= γ_{n−1}·Σ|x|,
γ_k = k·u/(1 − k·u), for the reductions whose order the layout changes (docs/numerics.md).

    python 01_single_gpu.py --check_gradients ref.pt FLAGS     # writes ref.pt (01's gradient and Σ|g_m|)
    mpiexec -n 4 python 06_tensor_parallel.py --check_gradients ref.pt FLAGS   # compares, exit 0 or 4

The run stops after step 0's backward (no update); clipping is off (the raw averaged
gradient is compared: a clipped one hides a scale)."""

import os

import torch
import torch.distributed as dist

from common import log, say
from infra.checkpoint_format import _copy_overlap, _flat_boxes, atomic_save
from infra.formulas import formula
from infra.ledger import LEDGER
from infra.start import agree, leave

GRADIENT_BUG_EXIT = 4  # the exit status of a run whose gradient is outside its bound

# u, the unit roundoff (half the distance from 1 to the next number) of each dtype
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

# what the reference records of its run, which the compared run must share: the same
# model, data, batch (its micro-batches: the same b, so one micro-batch's arithmetic is 01's)
AGREED = ("model", "data", "global_batch_size", "micro_batch_size", "seed", "dtype")


def gamma(k, u):
    """γ_k = k·u / (1 − k·u) (Higham, Accuracy and Stability of Numerical Algorithms, §3.1)."""
    return k * u / (1 - k * u) if k * u < 1 else float("inf")


def reduction_lengths(args, config, layout, world_size):
    """The reductions whose order or grouping this layout changes, as costs() writes them:
    (n, the fp32 sum's length, a Formula; r, the bf16 roundings that differ, a Formula).
    M = G/b micro-batches summed, by 01 in order and here in another grouping (DP's local
    sums, then the all-reduce's tree or ring); TP splits a matmul's inner dimension, at most
    4h (c_proj of the MLP), into T partial sums added across ranks; sequence parallelism and
    CP split a weight gradient's sum over the b·s tokens of a micro-batch across ranks, and
    the ring adds the s keys of attention in C steps; EP sums an expert's tokens from the ep
    ranks' micro-batches in one matmul (b·s·ep) and combines the top-k outputs; a pipeline
    sums the tied embedding's M head gradients apart from its M embedding gradients
    (docs/numerics.md has the table, and where the bound is rigorous and where not). Under
    bf16 autocast each split matmul's T partial outputs (C ring partials, k expert outputs)
    are rounded to bf16 before they are added, in each of L layers."""
    b, s, h, L, M = args.micro_batch_size, config.block_size, config.n_embd, config.n_layer, \
        args.global_batch_size // args.micro_batch_size
    strategy = layout.get("strategy", "")
    T = layout.get("tp", world_size if strategy == "tensor parallel" else 1)
    C = layout.get("cp", 1)
    ep = layout.get("ep", 1)
    P = layout.get("pp", 1)
    sp = bool(layout.get("sequence_parallel")) and T > 1
    terms, rounds = ["2*M" if P > 1 else "M"], []  # a pipeline: the tied head's M, summed apart
    if T > 1:
        terms.append("4*h")
        rounds.append("2*L*T")  # attention's and the MLP's row-parallel outputs
    if sp or C > 1:
        terms.append("b*s")
    if C > 1 and layout.get("cp_impl", "ring") == "ring":  # Ulysses keeps each head's keys whole
        terms.append("s")
        rounds.append("L*C")
    if strategy == "expert parallel":
        terms.append("b*s*ep + k")
        rounds.append("L*k")
    rounds = rounds if args.dtype == "bfloat16" else []  # fp32: no bf16 rounding in one micro-batch
    if getattr(args, "reduce_dtype", "float32") == "bfloat16":  # 05's bf16 reduce-scatter: each micro-batch's
        rounds.append("M")  # share rounded to bf16 once, the D partial sums added in bf16 (D <= M)
    n = formula(" + ".join(terms), M=M, h=h, b=b, s=s, ep=ep, k=getattr(config, "top_k", 0) or 1)
    r = formula(" + ".join(rounds) if rounds else "0", M=M, L=L, T=T, C=C, k=getattr(config, "top_k", 0) or 1)
    return n, r


def bound_factor(n, r):
    """2·(γ_n(fp32) + γ_r(bf16)): both 01's order and the layout's are within γ·Σ|x| of the
    exact sum, so they are within twice that of each other."""
    return 2 * (gamma(n, UNIT_ROUNDOFF[torch.float32]) + gamma(r, UNIT_ROUNDOFF[torch.bfloat16]))


def agreed_config(args, run_config):
    return {"model": run_config["model"], "data": run_config["data"], "global_batch_size": args.global_batch_size,
            "micro_batch_size": args.micro_batch_size, "seed": args.seed, "dtype": args.dtype}


def _flat(config):
    """{"model": {"n_layer": 4}, "seed": 1} -> {"n_layer": 4, "seed": 1}: what differs, by its flag's name."""
    return {k2: v2 for k, v in config.items() for k2, v2 in (v.items() if isinstance(v, dict) else [(k, v)])}


def _load(path):
    try:
        ref = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    except Exception as e:  # noqa: BLE001 (any unreadable file is the same one line)
        return None, f"--check_gradients {path}: unreadable ({type(e).__name__}: {str(e)[:120]})"
    if not (isinstance(ref, dict) and isinstance(ref.get("grads"), dict) and isinstance(ref.get("abs_sums"), dict)
            and isinstance(ref.get("config"), dict)):
        return None, f"--check_gradients {path}: not a gradient reference (write one with 01_single_gpu.py " \
                     "--check_gradients)"
    return ref, None


def _accumulate(total, grad):
    total.add_(grad.detach().abs().float())  # returns None: the hook leaves the gradient as it is


class GradientOracle:
    """Made by Run.begin with --check_gradients REF. If REF exists, the run's configuration
    must be the one REF was written with (AGREED); if it does not, only 01_single_gpu.py (one
    process) writes it, and measures Σ_m|g_m| as it goes (a hook on each parameter sees each
    micro-batch's gradient before it is accumulated)."""

    def __init__(self, args, env, script, run_config, pieces):
        self.path, self.env, self.script = args.check_gradients, env, script
        self.config = agreed_config(args, run_config)
        self.writing = not os.path.exists(self.path)
        self.ref, problem = None, None
        if self.writing:
            if not (script.startswith("01_") and env.world_size == 1):
                problem = (f"--check_gradients {self.path}: no such file; write 01's gradient first: "
                           f"python 01_single_gpu.py --check_gradients {self.path} with the same flags")
        else:
            self.ref, problem = _load(self.path)
            if self.ref:
                there, here = _flat(self.ref["config"]), _flat(self.config)
                differ = [k for k in here if there.get(k) != here[k]]
                if differ:
                    problem = (f"--check_gradients {self.path} was written with other " + ", ".join(
                        f"{k} ({there.get(k)!r:.40} there, {here[k]!r:.40} here)" for k in differ[:4])
                        + ": compare a gradient of the same model, data and micro-batches")
        agree(env, problem)
        self.abs_sums = {}
        if self.writing:  # Σ_m |g_m| of each parameter, as the micro-batches' gradients arrive
            for piece in pieces:
                if piece.source is not None:
                    param, pick = piece.source
                    name = piece.name.split("/", 2)[2]
                    total = self.abs_sums.setdefault(name, torch.zeros_like(pick(param.data), dtype=torch.float32))
                    param.register_hook(lambda g, total=total, pick=pick: _accumulate(total, pick(g)))

    def gather(self, pieces):
        """The whole gradient per parameter, on rank 0 (None elsewhere): every rank's written
        gradient pieces, gathered once (control traffic, not the strategy's)."""
        mine = []
        for piece in pieces:
            if piece.source is not None and piece.write:
                param, pick = piece.source
                grad = torch.zeros_like(pick(param.data)) if param.grad is None else pick(param.grad)
                mine.append((piece.name.split("/", 2)[2], piece.shape, piece.box, piece.flat,
                             grad.detach().float().cpu().clone()))
        everyone = [mine]
        if self.env.world_size > 1:
            everyone = [None] * self.env.world_size
            with LEDGER.paused():
                dist.gather_object(mine, everyone if self.env.master else None, dst=0, group=dist.group.WORLD)
        if not self.env.master:
            return None
        grads, covered = {}, {}
        for name, shape, box, flat, tensor in (item for rank in everyone for item in rank):
            full = grads.setdefault(name, torch.zeros(shape))
            covered[name] = covered.get(name, 0) + _copy_overlap(
                full.view(-1), [([[0, d] for d in shape], 0)], tensor.reshape(-1), _flat_boxes(box, flat))
        return grads, covered

    def verdict(self, args, config, layout, pieces):
        """Write REF (01, no REF yet) or compare with it; print the table on rank 0; exit 0 if
        every tensor is inside its bound, GRADIENT_BUG_EXIT otherwise, on every rank."""
        gathered, status = self.gather(pieces), 0
        if self.env.master:
            grads, covered = gathered
            missing = [name for name, g in grads.items() if covered[name] < g.numel()]
            if self.writing:
                atomic_save({"grads": grads, "abs_sums": self.abs_sums, "config": self.config}, self.path)
                say(f"gradient oracle: wrote 01's gradient at step 0 ({len(grads)} tensors) to {self.path}")
            else:
                n, r = reduction_lengths(args, config, layout, self.env.world_size)
                status = compare(self.ref, grads, missing, n, r, self.path)
        if self.env.world_size > 1:
            verdict = torch.tensor([status], device=self.env.device)
            with LEDGER.paused():
                dist.broadcast(verdict, src=0, group=dist.group.WORLD)
            status = int(verdict.item())
        leave(self.env, status)


def compare(ref, grads, missing, n, r, path):
    """The table: per parameter, max |g − g_01|, its bound 2(γ_n + γ_r)·max Σ_m|g_m|, OK/BUG.
    Returns the exit status."""
    (n_text, n), (r_text, r) = n, r
    factor = bound_factor(n, r)
    gammas, rounds = ("2(γ_n(2^-24) + γ_r(2^-8))", f", r = {r_text} = {r:,}") if r else ("2γ_n(2^-24)", "")
    say(f"gradient oracle: step 0 against {path}; bound = {gammas}·max Σ_m|g_m| = {factor:.3g}·max Σ_m|g_m|, "
        f"n = {n_text} = {n:,}{rounds}")
    say(f"{'parameter':<42} {'max |error|':>12} {'bound':>11}")
    bad, worst = [], 0.0
    for name in sorted(set(ref["grads"]) | set(grads)):
        if name not in grads or name not in ref["grads"] or grads[name].shape != ref["grads"][name].shape:
            bad.append(name)
            why = "missing here" if name not in grads else "not in the reference" if name not in ref["grads"] \
                else "another shape"
            say(f"{name:<42} {'-':>12} {'-':>11}  BUG ({why})")
            continue
        error = (grads[name] - ref["grads"][name]).abs().max().item()
        bound = factor * ref["abs_sums"][name].max().item()
        ok = error <= bound and name not in missing
        worst = max(worst, error / bound if bound > 0 else float("inf") if error > 0 else 0.0)
        if not ok:
            bad.append(name)
        say(f"{name:<42} {error:12.3e} {bound:11.3e}  {'OK' if ok else 'BUG'}"
            + (" (pieces do not cover it)" if name in missing else ""))
    if bad:
        say(f"gradient oracle: BUG: {len(bad)} of {len(set(ref['grads']) | set(grads))} tensors outside their bound "
            f"(first {bad[0]}; the worst at {worst:.3g}x its bound); exit {GRADIENT_BUG_EXIT}")
        return GRADIENT_BUG_EXIT
    say(f"gradient oracle: OK: every tensor inside its bound, the closest at {worst:.2g}x it (rounding, not a bug)")
    return 0
