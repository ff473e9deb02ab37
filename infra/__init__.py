"""The run infrastructure: what makes a training script a reference rather than a loop. Its
`Run` extends common.py's plain one at the same calls (see common.Run's docstring), with the
command line of the infrastructure and its checks; start-up (the run's files checked and
out_dir locked, agreed by every rank; the fit check and --micro_batch_size auto); the guard
(a non-finite loss or gradient stops every rank before the update; SIGTERM, SIGUSR1 and
--time_limit stop after a checkpoint); the communication ledger and the activation meter,
printed once next to the script's costs(); metrics (JSONL, wandb), the dry run, the
rehearsal, and the checkpoint files.

A numbered script's only tie to this package is `from infra import Run`; its costs() and
checkpoint pieces import what they need from the modules below inside the function, so a copy
of the script with `from common import Run` and common.py alone imports and trains (copy
infra/ beside it too, and nothing is lost).

One module per concern. A module imports only modules below it in this list, and common.py
imports nothing from here (tests/test_package.py checks both from the source):

Layers, top first:
    run                 Run (the run protocol), the rehearsed rank's RehearsedRun, launch_for
    rehearsal           --rehearse: fake process group and tensors, stand-ins, record_posts
    replay              every rank's posting order by symmetry; the replay under NCCL's rules
    dry_run             --dry_run: the layout and one rank's costs, without launching
    checkpoint          save, resume (any layout), export (--export, --export_hf), --init_from; agreed by every rank
    numerics            --check_gradients: step 0's gradient against 01's, inside a derived bound
    stop                the Guard (non-finite, signals, --time_limit), HostSyncs
    metrics             Metrics (JSONL rows, over ranks, MFU), wandb, the node map
    start               agree and leave; the start-up checks of the run's files; the out_dir lock
    fit                 the fit check: need against room, the cheapest fix; groups warmed up
    hf                  Hugging Face GPT-2 in and out: config.json, safetensors by hand, Conv1D's layout
    checkpoint_format   pieces, the files and their metadata checks, reading any region
    activations         ActivationMeter, LiveStorage, the allocator's peak
    profiling           --profile: torch.profiler traces of the named steps, one per rank; CUDA memory snapshots
    ledger              CommLedger (bytes by operation and group), the Flight Recorder trail
    fake_host           HostTensor (GPTPAR_FAKE_HOST=1): host memory told apart on a CPU
    data_check          --data scanned once per job before the run
    formulas            formula(): one expression, the text and the number; the model's terms, Muon's matrices
    cli                 the infrastructure's flags and their checks
    launch              common.setup hardened: another job's store, one line when a rank cannot join, the abort hook

docs/design.md draws the same picture.

A script imports this package before torch: a Ctrl-C while torch and the rest are imported,
or before the run's own handlers take over (the rehearsal's, the start-up checks', the guard's),
is one line and exit 130, not KeyboardInterrupt's traceback (quiet_start_up, first here)."""


def quiet_start_up():
    """Ctrl-C (SIGINT) during a numbered script's start-up: one line from rank 0 (by the
    launcher's variables; nothing is up yet to ask), the out_dir lock released if it was
    taken, exit 130 on every rank at once. Only where the script is the program (its
    __main__), never in a process that imports the package (a test, a notebook), and only
    over Python's own handler."""
    import os
    import signal
    import sys
    program = os.path.basename(getattr(sys.modules.get("__main__"), "__file__", None) or "")
    if not program[:2].isdigit() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def interrupted(signum, frame):
        rank = next((os.environ[v] for v in ("RANK", "PMI_RANK", "PALS_RANKID", "OMPI_COMM_WORLD_RANK",
                                             "SLURM_PROCID") if os.environ.get(v)), "0")
        if rank == "0":
            try:  # straight to the descriptor: the signal may have come in the middle of a print
                os.write(2, b"error: interrupted (SIGINT) during start-up: nothing was started\n")
            except OSError:
                pass
        try:  # the out_dir lock, if the start-up checks took it (infra.start may be half imported)
            sys.modules["infra.start"].release_out_dir()
        except Exception:  # noqa: BLE001 (nothing to release)
            pass
        os._exit(130)  # at once: no rank waits in a collective for one that is leaving
    signal.signal(signal.SIGINT, interrupted)


quiet_start_up()

from infra.run import Run  # noqa: E402, F401  (the scripts' one line: `from infra import Run`)
