# Shared by the job scripts (sourced, not run): find the repository, make the logs
# directory, and check that the requested parallel layout fits the allocation.

# The repository root: the directory the job was submitted from (PBS and Slurm copy the job
# script elsewhere, so its own location cannot be used). Submit from the repository root.
gpt_root() {
    local dir=${PBS_O_WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}
    if [ ! -f "$dir/common.py" ]; then
        echo "error: submit from the repository root (no common.py in $dir)" >&2
        exit 2
    fi
    echo "$dir"
}

# check_layout RANKS_PER_NODE WORLD SCRIPT FLAGS...: the script exists, and --tp divides the
# ranks of a node (a tensor-parallel group must stay inside one node's fast links) and
# --tp x --pp divides the world size (the rest is data parallel).
check_layout() {
    local per_node=$1 world=$2 script=$3
    shift 3
    if [ ! -f "$script" ]; then
        echo "error: no training script $script" >&2
        exit 2
    fi
    case $world in
        ''|*[!0-9]*|0) echo "error: the rank count must be a positive whole number, got '$world'" >&2; exit 2 ;;
    esac
    local tp=1 pp=1
    while [ $# -gt 0 ]; do
        case $1 in
            --tp) tp=$2; shift ;;
            --tp=*) tp=${1#--tp=} ;;
            --pp) pp=$2; shift ;;
            --pp=*) pp=${1#--pp=} ;;
        esac
        shift
    done
    local value
    for value in "$tp" "$pp"; do
        case $value in
            ''|*[!0-9]*|0) echo "error: --tp and --pp must be positive whole numbers, got '$value'" >&2; exit 2 ;;
        esac
    done
    if [ $((per_node % tp)) -ne 0 ]; then
        echo "error: --tp $tp does not divide the $per_node ranks per node: a tensor-parallel group must fit in one node" >&2
        exit 2
    fi
    if [ $((world % (tp * pp))) -ne 0 ]; then
        echo "error: --tp $tp x --pp $pp = $((tp * pp)) does not divide the world size $world" >&2
        exit 2
    fi
    echo "layout: $world ranks = $((world / (tp * pp))) data-parallel x $pp pipeline x $tp tensor-parallel"
}

# Logs go to logs/<job name>-<job id>.log under the repository root.
gpt_log() {
    mkdir -p "$1/logs"
    echo "$1/logs/$2.log"
}

# run_logged LOG COMMAND...: run COMMAND (the launcher and its ranks) with its output and
# errors copied to this job's own output and to LOG, and return COMMAND's exit status.
#
# Why not just `COMMAND 2>&1 | tee LOG`: at walltime PBS and Slurm send SIGTERM to every
# process of the job, and a terminal's Ctrl-C sends SIGINT to the whole foreground process
# group, so tee and this shell get the signal too. A tee killed by it closes the pipe: the
# launcher's and the ranks' next line fails (EPIPE) while they are still writing the
# checkpoint; and a job script killed by it ends the job, which PBS and Slurm then tear down.
# So here only the ranks act on a stop signal (they finish the step, write a checkpoint and
# exit 0; mpiexec and srun forward the signal to them as well, and keep relaying their output
# until they exit):
#   - tee ignores the stop signals, so it ends only at the end of its input, after the
#     launcher's last line; with -p it also outlives a reader that goes away (`| head`, a
#     closed terminal): it stops copying to that reader and goes on writing LOG;
#   - this shell traps them: a trapped signal waits for the pipeline to end (a signal
#     ignored with `trap ''` would be ignored by the launcher and the ranks too).
run_logged() {
    local log=$1 status=0
    shift
    local tee=(tee -p)
    tee -p < /dev/null > /dev/null 2>&1 || tee=(tee)  # BSD and macOS tee have no -p
    trap : TERM INT USR1 HUP
    "$@" 2>&1 | ( trap '' TERM INT USR1 HUP; exec "${tee[@]}" "$log" ) || status=${PIPESTATUS[0]}
    trap - TERM INT USR1 HUP
    return "$status"
}

# Sources of the environment lines in this file and in the job scripts that source it (each
# line names its source in brackets; tests/test_jobs.py checks that every one does):
#   [torch-fr]  https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html, and
#               torch 2.13.0's own sources (c10d/FlightRecorder.hpp reads TORCH_FR_BUFFER_SIZE, then
#               TORCH_NCCL_TRACE_BUFFER_SIZE, default 2000; ProcessGroupNCCL.hpp: TORCH_NCCL_DUMP_ON_TIMEOUT;
#               libtorch reads TORCH_FR_DUMP_TEMP_FILE, then TORCH_NCCL_DEBUG_INFO_TEMP_FILE), read 2026-11-25
#   [here]      this project's own choice, explained beside the line and in jobs/README.md (2026-11-25)
#   [nccl-env]  https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-runtime-connect
#               (NCCL_RUNTIME_CONNECT, since NCCL 2.22, default 1: "dynamically connect peers during
#               runtime ... instead of init stage"; RCCL, NCCL's fork, reads the same name; read 2026-11-29)

# Compilation caches on node-local storage: never on the shared home file system.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/${USER:-$(id -un)}/torchinductor}  # [here]
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/${USER:-$(id -un)}/triton}  # [here]

# flight_recorder FOLDER: when a collective hangs on NCCL, RCCL or XCCL, torch's watchdog ends
# the job from C++ at --timeout and the ranks' Python never says where they were. Its Flight
# Recorder keeps the last collectives of every rank in a ring buffer; these variables make the
# watchdog write every rank's buffer to FOLDER (the shared file system: NCCL's default,
# /tmp/nccl_trace_rank_, is node-local and gone with the job) before it ends the job. Beside
# the dumps the ledger leaves each rank's step and phase (infra/ledger.py), and
#   python plot.py --hangs FOLDER
# says where every rank waits (docs/failures.md, "Hangs on GPUs").
# Outside a scheduler FOLDER ends in "-local" or "-" (no job id): each run gets its own, named
# by its start time and process id, so a second run's dumps never sit beside the first's.
flight_recorder() {
    local folder=$1
    case $folder in *-local|*-) folder=${folder%-}${folder:+-}$(date +%Y%m%dT%H%M%S)-$$ ;; esac
    mkdir -p "$folder"
    export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}}  # [torch-fr] entries kept per rank (0 turns the recorder off)
    export TORCH_NCCL_DUMP_ON_TIMEOUT=1    # [torch-fr] dump every rank's buffer when a collective times out
    export TORCH_FR_DUMP_TEMP_FILE=$folder/rank_  # [torch-fr] the dumps: FOLDER/rank_<rank>, on the shared file system
    # and the same under the names torch read before the rename (a facility's older build would
    # otherwise keep 2000 entries in /tmp/nccl_trace_rank_, node-local, where the log does not say)
    export TORCH_NCCL_TRACE_BUFFER_SIZE=$TORCH_FR_BUFFER_SIZE  # [torch-fr] TORCH_FR_BUFFER_SIZE's older name
    export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$TORCH_FR_DUMP_TEMP_FILE  # [torch-fr] TORCH_FR_DUMP_TEMP_FILE's older name
    echo "a hang leaves its Flight Recorder dumps in $folder: python plot.py --hangs $folder"
}

# has_checkpoint OUT_DIR: OUT_DIR holds a committed checkpoint to resume from. The one place
# that knows the checkpoint's file names: every script writes OUT_DIR/ckpt/step_N/, committed
# by its metadata.json (written last; a set without it is an interrupted write).
has_checkpoint() {
    compgen -G "$1/ckpt/step_*/metadata.json" > /dev/null
}

# run_args SCRIPT FLAGS...: the command line to launch, in the array RUN_ARGS: the one given,
# plus --resume when its --out_dir (default: out) already holds a checkpoint, so that
# resubmitting the same job continues the run (not with --overwrite, which asks to replace that
# run: the scripts refuse the two together); plus --time_limit TIME_LIMIT_MINUTES when that is
# set and the flags do not give one. 02_collectives.py trains nothing: it gets neither.
run_args() {
    RUN_ARGS=("$@")
    case ${1##*/} in 02_collectives.py) return ;; esac  # the doctor and the bench keep no checkpoint
    local out=out resume=0 limit=0 prev="" arg
    for arg in "$@"; do
        [ "$prev" != --out_dir ] || out=$arg
        case $arg in
            --out_dir=*) out=${arg#--out_dir=} ;;
            --resume|--overwrite) resume=1 ;;  # the flags already say what to do with a checkpoint there
            --time_limit|--time_limit=*) limit=1 ;;
        esac
        prev=$arg
    done
    if [ "$resume" = 0 ] && has_checkpoint "$out"; then
        RUN_ARGS+=(--resume)
        echo "resuming: $out holds a checkpoint"
    fi
    if [ "$limit" = 0 ] && [ -n "${TIME_LIMIT_MINUTES:-}" ]; then
        RUN_ARGS+=(--time_limit "$TIME_LIMIT_MINUTES")
    fi
}

# pbs_time_limit: the minutes a run may use under PBS, which sends no warning before the
# walltime: the job's walltime (qstat) less the time this script has run and a margin for
# the launch and the last checkpoint (WALLTIME_MARGIN_MIN, default 5). Prints nothing when
# the walltime is unknown.
pbs_time_limit() {
    local wall seconds
    wall=$(qstat -f "${PBS_JOBID:-}" 2> /dev/null | sed -n 's/^ *Resource_List.walltime = //p' | head -n 1) || true
    [ -n "$wall" ] || return 0
    seconds=$(echo "$wall" | awk -F: '{ s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; print s }')
    local minutes=$(( (seconds - SECONDS) / 60 - ${WALLTIME_MARGIN_MIN:-5} ))
    echo $(( minutes > 1 ? minutes : 1 ))
}

# find_lib_dir GLOB: the first directory on LD_LIBRARY_PATH holding a file that matches GLOB
# (e.g. 'librccl-net*.so'); prints it, or fails when there is none. Used to check that a
# network plugin the facility's module should have put on the path is really there.
find_lib_dir() {
    local dir dirs
    IFS=: read -ra dirs <<< "${LD_LIBRARY_PATH:-}"
    for dir in "${dirs[@]}"; do
        if [ -n "$dir" ] && compgen -G "$dir/$1" > /dev/null; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}
