"""07_pipeline.py: pipeline parallelism by hand. The layers are cut into p stages, one per
rank, and the batch into m micro-batches that flow through them: a stage receives a
micro-batch's activations from the previous stage, runs its layers, sends the result on, and
in backward passes the gradient back the same way. Only b·s·h activations cross a stage
boundary, the cheapest parallelism in communication, paid for in idle time, the bubble,
while the pipeline fills and drains.

    1F1B (PipeDream-Flush, Narayanan et al. 2021), p = 4, m = 6, F and B one unit each:
    stage r runs p-r-1 warm-up forwards, then one forward one backward (the steady state),
    then the cool-down backwards.
              warm-up  steady state               cool-down  (stage 0's)
      stage 0  F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2  . B3  . B4  . B5
      stage 1   . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3  . B4  . B5  .
      stage 2   .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4  . B5  .  .
      stage 3   .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5  .  .  .
    bubble = (p-1)/(m+p-1), GPipe's (all forwards, then all backwards), but a backward frees
    its micro-batch as soon as the pipeline is full: stage r holds p-r of them, not m.

The variants, derived with their pictures, bubbles and memory in docs/strategies.md ("The
pipeline schedules, derived"): interleaved 1F1B (v chunks of layers per rank, r, r+p, ...);
zero bubble ZB-H1, each backward split into I, the input gradient the previous stage waits
for, and W, the weight gradient nobody waits for, deferred into the bubble (SplitLinear); and
ZB-V and DualPipeV, two chunks per rank in a V (r and 2p-1-r: rank 0 holds the first and last).

The words. A schedule is, per rank, a list of rounds; a round is a tuple of actions; an
action is (kind, micro-batch i, chunk c of this rank): F a forward, B a backward, or zero
bubble's two halves of a backward, I and W; `vee`: the chunks sit in a V (chunk_stage).
Between two rounds a rank posts one exchange, a single batch_isend_irecv of the sends of what
the round computed with the receives the next round needs (Megatron's
send_forward_recv_backward and friends). schedule_rounds() and the V schedules build it,
--schedule_csv FILE reads one in torch.distributed.pipelining's CSV ("3F1", "3I1", "3W1",
"3B1", "(0F4;1B2)OVERLAP_F_B"), --write_schedule FILE writes it, and Pipeline.run runs it as
it is.

One rank holds: its chunks' layers, gradients and optimizer state, and the activations in flight.
One rank sends: b·s·h each way per micro-batch per stage boundary, wte's gradient, norm and loss.

The tied embedding: the first stage owns wte for the lookup, the last stage a copy as the
head; their gradients are summed before every update, so the two stay equal.

Run:

    mpiexec -n 4 python 07_pipeline.py --schedule 1f1b --model gpt2 --micro_batch_size 4
    mpiexec -n 4 python 07_pipeline.py --schedule zb --model gpt2
    mpiexec -n 4 python 07_pipeline.py --schedule zbv --model gpt2 --write_schedule zbv.csv
    mpiexec -n 4 python 07_pipeline.py --schedule_csv zbv.csv --model gpt2
    torchrun --standalone --nproc_per_node 4 07_pipeline.py --schedule interleaved --virtual_stages 3 ...
"""

import csv
import json
import os
import re
import time

from infra import Run  # the run infrastructure; `from common import Run` is the plain loop
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.variable import Variable
from torch.nn import functional as F

from common import (autocast, Block, check, Data, fail, is_hidden_matrix, lr_at, make_optimizer, make_parser,
                    model_config, param_init, param_shapes, to_device, TreeSum)


# ---------------------------------------------------------------------------------------
# Where the chunks sit, and the messages between them
# ---------------------------------------------------------------------------------------

def chunk_stage(p, rank, c, vee=False):
    """The pipeline position (global chunk) of rank `rank`'s c-th chunk: c·p + rank
    (interleaved: rank r holds r, r+p, ...), or in a V (ZB-V, DualPipeV: two chunks per
    rank) r on the way down and 2p-1-r on the way back, so rank 0 holds the first and the
    last chunk and rank p-1 the two in the middle, passed from one to the other in memory."""
    return (2 * p - 1 - rank if c else rank) if vee else c * p + rank


def stage_rank(p, g, vee=False):
    """The rank that holds global chunk g (the inverse of chunk_stage)."""
    return (g if g < p else 2 * p - 1 - g) if vee else g % p


def forward_tag(i, g, n):
    """The tag of the activation that chunk g (of n in the pipeline) sends forward for
    micro-batch i: one number per (micro-batch, chunk), i·n + g."""
    return i * n + g


def backward_tag(i, g, n, m):
    """The tag of the input gradient that chunk g sends back for micro-batch i: after all m·n
    forward tags, n·m + i·n + g."""
    return n * m + forward_tag(i, g, n)


def free_output(out):
    """Free a stage output's storage once it has been sent (Megatron-LM's
    deallocate_output_tensor): backward needs only the graph `out` is the root of, never its
    values, so a micro-batch in flight keeps its activations, not its b·s·h output. `out` is
    no view (the chunk's last residual add): freeing a view would free nothing."""
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def backward_from_freed(out, grad):
    """out.backward(grad) for an output free_output emptied (Megatron's custom_backward):
    backward() would check grad's shape against out's, now [1], so autograd's engine runs it."""
    Variable._execution_engine.run_backward(tensors=(out,), grad_tensors=(grad,), keep_graph=False,
                                            create_graph=False, inputs=(), allow_unreachable=True,
                                            accumulate_grad=True)


# ---------------------------------------------------------------------------------------
# The executor: a rank runs its rounds, posting one exchange between two rounds
# ---------------------------------------------------------------------------------------

class Pipeline:
    """This rank's chunks and the stages of its pipeline `group`: the rank's stage is its
    rank in the group, and its messages name their peers by stage (group_peer), so that a
    pipeline inside a bigger mesh (08_3d.py) talks to its own stages only. `deferred`: zero
    bubble's list where I leaves its W (split_backward). `timed`: mark every F, B, I and W
    on the device's own timeline, to measure the bubble (08_3d.py measures none). `vee`: the
    chunks sit in a V (chunk_stage), so the rank passes some messages to itself, in memory."""

    def __init__(self, chunks, env, group, v, act_shape, deferred=None, timed=True, vee=False, tree=None):
        self.chunks, self.env, self.group, self.v, self.act_shape = chunks, env, group, v, act_shape
        self.p, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.deferred, self.timed, self.vee, self.tree = deferred, timed, vee, tree  # tree: --bitwise (StageTree)
        self.to_self = {}  # messages to this rank itself: one stage, or the V's turn

    def post(self, exchange, sends):
        """Post one exchange: its sends (of tensors in `sends`) and its receives, together in one
        batch_isend_irecv (NCCL: one request for the batch); returns (requests, {tag: tensor
        arriving}). A message to this rank itself passes in memory (pass_in_memory)."""
        ops, arriving = [], {}
        for op, peer, tag in exchange:
            if peer == self.rank:  # one stage, or the V's turn: no message at all
                if op == "send":
                    self.to_self[tag] = self.pass_in_memory(*sends[tag])
                else:
                    arriving[tag] = self.to_self.pop(tag)
            elif op == "send":  # an activation forward or a gradient back, b·s·h
                ops.append(dist.P2POp(dist.isend, sends[tag][0], group=self.group, group_peer=peer, tag=tag))
            else:
                arriving[tag] = torch.empty(self.act_shape, device=self.env.device)
                ops.append(dist.P2POp(dist.irecv, arriving[tag], group=self.group, group_peer=peer, tag=tag))
        return (dist.batch_isend_irecv(ops) if ops else []), arriving

    def complete(self, requests, exchange, sends):
        """Wait for the whole exchange, sends included (as Megatron's _communicate does), then
        free each output sent (free_output). No deadlock follows: the exchanges keep NCCL's
        rules (a rank's batches complete in order, a send once its receive is posted). Under
        gloo it is what frees the outputs: a send is complete to wait() only."""
        for request in requests:
            request.wait()
        requests.clear()  # a finished request still holds its tensors: let them go now
        for op, peer, tag in exchange:
            if op == "send" and peer != self.rank and sends[tag][1]:
                free_output(sends[tag][0])

    @staticmethod
    def pass_in_memory(tensor, free):
        """A message to this rank itself: the same storage, detached from the sender's graph;
        a sent output then keeps only its graph (free_output), as after a send."""
        passed = tensor.detach()
        if free:
            free_output(tensor)
        return passed

    def run(self, rounds, inputs, targets, m, train=True, posts=None):
        """Run one step's rounds, posting exchanges() between them (or `posts`, those ordered
        for NCCL in a V); returns the summed loss (last stage), the peak number of
        micro-batch chunks in flight (forward done, backward not; with zero bubble: W not),
        and when timed a function giving the share of the time this rank computed (1 - it is
        its measured bubble; call it after the step: it reads the device's events).

        bf16: the whole schedule is one autocast region, so autocast's cache casts each
        weight once per step, not once per micro-batch in flight; backward runs with autocast
        off, as it does outside a region."""
        n, posts = self.p * self.v, posts or exchanges(rounds, self.p, self.rank, self.v, m, self.vee)
        self.saved, self.weights, self.spans = {}, {}, []  # (i, c) -> (x, out); (i, c) -> its W nodes
        self.in_flight = self.peak = 0
        loss_sum, start = torch.zeros((), device=self.env.device), self.mark()
        with autocast(self.env):
            requests, received = self.post(posts[0], {})  # the first round's receives
            self.complete(requests, posts[0], {})
            for actions, exchange in zip(rounds, posts[1:]):
                sends = {}  # what this round sends: {tag: (tensor, free it once sent)}
                for kind, i, c in actions:
                    g = chunk_stage(self.p, self.rank, c, self.vee)  # this chunk's place in the pipeline
                    if kind == "F":  # in: the tokens, or chunk g-1's activation; out: to chunk g+1, or the loss
                        x = inputs[i] if g == 0 else received.pop(forward_tag(i, g - 1, n)).requires_grad_(train)
                        out = self.timed_span(self.forward, x, i, c, targets[i] if g == n - 1 else None, train, m)
                        if g == n - 1:
                            loss_sum += out.detach().float()
                        else:
                            sends[forward_tag(i, g, n)] = (out if train else out.detach(), train)
                        del x, out  # the input lives on in self.saved, the output as the message
                    elif kind in "BI":  # d loss / d out: 1 on the last chunk, else what chunk g+1 sent back
                        dy = received.pop(backward_tag(i, g + 1, n, m)) if g < n - 1 else None
                        dx = self.timed_span(self.backward, kind, i, c, dy)
                        if g > 0:  # x's gradient, back to chunk g-1
                            sends[backward_tag(i, g, n, m)] = (dx, False)
                        del dy, dx  # the message in `sends` is the only reference left
                requests, arriving = self.post(exchange, sends)  # this round's sends, the next one's receives
                for kind, i, c in actions:
                    if kind == "W":  # zero bubble: nobody waits for W, so it runs while the messages travel
                        self.timed_span(self.weight_gradient, i, c)
                self.complete(requests, exchange, sends)
                received.update(arriving)
        self.whole = whole = (start, self.mark())  # kept with self.spans for --measure_bubble's timeline
        spans = self.spans
        loss_sum = self.tree.finish() if self.tree and train else loss_sum  # --bitwise: the tree's sums, into .grad
        return loss_sum, self.peak, (lambda: self.busy_fraction(spans, whole)) if self.timed else None

    def forward(self, x, i, c, target, train, m):
        """F: chunk c on micro-batch i, kept for its backward; the last chunk's output is the
        loss, whose backward is that of the mean over the m micro-batches."""
        with torch.set_grad_enabled(train):  # in run()'s autocast region
            out = self.chunks[c](x, target)
        if train:
            self.saved[(i, c)] = (x, out / m if target is not None and not self.tree else out)  # (--bitwise: /m once)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        return out

    def backward(self, kind, i, c, dy):
        """B (or I, the input gradient only, on split Linears): from the loss, or from the
        gradient `dy` received for the output that was sent and freed; returns dx to send back."""
        x, out = self.saved.pop((i, c))
        with torch.autocast(self.env.device.type, enabled=False):  # backward: autocast off
            if dy is None:
                out.backward()
            else:
                backward_from_freed(out, dy)
        if self.tree: self.tree.take(i, c, "B" if self.deferred is None else "I", out)  # --bitwise: apart, for the tree
        if self.deferred is not None:  # zero bubble: the split Linears left their W nodes in `deferred`
            self.weights[(i, c)] = self.deferred[:]
            self.deferred.clear()
            if kind == "B":  # a whole backward: its W at once
                self.weight_gradient(i, c)
        else:
            self.in_flight -= 1
        return x.grad

    def weight_gradient(self, i, c):
        """W: dW = dyᵀ·x of every Linear of chunk c for micro-batch i, into .grad; frees x and dy."""
        with torch.autocast(self.env.device.type, enabled=False):
            torch.autograd.backward(self.weights.pop((i, c)))
        if self.tree: self.tree.take(i, c, "W")  # --bitwise: the Linears' weight gradients, apart, for the tree
        self.in_flight -= 1

    def timed_span(self, work, *args):
        """work(*args), between two marks when timed: the spans are the compute time."""
        if not self.timed:
            return work(*args)
        begin = self.mark()
        result = work(*args)
        self.spans.append((begin, self.mark()))
        return result

    def mark(self):
        """Now, on this rank's compute stream: a device event recorded behind the kernels
        already queued, which the host does not wait for, or on CPU the host clock. A wait()
        on an NCCL receive only makes the stream wait, so a span never counts the wait."""
        if not self.timed:
            return None
        if self.env.device.type == "cpu":
            return time.perf_counter()
        event = torch.Event(self.env.device, enable_timing=True)
        event.record()
        return event

    @staticmethod
    def busy_fraction(spans, whole):
        """The share of the schedule's time, `whole` (its first and last marks), that its
        `spans` took: read after the step, where waiting for the last event costs no overlap."""
        def seconds(start, end):
            if isinstance(start, float):
                return end - start
            end.synchronize()  # this event only, not the device
            return start.elapsed_time(end) / 1e3
        return sum(seconds(*span) for span in spans) / seconds(*whole)


# ---------------------------------------------------------------------------------------
# Schedules: per rank, its rounds of actions, and the exchange it posts between two rounds
# ---------------------------------------------------------------------------------------

def schedule_rounds(kind, p, rank, m, v=1):
    """The rounds of rank `rank` of `p` for `m` micro-batches (v chunks per rank for the
    interleaved schedule): one action per round, except in the interleaved steady state (a
    forward and a backward) and in ZB-H1, where a W rides in the round of the I before it
    (it runs while that round's messages travel)."""
    if kind == "gpipe":  # every forward, then every backward
        return [(("F", i, 0),) for i in range(m)] + [(("B", i, 0),) for i in range(m)]
    if kind == "1f1b":
        warmup = min(p - rank - 1, m)  # forwards before the first backward reaches this stage
        forwards = [("F", i, 0) for i in range(m)]
        backwards = [("B", i, 0) for i in range(m)]
        order = forwards[:warmup]
        for i in range(m - warmup):  # steady state: one forward, one backward
            order += [forwards[warmup + i], backwards[i]]
        return [(action,) for action in order + backwards[m - warmup:]]  # cool-down
    if kind == "interleaved":  # Megatron's: forwards visit chunks in groups of p micro-batches
        total = m * v

        def forward_action(k):
            return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

        def backward_action(k):
            return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        return ([(forward_action(k),) for k in range(warmup)]
                + [(forward_action(warmup + k), backward_action(k)) for k in range(total - warmup)]  # steady state
                + [(backward_action(k),) for k in range(total - warmup, total)])  # cool-down
    # zero bubble, ZB-H1 (Qi et al. 2023, Fig. 3; as sail-sg/zero-bubble-pipeline-parallelism's
    # ZeroBubbleH1Pipeline orders it): 1F1B's warm-up and F/I steady state, but stage `rank`
    # defers the W of its first `rank` backwards; from then on each I is followed by the W of
    # the oldest micro-batch whose W is pending, and the deferred Ws fill the tail, where
    # 1F1B's later stages sit idle
    assert kind == "zb", kind
    warmup = min(p - rank - 1, m)
    rounds, w = [(("F", i, 0),) for i in range(warmup)], 0
    for k in range(m):
        if warmup + k < m:  # steady state: one forward, then one backward
            rounds.append((("F", warmup + k, 0),))
        if k >= rank or warmup + k >= m:  # cool-down backwards always take their W
            rounds.append((("I", k, 0), ("W", w, 0)))
            w += 1
        else:
            rounds.append((("I", k, 0),))
    return rounds + [(("W", j, 0),) for j in range(w, m)]


def schedule(kind, p, rank, m, v=1):
    """The actions of schedule_rounds(), one after the other."""
    return [action for actions in schedule_rounds(kind, p, rank, m, v) for action in actions]


def forward_rounds(p, m, v):
    """Evaluation's rounds: forwards only, micro-batches in groups of p through chunk 0,
    then chunk 1, ... (the interleaved order without its backwards); v = 1: 0..m-1."""
    return [(("F", i, c),) for group in range(0, m, p) for c in range(v)
            for i in range(group, min(group + p, m))]


def eval_rounds(p, m, v, vee=False):
    """Evaluation's rounds: forward_rounds(), or in a V every micro-batch down, then back."""
    return forward_rounds(p, m, v) if not vee else [(("F", i, c),) for c in range(2) for i in range(m)]


def exchanges(rounds, p, rank, v, m, vee=False):
    """What the rank posts, one batch_isend_irecv per entry: before the first round, the
    receives it needs; after each round, the sends of what it computed (outputs to the next
    stage, input gradients to the previous) together with the receives of the next round.
    Megatron's p2p calls: send_forward_recv_forward after a forward (..._recv_backward when a
    backward follows), send_backward_recv_backward after a backward (..._recv_forward), and
    send_forward_backward_recv_forward_backward after an interleaved steady-state round.
    An entry: [("send" | "recv", peer stage, tag)], tags from forward_tag and backward_tag.
    vee: the chunks sit in a V (chunk_stage), and a peer may be the rank itself (the V's turn).

    Why one batch per round, sends and receives together: under NCCL a send completes only
    once its receive is posted, and a rank's batches complete one after another. Posted this
    way, no cycle of ranks waiting on each other's later batches forms (tests/test_schedules.py
    replays every rank's posting order under NCCL's rules; in a V, exchanges_for_nccl reorders
    the receives). Posted one batch per action instead, the interleaved schedule deadlocked
    on NCCL whenever m > p, though gloo, which buffers sends, ran it."""
    n = p * v

    def receives(actions):
        for kind, i, c in actions:
            g = chunk_stage(p, rank, c, vee)
            if kind == "F" and g > 0:  # chunk g-1's output, the input of chunk g
                yield "recv", stage_rank(p, g - 1, vee), forward_tag(i, g - 1, n)
            if kind in "BI" and g < n - 1:  # the gradient of chunk g's output, from chunk g+1
                yield "recv", stage_rank(p, g + 1, vee), backward_tag(i, g + 1, n, m)

    def sends(actions):
        for kind, i, c in actions:
            g = chunk_stage(p, rank, c, vee)
            if kind == "F" and g < n - 1:
                yield "send", stage_rank(p, g + 1, vee), forward_tag(i, g, n)
            if kind in "BI" and g > 0:
                yield "send", stage_rank(p, g - 1, vee), backward_tag(i, g, n, m)

    following = rounds[1:] + [()]
    return [list(receives(rounds[0]))] + [list(sends(actions)) + list(receives(nxt))
                                          for actions, nxt in zip(rounds, following)]


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"]
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank in a V (chunk_stage)


def run_schedule(args, p, m):
    """(every rank's rounds, v, vee, split) of the run: --schedule's rounds (the V schedules'
    from zbv_rounds and dualpipev_rounds, below) or those of --schedule_csv's table; the
    chunks per rank, whether they sit in a V, and whether backwards split into I and W."""
    v, vee = chunks_per_rank(args)
    if args.schedule_csv:
        rows = read_table(args.schedule_csv)
        every = [table_rounds(rows[r], p, r, v, vee) for r in range(p)]
    else:
        build = {"zbv": zbv_rounds, "dualpipev": dualpipev_rounds}.get(args.schedule)
        every = [build(p, r, m) if build else schedule_rounds(args.schedule, p, r, m, v) for r in range(p)]
    split = any(kind in "IW" for rounds in every for actions in rounds for kind, _, _ in actions)
    return every, v, vee, split


def chunks_per_rank(args):
    """(v, vee): chunks per rank, and whether they sit in a V (chunk_stage)."""
    if args.schedule_csv:
        return placement_of(read_table(args.schedule_csv))
    vee = args.schedule in V_SHAPED
    return (2 if vee else args.virtual_stages if args.schedule == "interleaved" else 1), vee


# ---------------------------------------------------------------------------------------
# A chunk of the model: some consecutive blocks, plus the embedding and/or the head
# ---------------------------------------------------------------------------------------

class Chunk(nn.Module):
    """Layers [first_layer, first_layer + n) of the GPT, with the embedding if it is the
    first chunk and the final norm and (tied) head if it is the last."""

    def __init__(self, config, first_layer, n_layers, is_first, is_last):
        super().__init__()
        self.config, self.is_first, self.is_last = config, is_first, is_last
        self.first_layer = first_layer
        if is_first:
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(n_layers)])
        if is_last:
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            # the tied head: the embedding itself, or (on another stage) a copy of its weight
            self.lm_head = self.wte if is_first else nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def full_name(self, name):
        """This parameter's name in 01's model (so param_init gives it the same value)."""
        if name.startswith("h."):
            index, rest = name[2:].split(".", 1)
            return f"transformer.h.{self.first_layer + int(index)}.{rest}"
        return {"lm_head.weight": "transformer.wte.weight"}.get(name, "transformer." + name)

    @torch.no_grad()
    def init_weights(self, seed):
        for name, p in self.named_parameters():
            p.copy_(param_init(self.full_name(name), p.shape, self.config, seed))
        return self

    def forward(self, x, targets=None):
        if self.is_first:  # x: token ids
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        if self.is_last:
            logits = F.linear(self.ln_f(x), self.lm_head.weight)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return x


def chunk_layers(n_layer, n_chunks):
    """(first layer, layer count) of each of the n_chunks chunks, in pipeline order: n_layer
    is cut as evenly as it goes, the last n_layer % n_chunks chunks taking one layer more
    (under 1F1B the first stages hold the most micro-batches of activations, so they get
    the fewer layers)."""
    base, extra = divmod(n_layer, n_chunks)
    sizes = [base + (c >= n_chunks - extra) for c in range(n_chunks)]
    return [(sum(sizes[:c]), sizes[c]) for c in range(n_chunks)]


def build_chunks(config, p, v, rank, seed=None, recompute=False, vee=False):
    """This rank's chunks r, r + p, ..., r + (v-1)p (in a V: r and 2p-1-r; chunk_stage) on
    the current device, with 01's initial values for `seed` (uninitialised without one)."""
    layout = chunk_layers(config.n_layer, p * v)
    chunks = nn.ModuleList()
    for c in range(v):
        g = chunk_stage(p, rank, c, vee)
        chunks.append(Chunk(config, *layout[g], g == 0, g == p * v - 1))
        for block in chunks[-1].h:
            block.recompute = recompute
    if chunks[0].is_first and chunks[-1].is_last and v > 1:  # one rank holds both ends: the head *is* wte
        chunks[-1].lm_head = chunks[0].wte
    for chunk in chunks if seed is not None else ():
        chunk.init_weights(seed)
    return chunks


# ---------------------------------------------------------------------------------------
# The training step's pieces, and main()
# ---------------------------------------------------------------------------------------

def check_layout(args, config, p):
    v, vee = chunks_per_rank(args)
    chunks = f" x {v} chunks per rank ({args.schedule})" if vee else f" x virtual_stages {v}" if v > 1 else ""
    check(config.n_layer >= p * v, f"n_layer {config.n_layer} is fewer than pp {p}{chunks}: "
          "every chunk needs at least one layer")


def check_micro_batches(args, p, m):
    check(args.schedule != "interleaved" or m % p == 0,
          f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple of pp {p}")
    check(args.schedule != "dualpipev" or m >= 2 * p,
          f"dualpipev needs at least 2·pp = {2 * p} micro-batches (its two chunks per rank), got {m}")


def micro_batches(data, split, step, args, env, m, first, last, eval_split=False):
    """The step's batch in m micro-batches: the tokens for the first stage, the targets for
    the last; a middle stage loads neither (None for each)."""
    if not (first or last):
        return [None] * m, [None] * m
    x, y = data.batch(split, step, args.global_batch_size, eval_split=eval_split)
    x, y = to_device(x, env) if first else None, to_device(y, env) if last else None
    b = args.micro_batch_size
    return ([x[i * b:(i + 1) * b] if first else None for i in range(m)],
            [y[i * b:(i + 1) * b] if last else None for i in range(m)])


def share_loss(loss_sum, group, m, last=None):
    """The mean loss over the micro-batches, on every stage of the pipeline `group`; `last`:
    the stage that holds the last chunk (in a V the first, 0)."""
    last = dist.get_world_size(group) - 1 if last is None else last
    if dist.get_world_size(group) > 1:  # a one-stage pipeline posts nothing
        dist.broadcast(loss_sum, group=group, group_src=last)  # the last stage's loss, to every stage for logging
    return loss_sum / m


def clip_grad_norm(chunks, max_norm, group, tree=None):
    """Scale the gradients so that the global norm over every stage of the pipeline `group`,
    the tied embedding counted once (on the first stage), is at most max_norm."""
    head_copy = chunks[-1].is_last and not chunks[0].is_first  # the last stage's copy of wte
    if tree:  # --bitwise: from each parameter's norm, whole, in 01's order, as clip_grad_norm_ takes it
        total_norm = tree.norm(head_copy, group)
    else:
        squares = sum(t.grad.float().pow(2).sum() for n, t in chunks.named_parameters()
                      if not (head_copy and n.endswith("lm_head.weight")))
        if dist.get_world_size(group) > 1:
            dist.all_reduce(squares, group=group)  # every stage's squared gradient norm
        total_norm = squares.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for t in chunks.parameters():
        t.grad.mul_(coef)
    return total_norm


def add_flags(parser):
    g = parser.add_argument_group("07_pipeline")
    g.add_argument("--pp", type=int, default=None, help="pipeline stages (= world size)")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="zb: zero bubble, ZB-H1 (Qi et al. 2023); zbv: its V-shaped ZB-V; dualpipev: "
                        "DeepSeek's DualPipeV (both two chunks per rank, in a V)")
    g.add_argument("--virtual_stages", type=int, default=2, help="chunks per rank (interleaved)")
    g.add_argument("--schedule_csv", default=None, metavar="FILE",
                   help="run this table instead of --schedule: one row per rank of actions such as 0F1, 0I1, 0W1, 0B1 "
                        "(torch.distributed.pipelining's _dump_csv/_load_csv format); its micro-batches set m")
    g.add_argument("--write_schedule", default=None, metavar="FILE",
                   help="write the run's table (any schedule) to FILE in that format (rank 0; also with --dry_run)")
    g.add_argument("--measure_bubble", action="store_true",
                   help="time every forward and backward with device events to measure each stage's busy "
                        "time, and so the bubble (metrics: busy_fraction; each rank's ops in METRICS.timeline.rankR"
                        ".json, for plot.py --measured); the events are read after the step, so nothing waits in it")
    return parser


@torch.no_grad()
def evaluate(pipeline, chunks, data, args, env, p, m, v):
    chunks.eval()
    losses, vee = {}, pipeline.vee
    rounds = eval_rounds(p, m, v, vee)
    posts = exchanges_for_nccl([rounds] * p, p, v, m, vee)[env.rank]
    for split in ("train", "val"):
        total = 0.0
        for k in range(args.eval_iters):
            xs, ys = micro_batches(data, split, k, args, env, m, chunks[0].is_first, chunks[-1].is_last,
                                   eval_split=True)
            loss_sum, _, _ = pipeline.run(rounds, xs, ys, m, train=False, posts=posts)
            total += share_loss(loss_sum, pipeline.group, m, stage_rank(p, p * v - 1, vee)).item()
        losses[split] = total / args.eval_iters
    chunks.train()
    return losses


def main():
    run = Run(add_flags(make_parser(__doc__)), __file__)
    args, p = run.args, run.world_size
    check(args.pp in (None, p), f"--pp {args.pp} must equal the world size {p} in 07_pipeline.py "
          "(08_3d.py combines PP with data and tensor parallelism)")
    check(args.virtual_stages >= 1, f"--virtual_stages must be positive, got {args.virtual_stages}")
    if args.schedule_csv:  # a user's table: checked before anything is built
        use_table_file(args, p)
    # auto: the largest micro-batch that fits every stage, aiming at m >= 2p (the bubble (p-1)/(m+p-1) about 1/3);
    # the tied embedding's group (first and last stage), made by every rank before the fit check
    env, m = run.start(costs, dp_size=1, aim=2 * p, multiple=p if args.schedule == "interleaved" else 1, ranks=range(p),
                       groups=lambda env: dist.new_group([0, p - 1], group_desc="embedding") if p > 1 else None)
    check_micro_batches(args, p, m)  # interleaved: a multiple of p; DualPipeV: at least 2p
    every, v, vee, split = run_schedule(args, p, m)  # every rank's rounds: what runs, is drawn and is priced
    write_schedule(args, every, p, vee, env)  # --write_schedule FILE: torch's CSV (rank 0)
    run.dry_run(costs, lambda config: plan(args, p, v, m))  # every stage's layers, bytes, activations in flight
    config = model_config(args, Data.vocab_size_of(args.data))
    data = Data(args.data, args.seed, config.block_size)
    check_layout(args, config, p)
    torch.manual_seed(args.seed + env.rank)  # dropout: every stage its own stream

    chunks = build_chunks(config, p, v, env.rank, args.seed, args.recompute, vee).to(env.device)
    deferred = split_backward(chunks) if split else None  # zero bubble: I and W apart
    first, last = chunks[0].is_first, chunks[-1].is_last
    # the two copies of the tied embedding: first stage (lookup) and last stage (head)
    tied = ([chunks[0].wte.weight] if first else []) + ([chunks[-1].lm_head.weight] if last else [])
    optimizer = make_optimizer(chunks.named_parameters(), args, env)  # AdamW, or Muon + AdamW
    act_shape = (args.micro_batch_size, config.block_size, config.n_embd)
    pipeline = Pipeline(chunks, env, dist.group.WORLD, v, act_shape, deferred,  # the pipeline: every rank
                        timed=args.measure_bubble, vee=vee, tree=stage_tree(args, chunks, m, run.groups))
    rounds = every[env.rank]  # this rank's rounds of ("F" | "B" | "I" | "W", micro-batch, chunk)
    posts = exchanges_for_nccl(every, p, v, m, vee)[env.rank]  # exchanges(), ordered for NCCL in a V
    run.begin(config, optimizer, costs, layout={"strategy": "pipeline", "pp": p, "virtual_stages": v},
              pieces=lambda: checkpoint_pieces(chunks, optimizer),
              evaluate=lambda: evaluate(pipeline, chunks, data, args, env, p, m, v),
              describe=describe(args, config, p, v, m))
    bubble = log_timeline(run, args, p, m)  # the schedule drawn, with its bubble

    for step in run.steps():
        lr = lr_at(step, args)  # linear warm-up, then cosine decay (nanoGPT's get_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        xs, ys = micro_batches(data, "train", step, args, env, m, first, last)  # tokens: first stage; targets: last
        with run.meter:
            loss_sum, in_flight, busy = pipeline.run(rounds, xs, ys, m, posts=posts)  # busy: computing
        loss = share_loss(loss_sum, pipeline.group, m, stage_rank(p, p * v - 1, vee))
        if p > 1 and first != last and not args.bitwise:  # (in a V, one rank holds both; --bitwise: StageTree)
            for weight in tied:  # keep the two copies of wte equal: sum their gradients
                dist.all_reduce(weight.grad, group=run.groups)  # the embedding group
        norm = clip_grad_norm(chunks, args.grad_clip, pipeline.group, pipeline.tree) if args.grad_clip > 0 else None
        run.check(loss, (t.grad for t in chunks.parameters()), norm)  # non-finite? asked to stop?
        optimizer.step()
        log_in_flight(run, step, env, in_flight)  # the first step, next to the ledger
        run.end_step(loss, lambda: {"activations_in_flight": in_flight, "bubble_drawn": bubble,  # read when logged
                                    "busy_fraction": busy() if busy else None,  # --measure_bubble's events
                                    "timeline": busy and write_timeline(args, env, step, rounds, pipeline),  # each op
                                    "bubble_theory": bubble_theory(args.schedule, p, m, v)})  # ledger, metrics, ckpt
        optimizer.zero_grad(set_to_none=True)
    run.finish()


# ----------------------------------------------------------------------------------------
# ---- Beyond the lesson ----
# ----------------------------------------------------------------------------------------
# What follows is not needed to read the strategy: zero bubble's split Linear (SplitLinear),
# the V schedules' orders (ZB-V, DualPipeV, as torch writes them), the exchanges reordered
# for NCCL in a V, a schedule's CSV import and export, costs() and the accounting, checkpoint
# pieces, the unit-cost replay that draws the schedule and its bubble, and --measure_bubble's
# timeline files (write_timeline, which plot.py --measured reads).


# ---------------------------------------------------------------------------------------
# Zero bubble: each Linear's backward split into I (the input gradient) and W (the weight's)
# ---------------------------------------------------------------------------------------

class _WeightGradient(torch.autograd.Function):
    """W of one Linear for one micro-batch, as its I leaves it behind: a graph node whose
    backward is the weight gradient dW = dyᵀ·x, db = Σ dy, which autograd accumulates into
    .grad as for any leaf. x (the Linear's input) and dy (its output's gradient) are saved
    the way autograd saves any tensor, so they are held, and the activation meter counts
    them, until W runs: per block 7 b·s·h of inputs and 9 b·s·h of gradients, 16e·bsh
    (Qi et al.'s M_W = 32bsh in 16 bits, against the M_B = 34bsh + 5as²b a block saves)."""

    @staticmethod
    def forward(ctx, weight, bias, x, dy):
        ctx.save_for_backward(x, dy)
        ctx.has_bias = bias is not None
        return x.new_zeros(())  # a handle: W is torch.autograd.backward(handles)

    @staticmethod
    def backward(ctx, _):
        x, dy = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])
        return dy.t() @ x.reshape(-1, x.shape[-1]), dy.sum(0) if ctx.has_bias else None, None, None


class _InputGradientOnly(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward is I alone: dx = dy·W, what the layer below (and the
    previous stage) waits for; the weight gradient is deferred as a _WeightGradient node
    appended to `deferred`."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferred):
        ctx.save_for_backward(x, weight, bias)
        ctx.deferred = deferred
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        with torch.enable_grad():  # W's node hangs off the weight, to run when the schedule says
            ctx.deferred.append(_WeightGradient.apply(weight, bias, x.detach(), dy.detach()))
        return dy @ weight, None, None, None


class SplitLinear(nn.Module):
    """An nn.Linear, the same parameters under the same names, whose backward is split
    (zero bubble's I and W). Under autocast the inputs are cast here, as F.linear's autocast
    would, so that what is saved (the compute-dtype input; the weight's copy is a
    parameter's) is what nn.Linear saves."""

    def __init__(self, linear, deferred):
        super().__init__()
        self.weight, self.deferred = linear.weight, deferred
        self.register_parameter("bias", linear.bias)

    def forward(self, x):
        if not torch.is_grad_enabled():  # evaluation: nothing to split
            return F.linear(x, self.weight, self.bias)
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        return _InputGradientOnly.apply(x, weight, bias, self.deferred)


def split_backward(chunks):
    """Replace every Linear of every block by a SplitLinear: I then leaves its weight
    gradients in the list returned, one _WeightGradient node per Linear. The head's weight
    gradient stays in I (deferring it would hold the b·s·V logits' gradient), as do those of
    the LayerNorms and the embeddings, which cost little."""
    deferred = []
    for block in (block for chunk in chunks for block in chunk.h):
        for module in list(block.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, name, SplitLinear(child, deferred))
    return deferred


# ---------------------------------------------------------------------------------------
# --bitwise: a stage sums its micro-batches' gradients in 01's tree, not as they come
# ---------------------------------------------------------------------------------------

def stage_tree(args, chunks, m, tied_group):
    """--bitwise's StageTree for this rank's chunks (None without --bitwise); the tied embedding is
    kept apart where its two copies sit on two stages (first and last, not in a V)."""
    if not getattr(args, "bitwise", False):
        return None
    first, last = chunks[0].is_first, chunks[-1].is_last
    tied = (chunks[0].wte.weight if first else chunks[-1].lm_head.weight) if first != last else None
    return StageTree(chunks, m, tied, tied_group)


class StageTree:
    """--bitwise: this stage's gradients summed in one fixed binary tree over the step's m
    micro-batches (common.TreeSum), the tree 01 --bitwise sums its micro-batches in, whatever
    order the schedule runs their backwards in. After each backward (B; zero bubble's I, then
    its W) the gradients it produced are moved out of .grad into micro-batch i's leaf, with the
    last chunk's loss; a leaf joins the tree once every chunk of the rank has given its part.
    Every backward is of the micro-batch's own mean loss; the tree's sum is divided once, by m.

    The tied embedding: 01's one backward adds the head's and the lookup's gradients of a
    micro-batch (a + b, the same bits in either order), and the tree sums those. In a V, or on
    one stage, the rank holds both and adds them so. Where the copies sit on two stages, each
    keeps its m per-micro-batch gradients and one all-reduce over the embedding group adds
    them pairwise (m·V·h, where the plain path sends V·h); both ends then form the same tree."""

    def __init__(self, chunks, m, tied, tied_group):
        self.chunks, self.m, self.tied, self.group = chunks, m, tied, tied_group
        split = {id(t) for module in chunks.modules() if isinstance(module, SplitLinear) for t in module.parameters()}
        self.parts = [{"B": list(chunk.parameters()), "I": [t for t in chunk.parameters() if id(t) not in split],
                       "W": [t for t in chunk.parameters() if id(t) in split]} for chunk in chunks]
        self.params = [t for t in chunks.parameters() if t is not tied]  # a leaf's tensors, in this order
        self.has_loss = chunks[-1].is_last
        self.expected = sum(len(part["B"]) for part in self.parts) - (tied is not None) + self.has_loss
        self.pending, self.tied_leaves, self.tree = {}, {}, TreeSum(m)

    def take(self, i, c, part, out=None):
        """Micro-batch i's gradients of chunk c that backward's `part` (B, I or W) produced, moved
        out of .grad; `out`: the chunk's output, on the last chunk the loss."""
        leaf = self.pending.setdefault(i, {})
        for t in self.parts[c][part]:
            g, t.grad = t.grad, None
            if t is self.tied:
                self.tied_leaves[i] = g
            else:  # in a V the tied embedding comes twice, head then lookup: added, as 01's backward adds them
                leaf[id(t)] = leaf[id(t)].add_(g) if id(t) in leaf else g
                leaf["parts"] = leaf.get("parts", 0) + 1
        if part != "W" and self.chunks[c].is_last:
            leaf["loss"] = out.detach().float().reshape(1)
            leaf["parts"] = leaf.get("parts", 0) + 1
        if leaf.get("parts") == self.expected:
            del self.pending[i]
            self.tree.add(i, [leaf[id(t)] for t in self.params] + ([leaf["loss"]] if self.has_loss else []))

    def finish(self):
        """The tree's sums divided by m into .grad (the tied embedding's pairs first added over the
        embedding group, then summed in the same tree); returns the losses' sum (0 off the last stage)."""
        total, self.tree = self.tree.total, TreeSum(self.m)
        for t, g in zip(self.params, total):
            t.grad = g.div_(self.m)
        if self.tied is not None:
            leaves = torch.stack([self.tied_leaves.pop(i) for i in range(self.m)])
            dist.all_reduce(leaves, group=self.group)  # lookup + head of every micro-batch, on both ends
            tree = TreeSum(self.m)
            for i in range(self.m):
                tree.add(i, [leaves[i]])
            self.tied.grad = tree.total[0].div(self.m)  # (a new tensor: the m leaves are freed)
        return total[-1][0] if self.has_loss else torch.zeros((), device=self.params[0].device)

    def norm(self, head_copy, group):
        """The global gradient norm as 01's clip_grad_norm_ takes it: each parameter's norm, whole,
        at its place in 01's order (0 elsewhere; the last stage's copy of wte not counted), summed
        over the pipeline `group` (x + 0 = x: no rounding), then the norm of those."""
        names = list(param_shapes(self.chunks[0].config))
        norms = torch.zeros(len(names), device=self.params[0].device)
        for chunk in self.chunks:
            for name, t in chunk.named_parameters():
                if not (head_copy and name == "lm_head.weight"):
                    norms[names.index(chunk.full_name(name))] = torch.linalg.vector_norm(t.grad)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(norms, group=group)  # every parameter's norm, from the stage that holds it
        return torch.linalg.vector_norm(norms)


# ---------------------------------------------------------------------------------------
# The V schedules, ZB-V and DualPipeV, as torch.distributed.pipelining orders them
# ---------------------------------------------------------------------------------------

def in_rounds(steps):
    """Rounds from steps (each a tuple: one action, or an overlapped pair): one round per
    step, and a W riding in the round of the I before it (it runs while that round's
    messages travel), as ZB-H1's rounds have it."""
    rounds = []
    for step in steps:
        if step[0][0] == "W" and rounds and rounds[-1][-1][0] == "I":
            rounds[-1] += step
        else:
            rounds.append(tuple(step))
    return rounds


def zbv_rounds(p, rank, m):
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6), as torch's
    ScheduleZBVZeroBubble orders it: rank r runs 2(p-r)-1 forwards down the V (its chunk 0,
    global chunk r), then alternates forwards of its two chunks, then from the bottom of the
    V a forward of the way back (chunk 1, global 2p-1-r) with its I and W at once; in the
    steady state one F, I and W of each chunk; the cool-down's Is, and the Ws last. Built for
    at least 2p-1 micro-batches (what fills the V), those beyond m then dropped."""
    down, up, n = 0, 1, max(2 * p - 1, m)
    out, count = [], {}

    def act(c, kind):  # the next micro-batch of this chunk and kind
        key = (c, kind)
        count[key] = count.get(key, 0) + 1
        out.append((kind, count[key] - 1, c))
    for _ in range(2 * (p - rank) - 1):  # warm-up: down the V
        act(down, "F")
    for _ in range(rank):
        act(up, "F"), act(down, "F")
    for _ in range(p - rank):  # the way back starts: its Is and Ws at once
        act(up, "F"), act(up, "I"), act(up, "W")
    while count[(down, "F")] < n or count.get((up, "F"), 0) < count[(down, "F")]:  # steady state
        if count[(down, "F")] < n:
            act(down, "F")
        act(down, "I"), act(down, "W"), act(up, "F"), act(up, "I"), act(up, "W")
    w_down, w_up = count.get((down, "W"), 0), count.get((up, "W"), 0)
    for _ in range(rank):  # cool-down: input gradients first, what the other ranks wait for
        act(down, "I"), act(up, "I")
    for _ in range(p - rank):
        act(down, "I")
        out.append(("W", w_down, down))
        w_down += 1
    out += [("W", i, up) for i in range(w_up, count.get((up, "I"), 0))]
    out += [("W", i, down) for i in range(w_down, count[(down, "I")])]
    return in_rounds([(action,) for action in out if action[1] < m])


def dualpipev_rounds(p, rank, m):
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, deepseek-ai/DualPipe), as torch's
    ScheduleDualPipeV orders it (m >= 2p): the steady state is one forward of one chunk
    overlapped with the whole backward of the other, a round of two ("(aFi;bBj)OVERLAP_F_B"
    in torch's notation), which on GPUs hides each one's communication behind the other's
    compute and here runs one after the other; the first and last phases use I and W."""
    down, up = 0, 1
    out, count, weights = [], {}, []

    def act(c, kind, emit=True):
        key = (c, "I" if kind == "B" else kind)
        i = count.get(key, 0)
        count[key] = i + 1
        if kind == "I":
            weights.append(("W", i, c))
        if emit:
            out.append(((kind, i, c),))
        return kind, i, c

    def overlap(forward, backward):
        out.append((act(forward, "F", False), act(backward, "B", False)))

    def pending_weight():
        if weights:
            out.append((weights.pop(0),))
    for _ in range(2 * (p - rank - 1)):
        act(down, "F")
    for _ in range(rank + 1):
        act(down, "F"), act(up, "F")
    for _ in range(p - rank - 1):
        act(up, "I"), pending_weight(), act(up, "F")
    for k in range(m - 2 * p + rank + 1):  # the main phase: F0B1 and F1B0, overlapped
        if k == 0 and rank == p - 1:  # not overlapped, to shorten the bubble
            act(down, "F"), act(up, "B")
        else:
            overlap(down, up)
        overlap(up, down)
    for _ in range(p - rank - 1):
        act(up, "B"), overlap(up, down)
    zero_bubble = False
    for k in range(rank + 1):  # the second half of the backwards uses I and W
        zero_bubble |= k == (rank + 1) // 2 and rank % 2 == 1
        act(up, "I" if zero_bubble else "B")
        zero_bubble |= k == (rank + 1) // 2 and rank % 2 == 0
        act(down, "I" if zero_bubble else "B")
    for _ in range(p - rank - 1):
        pending_weight(), act(down, "I" if zero_bubble else "B")
    for _ in range(rank + 1):
        pending_weight()
    return in_rounds(out)


# ---------------------------------------------------------------------------------------
# In a V, the exchanges reordered so that they complete under NCCL's rules
# ---------------------------------------------------------------------------------------

class Deadlock(ValueError):
    def __init__(self, rank, batch, message):
        super().__init__(message)
        self.rank, self.batch = rank, batch


def exchanges_for_nccl(rounds_by_rank, p, v, m, vee=False):
    """exchanges() of every rank, ordered to complete under NCCL's point-to-point rules (those of
    tests/nccl_replay.py: a rank's batches complete in posting order; a send completes only
    once its receive is posted; the k-th send from a to b is b's k-th receive from a,
    whatever the tags). The four older schedules' batches already do, and are returned as
    they are. In a V one channel carries two streams (rank r passes chunk r's activations
    and chunk 2p-1-r's gradients to rank r+1) and a rank may need a later message first
    (ZB-V at p = 2: rank 1 runs 2I0 before 1F2, whose input rank 0 sent first): 1. a
    receive is posted together with those its sender sends before it; 2. replaying the
    batches, where ranks wait on each other (a send's receive behind its peer's own send,
    posted alone), a receive whose send is already posted moves into the waiting rank's
    batch. Early receives wait in Pipeline.run's `received` until their round. Raises
    Deadlock naming the rank and its batch where no move helps (a real deadlock)."""
    batches = [[list(b) for b in exchanges(rounds_by_rank[r], p, r, v, m, vee)] for r in range(p)]
    sent = {(q, r): [tag for b in batches[q] for op, peer, tag in b if op == "send" and peer == r]
            for q in range(p) for r in range(p) if q != r}
    for r in range(p):  # 1. receives in their senders' order
        done = {q: 0 for q in range(p)}
        for b in batches[r]:
            wanted = [(q, tag) for op, q, tag in b if op == "recv" and q != r]
            b[:] = [entry for entry in b if entry[0] == "send" or entry[1] == r]
            for q, tag in wanted:
                if tag in sent[(q, r)][done[q]:]:
                    upto = sent[(q, r)].index(tag, done[q]) + 1
                    b += [("recv", q, t) for t in sent[(q, r)][done[q]:upto]]
                    done[q] = upto
    where, ops_of, key = {}, [], {}  # (channel, message number, op) -> its batch; per batch what it waits on
    for r in range(p):
        count = {}
        ops_of.append([])
        for j, b in enumerate(batches[r]):
            ops_of[r].append([])
            for entry in b:
                op, q, _ = entry
                if q != r:
                    channel = (r, q) if op == "send" else (q, r)
                    count[channel] = count.get(channel, 0) + 1
                    where[key.setdefault((r, entry), (channel, count[channel], op))] = j
                    ops_of[r][-1].append(((channel, count[channel], "recv" if op == "send" else "send"), q))
    head = [0] * p
    while True:  # 2. replay; where stuck, move a receive whose send is posted to its waiting rank
        moved = True
        while moved:  # a move only ever brings a receive forward: the heads reached stay reached
            moved = False
            for r in range(p):
                while head[r] < len(batches[r]) and all(where.get(other, len(batches[q])) <= head[q]
                                                        for other, q in ops_of[r][head[r]]):
                    head[r], moved = head[r] + 1, True
        if all(head[r] == len(batches[r]) for r in range(p)):
            return batches
        moves = 0
        for r in (r for r in range(p) if head[r] < len(batches[r])):
            for q in (q for q in range(p) if q != r and head[q] < len(batches[q])):
                tags = [tag for op, peer, tag in batches[q][head[q]] if op == "send" and peer == r]
                later = tags and next(((j, entry) for j in range(head[r] + 1, len(batches[r]))
                                       for entry in batches[r][j] if entry[0] == "recv" and entry[1] == q), None)
                if later and later[1][2] in tags:  # its send is posted: receive it now
                    j, entry = later  # the first from q after the head: its message number stays
                    batches[r][j].remove(entry)
                    batches[r][head[r]].append(entry)
                    where[key[(r, entry)]] = head[r]
                    send = ((*key[(r, entry)][:2], "send"), q)
                    ops_of[r][j].remove(send)
                    ops_of[r][head[r]].append(send)
                    moves += 1
        if not moves:
            r = min(r for r in range(p) if head[r] < len(batches[r]))
            raise Deadlock(r, head[r], f"its batch {batches[r][head[r]]} deadlocks under NCCL's rules "
                                       "(every rank waits on another)")



# ---------------------------------------------------------------------------------------
# A schedule as a table: torch.distributed.pipelining's CSV, imported and exported
# ---------------------------------------------------------------------------------------

ACTION = re.compile(r"^(\d{1,9})([FIWB])(\d{1,9})$")  # (a billion stages or micro-batches is no table's)


MAX_TABLE_BYTES = 64 * 2**20  # 1,024 ranks x 2,048 micro-batches of ZB-V take about 50 MiB


def parse_action(text):
    """[(stage, "F" | "I" | "W" | "B", micro-batch)] of one cell (two for an overlapped pair)."""
    pair = re.match(r"^\((.*);(.*)\)OVERLAP_F_B$", text.strip())
    parts = [pair.group(1), pair.group(2)] if pair else [text]
    found = [ACTION.match(part.strip()) for part in parts]
    if not all(found):
        from infra.cli import shown  # a spreadsheet's cell may be anything, of any length
        raise ValueError(f"not an action: '{shown(text, 80)}' (expected e.g. 2F0, 2I0, 2W0, 2B0 or "
                         "(0F1;1B0)OVERLAP_F_B)")
    return [(int(f.group(1)), f.group(2), int(f.group(3))) for f in found]


def table_rounds(row, p, rank, v, vee=False):
    """One rank's rounds from its row of cells (import): "3F1" is global chunk 3's forward of
    micro-batch 1 (3I1 its I, 3W1 its W, 3B1 a whole backward), an overlapped pair
    "(0F4;1B2)OVERLAP_F_B" one round; a W rides in the round of the I before it (in_rounds)."""
    local = {chunk_stage(p, rank, c, vee): c for c in range(v)}
    return in_rounds([tuple((kind, i, local[g]) for g, kind, i in parse_action(text)) for text in row])


def table(rounds_by_rank, p, vee=False):
    """Every rank's row of cells (export), as torch.distributed.pipelining writes them: one
    cell per action, a round that starts with a forward and holds a backward (the
    interleaved steady state, DualPipeV's overlapped pair) one "(aFi;bBj)OVERLAP_F_B" cell."""
    rows = []
    for rank, rounds in enumerate(rounds_by_rank):
        cells = []
        for actions in rounds:
            names = [f"{chunk_stage(p, rank, c, vee)}{kind}{i}" for kind, i, c in actions]
            pair = len(actions) > 1 and actions[0][0] == "F" and actions[1][0] in "BI"
            cells += [f"({names[0]};{names[1]})OVERLAP_F_B"] + names[2:] if pair else names
        rows.append(cells)
    return rows


def read_table(path):
    """Every rank's cells from a CSV file as torch.distributed.pipelining's _dump_csv
    writes it and _load_csv reads it: one row per rank, one action per cell, an empty cell
    an idle step. A spreadsheet's export is read too: the byte-order mark of Excel's "CSV
    UTF-8" is skipped, and empty lines at the end are no ranks."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = [[cell.strip() for cell in row if cell.strip()] for row in csv.reader(f)]
    while rows and not rows[-1]:
        rows.pop()
    return rows


def write_table(rows, path):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def write_schedule(args, every, p, vee, env):
    """--write_schedule FILE: the run's rounds as torch's CSV, by rank 0 (a dry run has no env).
    Start-up checked that FILE can be written; a write that fails even so (a full disk) is one
    line, agreed by every rank, and leaves no partial table."""
    if not args.write_schedule:
        return
    problem = None
    if env is None or env.rank == 0:
        try:
            write_table(table(every, p, vee), args.write_schedule)
        except OSError as e:
            problem = f"--write_schedule {args.write_schedule}: cannot write it: {e.strerror or e}"
            if os.path.isfile(args.write_schedule):
                os.remove(args.write_schedule)
    if env is None:
        check(problem is None, problem)
    else:
        from infra.start import agree  # the others wait for rank 0's verdict: every rank exits 2 on its problem
        agree(env, problem)


def placement_of(rows):
    """(v, vee): the chunks per rank and their placement that the table's stages name; None
    if no rank r holds r, r+p, ... (interleaved) or r and 2p-1-r (a V) for all r."""
    p = len(rows)
    held = [sorted({g for text in row for g, _, _ in parse_action(text)}) for row in rows]
    v = max(len(h) for h in held)
    for vee in (False, True) if v == 2 else (False,):
        if all(h == sorted(chunk_stage(p, r, c, vee) for c in range(v)) for r, h in enumerate(held)):
            return v, vee
    return None


def table_problem(actions, p, m):
    """Why the table cannot run at p ranks and m micro-batches, in one line naming the rank
    and the action, or None: rows not one per rank, an action that is not one, stages not
    placed as 07 places them, an action missing or twice (its send would have no receive),
    an I without its W or a W without its I, an action before its input exists or a W before
    its I (the order, replayed with every rank waiting for what it needs, stops), or an order
    that deadlocks under NCCL's rules (exchanges_for_nccl)."""
    if len(actions) != p:
        empty = [str(r + 1) for r, row in enumerate(actions) if not row]
        return (f"the table has {len(actions)} rows, one per rank, for {p} ranks"
                + (f" (line {', '.join(empty[:5])} {'is' if len(empty) == 1 else 'are'} empty)" if empty else ""))
    for r, row in enumerate(actions):
        for text in row:
            try:
                parse_action(text)
            except ValueError as e:
                return f"rank {r}: {e}"
    placement = placement_of(actions)
    if placement is None:
        return ("its stages are not placed as 07 places chunks: rank r holds r, r+p, ... (interleaved) "
                "or r and 2p-1-r (a V), every rank as many")
    (v, vee), seen = placement, {}
    for r, row in enumerate(actions):
        for text in row:
            for g, kind, i in parse_action(text):
                if (g, kind, i) in seen:
                    return f"rank {r}, action {text}: {g}{kind}{i} runs twice"
                if i >= m:
                    return f"rank {r}, action {text}: micro-batch {i}, but the run has {m} (0 to {m - 1})"
                seen[(g, kind, i)] = r
    n = p * v
    for g, i in ((g, i) for g in range(n) for i in range(m)):
        r, back = stage_rank(p, g, vee), [k for k in "BI" if (g, k, i) in seen]
        missing = (f"{g}F{i}" if (g, "F", i) not in seen else f"{g}B{i} (or {g}I{i} and {g}W{i})" if not back
                   else f"{g}W{i} after its {g}I{i}" if back == ["I"] and (g, "W", i) not in seen else None)
        if missing:
            return f"rank {r}: never runs {missing}"
        if len(back) > 1 or (back == ["B"] and (g, "W", i) in seen):
            return f"rank {r}: {g}{'I' if len(back) > 1 else 'W'}{i} besides the full backward {g}B{i}"
    def needs(g, kind, i):  # what must have run, on any rank, before this action
        if kind == "F":
            return [(g - 1, "F", i)] if g > 0 else []
        if kind == "W":
            return [(g, "I", i)]
        return [(g, "F", i)] + [(g + 1, k, i) for k in "BI" if g < n - 1 and (g + 1, k, i) in seen]
    flat = [[(text, sub) for text in row for sub in parse_action(text)] for row in actions]
    done, position, moved = set(), [0] * p, True
    while moved:  # every rank runs its next action once what it needs has run
        moved = False
        for r in range(p):
            while position[r] < len(flat[r]) and all(need in done for need in needs(*flat[r][position[r]][1])):
                done.add(flat[r][position[r]][1])
                position[r], moved = position[r] + 1, True
    stuck = [r for r in range(p) if position[r] < len(flat[r])]
    for r in sorted(stuck, key=lambda r: not any(  # a rank waiting on itself first: the cause, not a victim
            stage_rank(p, need[0], vee) == r for need in needs(*flat[r][position[r]][1]) if need not in done)):
        text, action = flat[r][position[r]]
        g, k, i = next(need for need in needs(*action) if need not in done)
        holder = stage_rank(p, g, vee)
        return (f"rank {r}, action {text}: needs {g}{k}{i} first, which this rank runs after it" if holder == r else
                f"rank {r}, action {text}: needs {g}{k}{i} first, which rank {holder} runs only after "
                f"what waits on this (the order deadlocks)")
    rounds = [table_rounds(actions[r], p, r, v, vee) for r in range(p)]
    try:
        exchanges_for_nccl(rounds, p, v, m, vee)
    except Deadlock as e:
        done = rounds[e.rank][e.batch - 1] if e.batch else ()
        names = " ".join(f"{chunk_stage(p, e.rank, c, vee)}{k}{i}" for k, i, c in done)
        return f"rank {e.rank}, after action {names or '(none)'}: {e}"
    return None


def use_table_file(args, p):
    """--schedule_csv: read the user's table and refuse it, in one line naming the rank and
    the action, if it cannot run (table_problem), before anything is built. Its micro-batch
    count is the run's m: the micro-batch size is the global batch over it. A FIFO, a device
    or an oversized file is refused before it is read (a FIFO nobody writes would block)."""
    from infra.cli import file_problem, shown
    problem = file_problem(args.schedule_csv, "--schedule_csv", MAX_TABLE_BYTES)
    check(problem is None, problem)
    try:
        actions = read_table(args.schedule_csv)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        fail(f"--schedule_csv {args.schedule_csv}: cannot read it ({shown(e)})")
    try:
        m = 1 + max((i for row in actions for text in row for _, _, i in parse_action(text)), default=-1)
    except ValueError:
        m = 1  # a cell that is not an action: table_problem names it
    problem = table_problem(actions, p, m) if m > 0 else "it holds no actions"
    check(problem is None, f"--schedule_csv {args.schedule_csv}: {problem}")
    check(args.global_batch_size % m == 0, f"--schedule_csv {args.schedule_csv}: its {m} micro-batches "
          f"do not divide --global_batch_size {args.global_batch_size}")
    check(args.micro_batch_size in ("auto", args.global_batch_size // m),
          f"--schedule_csv {args.schedule_csv} has {m} micro-batches of {args.global_batch_size // m}: "
          f"leave out --micro_batch_size {args.micro_batch_size}")
    args.micro_batch_size, args.schedule = args.global_batch_size // m, "csv"


# ----------------------------------------------------------------------------------------
# Accounting: what a stage holds and sends (the ledger's theory), checkpoint pieces, and the
# schedule's plan: its bubble, the unit-cost replay that is drawn, every stage's dry run
# ----------------------------------------------------------------------------------------

def costs(args, config, world_size, dtype, rank=0):
    """The docstring's formulas in bytes for stage `rank`: its parameters (the tied wte
    counted on the first and on the last stage), and per step the b·s·h activations and
    gradients it sends and receives across stage boundaries, which stay fp32 under autocast
    (the residual stream adds fp32 embeddings to bf16 block outputs), the wte gradient
    all-reduced between the first and last stage, the norm and the logged loss."""
    from infra.formulas import formula, newton_schulz_flops
    p, m = world_size, args.global_batch_size // args.micro_batch_size
    check_layout(args, config, p)  # the fit check prices the layout before main() has checked it
    every, v, vee, split = run_schedule(args, p, m)
    bitwise = getattr(args, "bitwise", False)
    chunks = meta_chunks(config, p, v, rank, vee)
    psi = sum(t.numel() for t in chunks.parameters())
    psi_m = sum(t.numel() for name, t in chunks.named_parameters() if is_hidden_matrix(name, t.shape))
    first, last = chunks[0].is_first, chunks[-1].is_last
    rounds = every[rank]
    order = [action for actions in rounds for action in actions]
    units = unit_actions(order, split)  # a whole backward of a split schedule: its I, then its W
    # what crosses to another rank (one rank alone, or the V's turn, passes in memory)
    posted = [op for batch in exchanges(rounds, p, rank, v, m, vee) for op, peer, _ in batch if peer != rank]
    sends, recvs = posted.count("send"), posted.count("recv")
    b, s, h = args.micro_batch_size, config.block_size, config.n_embd
    sent = {"send": formula("n*4*b*s*h", show="n", n=sends, b=b, s=s, h=h),
            "recv": formula("n*4*b*s*h", show="n", n=recvs, b=b, s=s, h=h),
            "broadcast": formula("4*loss" if p > 1 else "0", loss=1),  # the logged loss (none in one stage)
            # the tied wte's gradient, on the embedding group of the first and the last stage (--bitwise:
            # each micro-batch's, for the pairs StageTree adds before its tree)
            "all_reduce[embedding]": formula(("4*m*V*h" if bitwise else "4*V*h") if p > 1 and first != last else "0",
                                             m=m, V=config.vocab_size, h=h),
            # every stage's squared norm (--bitwise: each of 01's parameters' norm, StageTree.norm)
            "all_reduce": formula("4*norm" if args.grad_clip > 0 and p > 1 else "0",
                                  norm=len(param_shapes(config)) if bitwise else 1)}
    # the calls a step posts, each paying the network's latency once: a send or receive per boundary
    # crossed (each op of a batch), the loss's broadcast, the tied wte's and the norm's all-reduces
    calls = {"send": formula("n", show="n", n=sends), "recv": formula("n", show="n", n=recvs),
             "broadcast": formula("1"), "all_reduce[embedding]": formula("1"), "all_reduce": formula("1")}
    held = {"params": formula("4*Ψ_stage", Ψ_stage=psi), "grads": formula("4*Ψ_stage", Ψ_stage=psi),
            "optim": formula("8*Ψ_stage", Ψ_stage=psi) if args.optimizer == "adamw" else
            formula("4*Ψ_m + 8*(Ψ_stage - Ψ_m)", Ψ_stage=psi, Ψ_m=psi_m)}  # Muon: one moment of its matrices
    in_flight = {"gpipe": m, "1f1b": min(p - rank, m), "zb": min(p, m),
                 "interleaved": min(m * v, (p - rank - 1) * 2 + (v - 1) * p + 1)}.get(
        args.schedule, held_peak(order))  # the V schedules: walked (ZB-V: 2p chunks, as 1F1B's stage 0)
    cost = {"layout": f"stage {rank} of {p}" + (f", chunks {[chunk_stage(p, rank, c, vee) for c in range(v)]}"
                                                if v > 1 else ""),
            "held": held, "sent": {k: val for k, val in sent.items() if val[1]},
            "calls": {k: val for k, val in calls.items() if sent[k][1]},
            # Muon: Newton-Schulz on this stage's matrices (infra.formulas.newton_schulz_flops)
            "muon_flops": newton_schulz_flops([t.shape for name, t in chunks.named_parameters()
                                              if args.optimizer == "muon" and is_hidden_matrix(name, t.shape)]),
            "in_flight": in_flight, "activations": activation_peak(args, config, dtype, units, p, v, rank, vee, split)}
    # every live tensor at its most, by phase (infra.formulas.phase_peaks on this stage's chunks: the
    # logits only where the head is), with the boundaries' (boundary_terms). Start-up: the
    # stage's weights, each drawn whole by param_init
    from infra.formulas import activation_device_type, largest_matrix, matmul_weights, phase_peaks, transient_terms
    t = transient_terms(config, b, s, dtype, activation_device_type(args), args.optimizer, last=last, kept=False,
                        casts=matmul_weights({name: t.shape for name, t in chunks.named_parameters()}),
                        update=max(t.numel() for t in chunks.parameters()),
                        matrix=largest_matrix(t.shape for name, t in chunks.named_parameters()
                                              if is_hidden_matrix(name, t.shape)))
    forward, backward = boundary_terms(b, s, h, sends=p > 1 and any(not chunk.is_last for chunk in chunks))
    casts = {"casts": casts_peak(units, dtype, {chunk_stage(p, rank, c, vee): chunk_casts(chunk, split)
                                                for c, chunk in enumerate(chunks)}, p, rank, vee)}
    tree = bitwise_peaks(args, config, dtype, units, p, v, rank, vee, split, chunks, m,  # --bitwise: StageTree's
                         held=formula("params + optim", params=held["params"], optim=held["optim"]))
    cost["peak"] = phase_peaks(cost, t, forward={**casts, **(forward or {}), **tree[0]},
                               backward={**casts, **(backward or {}), **tree[1]})
    cost["startup"] = formula("params + init" + " + 4*Ψ_m" * (args.optimizer == "muon"), show="init",
                              params=held["params"], init=t["init"], Ψ_m=psi_m)
    return cost


_META_CHUNKS = {}


def meta_chunks(config, p, v, rank, vee):
    """This rank's chunks on the meta device (shapes, no storage) for costs(), built once per
    layout: plan.py and --micro_batch_size auto price the same stage at many micro-batches."""
    key = (repr(config), p, v, rank, vee)
    if key not in _META_CHUNKS:
        with torch.device("meta"):
            _META_CHUNKS[key] = build_chunks(config, p, v, rank, vee=vee)
    return _META_CHUNKS[key]


def chunk_casts(chunk, split=False):
    """The elements autocast copies into the compute dtype for one forward of `chunk`: the
    weights of its matmuls (infra.formulas.matmul_weights), the head's where it is the last chunk; wte
    only as the head (the first chunk's lookup reads it in fp32). (cached, per micro-batch):
    F.linear's casts go through autocast's cache, one per step (Pipeline.run); zero bubble's
    SplitLinear casts the blocks' weights itself, a copy per forward, kept until its B."""
    from infra.formulas import matmul_weights
    shapes = {name: t.shape for name, t in chunk.named_parameters()
              if chunk.is_last or not name.endswith("wte.weight")}
    blocks = matmul_weights({name: shape for name, shape in shapes.items() if name.startswith("h.")})
    whole = matmul_weights(shapes)
    return (whole - blocks, blocks) if split else (whole, 0)


def casts_peak(order, dtype, casts, p, rank, vee=False):
    """bf16: autocast's weight copies held at the peak, `casts` {global chunk: (cached, per
    micro-batch)} from chunk_casts: the cached ones once for the step (every chunk of the
    rank has run a forward by a phase's peak), zero bubble's per-forward ones for each
    micro-batch chunk from its F to its I, walked along the rank's unit_actions(). fp32: none."""
    from infra.formulas import formula
    e = dtype.itemsize
    if e != 2:
        return formula("0")
    now, peak = {}, {}
    for kind, _, c in order:
        g = chunk_stage(p, rank, c, vee)
        if kind in "FBI" and casts[g][1]:
            now[g] = now.get(g, 0) + (1 if kind == "F" else -1)
            if sum(n * casts[k][1] for k, n in now.items()) > sum(n * casts[k][1] for k, n in peak.items()):
                peak = {k: n for k, n in now.items() if n}
    cached = sum(cached for cached, _ in casts.values())
    terms = ["e*Ψ_c"] * (cached > 0) + [f"{n}*e*Ψ_s{g}" if n > 1 else f"e*Ψ_s{g}" for g, n in sorted(peak.items())]
    return formula(" + ".join(terms) or "0", show="e", e=e, Ψ_c=cached, **{f"Ψ_s{g}": casts[g][1] for g in peak})


def boundary_terms(b, s, h, sends):
    """What the pipeline itself holds at a stage boundary, beside the activations, tensor by
    tensor (Pipeline.run, post and complete), each b·s·h and fp32 (4 bytes) in bf16 runs too: the
    residual stream stays fp32 under autocast (fp32 embeddings plus bf16 block outputs) and
    the receive buffers are made in the default dtype. ({forward}, {backward}) for
    phase_peaks; `sends`: the stage has a next one (not the last chunk's, whose output is
    the loss).

      per micro-batch in flight:
        input x      received, requires_grad: the first LayerNorm's saved input, so
                     already in `activations` (activation_terms' 4bsh of each layer)
        output       sent, then freed (free_output): only its graph is kept      0
      transient:
        out          the chunk's output, from its forward until its send completes 4bsh
                     (forward)
        dy           d loss / d out, received in the batch that sends out (1F1B's
                     steady state, GPipe's turn) and kept until backward      4bsh
                     has started from it (forward and backward)
        dx           x's gradient, sent back once the backward is over: its
                     micro-batch's activations are freed by then             (not at a peak)

    So a first or middle stage holds out + dy at its forward's peak (k micro-batches
    in flight and the last one's output on its way out) and dy at its backward's, and the
    last stage none: (n·k + 2)·4bsh, the term fitted before, counted every output and
    gradient sent in a step, which gloo kept alive until the step's end (its sends were
    never polled complete)."""
    from infra.formulas import formula
    if not sends:
        return None, None
    out, dy = formula("4*b*s*h", b=b, s=s, h=h), formula("4*b*s*h", b=b, s=s, h=h)
    return {"boundary": formula("out + dy", out=out, dy=dy)}, {"boundary": formula("dy", dy=dy)}


def held_peak(order):
    """The most micro-batch chunks held at once along a rank's actions: from F to its B, or
    (zero bubble) to its W."""
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1 if kind in "BW" else 0
        peak = max(peak, held)
    return peak


def unit_actions(order, split):
    """The actions at unit cost: in a split schedule (SplitLinear) a whole backward B is its
    I, then its W, one unit each; elsewhere B is one unit, as F."""
    return [half for action in order for half in (
        [("I", *action[1:]), ("W", *action[1:])] if split and action[0] == "B" else [action])]


def activation_peak(args, config, dtype, order, p, v, rank, vee=False, split=False):
    """The most this stage holds for backward, walking its schedule: micro-batch chunk g
    holds kept_g (common's activation_terms for its layers) from its forward to its
    backward, during_g while its backward runs, and (zero bubble) W_g from B to W, the x
    and dy of its Linears (zero_bubble_phases). The formula is the sum at the peak: m
    chunks in flight for GPipe, p - rank for 1F1B, the interleaved warm-up's count. `order`:
    unit_actions(), a split schedule's whole backward as its I and W."""
    from infra.formulas import formula
    peak, values = {}, {}
    for _, held, values in activation_walk(args, config, dtype, order, p, v, rank, vee, split):
        if sum(n * values[k] for k, n in held.items()) > sum(n * values[k] for k, n in peak.items()):
            peak = {k: n for k, n in held.items() if n and values[k]}
    return formula(" + ".join(f"{n}*{k}" if n > 1 else k for k, n in sorted(peak.items())) or "0", **values)


def activation_walk(args, config, dtype, order, p, v, rank, vee=False, split=False):
    """activation_peak's walk: for each action of `order`, (action, what is held then {term: count},
    {term: bytes}), F's after it, B's (I's) while it runs, W's after it."""
    from infra.formulas import activation_device_type, activation_phases, activation_terms
    b = args.micro_batch_size
    terms = activation_terms(config, b, config.block_size, dtype, activation_device_type(args))
    e = torch.tensor([], dtype=dtype).element_size()
    e_bsh = e * b * config.block_size * config.n_embd  # one b·s·h tensor, compute dtype
    # the MLP's dropout mask, which B frees just before it keeps its first dy (zero bubble):
    # bool on GPUs, the compute dtype on CPU, as common's activation_terms counts it
    gpu = activation_device_type(args) in ("cuda", "xpu")
    mask = (e_bsh // e if gpu else e_bsh) if config.dropout > 0 else 0
    layout, now, values = chunk_layers(config.n_layer, p * v), {}, {}
    for kind, i, c in order:
        g = chunk_stage(p, rank, c, vee)
        chunk = (terms, layout[g][1], args.recompute, g == 0, g == p * v - 1)
        if split:
            values[f"kept_{g}"], values[f"during_{g}"], values[f"W_{g}"] = zero_bubble_phases(*chunk, e_bsh, mask)
        else:
            (values[f"kept_{g}"], values[f"during_{g}"]), values[f"W_{g}"] = activation_phases(*chunk), 0
        held = f"{'W' if kind == 'W' else 'kept'}_{g}"  # F keeps the chunk's tensors, B (I) and W free them
        now[held] = now.get(held, 0) + (1 if kind == "F" else -1)
        yield (kind, i, c), ({**now, f"during_{g}": 1} if kind in "BI" else dict(now)), values
        if kind in "BI":  # until its W, the chunk keeps what W needs
            now[f"W_{g}"] = now.get(f"W_{g}", 0) + 1


def bitwise_peaks(args, config, dtype, order, p, v, rank, vee, split, chunks, m, held):
    """--bitwise's forward and backward terms for phase_peaks, from one walk of the stage's actions
    (activation_walk's, with StageTree's state beside it); {} without --bitwise. A backward's
    gradients are moved out of .grad into its micro-batch's leaf (4Ψ_stage, the tied embedding apart),
    so `held` is the parameters and optimizer state alone; a leaf whose every chunk and part (I and
    W) is in joins the tree, which holds one copy per maximal finished subtree (common.TreeSum: c
    copies, popcount of the leaves in, in order); a leaf still missing a part holds the parts taken
    (Ψ_pend elements); the ends of a split tied embedding keep each micro-batch's gradient (j·4Vh)
    to the step's end. Each phase's peak is the action where activations and these together are the
    most, not the activations' own peak: on a first stage the most copies come late, with fewer
    micro-batches in flight. A B (I) runs while the state is as before its gradients are taken."""
    from infra.formulas import formula
    if not getattr(args, "bitwise", False):
        return {}, {}
    first, last = chunks[0].is_first, chunks[-1].is_last
    tied = (chunks[0].wte.weight if first else chunks[-1].lm_head.weight) if first != last else None
    linears = {id(t) for chunk in chunks for block in chunk.h for module in block.modules()
               if type(module) is nn.Linear for t in module.parameters()}  # split_backward's W part
    part = [{"B": sum(t.numel() for t in chunk.parameters() if t is not tied),
             "I": sum(t.numel() for t in chunk.parameters() if t is not tied and id(t) not in linears),
             "W": sum(t.numel() for t in chunk.parameters() if id(t) in linears)} for chunk in chunks]
    holds_tied = [tied is not None and any(t is tied for t in chunk.parameters()) for chunk in chunks]
    leaf, parts = sum(q["B"] for q in part), len(chunks) * (2 if split else 1)
    pending, tree, tied_n, peaks = {}, TreeSum(m), 0, {}

    def state():  # (the tree's copies, the parts' elements pending, the tied embedding's leaves)
        return len(tree.nodes) + (tree.total is not None), sum(n for n, _ in pending.values()), tied_n
    for (kind, i, c), now, values in activation_walk(args, config, dtype, order, p, v, rank, vee, split):
        if kind in "BIW":  # this part's gradients, taken (B, I: the state while it runs is the one before)
            before = state()
            pending[i] = (pending.get(i, (0, 0))[0] + part[c][kind], pending.get(i, (0, 0))[1] + 1)
            tied_n += kind != "W" and holds_tied[c]
            if pending[i][1] == parts:
                del pending[i]
                tree.add(i, [torch.zeros(())])  # common.TreeSum's own bookkeeping: which nodes it holds
        now_state = before if kind in "BI" else state()
        n_copies, pend, j = now_state
        bytes_now = sum(n * values[k] for k, n in now.items()) + \
            4 * (n_copies * (leaf + last) + pend + j * config.vocab_size * config.n_embd)
        phase = "forward" if kind == "F" else "backward"
        if bytes_now > peaks.get(phase, (-1,))[0]:
            peaks[phase] = (bytes_now, {k: n for k, n in now.items() if n and values[k]}, dict(values), now_state)
    terms = {}
    for phase, (_, now, values, (n_copies, pend, j)) in peaks.items():
        activations = formula(" + ".join(f"{n}*{k}" if n > 1 else k for k, n in sorted(now.items())) or "0", **values)
        kept = ["c*4*Ψ_leaf"] * bool(n_copies) + ["4*Ψ_pend"] * bool(pend) + ["j*4*V*h"] * bool(j)  # (those held)
        tree = formula(" + ".join(kept) or "0", show="c j", c=n_copies, j=j, Ψ_leaf=leaf + last, Ψ_pend=pend,
                       V=config.vocab_size, h=config.n_embd)
        terms[phase] = {"held": held, "activations": activations, "tree": tree}
    return terms.get("forward", {}), terms.get("backward", {})


def zero_bubble_phases(terms, n_layers, recompute, first, last, e_bsh, mask):
    """(kept, during B, for W): the bytes one micro-batch through n_layers blocks holds from
    its forward to its B, the most it holds while B runs, and what it holds from B until W:
    x and dy of each block's four Linears, 16e·bsh per block (e·bsh = one b·s·h tensor in
    the compute dtype). B walks the blocks from the top; each block frees what only B
    needed and keeps the same for W, its first step (the MLP's c_proj) adding its dy before
    anything is freed but the dropout mask before it: e·bsh - mask above the start, on a
    chunk without the head (whose backward first frees the b·s·V log-softmax). With
    --recompute each block's forward runs again and its W tensors pile up under the next
    block's: the bottom block's B holds (n-1) blocks' W tensors and a whole layer."""
    from infra.formulas import activation_phases
    kept, _ = activation_phases(terms, n_layers, recompute, first, last)
    for_w = 16 * e_bsh
    first_dy = max(0, e_bsh - mask)
    head = terms["head"][1] if last else 0
    if not recompute:
        return kept, max(kept, kept - head + first_dy), n_layers * for_w
    bottom = (terms["embedding"][1] if first else 0) + (n_layers - 1) * for_w + terms["layer"][1] + first_dy
    return kept, max(kept, bottom), n_layers * for_w


def checkpoint_pieces(chunks, optimizer):
    """Every parameter of this rank's chunks, whole, under 01's names (common.py's format,
    which any script resumes at any layout); the last stage's copy of the tied embedding
    (its head) is written by the first stage only, and read by both."""
    from infra.checkpoint_format import param_pieces
    return [piece for chunk in chunks for name, param in chunk.named_parameters()
            for piece in param_pieces(chunk.full_name(name), param.shape, param, optimizer,
                                      write=name != "lm_head.weight")]


def bubble_theory(kind, p, m, v):
    """The idle fraction of a stage: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v·m+p-1)
    interleaved, and for ZB-H1, with F, B and W taking one unit each (the paper's
    T_F = T_B = T_W), p-1 idle units in 3m + p - 1: (p-1)/(3m+p-1), about a third of 1F1B's
    (m >= p; with fewer micro-batches the tail cannot be filled: (2p-1-m)/(2m+2p-1)).
    DualPipeV, its pairs overlapped (max(F, B)): (p-1)(p+2)/4 idle units over the p stages
    of a 2m + 3p/2 long timeline (m >= 2p); run in order, ZB-V's."""
    if kind == "zb":  # fewer micro-batches than stages: stage 0 waits 2p-1-m units, not p-1
        return (p - 1) / (3 * m + p - 1) if m >= p else (2 * p - 1 - m) / (2 * m + 2 * p - 1)
    if kind == "csv":  # a user's table: drawn only
        return None
    if kind == "dualpipev":
        return (p - 1) * (p + 2) / (2 * p * (4 * m + 3 * p))
    if kind == "zbv":  # idle max((p-1)/2, 2p-1-m) units of 3m + idle: half of ZB-H1's once m >= (3p-1)/2
        return (p - 1) / (6 * m + p - 1) if 2 * m >= 3 * p - 1 else (2 * p - 1 - m) / (2 * m + 2 * p - 1)
    return (p - 1) / (v * m + p - 1) if kind == "interleaved" else (p - 1) / (m + p - 1)


def bubble_formula(kind, v):
    return {"zb": "(p-1)/(3m+p-1)", "interleaved": "(p-1)/(v·m+p-1)", "zbv": "(p-1)/(6m+p-1)",
            "dualpipev": "(p-1)(p+2)/(2p(4m+3p))", "csv": "no formula: the table's own"}.get(kind, "(p-1)/(m+p-1)")


def overlaps(rounds_by_rank, vee):
    """Per rank, {forward: the backward ops it overlaps}: DualPipe's OVERLAP_F_B pairs, a
    round in a V holding a forward and a backward (and any W riding with that backward).
    On GPUs the pair runs as one (DualPipe overlaps each one's communication with the
    other's compute); its simulated time is max(F, B), not F + B. The interleaved steady
    state's pairs (not in a V) share one batch of messages only: their forward and
    backward run one after the other on any device, as drawn before. A pair of one chunk's
    forward and backward of one micro-batch (a user's table may write one) runs in order:
    the backward needs that forward."""
    return [{actions[0]: actions[1:] for actions in rounds if vee and len(actions) > 1 and actions[0][0] == "F"
             and actions[1][0] in "BI" and actions[0][1:] != actions[1][1:]} for rounds in rounds_by_rank]


def replay(orders, p, v, vee=False, overlap=None):
    """The executed orders as the pipeline's dependencies let them run: every rank's groups of
    operations (one op, or a forward and the backward it overlaps: overlaps()), each after the
    ops it needs, as events (rank, the group's forwards, its backwards (B, I, W), what it waits
    for: [(the event that made it, that event's chunk, the chunk it feeds, whether it comes from
    another rank)], whether it waits for the rank's sends (all but a lone W), what it sends on
    to other ranks: [(chunk, to)]). Which op waits for which is the schedule's alone, not its
    costs': simulate() times the events, and plan.py times one schedule at many costs."""
    last_chunk = p * v - 1
    overlap = overlap or [{}] * p
    made, position, events = {}, [0] * p, []  # made: {an op's key: the event that ran it}
    ready, waiting = list(range(p)), {}  # the ranks that may go on; {an op not yet done: the ranks stopped for it}

    def needs(r, kind, i, c):
        g = chunk_stage(p, r, c, vee)  # global chunk index
        if kind == "F":
            return [("F", i, g - 1)] if g > 0 else []
        if kind == "W":  # the weight gradient needs only its own B (the same stage)
            return [("B", i, g)]
        return [("B", i, g + 1)] if g < last_chunk else [("F", i, g)]  # B: the next chunk's input gradient
    while ready:
        r = ready.pop()
        # as far as this rank can go, then on to another; a rank stopped for an op's result goes
        # on when that op is done (the order in which the ranks go does not change any time)
        while position[r] < len(orders[r]):
            op = orders[r][position[r]]
            group = [op, *overlap[r].get(op, ())]  # one op, or a forward and the backward it overlaps
            assert len(group) == 1 or orders[r][position[r]:position[r] + len(group)] == group, \
                "an overlapped pair out of order"
            keys = [("B" if kind == "I" else kind, i, chunk_stage(p, r, c, vee)) for kind, i, c in group]
            wanted = [(n, chunk_stage(p, r, member[2], vee)) for member in group for n in needs(r, *member)
                      if n not in keys]
            missing = next((n for n, _ in wanted if n not in made), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            sends = tuple((g, to) for kind, _, g in keys for to in [g + 1 if kind == "F" else g - 1 if kind == "B" else -1]
                          if 0 <= to <= last_chunk and stage_rank(p, to, vee) != r)  # an output forward, a gradient back
            events.append((r, tuple(op for op in group if op[0] == "F"), tuple(op for op in group if op[0] != "F"),
                           tuple((made[n], n[2], g, stage_rank(p, n[2], vee) != r) for n, g in wanted),
                           any(kind != "W" for kind, _, _ in group), sends))  # (tuples: the collector skips them)
            for key in keys:
                made[key] = len(events) - 1
                ready += waiting.pop(key, [])  # the ranks that were stopped for it go on
            position[r] += len(group)
    assert all(position[r] == len(orders[r]) for r in range(p)), "the schedule deadlocks"
    return events


def simulate(orders, p, v, vee=False, overlap=None, cost=None, transfer=None, events=None):
    """Replay the executed orders with unit costs (a forward or backward of a whole stage
    takes 1, of one of v chunks 1/v; ZB's B and W one each) and the pipeline's
    dependencies: returns, per rank, the (start, op) of each operation. This is the
    timeline that is drawn. `overlap` (overlaps()): a forward and the backward it overlaps
    start together, once the inputs of both are there, and take max(F, B + its Ws), not
    F + B: DualPipe's full overlap; what either sends leaves at the end of the pair.
    `cost(rank, kind, chunk)`: each operation's own duration instead (plan.py's step time:
    a stage's own layers, the head on the last), the dependencies the same.
    `transfer(g, to)`: the seconds a message from global chunk g to chunk `to` on another
    rank takes (plan.py: its latency and bytes over the link it crosses). The receiver
    starts once the message has arrived, and the sender's next operation waits for its
    sends too, as run() completes each exchange, sends included, before the next round;
    only a zero-bubble W, which runs while the messages travel, does not wait. `events`:
    replay()'s of these orders, when the same orders are timed at many costs."""
    starts, _, _ = run_events(events or replay(orders, p, v, vee, overlap), p, cost or (lambda _r, _kind, _c: 1.0 / v),
                              transfer)
    for row in starts:
        row.sort(key=lambda entry: entry[0])
    return starts


def run_events(events, p, cost, transfer=None, record=True):
    """replay()'s events timed (simulate): per rank the (start, op) of each operation in the
    order it ran (if `record`), when the rank's last operation ended, and when its last send
    arrived."""
    done, clock, sending, starts = [0.0] * len(events), [0.0] * p, [0.0] * p, [[] for _ in range(p)]
    for e, (r, forwards, backwards, wanted, waits, sends) in enumerate(events):
        start = clock[r]
        for j, g, to, elsewhere in wanted:  # once what it waits for has arrived
            start = max(start, done[j] + transfer(g, to) if transfer and elsewhere else done[j])
        if waits:  # and its own sends (07 completes each exchange before the next round)
            start = max(start, sending[r])
        if record:
            starts[r] += [(start, op) for op in forwards]
        offset = 0.0
        for op in backwards:  # a backward and the Ws riding with it, one after the other
            if record:
                starts[r].append((start + offset, op))
            offset += cost(r, op[0], op[2])
        clock[r] = done[e] = end = start + max(sum(cost(r, kind, c) for kind, _, c in forwards), offset)
        for g, to in sends if transfer else ():
            sending[r] = max(sending[r], end + transfer(g, to))
    return starts, clock, sending


def rank_events(args, p, m):
    """(the events, v, vee) of every rank running its rounds (run_schedule) as 07 runs them,
    one operation after another (DualPipeV's pairs in order): replay()'s, for rank_finishes."""
    every, v, vee, split = run_schedule(args, p, m)
    orders = [[action for actions in rounds for action in unit_actions(actions, split)] for rounds in every]
    return replay(orders, p, v, vee), v, vee


def rank_finishes(args, p, m, cost, transfer=None, events=None):
    """When each rank finishes its step, every rank running its rounds as 07 runs them
    (rank_events), each operation taking cost(rank, kind, chunk) (kind F, B, or I and W in a
    split backward), each message between ranks transfer(g, to) (simulate): the rank's last
    operation's end, or its last send's arrival. plan.py's time, rank by rank; `events`:
    rank_events(args, p, m), when one schedule is timed at many costs."""
    events, v, vee = events or rank_events(args, p, m)
    _, ends, arrived = run_events(events, p, cost, transfer, record=False)  # (one op at a time: the last ends last)
    return [max(end, last) for end, last in zip(ends, arrived)]


def step_length(args, p, m, cost, transfer=None):
    """The step's length (rank_finishes): the slowest rank's finish."""
    return max(rank_finishes(args, p, m, cost, transfer))


def draw(starts, p, v, overlap=None):
    """An ASCII timeline, one row per stage, one cell per F, B (or W) of one chunk,
    labelled with its micro-batch; '.' is the bubble. A forward overlapped with a backward
    (overlaps(): DualPipeV) is drawn in a second row under its stage's, in the cell where
    the backward above it starts: the two share that time. Returns (text, bubble fraction:
    the idle share of the stages' rows)."""
    hidden = [set(row) for row in overlap] if overlap else [set()] * p
    width = round(max(s for row in starts for s, _ in row) * v) + 1
    label = lambda kind, i, c: f"{kind}{i}" + ("" if v == 1 else "abcdefghijklmnop"[c])  # noqa: E731
    cell = 1 + max(len(label(*op)) for row in starts for _, op in row)
    rows, busy = [], 0
    for r in range(p):
        cells, under = [" " * (cell - 1) + "."] * width, [" " * cell] * width
        for start, op in starts[r]:
            lane = under if op in hidden[r] else cells
            lane[round(start * v)] = f"{label(*op):>{cell}}"
            busy += op not in hidden[r]
        rows.append(f"  stage {r} " + "".join(cells))
        if hidden[r]:
            rows.append("  with".ljust(len(f"  stage {r} ")) + "".join(under).rstrip())
    return "\n".join(rows), 1 - busy / (p * width)


def describe(args, config, p, v, m):
    """The layout, for the run's first log line."""
    layers = "/".join(str(n) for _, n in chunk_layers(config.n_layer, p * v))
    return (f"{p} pipeline stages x {v} chunk(s) of {layers} layer(s), schedule {args.schedule}, "
            f"{m} micro-batches of {args.micro_batch_size}")


def timeline(rounds_by_rank, p, v, vee, split, overlapped=True):
    """Every rank's rounds replayed at unit cost (simulate) and drawn (draw): (text, drawn
    bubble, starts, overlap). `overlapped`: DualPipeV's pairs take max(F, B) (overlaps());
    False: F + B, one after the other, as 07 runs them."""
    units = [[tuple(unit_actions(actions, split)) for actions in rounds] for rounds in rounds_by_rank]
    orders = [[action for actions in rounds for action in actions] for rounds in units]
    overlap = overlaps(units, vee) if overlapped else None
    starts = simulate(orders, p, v, vee, overlap)
    return (*draw(starts, p, v, overlap), starts, overlap)


def timeline_text(args, p, m):
    """The run's schedule drawn, with its bubble drawn and in theory, and where pairs
    overlap, the bubble with each pair run in order: (text, drawn bubble)."""
    every, v, vee, split = run_schedule(args, p, m)
    text, bubble, _, overlap = timeline(every, p, v, vee, split)
    theory = bubble_theory(args.schedule, p, m, v)  # None for a user's table
    pairs = any(overlap)
    text = ("schedule (unit-cost replay of the order each stage runs; '.' = idle"
            + ("; 'with': a forward overlapped with the backward above it, the pair taking max(F, B)" if pairs else "")
            + f"):\n{text}\nbubble: {bubble:.3f} drawn"
            + (f", {theory:.3f} in theory ({bubble_formula(args.schedule, v)})" if theory is not None else ""))
    if pairs:  # what 07 runs (one stream, on any device), and so what --measure_bubble measures
        in_order = timeline(every, p, v, vee, split, overlapped=False)[1]
        text += (f"; {in_order:.3f} with each pair run in order (F + B), as 07 runs it and --measure_bubble sees"
                 + (": ZB-V's (p-1)/(6m+p-1)" if args.schedule == "dualpipev" else ""))
    return text, bubble


def log_in_flight(run, step, env, in_flight):
    """The activations this stage held at once in the first step, beside costs()' count."""
    if step == run.start_step and run.cost:
        run.log(f"activations in flight on stage {env.rank}: at most {in_flight} micro-batch chunk(s) "
                f"(theory {run.cost['in_flight']})")


def log_timeline(run, args, p, m):
    """Log the schedule every stage runs as a unit-cost timeline; returns its drawn bubble."""
    text, bubble = timeline_text(args, p, m)
    run.log(text)
    return bubble


def timed_order(rounds):
    """The actions of `rounds` in the order Pipeline.run times them (one span each): in each
    round its forwards and backwards as listed, then its W, which run while the round's
    messages travel. A whole B of a split schedule is one span (its W runs inside it)."""
    return [a for actions in rounds for a in sorted(actions, key=lambda a: a[0] == "W")]


def timeline_path(metrics, rank):
    """--measure_bubble's timeline of rank `rank`, next to the --metrics file."""
    return f"{os.path.splitext(metrics)[0]}.timeline.rank{rank}.json"


def write_timeline(args, env, step, rounds, pipeline):
    """--measure_bubble with --metrics: this rank's ops of the logged step, each with its start
    and end in seconds from the step's first mark (Pipeline.run's `whole`), written by every
    rank to timeline_path() (the last logged step's; plot.py --measured draws them under the
    simulated step). Read after the step, as busy_fraction is; returns the file's path."""
    if not getattr(args, "metrics", None):  # (common's plain Run has no --metrics)
        return None
    spans, (start, end) = pipeline.spans, pipeline.whole
    order = timed_order(rounds)
    if len(spans) != len(order):
        raise RuntimeError(f"--measure_bubble: {len(spans)} spans timed for {len(order)} actions")

    def seconds(mark):  # from the step's first mark: host clock on CPU, device events elsewhere
        return mark - start if isinstance(mark, float) else start.elapsed_time(mark) / 1e3
    if not isinstance(end, float):
        end.synchronize()  # the step's last event, so every earlier one has happened
    row = {"rank": env.rank, "world_size": pipeline.p, "step": step, "schedule": args.schedule,
           "micro_batches": sum(kind == "F" and c == 0 for kind, _, c in order), "virtual_stages": pipeline.v,
           "device": env.device.type, "step_s": seconds(end),
           "ops": [{"op": kind, "micro_batch": i, "chunk": c, "start": seconds(b), "end": seconds(e)}
                   for (kind, i, c), (b, e) in zip(order, spans)]}
    path = timeline_path(args.metrics, env.rank)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(row, f)
        os.replace(path + ".tmp", path)
    except OSError as e:  # a full disk: the guard stops the run before the next update, on every rank
        from infra.metrics import WRITE_FAILURES
        WRITE_FAILURES.append(f"--measure_bubble: cannot write {path}: {e.strerror or e}")
    return path


DRY_RUN_DRAWN = 16  # the dry run draws the timeline up to this many micro-batch chunks (the run's log always)


def plan(args, p, v, m):
    """--dry_run: the layout, the schedule's bubble and every stage's layers, model state,
    traffic and activations in flight, and the timeline drawn while it is a screen wide
    (the lines Run.dry_run prints above stage 0's costs)."""
    from infra.formulas import format_bytes
    config = model_config(args, Data.vocab_size_of(args.data))
    check_layout(args, config, p)
    # the activation bytes are not in these lines: any dtype gives the same stage lines
    stages = [costs(args, config, p, torch.float32, rank) for rank in range(p)]
    layout, vee = chunk_layers(config.n_layer, p * v), chunks_per_rank(args)[1]
    held = [[chunk_stage(p, r, c, vee) for c in range(v)] for r in range(p)]  # every rank's global chunks
    return ([f"layout: {p} stages x {v} chunk(s), schedule {args.schedule}, {m} micro-batches of "
             f"{args.micro_batch_size}; bubble {bubble_formula(args.schedule, v)} = "
             f"{bubble_theory(args.schedule, p, m, v) or 0:.3f}"]
            + [f"  stage {r} (node {r // args.ranks_per_node}): layers "
               f"{', '.join(f'{layout[g][0]}-{sum(layout[g]) - 1}' for g in held[r])}, holds "
               f"{format_bytes(sum(val for _, val in s['held'].values()))}, "
               f"{format_bytes(sum(val for _, val in s['sent'].values()))} sent+received per step, "
               f"{s['in_flight']} micro-batch(es) of activations in flight"
               for r, s in enumerate(stages)]
            + (timeline_text(args, p, m)[0].split("\n") if m * v <= DRY_RUN_DRAWN else [])
            + ["(below: stage 0)"])


if __name__ == "__main__":
    main()
