"""The infrastructure's command line: the flags it adds to a script's parser (metrics,
checkpoints and stopping, the dry run, the rehearsal), their checks, and the GPU memory of the
facilities' nodes that a dry run's fit verdict plans for; and the two guards every tool puts
between a user's input and an error line: a file refused before it is read (a FIFO, a device,
an oversized file) and hostile text shown cut and escaped. Nothing here runs anything."""

import os
import stat

import common
from common import check


# The GPU memory of the facilities' nodes (per rank: a GCD of an MI250X, a tile of a Max 1550),
# for a dry run's fit verdict (--machine) and plan.py: ALCF Polaris 4 A100 40 GB; ALCF Aurora
# 768 GiB HBM per node over 12 tiles, 64 GiB each (counted as 64 GB: the lower reading);
# OLCF Frontier 64 GB HBM per GCD; NERSC Perlmutter 4 A100 40 GB (its 80 GB nodes:
# --gpu_mem_gb 80). The sources are cited in plan.py's MACHINES, which reads this table.
GPU_MEMORY_GB = {"polaris": 40, "aurora": 64, "frontier": 64, "perlmutter": 40}


def add_run_flags(parser):
    """The flags of the infrastructure, added to a script's parser (common.make_parser's)."""
    g = parser.add_argument_group("metrics")
    g.add_argument("--metrics", default=None, help="JSONL file, one object per logged step")
    g.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also log the metrics rows to Weights & Biases from rank 0 (optional package; "
                        "WANDB_MODE=offline on nodes without internet, `wandb sync` later)")
    g = parser.add_argument_group("checks, export and stopping")
    g.add_argument("--no_fit_check", action="store_true",
                   help="skip the check, before the model is built, that this rank's costs() fit in its memory")
    g.add_argument("--unverified", action="store_true",
                   help="--resume a set whose metadata records no checksums (read unchecked, with a warning)")
    g.add_argument("--export", default=None, metavar="FILE",
                   help="also write the final checkpoint consolidated into one file (nanoGPT's ckpt.pt format)")
    g.add_argument("--export_hf", default=None, metavar="DIR",
                   help="also write the final checkpoint as a transformers GPT-2 directory (config.json, "
                        "model.safetensors): GPT2LMHeadModel.from_pretrained(DIR) reads it")
    g.add_argument("--time_limit", type=float, default=None, metavar="MINUTES",
                   help="stop cleanly, with a checkpoint, before this many minutes from the start "
                        "(the job's walltime less a margin)")
    g.add_argument("--check_gradients", default=None, metavar="REF",
                   help="the gradient oracle: stop after step 0's backward and compare the whole gradient (clipping "
                        "off), per parameter, with 01_single_gpu.py's in REF against a bound derived from the "
                        "arithmetic (docs/numerics.md); 01 writes REF when it does not exist. Exit 0 if every tensor "
                        "is inside its bound, 4 otherwise")
    g.add_argument("--profile", default=None, metavar="STEPS",
                   help="torch.profiler traces of these steps (5, or 5-7), one per rank under OUT_DIR/profile/, "
                        "collectives named as the ledger names them; on GPUs a CUDA memory snapshot too")
    g = parser.add_argument_group("dry run (no launcher, network or accelerator needed)")
    g.add_argument("--dry_run", action="store_true",
                   help="validate the configuration for --world_size ranks, print the layout and what "
                        "one rank holds and sends per step, and exit")
    g.add_argument("--world_size", type=int, default=None, help="ranks of the dry run")
    g.add_argument("--ranks_per_node", type=int, default=None,
                   help="ranks per node of the dry run's mesh (default: all on one node)")
    g.add_argument("--machine", choices=sorted(GPU_MEMORY_GB),
                   help="the dry run's GPUs, for the fit verdict and --micro_batch_size auto (their memory)")
    g.add_argument("--gpu_mem_gb", type=float, default=None,
                   help="the dry run's GPU memory in GB, for the fit verdict (instead of --machine); without "
                        "either, --device cpu plans for this host's memory")
    g.add_argument("--rehearse", default=None, metavar="RANKS",
                   help="execute the real steps of these ranks of a --world_size run (0,17,511 | roles | all) in "
                        "this one process, on the fake backend with fake tensors: what each holds and sends next to "
                        "costs(); every rank's posting order (the others' by the mesh's symmetry) replayed under NCCL's "
                        "rules (infra/rehearsal.py)")
    return parser


def parse_args(parser, argv=None):
    """common.parse_args with the infrastructure's flags added and checked."""
    args = common.parse_args(add_run_flags(parser), argv)
    check(args.rehearse is None or args.rehearse.strip() != "", "--rehearse is empty (an unset variable?): "
          "name the ranks (0,17,511), roles or all")
    check(not (args.dry_run and args.rehearse), "--dry_run prices the layout from the formulas, --rehearse executes "
          "it: pass one")
    if args.dry_run or args.rehearse:
        check(args.world_size is not None and args.world_size > 0,
              f"{'--rehearse' if args.rehearse else '--dry_run'} needs --world_size N (the number of ranks to "
              "plan for), N > 0")
        args.ranks_per_node = args.ranks_per_node or args.world_size
        check(args.ranks_per_node > 0, f"--ranks_per_node must be positive, got {args.ranks_per_node}")
        check(args.gpu_mem_gb is None or args.gpu_mem_gb > 0, f"--gpu_mem_gb must be positive, got {args.gpu_mem_gb}")
        check(not (args.machine and args.gpu_mem_gb), "--machine and --gpu_mem_gb both give the GPU's memory: pass one")
    else:
        check(args.world_size is None and args.ranks_per_node is None and args.machine is None
              and args.gpu_mem_gb is None, "--world_size, --ranks_per_node, --machine and --gpu_mem_gb belong to "
              "--dry_run (a launch takes its size from the launcher and its memory from the device)")
    check(args.check_gradients != "", "--check_gradients needs a file (01's gradient), got an empty name")
    if args.check_gradients:
        check(not (getattr(args, "resume", False) or getattr(args, "init_from", None) or args.dry_run or args.rehearse),
              "--check_gradients compares step 0 from the seed's weights: not with --resume, --init_from, --dry_run "
              "or --rehearse")
        args.grad_clip = 0.0  # the raw averaged gradient is compared: clipping would hide a scale
    check(args.time_limit is None or args.time_limit > 0, f"--time_limit must be positive, got {args.time_limit}")
    for flag in ("export", "export_hf"):
        check(not getattr(args, flag) or args.ckpt_interval, f"--{flag} consolidates the final checkpoint: "
              "it needs --ckpt_interval (the final step is always saved)")
    experts = common.preset_config(args)["n_expert"]
    check(not args.export_hf or not experts, f"--export_hf: a mixture-of-experts model ({experts} experts) has no "
          "GPT-2 form (--export writes it)")
    check(not (args.profile and (args.dry_run or args.rehearse)), "--profile traces a launched run's steps; "
          "--dry_run and --rehearse launch none")
    if args.profile is not None:
        args.profile = profile_window(args.profile, args.max_iters)
    check(not args.unverified or args.resume, "--unverified belongs to --resume (a set without checksums)")
    check(args.wandb != "", "--wandb needs a project name, got an empty one (an unset variable in a job script?): "
          "name the project, or leave --wandb out")
    check(not args.wandb or wandb_installed(), f"--wandb {args.wandb}: the wandb package is not installed "
          "(it is optional: pip install wandb)")
    return args


def profile_window(spec, max_iters):
    """`--profile 5` or `--profile 5-7` as (first, last); one line otherwise."""
    try:
        first, _, last = spec.partition("-")
        first, last = int(first), int(last or first)
    except ValueError:
        first = last = None
    check(first is not None and 0 <= first <= last, f"--profile {spec!r}: name a step (5) or a range of steps (5-7)")
    check(last < max_iters, f"--profile {spec}: the run's steps are 0..{max_iters - 1} (--max_iters {max_iters})")
    return first, last


def wandb_installed():
    try:
        import wandb  # noqa: F401  (optional: imported only when --wandb is given)
        return True
    except ImportError:
        return False


def file_problem(path, what, max_bytes):
    """Why the file `path` cannot be read as `what` (e.g. "--schedule_csv"), or None, found
    before a byte of it is read: a file that does not exist, a directory, anything not a
    regular file (a FIFO nobody writes blocks the reader for ever, /dev/zero never ends) and a
    regular file over `max_bytes` (not what the flag expects; reading it would fill memory).
    The line names `what` and the path, cut and escaped."""
    try:
        info = os.stat(path)  # follows a link: a link to /dev/zero is /dev/zero
    except FileNotFoundError:
        return f"{what} {shown(path)}: no such file"
    except OSError as e:
        return f"{what} {shown(path)}: cannot be read: {e.strerror or e}"
    if stat.S_ISDIR(info.st_mode):
        return f"{what} {shown(path)} is a directory, not a file"
    if not stat.S_ISREG(info.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a device" if stat.S_ISCHR(info.st_mode)
                or stat.S_ISBLK(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a regular file")
        return f"{what} {shown(path)} is {kind}, not a regular file: it is not read (it could block or never end)"
    if info.st_size > max_bytes:
        return f"{what} {shown(path)}: {info.st_size:,} bytes, more than the {max_bytes:,} such a file can hold"
    if not os.access(path, os.R_OK):
        return f"{what} {shown(path)}: cannot be read: permission denied"
    return None


def shown(text, limit=200):
    """`text` (a cell, a path, a value from the user) as it may appear in a one-line error:
    escaped as Python writes a string (a newline, a control character or a byte-order mark
    shows as \\n, \\x07, \\ufeff, never acts on the terminal) and cut to about `limit`
    characters, saying how long it was, so that a 100,000-character cell makes a short line."""
    text = str(text)
    escaped = repr(text[:limit])[1:-1]
    if len(text) <= limit and len(escaped) <= limit:
        return escaped
    return f"{escaped[:limit]}... ({len(text):,} characters)"
