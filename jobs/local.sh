#!/bin/bash
# The same workflow on a laptop, a workstation or CI: N ranks on this machine, on its GPUs
# if it has them, else on CPU (gloo), through mpiexec when it is installed, torchrun if not.
#   bash jobs/local.sh 4 03_ddp.py --model tiny --max_iters 20
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/jobs/lib.sh"
cd "$ROOT"
if [ $# -lt 2 ]; then
    echo "usage: bash jobs/local.sh RANKS SCRIPT.py [flags...]" >&2
    exit 2
fi
RANKS=$1
shift
check_layout "$RANKS" "$RANKS" "$@"
# split the cores among the ranks (common.py does this too, unless OMP_NUM_THREADS is set)
CORES=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / RANKS > 0 ? CORES / RANKS : 1 ))}  # [here]
LOG=$(gpt_log "$ROOT" "local-$(date +%Y%m%d-%H%M%S)")
if command -v mpiexec > /dev/null; then
    LAUNCH=(mpiexec -n "$RANKS")
else
    LAUNCH=(torchrun --standalone --nproc_per_node "$RANKS")
fi
echo "local: ${LAUNCH[*]} ($OMP_NUM_THREADS threads per rank), log $LOG"
run_logged "$LOG" "${LAUNCH[@]}" python "$@"
