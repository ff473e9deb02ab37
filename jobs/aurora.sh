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
#
# Sources (each environment line below names its source in brackets; read 2026-11-25 from
# github.com/argonne-lcf/user-guides at 7d04a3f, 2026-08-19, the source of docs.alcf.anl.gov):
#   [alcf-oneccl]   https://docs.alcf.anl.gov/aurora/data-science/frameworks/oneCCL/
#                   (docs/aurora/data-science/frameworks/oneCCL.md, last changed 2026-03-17; its
#                   "Minimal set ... essential for functionality" was added 2026-03-06)
#   [alcf-pytorch]  https://docs.alcf.anl.gov/aurora/data-science/frameworks/pytorch/
#                   (docs/aurora/data-science/frameworks/pytorch.md, last changed 2026-03-17)
#   [alcf-binding]  https://docs.alcf.anl.gov/aurora/running-jobs-aurora/
#                   (docs/aurora/running-jobs-aurora.md, last changed 2026-07-27)
# Flux: none of these pages (nor any other of the guide at 7d04a3f) describes running under a
# Flux allocation on Aurora; this script is for PBS Pro and its mpiexec.
set -euo pipefail
source "${PBS_O_WORKDIR:-$PWD}/jobs/lib.sh"
ROOT=$(gpt_root)
cd "$ROOT"
[ $# -gt 0 ] || set -- ${ARGS:-03_ddp.py}

# environment, as ALCF documents it: the frameworks module holds PyTorch (XPU), oneCCL, mpi4py
module load frameworks                     # [alcf-pytorch]
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"

NNODES=$(wc -l < "$PBS_NODEFILE")
RANKS_PER_NODE=12         # one rank per tile
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
TIME_LIMIT_MINUTES=$(pbs_time_limit)   # stop with a checkpoint before the walltime
run_args "$@"                          # + --resume when out_dir holds a checkpoint
# CPU binding from ALCF's PyTorch-on-Aurora page: 4 cores per rank, ranks 0-5 on socket 0 and
# 6-11 on socket 1, clear of cores 0 and 52 (kept for the OS) and of the last cores of each
# socket, where oneCCL puts its worker threads when CCL_WORKER_AFFINITY is unset.
CPU_BIND=list:4-7:8-11:12-15:16-19:20-23:24-27:56-59:60-63:64-67:68-71:72-75:76-79
# GPU affinity: no wrapper. With the flat hierarchy each rank sees all 12 tiles and common.py
# takes xpu:(local rank), and in PCI order tile t is GPU t/2, tile t%2; GPUs 0-2 hang off
# socket 0 and 3-5 off socket 1, so local rank r runs on the socket of its own tile. ALCF
# advises against gpu_tile_compact.sh (ZE_AFFINITY_MASK per rank) with the frameworks module.

export ZE_FLAT_DEVICE_HIERARCHY=FLAT       # [alcf-binding] each tile is its own XPU device (the frameworks module's default)
export ZE_ENABLE_PCI_ID_DEVICE_ORDER=1     # [alcf-binding] device numbering follows the PCI order (and the CPU binding)
# oneCCL: the page's "Minimal set" ("essential for functionality for training workloads", tested
# up to 1024 nodes), then its tuning list ("an application should tune based on the list")
export CCL_PROCESS_LAUNCHER=pmix           # [alcf-oneccl] minimal set: oneCCL learns ranks from Cray PALS' PMIx
export CCL_ATL_TRANSPORT=mpi               # [alcf-oneccl] minimal set: oneCCL moves data across nodes over MPI (libfabric/CXI)
export FI_MR_CACHE_MONITOR=userfaultfd     # [alcf-oneccl] minimal set: libfabric's memory-registration cache monitor
export CCL_KVS_MODE=mpi                    # [alcf-oneccl] minimal set: oneCCL's key-value store bootstraps over MPI
export CCL_KVS_USE_MPI_RANKS=1             # [alcf-oneccl] the KVS numbers ranks as MPI does
export CCL_KVS_CONNECTION_TIMEOUT=600      # [alcf-oneccl] seconds to set up the KVS connections (large jobs start slowly)
export CCL_CONFIGURATION=cpu_gpu_dpcpp     # [alcf-oneccl] the oneCCL build with GPU (SYCL) support
export CCL_CONFIGURATION_PATH=""           # [alcf-oneccl] with CCL_CONFIGURATION: no other oneCCL configuration file
export CCL_ALLREDUCE=topo                  # [alcf-oneccl] ("Algorithm selection") topology-aware all-reduce inside a node (oneCCL's GPU default)
export CCL_ALLREDUCE_SCALEOUT="direct:0-1048576;rabenseifner:1048577-max"  # [alcf-oneccl] across nodes: MPI's below 1 MiB, Rabenseifner above
export CCL_BCAST=double_tree               # [alcf-oneccl] broadcast algorithm ALCF found best at large scale
export CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD=1024  # [alcf-oneccl] more cached Level Zero IPC handles
[ -z "${FI_PROVIDER:-}" ] || export MPI_PROVIDER=$FI_PROVIDER  # [alcf-oneccl] oneCCL's MPI transport uses the same libfabric provider as MPI
unset MPIR_CVAR_CH4_POSIX_COLL_SELECTION_TUNING_JSON_FILE  # [alcf-oneccl] MPICH collective tuning files: ALCF unsets them for oneCCL
unset MPIR_CVAR_CH4_COLL_SELECTION_TUNING_JSON_FILE        # [alcf-oneccl] (same)
unset MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE            # [alcf-oneccl] (same)
unset CCL_WORKER_AFFINITY                  # [alcf-pytorch] oneCCL picks its worker cores itself, outside CPU_BIND
# libfabric/CXI and PALS settings from the same page's "might be application-dependent" list, but
# not its FI_MR_CACHE_MONITOR=disabled: the minimal set's userfaultfd (above) is "essential"
export FI_CXI_DEFAULT_CQ_SIZE=1048576      # [alcf-oneccl] larger completion queue for many-rank collectives
export FI_CXI_OFLOW_BUF_SIZE=8388608       # [alcf-oneccl] larger CXI overflow buffers (unexpected messages at scale)
export FI_CXI_CQ_FILL_PERCENT=30           # [alcf-oneccl] completion-queue fill level that triggers flow control
export FI_CXI_RX_MATCH_MODE=hybrid         # [alcf-oneccl] fall back to software matching instead of failing
export FI_MR_ZE_CACHE_MONITOR_ENABLED=0    # [alcf-oneccl] no Level Zero (GPU memory) registration monitor
export PALS_PING_PERIOD=240                # [alcf-oneccl] PALS heartbeat period (s): no false node-failure kills at scale
export PALS_RPC_TIMEOUT=240                # [alcf-oneccl] PALS RPC timeout (s)
# if a large run hangs in a collective, ALCF's page also suggests (slower):
# export CCL_ATL_SYNC_COLL=1               # [alcf-oneccl] synchronous collectives in oneCCL's transport layer
# export CCL_OP_SYNC=1                     # [alcf-oneccl] one oneCCL operation at a time
export OMP_NUM_THREADS=4                   # [alcf-pytorch] threads per rank = cores bound to it (4 a rank)
flight_recorder "$ROOT/logs/fr-${PBS_JOBID:-local}"  # a hang's Flight Recorder dumps (jobs/lib.sh; XCCL's: unverified)
# MASTER_ADDR/PORT are not needed: under mpiexec, rank 0 broadcasts them through mpi4py

LOG=$(gpt_log "$ROOT" "gpt-parallel-${PBS_JOBID:-local}")
echo "aurora: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
run_logged "$LOG" mpiexec -n "$WORLD" --ppn "$RANKS_PER_NODE" --cpu-bind "$CPU_BIND" \
    python "${RUN_ARGS[@]}"
