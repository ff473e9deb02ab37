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

# Compilation caches on node-local storage: never on the shared home file system.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/${USER:-$(id -un)}/torchinductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/${USER:-$(id -un)}/triton}
