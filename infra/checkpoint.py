"""Saving, resuming and exporting checkpoints, agreed by every rank: a set written by every
rank and committed by rank 0's metadata.json; the newest set opened and checked against this run
(its data, even if it moved, recognised by a fingerprint of its files) and every piece this rank
holds read from it at any layout; the final set consolidated into nanoGPT's one-file format
(--export), or into transformers' GPT-2 (--export_hf), and either read back (--init_from). The format
itself is infra.checkpoint_format's; the Hugging Face one infra.hf's."""

import json
import math
import os
import time
import zlib
from dataclasses import asdict

import torch
import torch.distributed as dist

from common import GPTConfig, check, log, rng_state, set_rng_state
from infra.formulas import format_bytes
from infra.hf import HFError, export_hf, import_hf
from infra.checkpoint_format import (CHECKPOINT_FORMAT, Checkpoint, CheckpointError, atomic_save, checkpoint_root,
                                     clean_checkpoints, latest_checkpoint, load_tensors, tensor_checksum)
from infra.start import Diverged, agree


def _agreed(env, action):
    """Run `action` on every rank; a CheckpointError (or any error reading a file) on any
    rank becomes one line and exit 2 on every rank (`agree`)."""
    result, problem = None, None
    try:
        result = action()
    except CheckpointError as e:
        problem = str(e)
    agree(env, problem)
    return result


def save_checkpoint(args, step, env, pieces, run, optimizer, extra_rng=None):
    """Write the checkpoint of `step`: every rank its pieces (those with write=True) and its
    RNG states to rank<r>.pt, atomically; then, once every rank has succeeded, rank 0 writes
    metadata.json (the commit) and only then removes the previous set. With --export, the
    final checkpoint is also written consolidated into one file. Returns nothing; a failed
    write on any rank is one line and exit 2 on every rank, the previous set intact. Weights or
    optimizer state that the last update left non-finite (finite gradients, too large an --lr:
    the guard saw nothing) are never written over the last good set: one line, and every rank
    exits 3 (NONFINITE_EXIT) before any rank writes a byte."""
    tensors, described, count = {}, [], {}
    for piece in pieces:
        if piece.write:
            n = count[piece.name] = count.get(piece.name, -1) + 1
            key = f"{piece.name}#{n}"
            tensors[key] = piece.tensor.detach().to("cpu", copy=True).contiguous()
            described.append(dict(name=piece.name, shape=list(piece.shape), dtype=str(piece.tensor.dtype),
                                  key=key, box=piece.box, **({"flat": list(piece.flat)} if piece.flat else {})))
    tensors.update({f"rng/{k}": v for k, v in rng_state(env).items()})
    tensors.update({f"extra_rng/{k}": v for k, v in (extra_rng or {}).items()})
    agree(env, diverged(args, step, env, tensors))  # never replace the last good checkpoint with a diverged one
    directory, previous = [None], None
    if env.master:
        previous = latest_checkpoint(args.out_dir)  # the set this one replaces: resumed, or written last
        clean_checkpoints(args.out_dir, keep=previous, committed=False)
        directory[0], n = os.path.join(checkpoint_root(args.out_dir), f"step_{step}"), 1
        while os.path.exists(directory[0]):  # a committed set of the same step stays until this one is
            directory[0], n = os.path.join(checkpoint_root(args.out_dir), f"step_{step}.{n}"), n + 1
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(directory, src=0)  # rank 0's choice of directory, to every rank
    directory = directory[0]
    checksums = {key: tensor_checksum(t) for key, t in tensors.items()}  # verified when read
    problem, written, t0 = None, 0, time.perf_counter()
    try:
        path = os.path.join(directory, f"rank{env.rank}.pt")
        atomic_save(tensors, path)
        written = os.path.getsize(path)
    except OSError as e:
        problem = f"cannot write checkpoint {directory}/rank{env.rank}.pt: {e}"
    everyone = [(problem, described, written, checksums)]
    if dist.is_initialized() and env.world_size > 1:
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, (problem, described, written, checksums))  # who wrote what
    agree(env, next((p for p, *_ in everyone if p), None))  # the same verdict on every rank
    if env.master:
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "time": time.time(),
                "optimizer_step": _optimizer_step(optimizer, step), "run": run,
                "layout": {**run["layout"], "world_size": env.world_size},
                "bytes_per_rank": [w for _, _, w, _ in everyone], "tensors": {},
                "checksums": [c for *_, c in everyone],  # per rank file: {key: CRC-32}
                "data_files": data_fingerprint(run["data"])}  # to know the data again if it moves
        for rank, (_, described, _, _) in enumerate(everyone):
            for d in described:
                entry = meta["tensors"].setdefault(d["name"], {"shape": d["shape"], "dtype": d["dtype"], "pieces": []})
                assert entry["shape"] == d["shape"], f"ranks disagree on the shape of {d['name']}"
                entry["pieces"].append({"rank": rank, **{k: d[k] for k in ("key", "box", "flat") if k in d}})
        for name, entry in meta["tensors"].items():  # the pieces tile the tensor exactly once
            held = sum(p["flat"][1] - p["flat"][0] if "flat" in p else math.prod(e - s for s, e in p["box"])
                       for p in entry["pieces"])
            assert held == math.prod(entry["shape"]), f"{name}: the written pieces hold {held} of {math.prod(entry['shape'])} elements"
        try:
            atomic_save(json.dumps(meta, indent=1), os.path.join(directory, "metadata.json"))  # the commit
            # only now: the previous set; every other committed set only if --overwrite said so
            # (an older set a user copied back stays: it was named when the run resumed)
            replaced = True if getattr(args, "overwrite", False) and not args.resume else [previous]
            clean_checkpoints(args.out_dir, keep=directory, committed=replaced)
            problem = None
        except OSError as e:
            problem = f"cannot write checkpoint metadata {directory}/metadata.json: {e}"
    agree(env, problem if env.master else None)
    sizes = [w for _, _, w, _ in everyone]
    log(env, f"checkpoint step {step} committed to {directory}: {format_bytes(min(sizes))} to "
             f"{format_bytes(max(sizes))} per rank, {format_bytes(sum(sizes))} in all, {time.perf_counter() - t0:.2f} s")
    if (getattr(args, "export", None) or getattr(args, "export_hf", None)) and step == args.max_iters:
        export_agreed(args, env, step)


# The largest weight whose product with another of its size stays finite in float32 (and in
# bfloat16, whose range is float32's): a model holding a larger one can no longer compute its
# logits (01 --lr 1e36 leaves every weight near 1e34, finite, and every logit infinite).
WEIGHT_LIMIT = math.sqrt(torch.finfo(torch.float32).max)  # about 1.8e19


def diverged(args, step, env, tensors):
    """This rank's verdict on the checkpoint of `step` before it is written: a Diverged problem
    naming the first tensor that holds a non-finite value, or a weight beyond WEIGHT_LIMIT (an
    update that overflowed the model without a non-finite gradient), or None."""
    def problem(key, t):
        if not t.is_floating_point() or t.numel() == 0:
            return None
        if not bool(torch.isfinite(t).all()):
            return "holds non-finite values"
        if not key.startswith("model/"):
            return None
        largest = max(abs(float(v)) for v in torch.aminmax(t))  # one pass, no copy of the piece
        if largest > WEIGHT_LIMIT:
            return f"holds weights as large as {largest:.1e} (beyond {WEIGHT_LIMIT:.1e}: their products overflow)"
        return None
    bad = next(((key, why) for key, t in tensors.items() if (why := problem(key, t))), None)
    if bad is None:
        return None
    kept = latest_checkpoint(args.out_dir)
    return Diverged(f"not writing the checkpoint of step {step}: {bad[0].split('#')[0]} {bad[1]} on rank {env.rank} "
                    "after the last update (too large an --lr?); "
                    + (f"the last good checkpoint, {kept}, is kept" if kept else "there is no earlier one"))


def export_agreed(args, env, step):
    """--export, --export_hf: rank 0 writes the newest committed set consolidated; a failure
    is one agreed line (the checkpoint itself is committed)."""
    problem = None
    if env.master:
        flag = "--export"
        try:
            if args.export:
                export_checkpoint(args.out_dir, args.export)
                log(env, f"exported step {step}, consolidated, to {args.export} (nanoGPT's ckpt.pt format)")
            if getattr(args, "export_hf", None):
                flag = "--export_hf"
                state, meta = consolidated_model(args.out_dir)
                notes = export_hf(state, meta["run"]["model"], args.export_hf)
                log(env, f"exported step {step} to {args.export_hf} as transformers' GPT-2 (config.json, "
                         f"model.safetensors){': ' + '; '.join(notes) if notes else ''}")
        except (OSError, HFError) as e:  # checked at start; the disk may have filled since
            problem = (f"cannot write {flag} {args.export_hf if flag == '--export_hf' else args.export}: {e}; "
                       f"the checkpoint {latest_checkpoint(args.out_dir)} is committed")
    agree(env, problem)


def _optimizer_step(optimizer, default):
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return default


DATA_SAMPLES, DATA_SAMPLE_BYTES = 16, 1 << 16  # a token file's fingerprint: 16 windows of 64 KiB, 1 MiB read


def data_fingerprint(spec):
    """What identifies a --data directory's files whatever its path: per file (train.bin,
    val.bin, meta.pkl) its size and a CRC-32 of DATA_SAMPLES windows spread evenly over it,
    first and last bytes included (1 MiB read, whatever the file's size). Recorded in every
    checkpoint, so that a run whose data moved ($HOME to $SCRATCH) is recognised as the same
    run. None for the embedded corpora (their name says it)."""
    if not os.path.isdir(spec):
        return None
    found = {}
    for name in ("train.bin", "val.bin", "meta.pkl"):
        path = os.path.join(spec, name)
        if os.path.isfile(path):
            stat = os.stat(path)
            version = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
            if version not in _FINGERPRINTS:  # once per file and version in a process (every save asks)
                _FINGERPRINTS[version] = [stat.st_size, _sampled_crc(path, stat.st_size)]
            found[name] = _FINGERPRINTS[version]
    return found


_FINGERPRINTS = {}


def _sampled_crc(path, size):
    crc, span = 0, max(0, size - DATA_SAMPLE_BYTES)
    with open(path, "rb") as f:
        for i in range(DATA_SAMPLES):
            f.seek(span * i // (DATA_SAMPLES - 1))
            crc = zlib.crc32(f.read(DATA_SAMPLE_BYTES), crc)
    return crc


def _moved_data(ckpt, written, now):
    """None if --data `now` holds the same files as `written`, the data the checkpoint was
    written with (moved or linked elsewhere): compared by the fingerprint the checkpoint
    recorded, or by both directories' when it recorded none and `written` still exists.
    Else why the two cannot be taken for the same data."""
    recorded = ckpt.meta.get("data_files")
    if not isinstance(recorded, dict):
        if not (isinstance(written, str) and os.path.isdir(written)):
            return (f"{written} is gone and this set records no fingerprint of its files to compare {now}'s "
                    "with (written before fingerprints were): put the data back at that path to resume")
        recorded = data_fingerprint(written)
    return None if os.path.isdir(now) and data_fingerprint(now) == recorded else (
        f"the files in {now} are not those it was written with (their sizes and checksums differ)")


def open_checkpoint(out_dir, run, unverified=False):
    """The newest committed set in out_dir, checked against this run; one line if there is
    none, or if what is there is not a checkpoint of this run. Data that moved is the same
    run (a note says so: `ckpt.notes`) when its files are the same (`_moved_data`)."""
    directory = latest_checkpoint(out_dir)
    if directory is None:
        single = [f for f in ("ckpt.pt", "zero_ckpt.pt", "fsdp_ckpt.pt", "tp_ckpt.pt", "pp_ckpt.pt", "3d_ckpt.pt")
                  if os.path.exists(os.path.join(out_dir, f))]
        if single:
            raise CheckpointError(f"{os.path.join(out_dir, single[0])} is not a checkpoint of this format "
                                  f"(expected {checkpoint_root(out_dir)}/step_<N>/metadata.json); "
                                  "to start from a one-file model, use 01_single_gpu.py --init_from")
        raise CheckpointError(f"no checkpoint in {checkpoint_root(out_dir)} to resume from")
    ckpt = Checkpoint(directory, unverified)
    ckpt.notes = []
    saved = ckpt.meta.get("run") or {}
    for key in run:
        if key == "layout":
            continue
        value = saved.get(key)
        if key == "model" and isinstance(value, dict):  # written before a field existed: its default
            value = {**asdict(GPTConfig()), **value}
        if key == "optimizer" and value is None:  # written before --optimizer existed: AdamW's
            value = "adamw"
        if key == "data" and isinstance(value, str) and os.path.isdir(value):
            value = os.path.normpath(value)  # written before run_config normalised it
        recorded = ckpt.meta.get("data_files")
        if key == "data" and value == run[key] and isinstance(recorded, dict) and os.path.isdir(value):
            if data_fingerprint(value) != recorded:  # the same path, other files: not the same run
                raise CheckpointError(f"checkpoint {directory} was written with data={value}, whose files have "
                                      "changed since (their sizes or checksums differ): restore them, or start a "
                                      "new run (--overwrite, or another --out_dir)")
            continue
        if key == "data" and value != run[key] and os.path.isdir(run[key]):  # the same files elsewhere?
            why = _moved_data(ckpt, value, run[key])
            if why:
                raise CheckpointError(f"checkpoint {directory} holds another run: it was written with data="
                                      f"{value}, this run has data={run[key]}, and {why}")
            ckpt.notes.append(f"note: the data moved: {directory} was written with --data {value}; {run[key]} "
                              "holds the same files (sizes and checksums): resuming on it")
            continue
        if value != run[key]:
            what = "another model" if key == "model" else "another run"
            hint = (f" (to train on with the same schedule, pass --lr_decay_iters {saved.get(key)}: "
                    "its default is --max_iters)") if key == "lr_decay_iters" else ""
            raise CheckpointError(f"checkpoint {directory} holds {what}: it was written with {key}="
                                  f"{str(value)[:200]}, this run has {key}={run[key]}{hint}")
    return ckpt


def other_committed_sets(out_dir, directory):
    """The committed sets in out_dir other than `directory`: an older set a user copied back,
    or one a job ended before removing. A resumed run keeps them (it replaces only the set
    it resumed from) and names them."""
    root = checkpoint_root(out_dir)
    return [os.path.join(root, name) for name in sorted(os.listdir(root))
            if name.startswith("step_") and os.path.lexists(os.path.join(root, name, "metadata.json"))
            and os.path.abspath(os.path.join(root, name)) != os.path.abspath(directory)]


def resume_checkpoint(out_dir, env, pieces, run, optimizer, unverified=False):
    """Load every piece this rank holds from the newest committed set in out_dir, whatever
    the layout (and script) that wrote it; the RNG states too when the layout is the same
    (then the run continues bit for bit). Returns (step, the extra RNG states or None).
    `unverified` (--unverified): a set without checksums is read, with a warning."""
    t0 = time.perf_counter()  # (setup() removed the leftovers of interrupted writes)

    def load():
        ckpt = open_checkpoint(out_dir, run, unverified)
        if env.master:
            for note in ckpt.notes:
                log(env, note)
            if ckpt.unverified:
                log(env, f"warning: --unverified: {ckpt.directory} records no checksums; its files are read "
                         "unchecked (a damaged file would be trained on)")
            others = other_committed_sets(out_dir, ckpt.directory)
            if others:
                log(env, f"note: kept: {', '.join(others)}, committed set(s) besides {ckpt.directory}, the newest, "
                         "resumed (this run replaces only the set it resumes; to resume an older set, remove "
                         "the newer ones)")
        with torch.no_grad():
            for piece in pieces:
                value = ckpt.read(piece.name, piece.shape, piece.box, piece.flat)
                piece.tensor.copy_(value.view(piece.tensor.shape))
        same = ckpt.meta["layout"] == {**run["layout"], "world_size": env.world_size}
        rng = None
        if same:
            _, data = ckpt.file(env.rank)
            for key in data:
                if key.startswith(("rng/", "extra_rng/")):
                    ckpt.verify(env.rank, key, data[key])
            rng = {k[4:]: v.clone() for k, v in data.items() if k.startswith("rng/")}
            extra = {k[10:]: v.clone() for k, v in data.items() if k.startswith("extra_rng/")}
        return ckpt.meta, same, rng, (extra if same else None)

    meta, same, rng, extra = _agreed(env, load)
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].fill_(meta["optimizer_step"])
    log(env, f"resumed step {meta['step']} from {latest_checkpoint(out_dir)} in {time.perf_counter() - t0:.2f} s")
    if same:
        set_rng_state(env, rng)
    else:
        log(env, f"resuming step {meta['step']} written by {meta['layout']} as {run['layout']} on "
                 f"{env.world_size} rank(s): parameters and AdamW state resharded; the dropout streams start "
                 "afresh: they cannot carry across layouts (the same layout resumes bit for bit)")
    return meta["step"], extra


def consolidated_model(out_dir):
    """The newest committed set's model, consolidated: (state dict under nanoGPT's names with
    the tied lm_head.weight, the set's metadata)."""
    ckpt = Checkpoint(latest_checkpoint(out_dir))
    state = {}
    for name, entry in ckpt.meta["tensors"].items():
        if name.startswith("model/"):
            shape = entry["shape"]
            state[name[6:]] = ckpt.read(name, shape, [[0, s] for s in shape]).view(shape)
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied, as in nanoGPT
    return state, ckpt.meta


def export_checkpoint(out_dir, path):
    """The newest committed set, consolidated into one file in nanoGPT's ckpt.pt format
    (model state dict with the tied lm_head.weight, model_args, iter_num, config): for
    nanoGPT's sample.py, 01_single_gpu.py --init_from, or any user."""
    state, meta = consolidated_model(out_dir)
    run = meta["run"]
    atomic_save({"model": state, "model_args": run["model"], "iter_num": meta["step"],
                 "config": {**{k: v for k, v in run.items() if k != "model"}, "dataset": run["data"]}}, path)


def load_model_file(path, config):
    """--init_from: a one-file model (--export's, or nanoGPT's own ckpt.pt), or hf:DIR (a
    transformers GPT-2 directory, infra.hf), as (config, state dict) after checking that it is
    this model; one line otherwise. The config is `config`, or for hf:DIR with the directory's
    vocabulary (GPT-2's 50257 where --data says nanoGPT's padded 50304)."""
    if path.startswith("hf:"):
        directory = path[3:]
        check(os.path.isdir(directory), f"--init_from {path}: {directory} is not a directory (hf:DIR names a "
              "transformers model directory, save_pretrained's)")
        try:
            vocab, state, notes = import_hf(directory, config, load_tensors)
        except (HFError, OSError) as e:
            check(False, str(e) if isinstance(e, HFError) else f"--init_from {path}: {e}")
        print(f"--init_from {path}: transformers' GPT-2 read{': ' + '; '.join(notes) if notes else ''}", flush=True)
        return GPTConfig(**{**asdict(config), "vocab_size": vocab}), state
    check(os.path.exists(path), f"--init_from {path}: no such file (hf:DIR for a transformers directory)")
    check(os.path.isfile(path), f"--init_from {path} is {'a directory' if os.path.isdir(path) else 'not a regular file'}"
          ", not a one-file model (--export's, or nanoGPT's ckpt.pt; hf:DIR for a transformers directory)")
    obj, problem = load_tensors(path)  # /dev/zero would be read for ever: files only, above
    check(problem is None, f"--init_from {path} {problem}")
    check(isinstance(obj, dict) and isinstance(obj.get("model"), dict) and isinstance(obj.get("model_args"), dict),
          f"--init_from {path} is not a one-file model (expected a dict with 'model' and 'model_args', as "
          f"--export and nanoGPT write; it holds a {type(obj).__name__}"
          + (f" with keys {sorted(obj)[:6]}" if isinstance(obj, dict) else "") + ")")
    architecture = lambda cfg: {**{k: cfg.get(k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias",  # noqa: E731
                                                          "vocab_size")}, "n_expert": cfg.get("n_expert", 0),
                                **({"shared_experts": cfg.get("shared_experts", 0),  # the tensors a MoE holds
                                    "routers' biases": cfg.get("balance") == "bias"} if cfg.get("n_expert") else {})}
    check(architecture(obj["model_args"]) == architecture(asdict(config)), f"--init_from {path} holds another "
          f"model: {architecture(obj['model_args'])}, this run builds {architecture(asdict(config))}")
    state = {k.removeprefix("_orig_mod."): v for k, v in obj["model"].items()}  # nanoGPT's compiled names
    return config, {k: v for k, v in state.items() if not (k.endswith(".attn.bias") and v.dim() == 4)}  # its mask


def run_config(args, config, world_layout):
    """What a checkpoint must agree on to be resumed (all but the layout, which may change),
    and the layout that wrote it (the same layout resumes bit for bit, RNG included)."""
    keys = ("data", "global_batch_size", "seed", "lr", "min_lr", "warmup_iters",
            "lr_decay_iters", "weight_decay", "grad_clip", "optimizer")
    run = {"model": asdict(config), "layout": world_layout, **{k: getattr(args, k) for k in keys}}
    if os.path.isdir(run["data"]):  # the same directory however it is spelled (a trailing slash)
        run["data"] = os.path.normpath(run["data"])
    return run
