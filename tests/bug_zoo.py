"""The bug zoo: real distributed-training bugs, each a small edit of ONE numbered script, and
the check that must catch it (docs/bugs.md is the page for readers; tests/test_bug_zoo.py
applies every bug to a temporary copy and runs its check).

A bug is never shipped in the scripts: its `edits` are (old, new) pairs of exact text,
applied to a copy, and `old` must occur exactly once in today's script, so that a script
that drifts makes its bug fail loudly instead of silently testing nothing.

    copy of 04_zero.py        old: "handle = dist.reduce_scatter_tensor(shard, flat, ...)"
                              new: "handle = dist.all_reduce(flat, ...) ..."
          |
          v  launched at the smallest layout that shows the bug (ranks, flags)
    the check it names    ->  must FAIL, printing `first_line`

The checks (what each prints first when it fires):

    oracle       01_single_gpu.py's per-step losses, fp32, dropout 0 (tests/harness.py's
                 assert_losses_match): "losses differ from 01"
    resume       a checkpoint the bug wrote, resumed by 01 at one rank: the oracle again, on
                 the resumed steps
    ledger       measured bytes against the script's costs() (infra.ledger.print_ledger), on every
                 rank: "ledger mismatch on rank R: ..."; the losses stay 01's
    nccl         the run's posting order recorded and replayed under NCCL's rules
                 (tests/nccl_replay.py); gloo ran it: "DEADLOCK under NCCL's semantics"
    hang         the collective a rank was in when the job failed or timed out (the ledger's
                 CommLedger.report): "rank R was in OP #N on group G, step S, PHASE when it failed"
    checksum     a damaged checkpoint refused on resume (infra.checkpoint_format.Checkpoint.verify)
    refusal      one line and exit 2 on every rank (common.check)
    streams      each rank's dropout generator state at every draw (a probe run before the
                 script): inside TP's sharded heads the ranks' streams must differ, on the
                 replicated residual stream agree: "rank 0 and rank 1 drew attention dropout
                 #1 from the same stream"
    crash        an exception that ends the job, its message shown (infra.launch's abort hook): an
                 error in backward, or 07's own replay of its schedule (simulate()) refusing it

`perturb`: the run is made irregular the way real ranks are (tests/test_bug_zoo.py's
PERTURBATIONS: e.g. one rank's gradients ready in another order), since a CPU run keeps every
rank alike; the script without the bug is run the same way and must pass.

`gradient`: what the gradient oracle (--check_gradients against 01's step-0 gradient, clipping
off, infra/numerics.py) says of the bug: CAUGHT (tests/test_grad_oracle.py runs it and expects
exit 4), or why it cannot: the bug does not change the gradient (a logged loss, clipping's norm,
a hang, a byte count). The column beside the check in docs/bugs.md.

`slips`: the bug passes every check we have; the entry says which check must grow, and the
test expects it to slip (strict xfail: the day a check catches it, the test says so)."""

from dataclasses import dataclass

ORACLE, RESUME, LEDGER, NCCL, HANG, CHECKSUM, REFUSAL, CRASH, STREAMS = (
    "oracle", "resume", "ledger", "nccl", "hang", "checksum", "refusal", "crash", "streams")

MOE = ("--n_expert", "4", "--top_k", "2")

# the gradient oracle's verdicts (Bug.gradient): caught, or why the raw gradient is right
CAUGHT = "caught"
NOT_GRADIENT = {
    "clip": "no: the raw gradient is right; only clipping's norm is wrong (the loss oracle's norm comparison sees it)",
    "logged": "no: the gradient is right; only the logged loss is wrong",
    "traffic": "no: the gradient is right; the bytes, the posting order or the collectives are wrong",
    "checkpoint": "no: the gradient is right; what the checkpoint holds is wrong",
    "stream": "n/a: dropout (the oracle runs at dropout 0)",
    "crash": "n/a: the run stops before a gradient exists",
}


@dataclass(frozen=True)
class Bug:
    name: str
    script: str
    edits: tuple  # ((old, new), ...): exact text, each old found exactly once
    origin: str  # where the field met it: an anchor's issue, a paper, our history
    symptom: str  # what a user would see
    check: str  # which of our checks must catch it (above)
    first_line: str  # what that check prints first (a prefix or a telling part of it)
    ranks: int = 2
    flags: tuple = ()  # the smallest layout that shows it (added to the test's base flags)
    slips: str = ""  # set when no check catches it yet: which must grow
    damage: str = ""  # not an edit of the script but of what it wrote (a checkpoint file)
    perturb: str = ""  # run under a perturbation that makes the ranks differ (test_bug_zoo.PERTURBATIONS)
    gradient: str = ""  # the gradient oracle's verdict: CAUGHT, or a key of NOT_GRADIENT


BUGS = [
    # ------------------------------------------------------------------ 03: data parallel
    Bug("ddp_bucket_completion_order", "03_ddp.py",
        (("while self.next_to_launch < len(self.buffers) and self.waiting[self.next_to_launch] == 0:\n"
          "            self._launch(self.next_to_launch)\n"
          "            self.next_to_launch += 1",
          "if self.waiting[self.bucket_of[param]] == 0:  # launch each bucket the moment it is full\n"
          "            self._launch(self.bucket_of[param])\n"
          "            self.next_to_launch += 1"),),
        origin="Li et al. 2020 (PyTorch DDP, VLDB) §3.2.3: buckets must be all-reduced in the same order on "
               "every rank; the ready order differs across ranks and the collectives mismatch (wrong sums or a hang)",
        symptom="nothing in a plain CPU run (every rank readies its gradients in the same order); once rank 1 "
                "readies them in another order, its k-th all-reduce is another bucket than rank 0's: gloo "
                "fails or sums the wrong buckets, NCCL sums them or hangs",
        check=NCCL, gradient="traffic", first_line="mismatch: collective",
        flags=("--bucket_mb", "0.01"), perturb="grad_ready_order_reversed_on_rank_1"),
    Bug("ddp_grad_accum_not_averaged", "03_ddp.py",
        (("(loss if tree else loss / accum_steps).backward()", "(loss if tree else loss).backward()"),),
        origin="nanoGPT train.py scales the loss by 1/gradient_accumulation_steps; forgetting it is the "
               "classic accumulation bug (Hugging Face transformers' accumulation fix, Oct 2024, is its cousin)",
        symptom="gradients accum_steps times too large, which AdamW divides away (m/sqrt(v) does not see a "
                "constant scale): the losses change only where clipping engages for one and not the other "
                "(at the default --grad_clip 1.0 both clip, to the same update); the gradient norm the "
                "oracle compares is accum_steps times 01's from step 0",
        check=ORACLE, gradient=CAUGHT, first_line="gradient norms differ from 01"),
    Bug("ddp_unused_parameter", "03_ddp.py",
        (("model = build_model(config, args.seed, env.device, recompute=args.recompute)",
          "model = build_model(config, args.seed, env.device, recompute=args.recompute)\n"
          "    model.transformer.h[0].attn.register_parameter(\"gate\", torch.nn.Parameter(torch.zeros(1)))  # never used"),),
        origin="torch DDP's 'Expected to have finished reduction in the prior iteration' "
               "(find_unused_parameters); a parameter that never receives its gradient",
        symptom="DDP hangs waiting for a bucket that never fills; here, one line",
        check=REFUSAL, gradient="crash", first_line="error: a gradient never arrived (a parameter unused in forward?)"),
    Bug("ddp_rank_skips_collective", "03_ddp.py",
        (("mean_over_replicas(loss_sum, dp_group)  # the global batch's mean loss, for logging",
          "if env.master:  # only rank 0 logs, so only rank 0 averages the loss\n"
          "                mean_over_replicas(loss_sum, dp_group)"),),
        origin="a collective inside `if rank == 0:` (logging): torch forums' most common NCCL hang; "
               "NVIDIA/Megatron-LM and DeepSpeed issues report it as a watchdog timeout",
        symptom="the job hangs at the end of step 0 until the collective timeout",
        check=HANG, gradient="traffic", first_line="was in all_reduce #", flags=("--timeout", "1")),

    # ------------------------------------------------------------------ 04: ZeRO
    Bug("zero_norm_on_shard", "04_zero.py",
        (("dist.all_reduce(squares, group=self.group)", "dist.all_reduce(squares.clone(), group=self.group)"),),
        origin="microsoft/DeepSpeed: the gradient norm of a partitioned optimizer taken on the local "
               "partition (its clip_grad_norm_ and get_global_norm fixes); the reduction ran on a copy",
        symptom="each rank clips its shard with its own shard's norm; AdamW divides most of that away, so "
                "the loss moves late and little (by 2.4e-5 at the default clipping, just over the oracle's "
                "tolerance; by 3e-4 at --grad_clip 2.0); the norm clipping reports is the shard's, not 01's, "
                "from step 0, which the oracle's norm comparison sees even where the losses would not",
        check=ORACLE, gradient="clip", first_line="losses differ from 01", flags=("--stage", "2")),
    Bug("zero2_all_reduce_not_reduce_scatter", "04_zero.py",
        (("handle = dist.reduce_scatter_tensor(shard, flat, group=self.group, async_op=True)",
          "handle = dist.all_reduce(flat, group=self.group, async_op=True)  # the whole gradient, then our slice\n"
          "            handle.wait()\n"
          "            shard.copy_(flat[unit.lo:unit.hi])"),),
        origin="Rajbhandari et al. 2020 (ZeRO) §5: stage 2 reduce-scatters; an all-reduce is correct but "
               "sends twice the bytes and holds the whole gradient",
        symptom="right losses; twice the gradient traffic on the wire",
        check=LEDGER, gradient="traffic",
        first_line="ledger mismatch on rank 0: sent all_reduce", flags=("--stage", "2")),
    Bug("zero_uneven_last_batch", "04_zero.py",
        (('x, y = data.batch("train", step, args.global_batch_size, env.rank, env.world_size)',
          'x, y = data.batch("train", step, args.global_batch_size, env.rank, env.world_size)\n'
          "        if step == args.max_iters - 1:  # the data's last batch is short: the last rank gets what is left\n"
          "            keep = len(x) - args.micro_batch_size * (env.rank == env.world_size - 1)\n"
          "            x, y = x[:keep], y[:keep]"),
         ("        with run.meter:\n            for micro in range(accum_steps):",
          "        with run.meter:\n            for micro in range(math.ceil(len(x) / args.micro_batch_size)):")),
        origin="microsoft/DeepSpeed#5394: ZeRO hangs when the last batch is uneven across ranks",
        symptom="the last step hangs: one rank posts a reduce-scatter the other never joins",
        check=HANG, gradient="traffic",
        first_line="was in reduce_scatter_tensor #", flags=("--stage", "2", "--timeout", "3")),

    # ------------------------------------------------------------------ 05: FSDP
    Bug("fsdp_reshard_before_backward", "05_fsdp.py",
        (("out.register_hook(lambda grad, i=i: self.before_backward(i))",
          "pass  # (backward finds the block as forward left it)"),),
        origin="pytorch/pytorch FSDP: a unit resharded after forward and not unsharded before its "
               "backward (the pre-backward hook missing, e.g. an output that bypasses it)",
        symptom="backward meets freed parameters and stops with a shape error",
        check=CRASH, gradient="crash", first_line="RuntimeError"),
    Bug("fsdp_logged_loss_not_averaged_over_micro_batches", "05_fsdp.py",
        (("loss_sum /= accum_steps * env.world_size", "loss_sum /= env.world_size"),),
        origin="NVIDIA/Megatron-LM#1736 (users asking whether a loss gap is drift or a bug); a logged loss "
               "summed over micro-batches instead of averaged",
        symptom="the logged loss is accum_steps times too large (training itself is right)",
        check=ORACLE, gradient="logged", first_line="losses differ from 01"),

    # ------------------------------------------------------------------ 06: tensor parallel
    Bug("tp_vocab_not_divisible", "06_tensor_parallel.py",
        (("shape[split[1]] = math.ceil(shape[split[1]] / tp_size)",
          "shape[split[1]] = shape[split[1]] // tp_size  # (65 tokens over 2 ranks: 32 each)"),),
        origin="NVIDIA/Megatron-LM#1754: a vocabulary not divisible by TP gives a loss about 50% off",
        symptom="the last V mod T tokens belong to no rank: their logits are missing, the loss is wrong",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01"),
    Bug("tp_gathered_logits_into_vocab_parallel_loss", "06_tensor_parallel.py",
        (("return VocabParallelCrossEntropy.apply(logits.view(-1, logits.size(-1)), targets.view(-1),\n"
          "                                               self.tp_rank * self.vocab_local,",
          "parts = [torch.empty_like(logits) for _ in range(self.tp_size)]\n"
          "        dist.all_gather(parts, logits.contiguous(), group=self.group)  # the whole vocabulary, as picotron\n"
          "        parts[self.tp_rank] = logits  # our slice keeps its gradient\n"
          "        logits = torch.cat(parts, dim=-1)\n"
          "        return VocabParallelCrossEntropy.apply(logits.view(-1, logits.size(-1)), targets.view(-1),\n"
          "                                               0,"),),
        origin="NVIDIA/NeMo#7452: gathered logits fed to the vocab-parallel cross-entropy, loss off by log(TP)",
        symptom="every rank holds the whole vocabulary, so the all-reduces count it T times: log T too much "
                "from the denominator, and here the target's logit T times over",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01"),
    Bug("sp_layernorm_grads_not_all_reduced", "06_tensor_parallel.py",
        (("all_reduce_sequence_parallel_grads(model, tp_group)", "pass"),),
        origin="Korthikanti et al. 2022 §4.2.2; NVIDIA/Megatron-LM's allreduce_sequence_parallel_grads "
               "(LayerNorm weights under sequence parallelism see one sequence shard per rank)",
        symptom="LayerNorm (and bias, position embedding) gradients are partial: the replicas drift apart",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01", flags=("--sequence_parallel",)),
    Bug("tp_dropout_not_forked", "06_tensor_parallel.py",
        (("with self.rng.sharded():  # attention dropout acts inside this rank's heads",
          "if True:  # (attention dropout from the stream every rank shares)"),),
        origin="Shoeybi et al. 2019 §3 / Megatron's model-parallel RNG tracker: dropout inside the "
               "sharded heads must draw a different mask on every rank",
        symptom="every rank's heads drop the same positions: correlated masks, a silently worse regulariser; "
                "the oracle runs at dropout 0 and cannot see it",
        check=STREAMS, gradient="stream", first_line="rank 0 and rank 1 drew attention dropout #1 from the same stream",
        flags=("--dropout", "0.1", "--max_iters", "1")),
    Bug("tp_norm_counts_replicated_params_per_rank", "06_tensor_parallel.py",
        (("replicated += square", "sharded += square  # (every parameter summed over the group)"),),
        origin="NVIDIA/Megatron-LM's clip_grad_norm: replicated parameters counted once (not on every TP "
               "rank); the gradient norm taken as if every gradient were a shard",
        symptom="the norm counts LayerNorms and biases T times: clipping too strong",
        check=ORACLE, gradient="clip", first_line="losses differ from 01"),
    Bug("tp_checkpoint_wrong_box", "06_tensor_parallel.py",
        (("full, boxes = shard_boxes(name, p.shape, model.config.vocab_size, model.tp_size, model.tp_rank)\n"
          "        write = ",
          "full, boxes = shard_boxes(name, p.shape, model.config.vocab_size, model.tp_size, "
          "model.tp_size - 1 - model.tp_rank)\n        write = "),),
        origin="our history (issue 8, one checkpoint format for every layout): a piece written under "
               "another rank's box; the same layout reads it back as written and never notices",
        symptom="resuming at the same layout is fine; any other layout loads permuted weights",
        check=RESUME, gradient=CAUGHT,
        first_line="losses differ from 01", flags=("--max_iters", "2", "--ckpt_interval", "2")),

    # ------------------------------------------------------------------ 07: pipeline
    Bug("pp_interleaved_one_batch_per_operation", "07_pipeline.py",
        (("return (dist.batch_isend_irecv(ops) if ops else []), arriving",
          "return [r for op in ops for r in dist.batch_isend_irecv([op])], arriving  # each on its own"),),
        origin="our history (07's interleaved deadlock at m > p, tests/test_schedules.py); Megatron's "
               "send_forward_recv_backward batches exist for this reason",
        symptom="runs on gloo (it buffers sends); deadlocks on the first GPU run",
        check=NCCL, gradient="traffic", first_line="DEADLOCK under NCCL's semantics",
        flags=("--schedule", "interleaved", "--virtual_stages", "2", "--n_layer", "4")),
    Bug("pp_w_before_its_b", "07_pipeline.py",
        (('            rounds.append((("I", k, 0), ("W", w, 0)))\n            w += 1',
          '            w += 1\n            rounds.append((("I", k, 0), ("W", w, 0)))'),),
        origin="Qi et al. 2023 (zero bubble): W of a micro-batch needs the x and dy its I saved "
               "(the paper's B); an off-by-one schedules a W before its I",
        symptom="the W would find nothing to run on; 07 replays its schedule at unit cost before the "
                "first step (simulate(), to draw it) and stops there: the W waits for an I that comes later",
        check=CRASH, gradient="crash",
        first_line="uncaught AssertionError: the schedule deadlocks", flags=("--schedule", "zb")),
    Bug("pp_tied_embedding_not_synced", "07_pipeline.py",
        (("dist.all_reduce(weight.grad, group=run.groups)", "pass  # (each stage keeps its own wte)"),),
        origin="NVIDIA/Megatron-LM's embedding group (_allreduce_embedding_grads): the first stage's "
               "embedding and the last stage's tied head must get the same gradient",
        symptom="the two copies of wte drift apart from the first update",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01"),

    # ------------------------------------------------------------------ 09: context parallel
    Bug("cp_ring_lse_merged_in_wrong_order", "09_context_parallel.py",
        (("new_lse = torch.logaddexp(lse, block_lse)", "new_lse = lse.copy_(torch.logaddexp(lse, block_lse))"),),
        origin="Liu et al. 2023 (ring attention) / zhuzilin/ring-flash-attention: the running "
               "log-sum-exp updated before the old output is rescaled by it",
        symptom="attention outputs of every ring step but the first are mis-weighted",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01", flags=("--cp", "2", "--cp_impl", "ring")),
    Bug("cp_zigzag_chunks_assigned_plainly", "09_context_parallel.py",
        (("return rank, 2 * C - 1 - rank", "return 2 * rank, 2 * rank + 1  # contiguous"),),
        origin="Megatron-core / zhuzilin's zigzag ring attention: rank r holds chunks r and 2C-1-r so "
               "that causal work is balanced; contiguous chunks load the last rank C times more",
        symptom="here the causal blocks assume zigzag, so the mask is wrong; with the mask fixed for "
                "contiguous chunks the losses would be right and only the last rank's time would show it",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01", flags=("--cp", "2", "--cp_impl", "ring")),

    Bug("cp_local_position_ids", "09_context_parallel.py",
        (("device_positions = positions.to(env.device)",
          "device_positions = torch.arange(len(positions), device=env.device)  # (positions of our own tokens)"),),
        origin="huggingface/transformers and Megatron-LM context-parallel reports: position ids must be "
               "the tokens' global positions, not 0..s/C-1 on every rank",
        symptom="every rank embeds its tokens as if they began the sequence: the loss is off from step 0",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01", flags=("--cp", "2", "--cp_impl", "ring")),
    Bug("cp_ulysses_heads_scattered_on_the_wrong_axis", "09_context_parallel.py",
        (("send = x.reshape(b, C, H // C, t, d).transpose(0, 1).contiguous()",
          "send = x.reshape(b, H // C, C, t, d).permute(2, 0, 1, 3, 4).contiguous()  # (head h to rank h mod C)"),),
        origin="Jacobs et al. 2023 (DeepSpeed-Ulysses): the all-to-all scatters heads and gathers the "
               "sequence; its scatter/gather indices (deepspeed.sequence.layer) are easy to get crosswise",
        symptom="heads come back to the wrong places: c_proj mixes other heads' outputs, the loss is off",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01", flags=("--cp", "2", "--cp_impl", "ulysses")),

    # ------------------------------------------------------------------ 10: expert parallel
    Bug("ep_expert_grads_not_reduced_over_replicas", "10_expert_parallel.py",
        (("if not expert or dp_size > 1:", "if not expert:"),),
        origin="microsoft/DeepSpeed MoE: expert gradients reduced over the expert-data-parallel group "
               "(expert_data_parallel_group); skipped, the replicas of an expert diverge",
        symptom="each replica of an expert trains on its own ranks' tokens only: the loss drifts",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01", flags=MOE + ("--ep", "1")),
    Bug("ep_split_sizes_not_exchanged", "10_expert_parallel.py",
        (("dist.all_to_all_single(received, counts, group=self.group)  # E int64 counts",
          "received.copy_(counts)  # (assumed: every rank routes as this one does)"),),
        origin="Lepikhin et al. 2020 (GShard) / Megatron-LM's token dispatcher: dropless all-to-all "
               "needs every rank's counts first",
        symptom="each rank posts an all-to-all whose sizes the others do not expect: an error or a hang",
        check=HANG, gradient="traffic",
        first_line="was in all_to_all_single #", flags=MOE + ("--ep", "2", "--timeout", "3")),
    Bug("ep_outputs_combined_expert_major", "10_expert_parallel.py",
        (("back = torch.cat([piece for row in zip(*outs_by_expert) for piece in row])",
          "back = torch.cat(outs)  # (expert-major, as the experts produced them)"),),
        origin="NVIDIA/Megatron-LM's token dispatcher (sort_chunks_by_idxs): the rows must go back "
               "source-major before the combine all-to-all",
        symptom="the sizes match, so nothing fails: tokens get other tokens' expert outputs",
        check=ORACLE, gradient=CAUGHT, first_line="losses differ from 01", flags=MOE + ("--ep", "2")),

    # ------------------------------------------------------------------ checkpoints
    Bug("ckpt_bit_flip", "01_single_gpu.py", (),
        origin="silent data corruption on disk or in a copy; torch.distributed.checkpoint and "
               "DeepSpeed have no checksum; ours is in metadata.json (issue: hostile cases)",
        symptom="a resumed run trains from a weight that changed after it was written",
        check=CHECKSUM, gradient="checkpoint", first_line="fails its checksum", ranks=1,
        damage="one bit of one float of transformer.h.0.mlp.c_fc.weight in rank0.pt flipped"),
]
