#!/bin/bash
# ALCF Polaris: PBS Pro, 4 NVIDIA A100 per node, NCCL, Cray MPICH's mpiexec (PALS).
# Any training script, any flags: edit the placeholders below, then from the repository root
#   qsub -v ARGS="03_ddp.py --model gpt2" jobs/polaris.sh
# (with `qsub ... -- $PWD/jobs/polaris.sh 03_ddp.py ...` PBS ignores the #PBS lines: give
# -A, -q and -l on the command line instead)
#PBS -A YOUR_PROJECT
#PBS -q debug
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:eagle
#PBS -k doe
#PBS -j oe
#PBS -N gpt-parallel
set -euo pipefail
source "${PBS_O_WORKDIR:-$PWD}/jobs/lib.sh"
ROOT=$(gpt_root)
cd "$ROOT"
[ $# -gt 0 ] || set -- ${ARGS:-03_ddp.py}

# environment, as ALCF documents it: the conda module holds PyTorch and mpi4py
module use /soft/modulefiles
module load conda
conda activate
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"   # your own venv on top, if any

NNODES=$(wc -l < "$PBS_NODEFILE")
RANKS_PER_NODE=4          # one rank per A100
DEPTH=8                   # 32 cores / 4 ranks: CPU cores per rank = one NUMA domain each
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
TIME_LIMIT_MINUTES=$(pbs_time_limit)   # stop with a checkpoint before the walltime
run_args "$@"                          # + --resume when out_dir holds a checkpoint

# NCCL and libfabric as ALCF's NCCL page gives them (the conda module sets the same, and puts
# the aws-ofi-nccl plugin on LD_LIBRARY_PATH); see jobs/README.md for the citations
find_lib_dir 'libnccl-net*.so' > /dev/null ||
    echo "warning: no aws-ofi-nccl plugin (libnccl-net*.so) on LD_LIBRARY_PATH: with NCCL_NET set, NCCL will stop at start-up instead of using TCP" >&2
export NCCL_NET_GDR_LEVEL=PHB              # GPUDirect RDMA when GPU and NIC share a PCIe host bridge
export NCCL_CROSS_NIC=1                    # rings may leave through a different NIC than they enter
export NCCL_COLLNET_ENABLE=1               # use the Slingshot collective offload where available
export NCCL_NET="AWS Libfabric"            # NCCL over libfabric (the aws-ofi-nccl plugin), never TCP sockets
export FI_CXI_DISABLE_HOST_REGISTER=1      # avoids CXI registration-cache hangs with CUDA
export FI_MR_CACHE_MONITOR=userfaultfd     # memory-registration cache monitor recommended by ALCF
export FI_CXI_DEFAULT_CQ_SIZE=131072       # larger completion queue for many-rank collectives
export OMP_NUM_THREADS=$DEPTH              # threads per rank = cores bound to it
# MASTER_ADDR/PORT are not needed: under mpiexec, rank 0 broadcasts them through mpi4py

LOG=$(gpt_log "$ROOT" "gpt-parallel-${PBS_JOBID:-local}")
echo "polaris: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
# --depth 8 --cpu-bind depth: local rank r on cores 8r..8r+7 (NUMA domain r); the wrapper gives
# it the GPU of that domain, 3 - r (Polaris numbers its GPUs in reverse of the NUMA domains)
run_logged "$LOG" mpiexec -n "$WORLD" --ppn "$RANKS_PER_NODE" --depth "$DEPTH" --cpu-bind depth \
    "$ROOT/jobs/polaris_gpu_affinity.sh" python "${RUN_ARGS[@]}"
