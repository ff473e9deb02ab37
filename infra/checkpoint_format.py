"""The checkpoint format and the sets on disk: a rank's pieces (a box of the global tensor,
or a flat range of it), the atomic write of a file, the metadata's checks, the committed sets in
an out_dir (newest, unfinished, removed), and Checkpoint, which reads any region of any tensor
from the pieces that overlap it: resharding on load. Nothing here talks to another rank;
saving and resuming, agreed by every rank, are infra.checkpoint's."""

import json
import math
import os
import shutil
import zlib
from dataclasses import dataclass

import torch

from infra.formulas import format_bytes


# One format for every script, resharded on load. Written by hand rather than with
# torch.distributed.checkpoint (DCP): DCP describes shards through DTensor/ShardedTensor
# metadata that these hand-written layouts do not have (ZeRO's flat shards of a padded
# buffer, Megatron's [Q_t; K_t; V_t] rows, a vocabulary padded to a multiple of T), it would
# be a second way of saying where a piece lives, and reading its files needs DCP itself. Here
# a piece is said once, as a box and an optional flat range (below), and the files are plain
# torch.save dicts of tensors plus one JSON file, readable with nothing but torch and json.
#
#   out_dir/ckpt/step_<N>/rank<r>.pt      every rank's pieces: {key: tensor}, its RNG states
#   out_dir/ckpt/step_<N>/metadata.json   written last, by rank 0: the commit
#
# metadata.json: format, step, optimizer step, run configuration, layout, time, and per
# tensor ("model/<nanoGPT name>", "optim/exp_avg/<name>", "optim/exp_avg_sq/<name>") its
# global shape, dtype and pieces {rank, key, box, flat}. A piece is the region `box` of the
# global tensor (per dimension [start, stop): TP, PP and FSDP shards), or, with `flat`, the
# elements [a, b) of that box flattened row-major (ZeRO's flat shards). A set without
# metadata.json is never read; the previous set is removed only after the new one is
# committed; leftovers of interrupted writes are removed at the next save or resume.

CHECKPOINT_FORMAT = "gpt-parallel-by-hand checkpoint v1"


class CheckpointError(Exception):
    """A wrong, damaged or missing checkpoint: reported in one line, exit 2 on every rank."""


@dataclass
class Piece:
    """One rank's piece of one global tensor: `tensor` holds the region `box` of the tensor
    `name` (global shape `shape`), or with `flat` = (a, b) the elements [a, b) of that box
    flattened. `write`: this rank stores it (one of the replicas does); every rank reads.
    `source`: on the first optimizer piece of a parameter, (the tensor the optimizer steps on,
    the function that picks this piece from it): its .grad is the piece's gradient, which the
    gradient oracle reassembles (infra.numerics)."""
    name: str
    shape: tuple
    box: list
    flat: tuple
    tensor: torch.Tensor
    write: bool = True
    source: tuple = None


def param_pieces(name, shape, param, optimizer=None, box=None, flat=None, index=None, write=True, model=True):
    """The pieces of parameter `name` (nanoGPT's name, global shape `shape`) that this rank
    holds in `param` (or in param[index]): its value and, given the optimizer, its AdamW
    moments (Muon's matrices: its momentum), under the same box/flat. AdamW state is created
    (zeros) if it does not exist yet, so that a resumed run has somewhere to load it into."""
    shape = tuple(shape)
    box = [list(b) for b in box] if box is not None else [[0, s] for s in shape]
    flat = tuple(flat) if flat is not None else None
    pick = (lambda t: t[index]) if index is not None else (lambda t: t)
    pieces = [Piece(f"model/{name}", shape, box, flat, pick(param.data), write)] if model else []
    if optimizer is not None:
        state = optimizer.state[param]
        if "momentum_buffer" in state:  # a Muon matrix (common.Muon makes its buffer at once)
            return pieces + [Piece(f"optim/momentum/{name}", shape, box, flat, pick(state["momentum_buffer"]), write,
                                   (param, pick))]
        if "exp_avg" not in state:
            fused = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        for moment in ("exp_avg", "exp_avg_sq"):
            pieces.append(Piece(f"optim/{moment}/{name}", shape, box, flat, pick(state[moment]), write,
                                (param, pick) if moment == "exp_avg" else None))
    return pieces


def _flat_boxes(box, flat):
    """The region `box`, or the elements [a, b) of it flattened row-major, as boxes of the
    global tensor, each with the offset of its first element in the piece's (flattened)
    data. A flat range is at most 2·ndim + 1 boxes: partial rows around whole ones."""
    sizes = [stop - start for start, stop in box]
    if flat is None:
        return [(box, 0)]
    a0, b0 = flat
    out = []

    def split(a, b, dims, prefix, base):  # [a, b) of the sub-tensor `dims` at flat `base`
        if a >= b:
            return
        if not dims:
            out.append((prefix, base - a0))
            return
        inner = math.prod(dims[1:])
        rest = [[0, d] for d in dims[1:]]
        first, last = a // inner, (b - 1) // inner
        if a % inner:  # a partial first row
            split(a - first * inner, min(b, (first + 1) * inner) - first * inner, dims[1:],
                  prefix + [[first, first + 1]], base + first * inner)
            first += 1
        whole_to = last + 1 if b % inner == 0 else last  # rows [first, whole_to) are whole
        if whole_to > first:
            out.append((prefix + [[first, whole_to]] + rest, base + first * inner - a0))
        if b % inner and last >= first:  # a partial last row
            split(0, b - last * inner, dims[1:], prefix + [[last, last + 1]], base + last * inner)

    split(a0, b0, sizes, [], 0)
    return [([[s + o, e + o] for (s, e), (o, _) in zip(sub, box)], offset) for sub, offset in out]


def _copy_overlap(dst, dst_regions, src, src_regions):
    """Copy every element that the two pieces share from src to dst (both flattened data);
    returns how many."""
    copied = 0
    for dbox, doff in dst_regions:
        dshape = [e - s for s, e in dbox]
        for sbox, soff in src_regions:
            inter = [[max(d[0], s[0]), min(d[1], s[1])] for d, s in zip(dbox, sbox)]
            if any(s >= e for s, e in inter):
                continue
            sshape = [e - s for s, e in sbox]
            d = dst[doff:doff + math.prod(dshape)].view(dshape)[tuple(slice(s - o[0], e - o[0]) for (s, e), o in zip(inter, dbox))]
            s_ = src[soff:soff + math.prod(sshape)].view(sshape)[tuple(slice(s - o[0], e - o[0]) for (s, e), o in zip(inter, sbox))]
            d.copy_(s_)
            copied += math.prod(e - s for s, e in inter)
    return copied


def atomic_save(obj, path):
    """Write atomically: a temporary file in the same directory, flushed to disk, then
    renamed over the old one; a crash mid-write leaves the previous file intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if isinstance(obj, (bytes, str)):
                f.write(obj.encode() if isinstance(obj, str) else obj)
            else:
                try:
                    torch.save(obj, f)
                except RuntimeError as e:  # a full disk reads "enforce fail at inline_container.cc ..."
                    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
                    raise OSError(f"the write failed ({format_bytes(free)} free on that file system; "
                                  f"torch: {(str(e).splitlines() or [''])[0][:120]})") from e
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX file systems
    finally:
        if os.path.exists(tmp):  # the write failed: leave no half-written file behind
            os.remove(tmp)


def tensor_checksum(t):
    """CRC-32 of a CPU tensor's bytes: cheap next to the I/O, and a flipped bit changes it."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def checkpoint_root(out_dir):
    return os.path.join(out_dir, "ckpt")


DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def _is_int(value, low=0, high=None):
    """A JSON whole number in [low, high) (True and 3.0 are not one)."""
    return type(value) is int and value >= low and (high is None or value < high)


def _metadata_problems(meta):
    """What is wrong with a parsed metadata.json of this format (a list, empty when nothing
    is): every field the reader relies on has its kind and its range, so that a damaged or
    hand-edited file is one line naming the fields, never a KeyError or a TypeError deep in a
    resume. The checksums are checked here for their shape only (a list of one {key: CRC-32}
    per rank file); a set without them cannot be verified (Checkpoint says so)."""
    found = []
    for key, kind in {"step": int, "optimizer_step": int, "run": dict, "layout": dict, "tensors": dict}.items():
        if type(meta.get(key)) is not kind or kind is int and meta[key] < 0:
            found.append(f'{key} is missing or not a{"" if kind is dict else " non-negative"} {kind.__name__}')
    stamp = meta.get("time")
    if type(stamp) not in (int, float) or not math.isfinite(stamp):
        found.append(f"time is {json.dumps(stamp)[:40]}, not the commit's time in seconds")
    world = meta["layout"].get("world_size") if isinstance(meta.get("layout"), dict) else None
    if isinstance(meta.get("layout"), dict) and not _is_int(world, 1):
        found.append(f"layout/world_size is {json.dumps(world)[:40]}, not a positive whole number of rank files")
    world = world if _is_int(world, 1) else None
    sums = meta.get("checksums")
    if sums is not None and world is not None:
        if not isinstance(sums, list) or len(sums) != world:
            found.append(f'checksums is {"a list of " + str(len(sums)) if isinstance(sums, list) else "a " + type(sums).__name__}'
                         f", not a list of one {{key: CRC-32}} table per rank file (the layout has {world})")
        else:
            found += [f"checksums[{rank}] is not a {{key: CRC-32}} table of rank{rank}.pt"
                      for rank, table in enumerate(sums) if not isinstance(table, dict)
                      or not all(isinstance(k, str) and _is_int(v, 0, 2**32) for k, v in table.items())]
    tensors = meta.get("tensors") if isinstance(meta.get("tensors"), dict) else {}
    for name, entry in tensors.items():
        problem = _tensor_entry_problem(entry, world)
        if problem:
            found.append(f"tensors/{name[:120]}: {problem}")
    return found


def _tensor_entry_problem(entry, world):
    """What is wrong with one tensor's entry {shape, dtype, pieces}, or None: every piece on
    a rank file that exists, its box inside the shape, its flat range inside its box."""
    if not isinstance(entry, dict) or not isinstance(entry.get("pieces"), list):
        return "no list of pieces"
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
        return "its shape is not a list of whole numbers"
    if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in {f"torch.{d}" for d in DTYPES}:
        return f"its dtype {json.dumps(entry.get('dtype'))[:40]} is not a tensor type"
    for piece in entry["pieces"]:
        if not (isinstance(piece, dict) and isinstance(piece.get("key"), str) and isinstance(piece.get("box"), list)):
            return "a piece without its key or box"
        if not _is_int(piece.get("rank"), 0, world):
            return (f"a piece on rank {json.dumps(piece.get('rank'))[:20]}, not one of the "
                    + (f"{world} rank files" if world else "layout's rank files"))
        box = piece["box"]
        if len(box) != len(shape) or not all(isinstance(b, list) and len(b) == 2 and _is_int(b[0]) and _is_int(b[1])
                                             and b[0] <= b[1] <= s for b, s in zip(box, shape)):
            return f"the box {json.dumps(box)[:60]} of {piece['key'][:80]} is not inside the shape {shape}"
        flat = piece.get("flat")
        if flat is not None and not (isinstance(flat, list) and len(flat) == 2 and _is_int(flat[0]) and _is_int(flat[1])
                                     and flat[0] <= flat[1] <= math.prod(b - a for a, b in box)):
            return f"the flat range {json.dumps(flat)[:60]} of {piece['key'][:80]} is not inside its box"
    return None


def _read_metadata(path):
    """metadata.json parsed and checked (`_metadata_problem`); a CheckpointError naming the
    file and what is wrong with it otherwise."""
    if not os.path.isfile(path):  # a link to a device (/dev/zero is read for ever) or a dangling one
        raise CheckpointError(f"checkpoint metadata {path} is not a regular file (a link to a device, or to "
                              "nothing?): not a checkpoint's metadata")
    try:
        with open(path) as f:
            meta = json.load(f)
    except RecursionError:  # [[[[...]]]]: JSON nested deeper than the parser's recursion
        raise CheckpointError(f"checkpoint metadata {path} is not a checkpoint's metadata: "
                              "its JSON is nested thousands of levels deep") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint metadata {path} is unreadable (truncated or corrupt?): "
                              f"{type(e).__name__}: {str(e)[:150]}") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not the metadata of a checkpoint of these scripts "
                              f"(no \"format\": \"{CHECKPOINT_FORMAT}\")")
    problems = _metadata_problems(meta)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint metadata {path} is damaged: {'; '.join(problems[:3])}{more}")
    return meta


def _commit_time(path):
    """The "time" a committed set's metadata.json records, else the file's modification time
    (an unreadable or damaged file: refused, with its name, if it is the set chosen)."""
    if not os.path.isfile(path):
        return os.lstat(path).st_mtime  # not read: refused, with its name, if it is the set chosen
    stamp = os.path.getmtime(path)
    try:
        with open(path) as f:
            recorded = json.load(f).get("time")
    except (OSError, ValueError, AttributeError, RecursionError):
        return stamp
    return float(recorded) if type(recorded) in (int, float) and math.isfinite(recorded) else stamp


def latest_checkpoint(out_dir):
    """The directory of the newest committed set (the one whose metadata was written last),
    or None. Sets without metadata.json (a write that did not finish) are ignored."""
    root, best = checkpoint_root(out_dir), (None, -1.0)
    if not os.path.isdir(root):
        return None
    for name in os.listdir(root):
        meta = os.path.join(root, name, "metadata.json")
        if name.startswith("step_") and os.path.lexists(meta):  # (a link to a device: refused when read)
            stamp = _commit_time(meta)
            if stamp > best[1]:
                best = (os.path.join(root, name), stamp)
    return best[0]


def unfinished_checkpoints(out_dir):
    """The sets in out_dir without metadata.json (writes that did not finish), and the
    temporary files of killed writes."""
    root = checkpoint_root(out_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if ".tmp." in name or name.startswith("step_") and not os.path.lexists(os.path.join(path, "metadata.json")):
            found.append(path)
        elif os.path.isdir(path):
            found += [os.path.join(path, f) for f in sorted(os.listdir(path)) if ".tmp." in f]
    return found


def clean_checkpoints(out_dir, keep, committed=True):
    """Rank 0: remove the leftovers of interrupted writes (sets without metadata, temporary
    files) and the committed sets `committed` names but `keep`: True, every one (after the
    first commit of an --overwrite run), or a list of directories (after a commit: the set it
    replaces). At start-up committed sets are never removed (a user may have copied an older
    one back to roll back)."""
    for path in unfinished_checkpoints(out_dir):
        if keep is None or os.path.abspath(path) != os.path.abspath(keep):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    root = checkpoint_root(out_dir)
    if committed and os.path.isdir(root):
        named = None if committed is True else {os.path.abspath(p) for p in committed if p}
        for name in os.listdir(root):
            path = os.path.abspath(os.path.join(root, name))
            if (name.startswith("step_") and (keep is None or path != os.path.abspath(keep))
                    and (named is None or path in named)):
                shutil.rmtree(path, ignore_errors=True)


class Checkpoint:
    """A committed set, opened for reading: `read(name, box, flat)` assembles any region of
    any tensor from the pieces that overlap it, opening only the rank files that hold them
    (memory-mapped, weights_only: nothing is unpickled but tensors)."""

    def __init__(self, directory, unverified=False):
        self.directory = directory
        self.meta = _read_metadata(os.path.join(directory, "metadata.json"))
        self.files, self.verified = {}, set()
        # a set whose metadata records no checksums (written before they were, or edited)
        # cannot be verified: refused, unless --unverified says to read it all the same
        self.unverified = unverified and self.meta.get("checksums") is None
        if self.meta.get("checksums") is None and not unverified:
            raise CheckpointError(f"checkpoint metadata {os.path.join(directory, 'metadata.json')} records no "
                                  "checksums of its rank files, so what they hold cannot be verified (a set "
                                  "written before checksums were, or an edited one): resume it with --unverified "
                                  "to read it unchecked, or from a copy that has them")

    def verify(self, rank, key, stored):
        """The tensor read back is the one written: its CRC-32 against metadata.json's. A
        tensor the checksums do not list cannot be verified, and is refused like a wrong one
        (only a set without any checksums may be read, with --unverified)."""
        if self.unverified or (rank, key) in self.verified:
            return
        path = os.path.join(self.directory, f"rank{rank}.pt")
        expected = self.meta["checksums"][rank].get(key)
        if expected is None:
            raise CheckpointError(f"checkpoint metadata {os.path.join(self.directory, 'metadata.json')} lists no "
                                  f"checksum for {key.split('#')[0]} in {path}, so it cannot be verified "
                                  "(an edited or foreign metadata.json?)")
        if tensor_checksum(stored) != expected:
            raise CheckpointError(f"checkpoint file {path}: "
                                  f"{key.split('#')[0]} fails its checksum (the file changed after it was "
                                  "written: a damaged disk or copy); resume from another copy of this set")
        self.verified.add((rank, key))

    def file(self, rank):
        if rank not in self.files:
            path = os.path.join(self.directory, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise CheckpointError(f"checkpoint file {path} is missing")
            data, problem = load_tensors(path, mmap=True)
            if problem:
                raise CheckpointError(f"checkpoint file {path} {problem}")
            if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
                raise CheckpointError(f"checkpoint file {path} is not a rank file of these scripts "
                                      f"(it holds a {type(data).__name__}, not a dict of tensors)")
            self.files[rank] = (path, data)
        return self.files[rank]

    def read(self, name, shape, box, flat=None):
        entry = self.meta["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name}")
        if list(entry["shape"]) != list(shape):
            raise CheckpointError(f"checkpoint {self.directory} holds {name} of shape {entry['shape']}, "
                                  f"this run needs {list(shape)}")
        numel = (flat[1] - flat[0]) if flat else math.prod(e - s for s, e in box)
        out = torch.empty(numel, dtype=getattr(torch, entry["dtype"].replace("torch.", "")))
        wanted, copied = _flat_boxes(box, flat), 0
        for piece in entry["pieces"]:
            regions = _flat_boxes(piece["box"], piece.get("flat"))
            if not any(all(max(d[0], s[0]) < min(d[1], s[1]) for d, s in zip(w, r))
                       for w, _ in wanted for r, _ in regions):
                continue  # no overlap: its file is not opened
            path, data = self.file(piece["rank"])
            stored = data.get(piece["key"])
            size = (piece["flat"][1] - piece["flat"][0]) if piece.get("flat") else math.prod(e - s for s, e in piece["box"])
            if stored is None or stored.numel() != size:
                raise CheckpointError(f"checkpoint file {path} does not hold {piece['key']} as its metadata says")
            self.verify(piece["rank"], piece["key"], stored)
            copied += _copy_overlap(out, wanted, stored.reshape(-1), regions)
        if copied != numel:
            raise CheckpointError(f"checkpoint {self.directory} covers {copied} of the {numel} elements "
                                  f"of {name} this rank needs")
        return out


def load_tensors(path, mmap=False):
    """torch.load(path) of tensors and plain containers only (weights_only: nothing else is
    unpickled, so a malicious pickle runs nothing), quietly: (what it holds, None), or (None,
    why not) in a few words. torch's own refusal is a paragraph about weights_only and its
    warnings (an old pickle protocol) print lines with their source: the cause is kept."""
    import pickle
    import re
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap), None
    except pickle.UnpicklingError as e:
        found = re.search(r"(Unsupported global: GLOBAL \S+|unsupported GLOBAL \S+|Unsupported operand \d+)", str(e))
        cause = found.group(1) if found else "objects other than tensors"
        return None, (f"holds more than tensors ({cause}): refused unread (only tensors are ever unpickled; "
                      "a pickle of code or of other objects is not a checkpoint of these scripts)")
    except Exception as e:  # a zip torch cannot read, a short file, a directory
        first = re.sub(r"\x1b\[[0-9;]*m", "", (str(e).splitlines() or [""])[0])[:150]
        return None, f"is unreadable (truncated, corrupt, or not a torch file?): {type(e).__name__}: {first}"
