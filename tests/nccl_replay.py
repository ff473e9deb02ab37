"""Would this communication deadlock under NCCL? Record what every rank of a real CPU run
posts, then replay the posting orders under NCCL's semantics.

gloo, which the CPU tests run on, buffers a send whatever the receiver is doing, so an order
of point-to-point operations that hangs on GPUs passes every CPU test. This module records
the order and replays it under the rules below; a deadlock (or a mismatched pair) is reported
with what every rank is blocked on.

Recording. Run a script through this file, which wraps torch.distributed's functions and
then runs the script as __main__ (harness.launch runs it like any script):

    python tests/nccl_replay.py RECORD_DIR 07_pipeline.py --schedule interleaved ...

Each rank appends one JSON line per posted operation to RECORD_DIR/rank<r>.jsonl, in the
order its host posts them: a batch_isend_irecv as one line {"kind": "batch", "group",
"ops": [{"op": "send" | "recv", "peer" (global rank), "bytes", "tag"}]}; a lone isend /
irecv / send / recv as {"kind": "send" | "recv", "group", "peer", "bytes", "tag"}; a
collective as {"kind": "all_reduce", ..., "group", "ranks", "bytes"}. "group" names the
communicator (torch's group_name: two groups of the same ranks are two communicators).

The model (NCCL's point-to-point and collective semantics, taken strictly):

 1. A rank's operations complete in the order it posts them. NCCL runs every operation of a
    communicator on one CUDA stream, in posting order; and in these scripts each operation
    waits for the one before it through the compute stream (a received input is computed
    on before the next send is posted), so one queue per rank is the model: a rank works
    on the first of its operations that has not completed (its head), and on nothing later.
 2. A batch_isend_irecv is one NCCL group (ncclGroupStart/End): its sends and receives are
    posted together, progress independently, and the batch completes when all of them have;
    only then does the rank move on. A lone send or receive is a batch of one.
 3. A send completes only when its matching receive is posted, and vice versa
    (rendezvous: NCCL does not buffer a send for a receiver that has not posted). Posted
    means: in the head batch of its rank.
 4. Matching is FIFO per (communicator, sender, receiver): the k-th send from a to b is
    received by b's k-th receive from a. NCCL ignores tags, so a pair whose tags or sizes
    differ is a mismatch (the wrong tensor would arrive), reported as an error.
 5. A collective completes when every member of its communicator has it at its head; the
    k-th collective of a communicator must be the same operation (and size) on every member.

Deadlock: no rule can move any rank and some rank has operations left. The report lists,
for every blocked rank, its head operation and, for each of its unmatched sends and
receives, where the counterpart is (a later operation of the peer, or never posted)."""

import json
import os
import runpy
import sys
from dataclasses import dataclass, field
from functools import wraps

# ----------------------------------------------------------------------------------------
# Replay
# ----------------------------------------------------------------------------------------


@dataclass
class Replay:
    ok: bool
    blocked: dict = field(default_factory=dict)  # rank -> what it waits on (lines)
    mismatches: list = field(default_factory=list)  # matched pairs whose tag or size differ
    completed: dict = field(default_factory=dict)  # rank -> operations completed

    def report(self):
        if self.ok:
            return "no deadlock: every rank completed every operation"
        lines = [f"mismatch: {m}" for m in self.mismatches]
        if self.blocked:
            lines.append("DEADLOCK under NCCL's semantics; blocked ranks:")
            for rank, waits in sorted(self.blocked.items()):
                lines.append(f"  rank {rank} (after {self.completed[rank]} completed operations):")
                lines += [f"    {w}" for w in waits]
        return "\n".join(lines)


def _describe(entry):
    def op(o, kind):
        return f"{kind} {'to' if kind == 'send' else 'from'} {o['peer']} tag {o['tag']}"
    if entry["kind"] == "batch":
        return "batch_isend_irecv[" + ", ".join(op(o, o["op"]) for o in entry["ops"]) + "]"
    if entry["kind"] in ("send", "recv"):
        return op(entry, entry["kind"])
    return f"{entry['kind']} on group {entry['group']} {entry.get('ranks')}"


def replay(posts):
    """posts: {rank: [entry, ...]} in posting order (the recorded JSON lines, or orders
    computed the same way). Returns a Replay: ok, or the deadlock / mismatches found."""
    # every operation as (rank, position in its queue), p2p ops numbered per channel
    items, channel_count, where = {}, {}, {}
    for rank, entries in posts.items():
        items[rank] = []
        for position, entry in enumerate(entries):
            if entry["kind"] in ("batch", "send", "recv"):
                ops = entry["ops"] if entry["kind"] == "batch" else [dict(entry, op=entry["kind"])]
                keyed = []
                for op in ops:
                    side = op["op"]
                    src, dst = (rank, op["peer"]) if side == "send" else (op["peer"], rank)
                    channel = (entry.get("group"), src, dst)
                    k = channel_count.get((channel, side), 0)
                    channel_count[(channel, side)] = k + 1
                    key = (channel, k)
                    where[(key, side)] = (rank, position, op)
                    keyed.append((key, side))
                items[rank].append(("p2p", entry, keyed))
            else:
                items[rank].append(("collective", entry, None))
    collective_seq = {}  # (rank, position) -> index of this collective within its group, on its rank
    seen = {}
    for rank, queue in items.items():
        for position, (kind, entry, _) in enumerate(queue):
            if kind == "collective":
                n = seen.get((rank, entry["group"]), 0)
                seen[(rank, entry["group"])] = n + 1
                collective_seq[(rank, position)] = n

    pos = {rank: 0 for rank in items}
    done, mismatches = set(), []
    progressed = True
    while progressed:
        progressed = False
        for rank, queue in items.items():
            if pos[rank] == len(queue):
                continue
            kind, entry, keyed = queue[pos[rank]]
            if kind == "p2p":
                for key, side in keyed:
                    if (key, side) in done:
                        continue
                    other = "recv" if side == "send" else "send"
                    peer = where.get((key, other))
                    if peer is None or pos[peer[0]] != peer[1]:
                        continue  # the counterpart is not posted (yet)
                    done.update({(key, side), (key, other)})
                    mine, theirs = where[(key, side)][2], peer[2]
                    if mine.get("tag") != theirs.get("tag") or mine.get("bytes") != theirs.get("bytes"):
                        send, recv = (mine, theirs) if side == "send" else (theirs, mine)
                        mismatches.append(f"channel {key[0][1]}->{key[0][2]} message {key[1]}: sent tag "
                                          f"{send.get('tag')} ({send.get('bytes')} bytes), received as tag "
                                          f"{recv.get('tag')} ({recv.get('bytes')} bytes)")
                if all(k in done for k in keyed):
                    pos[rank] += 1
                    progressed = True
            else:
                members = entry["ranks"]
                n = collective_seq[(rank, pos[rank])]
                heads = []
                for member in members:
                    if member not in items or pos[member] == len(items[member]):
                        break
                    head = items[member][pos[member]]
                    if head[0] != "collective" or head[1]["group"] != entry["group"]:
                        break
                    if collective_seq[(member, pos[member])] != n:
                        break
                    heads.append(head[1])
                else:
                    if any((h["kind"], h.get("bytes")) != (entry["kind"], entry.get("bytes")) for h in heads):
                        mismatches.append(f"collective {n} of group {entry['group']}: "
                                          + ", ".join(f"rank {m} {h['kind']} ({h.get('bytes')} bytes)"
                                                      for m, h in zip(members, heads)))
                    for member in members:
                        pos[member] += 1
                    progressed = True

    def head(rank):
        return _describe(items[rank][pos[rank]][1]) if pos[rank] < len(items[rank]) else "done"

    blocked = {}
    for rank, queue in items.items():
        if pos[rank] == len(queue):
            continue
        kind, entry, keyed = queue[pos[rank]]
        waits = [f"head: {_describe(entry)}"]
        for key, side in keyed or ():
            if (key, side) in done:
                continue
            other = "recv" if side == "send" else "send"
            peer = where.get((key, other))
            (src, dst), k = key[0][1:], key[1]
            what = (f"{side} {'to ' + str(dst) if side == 'send' else 'from ' + str(src)} "
                    f"(message {k} of {src}->{dst})")
            if peer is None:
                waits.append(f"{what}: its {other} is never posted")
            else:
                waits.append(f"{what}: its {other} is rank {peer[0]}'s operation {peer[1]}, which waits "
                             f"behind {peer[1] - pos[peer[0]]} operation(s) of its own: {head(peer[0])}")
        if kind == "collective":
            waits.append("members' heads: " + "; ".join(f"rank {m}: {head(m)}" for m in entry["ranks"]))
        blocked[rank] = waits
    return Replay(ok=not blocked and not mismatches, blocked=blocked, mismatches=mismatches,
                  completed={rank: pos[rank] for rank in items})


def read_records(directory):
    """{rank: [entry, ...]} from RECORD_DIR/rank<r>.jsonl."""
    posts = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                posts[int(name[4:-6])] = [json.loads(line) for line in f if line.strip()]
    return posts


# ----------------------------------------------------------------------------------------
# Recording: wrap torch.distributed's functions before the script imports them
# ----------------------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def install(directory):
    """Wrap torch.distributed so that every rank appends what it posts to directory/rank<r>.jsonl."""
    import torch
    import torch.distributed as dist
    os.makedirs(directory, exist_ok=True)
    files = {}

    def write(entry):
        rank = dist.get_rank()
        if rank not in files:
            files[rank] = open(os.path.join(directory, f"rank{rank}.jsonl"), "a", buffering=1)
        files[rank].write(json.dumps(entry) + "\n")

    def group_of(group):
        group = group if group is not None else dist.group.WORLD
        return group.group_name, dist.get_process_group_ranks(group)

    def nbytes(value):
        if torch.is_tensor(value):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
            return sum(nbytes(v) for v in value)
        return None  # Python objects (all_gather_object, ...): their pickles' size is not known here

    def collective(name, fn):
        @wraps(fn)
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            first = args[0] if args else next(iter(kwargs.values()), None)
            name_, ranks = group_of(group)
            write({"kind": name, "group": name_, "ranks": ranks, "bytes": nbytes(first)})
            return fn(*args, **kwargs)
        return recorded

    def point_to_point(name, fn):
        @wraps(fn)
        def recorded(tensor, peer=None, group=None, tag=0, **kwargs):
            write({"kind": "send" if name in ("send", "isend") else "recv", "group": group_of(group)[0],
                   "peer": peer, "bytes": nbytes(tensor), "tag": tag})
            return fn(tensor, peer, group, tag, **kwargs)
        return recorded

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, collective(name, getattr(dist, name)))
    for name in ("send", "recv", "isend", "irecv"):
        setattr(dist, name, point_to_point(name, getattr(dist, name)))

    class P2POp(dist.P2POp):
        """torch's P2POp accepts only its own isend/irecv: hand it the unwrapped ones."""

        @staticmethod
        def _unwrap(op):
            while hasattr(op, "__wrapped__"):
                op = op.__wrapped__
            return op

        def __new__(cls, op, *args, **kwargs):
            return super().__new__(cls, cls._unwrap(op), *args, **kwargs)

        def __init__(self, op, *args, **kwargs):
            super().__init__(self._unwrap(op), *args, **kwargs)
    dist.P2POp = P2POp
    original = dist.batch_isend_irecv

    @wraps(original)
    def batch_isend_irecv(p2p_ops):
        write({"kind": "batch", "group": group_of(p2p_ops[0].group)[0] if p2p_ops else None,
               "ops": [{"op": "send" if p.op.__name__ == "isend" else "recv", "peer": p.peer,
                        "bytes": nbytes(p.tensor), "tag": p.tag} for p in p2p_ops]})
        return original(p2p_ops)
    dist.batch_isend_irecv = batch_isend_irecv


if __name__ == "__main__":  # python tests/nccl_replay.py RECORD_DIR SCRIPT ARGS...
    record_dir, script = sys.argv[1], sys.argv[2]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = script if os.path.isabs(script) else os.path.join(root, script)
    install(record_dir)
    sys.argv = [script] + sys.argv[3:]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
