#!/bin/bash
# ALCF Aurora: PBS Pro, 6 Intel Max 1550 GPUs x 2 tiles = 12 XPU devices per node (flat
# hierarchy: one rank per tile), oneCCL (xccl backend), Cray MPICH's mpiexec (PALS).
# Edit the placeholders below, then from the repository root
#   qsub -v ARGS="03_ddp.py --model gpt2" jobs/aurora.sh
#PBS -A YOUR_PROJECT
#PBS -q debug
#PBS -l select=2
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:flare
#PBS -k doe
#PBS -j oe
#PBS -N gpt-parallel
set -euo pipefail
source "${PBS_O_WORKDIR:-$PWD}/jobs/lib.sh"
ROOT=$(gpt_root)
cd "$ROOT"
[ $# -gt 0 ] || set -- ${ARGS:-03_ddp.py}

# environment, as ALCF documents it: the frameworks module holds PyTorch (XPU), oneCCL, mpi4py
module load frameworks
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"

NNODES=$(wc -l < "$PBS_NODEFILE")
RANKS_PER_NODE=12         # one rank per tile
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
TIME_LIMIT_MINUTES=$(pbs_time_limit)   # stop with a checkpoint before the walltime
run_args "$@"                          # + --resume when out_dir holds a checkpoint
# 8 cores per rank, skipping cores 0 and 52 (one per socket) that ALCF keeps for the OS
CPU_BIND=list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100

export ZE_FLAT_DEVICE_HIERARCHY=FLAT       # each tile is its own XPU device
export ZE_ENABLE_PCI_ID_DEVICE_ORDER=1     # device numbering follows the PCI order (and the CPU binding)
export CCL_PROCESS_LAUNCHER=pmix           # oneCCL learns ranks from Cray PALS' PMIx
export CCL_ATL_TRANSPORT=mpi               # oneCCL moves data across nodes over MPI (libfabric/CXI)
export CCL_KVS_MODE=mpi                    # oneCCL's key-value store bootstraps over MPI
export CCL_ALLREDUCE=topo                  # topology-aware all-reduce inside a node
export CCL_ALLREDUCE_SCALEOUT=rabenseifner # bandwidth-optimal all-reduce across nodes
export FI_CXI_DEFAULT_CQ_SIZE=1048576      # larger completion queue for many-rank collectives
export FI_CXI_RX_MATCH_MODE=hybrid         # fall back to software matching instead of failing
export FI_MR_CACHE_MONITOR=userfaultfd     # memory-registration cache monitor recommended by ALCF
export OMP_NUM_THREADS=8

LOG=$(gpt_log "$ROOT" "gpt-parallel-${PBS_JOBID:-local}")
echo "aurora: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
mpiexec -n "$WORLD" --ppn "$RANKS_PER_NODE" --cpu-bind "$CPU_BIND" \
    python "${RUN_ARGS[@]}" 2>&1 | tee "$LOG"
