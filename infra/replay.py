"""The posting orders of every rank, completed and replayed: the symmetry (every rank's
posting order from its role's, through the mesh's rotations) and the replay under NCCL's rules
(rendezvous sends, one queue a rank, FIFO matching, collectives in the same order on every
member), which finds the deadlocks and mismatches that gloo's buffered sends hide from a CPU run."""

import dataclasses
import collections
import collections.abc
import gc
import json
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps

import torch.distributed as dist

from infra.metrics import spans


# A `roles` rehearsal executes one rank per role; the replay needs every rank's posting order.
# The others come from the mesh, the way a reader sees them: in 08 at dp 8 x pp 16 x tp 8,
# rank 517 (dp 4, pp 0, tp 5) is rank 0 moved 4 replicas over and 5 places along its TP group:
#
#   the groups every rank made, in order     families (runs of disjoint groups, one desc):
#   tp {0..7} {8..15} ...  dp {0,128,..}       tp, model, dp, pp, embedding, guard, world
#   ...                                        a family's rotation: each member of each of its
#                                              groups moves k places along its own group
#
# A rotation is a symmetry of the mesh when it maps every group onto a group of the same desc
# (tp by 1: yes; dp by 1 with cp 2: no, a CP ring breaks; pp by 1: no, the embedding group
# breaks), and it is taken only if it leaves apart the ranks the script says differ (Run.start's
# `ranks`: the pipeline stages; 07's stages share the world group, and its rotation would merge
# them). Rotations found: each rank's order is its rehearsed role-mate's with every rank id and
# group mapped through them (the same position in another replica posts the same sequence on
# its own replica's groups). Where two rehearsed ranks share a role (`roles` rehearses the last
# rank, which is its stage's first rank moved), one is mapped and compared with the other: an
# order that is not symmetric (04's Muon owners, whose all-to-all sizes differ per rank) shows
# there, and then the replay is not done; nor where a role has no rehearsed rank.


@contextmanager
def recording_every_group(made):
    """Inside, every dist.new_group call appends (name, sorted ranks, desc) to `made`, whether
    or not this rank is a member (torch names a group by a counter every rank advances)."""
    new_group, c10d = dist.new_group, dist.distributed_c10d

    @wraps(new_group)
    def recorded(ranks=None, *args, **kwargs):
        before = c10d._world.group_count
        group = new_group(ranks, *args, **kwargs)
        members = tuple(sorted(ranks)) if ranks is not None else tuple(range(dist.get_world_size()))
        name = group.group_name if isinstance(group, dist.ProcessGroup) else \
            str(before) if c10d._world.group_count == before + 1 else None
        made.append((name, members, kwargs.get("group_desc")))
        return group
    dist.new_group = recorded
    try:
        yield made
    finally:
        dist.new_group = new_group


# What one new_group costs at start-up where the backend is NCCL (or RCCL) and device_id is bound
# (common.setup binds it): torch splits every group's communicator from the world's with
# ncclCommSplit, and every rank of the world calls it, members or not (a non-member's split has
# no colour). Each split is one bootstrap all-gather over the world, a ring of N - 1 socket hops
# (NCCL's bootstrapAllGather); a member then initialises the new communicator (topology,
# channels). Assumed, to be measured on a first allocation (docs/design.md's checklist): a hop
# of BOOT_HOP_S (a TCP round trip on the management network), and INIT_S per member's
# communicator, the 0.15 s of a 2-rank ncclCommSplit in NCCL's own "Init timings" line
# (NVIDIA/nccl#1605, 2025, nearly all of it topology detection).
BOOT_HOP_S, INIT_S = 50e-6, 0.15


def groups_line(made, rank):
    """One line of the rehearsal: the process groups the layout makes (`made`: this rank's
    list, the world first), how many `rank` is a member of, and what making them costs at
    start-up under the model above; with one torch.distributed.split_group per mesh axis instead,
    each family of disjoint groups would be one split (the saving is the rest of the all-gathers)."""
    world, groups = len(made[0][1]), made[1:]
    mine = sum(rank in ranks for _, ranks, _ in groups)
    families = len({desc for _, _, desc in groups})
    seconds = len(groups) * (world - 1) * BOOT_HOP_S + mine * INIT_S
    return (f"process groups: {len(groups):,} new_group calls on every rank ({families} kind(s); rank {rank} is in "
            f"{mine}); under device_id on NCCL each is an ncclCommSplit of the {world:,}-rank world: about "
            f"{seconds:.1f} s of start-up at {BOOT_HOP_S * 1e6:g} us a bootstrap hop and {INIT_S:g} s a member's "
            "communicator (assumed, unmeasured)")


def mesh_rotations(made, world_size, roles):
    """The rotations of the mesh the groups in `made` describe that keep `roles` apart: a list of
    (permutation of the ranks, {group name: its image's name}, "family by k")."""
    families, current = [], []
    for group in made:
        if current and (group[2] != current[-1][2] or any(set(group[1]) & set(g[1]) for g in current)):
            families.append(current)
            current = []
        current.append(group)
    families.append(current)
    families.sort(key=lambda family: len(family[0][1]) == world_size)  # named axes first, the world's last
    index = {}
    for name, ranks, desc in made:
        index.setdefault((desc, frozenset(ranks)), []).append(name)
    ordinal = {name: names.index(name) for names in index.values() for name in names}
    parent = list(range(world_size))

    def root(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r
    found = []
    for family in families:
        size = len(family[0][1])
        if size < 2 or any(len(g[1]) != size for g in family):
            continue
        for k in (d for d in range(1, size) if size % d == 0):
            perm = list(range(world_size))
            for _, ranks, _ in family:
                for i, r in enumerate(ranks):
                    perm[r] = ranks[(i + k) % size]
            names = {}
            for name, ranks, desc in made:
                image = index.get((desc, frozenset(perm[r] for r in ranks)))
                if image is None or len(image) <= ordinal[name]:
                    break
                names[name] = image[ordinal[name]]
            else:
                merged = parent[:]
                for r in range(world_size):
                    a, b = root(r), root(perm[r])
                    parent[a] = b
                if len({root(r) for r in roles}) < len(set(roles)):
                    parent = merged  # it would make two of the script's roles one
                    continue
                if all(perm != other for other, _, _ in found):  # (the world's by dp·... is dp's)
                    found.append((perm, names, f"{family[0][2] or f'groups of {size}'} by {k}"))
                break  # the rotations by multiples of k are its powers
    return found


def moved_entry(entry, perm, names, members):
    """One posted operation moved by a mesh rotation: every peer and every group mapped."""
    group = entry.get("group")
    if (group is None or names[group] == group) and not ("peer" in entry or "ops" in entry or "sent" in entry):
        return entry  # nothing in it moves (a collective on the world, or on a group the rotation keeps)
    e = dict(entry)
    if entry.get("group") is not None:
        e["group"] = names[entry["group"]]
    if "ranks" in entry:
        e["ranks"] = members[e["group"]]
    if "sent" in entry:  # per member, in group order: each to its image's place
        places = [e["ranks"].index(perm[m]) for m in entry["ranks"]]
        for key in ("sent", "received"):
            e[key] = [None] * len(places)
            for i, j in enumerate(places):
                e[key][j] = entry[key][i]
    if "peer" in entry:
        e["peer"] = perm[entry["peer"]]
    if "ops" in entry:
        e["ops"] = [dict(op, peer=perm[op["peer"]]) for op in entry["ops"]]
    return e


class MovedOrder(collections.abc.Sequence):
    """A rehearsed rank's posting order moved by a mesh rotation (or by several, composed into
    one), made as it is read: 959 ranks' orders of 4,216 operations each (GPT-3 175B, pp 64 x
    cp 4 x tp 4) were 6 GiB as dicts; as views they are the few ranks and groups the order
    names, mapped.

        order[i] = moved_entry(source[i], perm, names, members)

    `perm` keeps only the ranks the source order names (its peers, and the members of a group
    whose all-to-all sizes it records): a data-parallel rank names none, so 65,536 ranks' moved
    orders are 65,536 small objects, where a whole permutation each was 65,536² integers."""

    __slots__ = ("source", "perm", "names", "members")

    def __init__(self, source, perm, names, members):
        if isinstance(source, MovedOrder):  # a moved order moved again: one rotation, composed
            self.source = source.source
            self.perm = {r: perm[p] for r, p in source.perm.items()} if source.perm else source.perm
            moved = {g: names[h] for g, h in source.names.items()}
            self.names = source.names if moved == source.names else moved  # (a world's: itself, shared)
        else:
            groups, ranks = named(source)
            self.source, self.perm, self.names = source, {r: perm[r] for r in ranks}, {g: names[g] for g in groups}
        self.members = members

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [moved_entry(e, self.perm, self.names, self.members) for e in self.source[i]]
        return moved_entry(self.source[i], self.perm, self.names, self.members)

    def __iter__(self):
        perm, names, members = self.perm, self.names, self.members
        return (moved_entry(e, perm, names, members) for e in self.source)


def named(order):
    """The groups and the ranks a posting order names: what moving it needs mapped."""
    groups, ranks = set(), set()
    for e in order:
        if e.get("group") is not None:
            groups.add(e["group"])
        if "peer" in e:
            ranks.add(e["peer"])
        if "ops" in e:
            ranks.update(op["peer"] for op in e["ops"])
        if "sent" in e:
            ranks.update(e["ranks"])
    return groups, ranks


NAMED_RANK_BYTES, MOVED_ORDER_BYTES = 100, 2048  # a moved order's map entry; its object and replay state (measured)


def available_bytes():
    """The memory this host has available (Linux's MemAvailable), or no limit where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return float("inf")


REPLAYED = ("kind", "group", "ranks", "bytes", "peer", "tag", "ops", "sent", "received")


def symmetric_posts(posts, made, world_size, roles):
    """Every rank's posting order from the rehearsed ones (`posts`, rank -> entries) through
    the mesh's rotations (`made`: rank -> the groups it made, the world first). Returns (every
    rank's posts, the line saying how), or (None, why not)."""
    groups = made[min(made)]
    if any(made[r] != groups for r in made):
        return None, "the rehearsed ranks made different process groups"
    if any(name is None for name, _, _ in groups):
        return None, "a process group has a hashed name (use_local_synchronization)"
    naming = max(len(named(order)[1]) for order in posts.values())  # ranks a moved order maps (MovedOrder)
    need, free = (world_size - len(posts)) * (naming * NAMED_RANK_BYTES + MOVED_ORDER_BYTES), available_bytes()
    if need > free / 2:  # (an all-to-all over a large group names all of its members)
        return None, (f"the symmetry would need about {need / 2**30:.1f} GiB ({world_size - len(posts):,} ranks' "
                      f"orders, each naming {naming:,} ranks), more than half the {free / 2**30:.1f} GiB available")
    rotations = mesh_rotations(groups, world_size, roles)
    members = {name: ranks for name, ranks, _ in groups}
    full, queue, checked = dict(posts), collections.deque(sorted(posts)), {}
    origin = {rank: rank for rank in posts}  # the rehearsed rank each order was moved from
    while queue:
        rank = queue.popleft()
        for perm, names, _ in rotations:
            other = perm[rank]
            if other in full and (other not in posts or other in checked or origin[rank] == other
                                  or checked.get(origin[rank]) == other):  # (each pair compared once)
                continue
            moved = MovedOrder(full[rank], perm, names, members)
            if other not in full:
                full[other], origin[other] = moved, origin[rank]
                queue.append(other)
                continue
            checked[other] = origin[rank]  # a rehearsed rank reached from its role-mate: the symmetry checked
            mine, theirs = ([tuple(e.get(k) for k in REPLAYED) for e in order] for order in (posts[other], moved))
            if mine != theirs:
                at = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
                return None, (f"rank {other}'s rehearsed posting order is not rank {rank}'s moved through the mesh "
                              f"(they differ at operation {at}): the ranks of a role do not post alike")
    missing = [r for r in range(world_size) if r not in full]
    if missing:
        return None, f"rank(s) {spans(missing)} have no rehearsed rank of their role"
    how = ", ".join(desc for _, _, desc in rotations) or "none needed"
    return full, (f"replayed {world_size:,} ranks: {len(posts):,} rehearsed, {world_size - len(posts):,} by symmetry "
                  f"(the mesh's rotations: {how}" + "".join(f"; rank {r} rehearsed and also moved from rank {o}: "
                                                             "the same order" for r, o in sorted(checked.items())) + ")")


def posts_json(rehearsed, posts):
    """{"rehearsed": [ranks], "posts": {rank: [entries]}} as JSON text, one rank's order at a
    time: the orders the symmetry fills in are made as they are read, never all at once."""
    yield '{"rehearsed": ' + json.dumps(rehearsed) + ', "posts": {'
    for i, (rank, order) in enumerate(posts.items()):
        yield (", " if i else "") + json.dumps(str(rank)) + ": " + json.dumps(list(order))
    yield "}}"


# The posting orders are what record_posts() writes: a rehearsal's (every rank's, in this
# process) or a real CPU run's (tests/nccl_replay.py records each rank to a file). gloo, which
# the CPU runs use, buffers a send whatever the receiver is doing, so an order that hangs on
# GPUs passes every CPU run.
#
# The model (NCCL's point-to-point and collective semantics, taken strictly):
#
#  1. A rank's operations complete in the order it posts them. NCCL runs every operation of a
#     communicator on one CUDA stream, in posting order; and in these scripts each operation
#     waits for the one before it through the compute stream (a received input is computed
#     on before the next send is posted), so one queue per rank is the model: a rank works
#     on the first of its operations that has not completed (its head), and on nothing later.
#  2. A batch_isend_irecv is one NCCL group (ncclGroupStart/End): its sends and receives are
#     posted together, progress independently, and the batch completes when all of them have;
#     only then does the rank move on. A lone send or receive is a batch of one.
#  3. A send completes only when its matching receive is posted, and vice versa
#     (rendezvous: NCCL does not buffer a send for a receiver that has not posted). Posted
#     means: in the head batch of its rank.
#  4. Matching is FIFO per (communicator, sender, receiver): the k-th send from a to b is
#     received by b's k-th receive from a. NCCL ignores tags, so a pair whose tags or sizes
#     differ is a mismatch (the wrong tensor would arrive), reported as an error.
#  5. A collective completes when every member of its communicator has it at its head; the
#     k-th collective of a communicator must be the same operation (and size) on every member;
#     an all-to-all's sizes may differ per pair (10's routing, 04's Muon owners): there, what
#     member i sends member j must be what j receives from i.
#
# Deadlock: no rule can move any rank and some rank has operations left. The report lists,
# for every blocked rank, its head operation and, for each of its unmatched sends and
# receives, where the counterpart is (a later operation of the peer, or never posted).


@dataclass
class Replay:
    ok: bool
    blocked: dict = dataclasses.field(default_factory=dict)  # rank -> what it waits on (lines)
    mismatches: list = dataclasses.field(default_factory=list)  # matched pairs whose tag or size differ
    completed: dict = dataclasses.field(default_factory=dict)  # rank -> operations completed
    operations: int = None  # when ok: how many operations were replayed, and on which groups (their descs)
    groups: set = None

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
    # Millions of small tuples for a 1,024-rank mesh: the cycle collector, run as they are
    # made, would walk every one of them (and every posted entry) many times over (half of
    # the time at 512 ranks); nothing here makes a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _replay(posts)
    finally:
        if collecting:
            gc.enable()


def _records(rank, entries):
    """A rank's posting order as the replay's records, made as the replay reaches them: (True,
    entry, [(message, side), ...], None) for a batch (a lone send or receive is a batch of one),
    a message being (communicator, sender, receiver, k) for the k-th on that channel (rule 4),
    side 0 its send and 1 its receive; (False, entry, None, n) for the n-th collective of its
    communicator on this rank. Each channel has this rank at one end, so counting its messages
    needs this rank's order alone."""
    count, seq = {}, {}
    for entry in entries:
        kind = entry["kind"]
        if kind == "batch" or kind == "send" or kind == "recv":
            group, keyed = entry.get("group"), []
            for op in entry["ops"] if kind == "batch" else (entry,):
                side = 1 if (op["op"] if kind == "batch" else kind) == "recv" else 0
                channel = (group, op["peer"], rank, side) if side else (group, rank, op["peer"], side)
                k = count.get(channel, 0)
                count[channel] = k + 1
                keyed.append((channel[:3] + (k,), side, op))
            yield True, entry, keyed, None
        else:
            n = seq.get(entry["group"], 0)
            seq[entry["group"]] = n + 1
            yield False, entry, None, n


def _replay(posts):
    # The ranks' orders are read as the replay goes, each rank's head (the first operation it
    # has not completed) its only record held (rule 1): a 1,024-rank rehearsal's 4 million
    # operations are never all in memory at once, nor are the orders of the ranks filled in by
    # symmetry (symmetric_posts: they are made as they are read). A send or a receive of the
    # head is matched when its counterpart is the head of its peer's (rule 3).
    orders = {rank: _records(rank, entries) for rank, entries in posts.items()}
    heads, pos = {}, {}
    operations, groups = 0, set()

    def advance(rank):
        nonlocal operations
        head = heads[rank] = next(orders[rank], None)
        if head is not None:
            operations += 1
            entry = head[1]
            groups.add(entry["desc"] if "desc" in entry else entry["group"])
    for rank in orders:
        pos[rank] = 0
        advance(rank)

    def counterpart(key, side):
        """The head record of the peer holding `key`'s other end, or None."""
        peer = key[2] if side == 0 else key[1]
        head = heads.get(peer)
        if head is None or not head[0]:
            return None
        for other, other_side, op in head[2]:
            if other == key and other_side != side:
                return peer, op
        return None

    # A worklist, not passes over every rank: a rank is looked at again only when its head
    # changed or a send/receive of its head was matched, the only events that can let it move
    # (a match from either side is found by whichever of the two ranks reaches it last).
    done, mismatches = {}, []  # done: message -> its ends still at their ranks' heads (both posted together)
    arrived, counted = {}, {}  # (group, n) -> how many members have it at their head; rank -> its counted head
    ready, queued = collections.deque(orders), set(orders)

    def wake(rank):
        if rank not in queued:
            queued.add(rank)
            ready.append(rank)

    def step(rank):
        """Complete rank's head; a message both of whose ends have moved on is forgotten."""
        for key, _, _ in heads[rank][2] or ():
            done[key] -= 1
            if not done[key]:
                del done[key]
        pos[rank] += 1
        advance(rank)
        wake(rank)
    while ready:
        rank = ready.popleft()
        queued.discard(rank)
        head = heads[rank]
        if head is None:
            continue
        p2p, entry, keyed, n = head
        if p2p:
            complete = True
            for key, side, mine in keyed:
                if key in done:
                    continue
                found = counterpart(key, side)
                if found is None:
                    complete = False
                    continue  # the counterpart is not posted (yet): its rank finds this one when it is
                peer, theirs = found
                done[key] = 2
                wake(peer)  # its batch may be complete now
                if mine.get("tag") != theirs.get("tag") or mine.get("bytes") != theirs.get("bytes"):
                    send, recv = (theirs, mine) if side else (mine, theirs)
                    mismatches.append(f"channel {key[1]}->{key[2]} message {key[3]}: sent tag "
                                      f"{send.get('tag')} ({send.get('bytes')} bytes), received as tag "
                                      f"{recv.get('tag')} ({recv.get('bytes')} bytes)")
            if complete:
                step(rank)
        else:
            members, group = entry["ranks"], entry["group"]
            if counted.get(rank) != pos[rank]:
                counted[rank] = pos[rank]
                arrived[(group, n)] = arrived.get((group, n), 0) + 1
            if arrived[(group, n)] < len(members):
                continue  # the last member to reach it completes it
            member_heads = []
            for member in members:
                head = heads.get(member)
                if head is None or head[0] or head[1]["group"] != group or head[3] != n:
                    break
                member_heads.append(head[1])
            else:
                if any(h["kind"] != entry["kind"] or "sent" not in h and h.get("bytes") != entry.get("bytes")
                       or "sent" in h and any(h["sent"][j] != member_heads[j]["received"][i]
                                              for j in range(len(member_heads)))
                       for i, h in enumerate(member_heads)):  # an all-to-all: what i sends j, j receives from i
                    mismatches.append(f"collective {n} of group {group}: "
                                      + ", ".join(f"rank {m} {h['kind']} ({h.get('bytes')} bytes)"
                                                  for m, h in zip(members, member_heads)))
                del arrived[(group, n)]
                for member in members:
                    step(member)
    return _blocked(posts, orders, heads, pos, done, mismatches, operations, groups)


def _blocked(posts, orders, heads, pos, done, mismatches, operations, groups):
    """The Replay: for every rank with operations left, its head and, for each unmatched send
    or receive, where its counterpart is (the peer's operations left are read for it)."""
    rest = {}

    def left(rank):  # rank's records from its head on
        if rank not in rest:
            rest[rank] = [heads[rank], *orders[rank]] if heads.get(rank) is not None else []
        return rest[rank]

    def head(rank):
        return _describe(heads[rank][1]) if heads.get(rank) is not None else "done"

    blocked = {}
    for rank in orders:
        if heads[rank] is None:
            continue
        p2p, entry, keyed, _ = heads[rank]
        waits = [f"head: {_describe(entry)}"]
        for key, side, _ in keyed or ():
            if key in done:
                continue
            peer = key[2] if side == 0 else key[1]
            at = next((i for i, record in enumerate(left(peer) if peer in orders else ()) if record[0]
                       and any(k == key and s != side for k, s, _ in record[2])), None)
            (src, dst), k = key[1:3], key[3]
            what = (f"{'recv' if side else 'send'} {'from ' + str(src) if side else 'to ' + str(dst)} "
                    f"(message {k} of {src}->{dst})")
            other = "send" if side else "recv"
            if at is None:
                waits.append(f"{what}: its {other} is never posted")
            else:
                waits.append(f"{what}: its {other} is rank {peer}'s operation {pos[peer] + at}, which waits "
                             f"behind {at} operation(s) of its own: {head(peer)}")
        if not p2p:
            waits.append("members' heads: " + "; ".join(f"rank {m}: {head(m)}" for m in entry["ranks"]))
        blocked[rank] = waits
    ok = not blocked and not mismatches
    return Replay(ok=ok, blocked=blocked, mismatches=mismatches, completed=dict(pos),
                  operations=operations if ok else None, groups=groups if ok else None)


def replay_verdict(result, posts):
    """The replay in one line: no deadlock and every collective matched on every group, or
    the first rank (lowest) that would block, its group and operation, or the first mismatch."""
    if result.ok:
        groups, n = result.groups, result.operations
        if groups is None:  # (a Replay made by hand)
            groups = {e["desc"] if "desc" in e else e["group"] for entries in posts.values() for e in entries}
            n = sum(len(entries) for entries in posts.values())
        return (f"replay under NCCL's rules: no deadlock; every collective and send/recv matched on every group "
                f"({n} operations of {len(posts)} ranks on {len(groups)} group(s): {', '.join(sorted(map(str, groups)))})")
    if result.blocked:
        rank = min(result.blocked)
        entry = posts[rank][result.completed[rank]]
        op = _describe(entry) if entry["kind"] in ("batch", "send", "recv") else \
            f"{entry['kind']} of {entry.get('bytes')} bytes over ranks {spans(list(entry['ranks']))}"
        return (f"replay under NCCL's rules: DEADLOCK: rank {rank} blocks first, at its operation "
                f"{result.completed[rank]}: {op} on group {entry.get('desc', entry['group'])} "
                f"({entry.get('where', 'where unknown')}); {len(result.blocked)} rank(s) blocked")
    return f"replay under NCCL's rules: mismatch: {result.mismatches[0]}"


def pair_bytes(op, bound, group_size):
    """An all-to-all's bytes to and from each member of its group, in group order."""
    if op == "all_to_all":
        return ([t.numel() * t.element_size() for t in bound["input_tensor_list"]],
                [t.numel() * t.element_size() for t in bound["output_tensor_list"]])

    def split(tensor, sizes):
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() else tensor.element_size()
        if sizes is None:
            return [tensor.numel() * tensor.element_size() // group_size] * group_size
        return [int(n) * row for n in sizes]
    return split(bound["input"], bound.get("input_split_sizes")), split(bound["output"], bound.get("output_split_sizes"))
