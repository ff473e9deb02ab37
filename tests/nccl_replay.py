"""Would this communication deadlock under NCCL? Record what every rank of a real CPU run
posts, then replay the posting orders under NCCL's semantics.

gloo, which the CPU tests run on, buffers a send whatever the receiver is doing, so an order
of point-to-point operations that hangs on GPUs passes every CPU test. This module records
the order and replays it under the rules below; a deadlock (or a mismatched pair) is reported
with what every rank is blocked on.

Recording. Run a script through this file, which wraps torch.distributed's functions
(infra.rehearsal.record_posts) and then runs the script as __main__ (harness.launch runs it like any script):

    python tests/nccl_replay.py RECORD_DIR 07_pipeline.py --schedule interleaved ...

Each rank appends one JSON line per posted operation to RECORD_DIR/rank<r>.jsonl, in the
order its host posts them: a batch_isend_irecv as one line {"kind": "batch", "group",
"ops": [{"op": "send" | "recv", "peer" (global rank), "bytes", "tag"}]}; a lone isend /
irecv / send / recv as {"kind": "send" | "recv", "group", "peer", "bytes", "tag"}; a
collective as {"kind": "all_reduce", ..., "group", "ranks", "bytes"}. "group" names the
communicator (torch's group_name: two groups of the same ranks are two communicators).

The model (NCCL's point-to-point and collective semantics, taken strictly; infra.replay
implements it, for this file and for --rehearse all):

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # infra/, beside the scripts
from infra.rehearsal import record_posts  # noqa: E402  (the recorder a rehearsal uses too)
from infra.replay import Replay, replay  # noqa: E402  (the model: NCCL's rules)

__all__ = ["Replay", "replay", "read_records", "install"]


def read_records(directory):
    """{rank: [entry, ...]} from RECORD_DIR/rank<r>.jsonl."""
    posts = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                posts[int(name[4:-6])] = [json.loads(line) for line in f if line.strip()]
    return posts


# ----------------------------------------------------------------------------------------
# Recording: infra.rehearsal.record_posts, each rank to its own file
# ----------------------------------------------------------------------------------------

def install(directory):
    """Wrap torch.distributed so that every rank appends what it posts to directory/rank<r>.jsonl."""
    import torch.distributed as dist
    os.makedirs(directory, exist_ok=True)
    files = {}

    def write(entry):
        rank = dist.get_rank()
        if rank not in files:
            files[rank] = open(os.path.join(directory, f"rank{rank}.jsonl"), "a", buffering=1)
        files[rank].write(json.dumps(entry) + "\n")
    record_posts(write)


if __name__ == "__main__":  # python tests/nccl_replay.py RECORD_DIR SCRIPT ARGS...
    record_dir, script = sys.argv[1], sys.argv[2]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = script if os.path.isabs(script) else os.path.join(root, script)
    install(record_dir)
    sys.argv = [script] + sys.argv[3:]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
