"""Metrics and logging: tokens/s, MFU, memory, the JSONL rows (always valid JSON: a non-finite
number is null), the min / max / mean over ranks with the straggler named, which ranks run on
which host, and Weights & Biases (--wandb). A row that cannot be written is left in
WRITE_FAILURES for the guard to act on."""

import json
import math
import os
import socket

import torch
import torch.distributed as dist

from common import log, model_block_size
from infra.ledger import LEDGER, theory_bytes, theory_calls
from infra.activations import peak_memory
from infra.fit import peak_numbers
from infra.start import agree


# Dense peak FLOP/s per device (one GCD of an MI250X, one tile of a Max 1550), for MFU:
# (bf16/fp16 tensor-core peak, fp32 peak). From the vendors' data sheets.
PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),  # SXM; the PCIe card is lower (756e12)
    "A100": (312e12, 19.5e12),
    "MI250X": (191.5e12, 47.9e12 / 2),
    "MAX 1550": (419e12, 52.4e12 / 2),
}


def peak_flops(env):
    """The device's peak for env.dtype, or None where unknown (CPU, unlisted devices)."""
    if env.device.type == "cuda":
        name = torch.cuda.get_device_name(env.device)
    elif env.device.type == "xpu":
        name = torch.xpu.get_device_name(env.device)
    else:
        return None
    for key, (half, single) in PEAK_FLOPS.items():
        if key in name.upper():
            return single if env.dtype == torch.float32 else half
    return None


def host_bytes(state):
    """The model-state bytes this rank keeps in host memory (--offload's "(host)" kinds, which
    mem_peak_bytes, the device's, leaves out), or None when it keeps none there."""
    return sum(v for kind, v in state.items() if kind.endswith("(host)")) or None


STRAGGLER = 1.5  # a rank this many times slower than the median is named on the console


class Metrics:
    """Rank-0 console lines and the JSONL metrics file (schema in docs/design.md)."""

    def __init__(self, args, env, flops_per_tok, cost, config=None):
        self.env, self.flops_per_tok = env, flops_per_tok
        self.wandb = start_wandb(args, env, config or {}) if args.wandb else None  # rank 0's run, or None
        self.theory(cost)
        self.tokens_per_step = args.global_batch_size * model_block_size(args)
        self.micro_batch_size = args.micro_batch_size
        self.peak = peak_flops(env)
        self.path, self.file = args.metrics, open(args.metrics, "a") if (args.metrics and env.master) else None

    def theory(self, cost):
        """The theory columns, from the script's costs() for this rank."""
        self.state_theory, self.comm_theory = theory_bytes(cost)
        self.calls_theory = theory_calls(cost)
        # None where a cost gives no activation formula (every training script now gives one)
        self.activation_theory = cost["activations"][1] if "activations" in cost else None
        self.live_theory = peak_numbers(cost)

    def step(self, step, loss, lr, dt, state, comm, extra=None, activations=None, live=None, calls=None):
        """Log one optimizer step; `dt` in seconds; `state`, `comm`, `activations` (the
        ActivationMeter's peak) and `live` (its peaks of every live tensor by phase) from
        this rank."""
        tokens_per_s = self.tokens_per_step / dt
        mfu = None
        if self.peak is not None:
            # flops of the whole step divided among the ranks, against one device's peak
            mfu = tokens_per_s * self.flops_per_tok / (self.peak * self.env.world_size)
        row = dict(step=step, loss=loss, lr=lr, dt_ms=dt * 1e3, tokens_per_s=tokens_per_s, mfu=mfu,
                   mem_peak_bytes=peak_memory(self.env), mem_host_bytes=host_bytes(state),
                   state_bytes=state, comm_bytes=comm,
                   state_bytes_theory=self.state_theory, comm_bytes_theory=self.comm_theory,
                   activation_bytes=activations, activation_bytes_theory=self.activation_theory,
                   micro_batch_size=self.micro_batch_size)
        if calls is not None:  # the calls per key, next to costs()' (None where it states none)
            row["comm_calls"], row["comm_calls_theory"] = calls, self.calls_theory
        if live is not None:  # every live tensor's bytes by phase, where counted (GPTPAR_COUNT_LIVE=1, GPUs)
            row["live_bytes"], row["live_bytes_theory"] = live, self.live_theory
            if os.environ.get("GPTPAR_COUNT_LIVE") == "1":  # a test's count: every rank's, one gather
                row["live_bytes_ranks"] = self.live_ranks(live)
        ranks = self.over_ranks(row["dt_ms"], row["mem_peak_bytes"])
        straggler = ranks.pop("straggler", "")  # for the console line, not a metrics key
        row.update(ranks)
        row.update(extra or {})
        self.write(row)
        mfu_s = f", mfu {mfu * 100:.1f}%" if mfu is not None else ""
        log(self.env, f"step {step}: loss {loss:.4f}, lr {lr:.2e}, {dt * 1e3:.0f} ms, "
                      f"{tokens_per_s:,.0f} tok/s{mfu_s}{straggler}")
        return row

    def over_ranks(self, dt_ms, mem_peak):
        """Step time and peak memory over the ranks: min, max, mean, and the rank and host of
        the maximum, from one small gather per logged step (outside the ledger's step: the
        step's traffic was taken before). A straggler is named when the slowest rank took
        more than STRAGGLER times the median."""
        mine = (dt_ms, mem_peak, socket.gethostname())
        everyone = [mine]
        if self.env.world_size > 1 and dist.is_initialized():
            everyone = [None] * self.env.world_size
            dist.all_gather_object(everyone, mine)
        return rank_stats(everyone)


    def live_ranks(self, live):
        """[{"live": .., "theory": ..}] of every rank, in rank order (one gather, only where
        live bytes are counted: a pipeline's stages, 08's mesh, hold different things)."""
        mine = {"live": live, "theory": self.live_theory}
        if self.env.world_size == 1 or not dist.is_initialized():
            return [mine]
        everyone = [None] * self.env.world_size
        with LEDGER.paused():  # a measurement's own traffic, not a step's
            dist.all_gather_object(everyone, mine)
        return everyone

    def write(self, row):
        if self.file:
            try:
                self.file.write(json.dumps(finite_or_null(row), allow_nan=False) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk, a file system gone read-only: the guard stops the run
                self.file = None
                WRITE_FAILURES.append(f"cannot write --metrics {self.path}: {e.strerror or e}")
        if self.wandb:  # the same keys, nested ones flattened: state_bytes/params by state_bytes_theory/params
            flat = flat_row(finite_or_null(row))
            self.wandb.log({k: v for k, v in flat.items() if v is not None}, step=row["step"])

    def close(self):
        if self.wandb:
            self.wandb.finish()
            self.wandb = None


def start_wandb(args, env, config):
    """--wandb PROJECT: rank 0 opens a Weights & Biases run in that project, with the command
    line and the run's configuration (model, layout) as its config, in --out_dir unless
    WANDB_DIR says where. Offline (WANDB_MODE=offline, for compute nodes without internet) it
    writes only there; `wandb sync` uploads it later. A run that cannot start (online without
    an API key) is one agreed line. Returns the run on rank 0, None elsewhere."""
    run, problem = None, None
    if env.master:
        import wandb
        try:
            run = wandb.init(project=args.wandb, config={**vars(args), **config, "world_size": env.world_size},
                             dir=None if os.environ.get("WANDB_DIR") else args.out_dir,
                             settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # wandb's own errors (no API key, no server) are not one class
            why = (str(e).strip() or type(e).__name__).splitlines()[0]
            problem = f"--wandb {args.wandb}: wandb could not start a run: {why}"
    agree(env, problem)
    if run is not None:
        offline = run.settings.mode == "offline"
        log(env, f"wandb: run {run.name or run.id} in project {args.wandb}, " + (
            f"offline in {run.dir} (upload with `wandb sync {os.path.dirname(run.dir)}`)" if offline else run.url))
    return run


def flat_row(row):
    """{"comm_bytes": {"all_reduce": n}} -> {"comm_bytes/all_reduce": n}, and a list's items
    numbered ({"expert_tokens": [a, b]} -> expert_tokens/0, expert_tokens/1): the metrics row's
    keys, flattened for loggers that take one level."""
    flat = {}
    for key, value in row.items():
        if isinstance(value, (list, tuple)):
            value = dict(enumerate(value))
        if isinstance(value, dict):
            flat.update({f"{key}/{sub}": v for sub, v in flat_row(value).items()})
        else:
            flat[key] = value
    return flat


def rank_stats(everyone):
    """[(dt_ms, mem_peak_bytes or None, host)] of every rank -> the metrics' over-ranks keys,
    and a 'straggler' note for the console when the slowest rank is far behind the median."""
    stats = {}
    for i, key in enumerate(("dt_ms", "mem_peak_bytes")):
        values = [r[i] for r in everyone]
        if any(v is None for v in values):
            continue
        worst = max(range(len(values)), key=values.__getitem__)
        stats.update({f"{key}_min": min(values), f"{key}_max": values[worst], f"{key}_mean": sum(values) / len(values),
                      f"{key}_max_rank": worst, f"{key}_max_host": everyone[worst][2]})
    times = sorted(r[0] for r in everyone)
    median = times[(len(times) - 1) // 2]
    if len(times) > 1 and stats["dt_ms_max"] > STRAGGLER * median:
        stats["straggler"] = (f"; straggler: rank {stats['dt_ms_max_rank']} on {stats['dt_ms_max_host']}, "
                              f"{stats['dt_ms_max'] / median:.1f}x the median step time")
    return stats


WRITE_FAILURES = []  # writes that failed outside an agreed path (metrics rows): the guard acts on them


def finite_or_null(value):
    """A metrics row with every non-finite float replaced by None (JSON null, never NaN)."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def spans(ranks):
    """A sorted list of ranks in short: [0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(out)


def log_node_map(env):
    """Once at start: which ranks run on which host (one small gather)."""
    hosts = [socket.gethostname()]
    if env.world_size > 1 and dist.is_initialized():
        hosts = [None] * env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
    nodes = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    log(env, f"nodes: {len(nodes)}; " + "; ".join(f"{host}: ranks {spans(r)}" for host, r in nodes.items()))
