#!/bin/bash
# OLCF Frontier: Slurm, 4 MI250X per node = 8 GCDs (one rank each), RCCL (the nccl backend).
#   sbatch -A MYPROJECT -N 2 jobs/frontier.sh 03_ddp.py --model gpt2
#SBATCH -A YOUR_PROJECT
#SBATCH -p batch
#SBATCH -J gpt-parallel
#SBATCH -N 2
#SBATCH -t 00:30:00
#SBATCH --signal=USR1@180
#SBATCH -o gpt-parallel-%j.out
# --signal: Slurm sends SIGUSR1 to every rank 3 minutes before the walltime; they finish the
# step, write a checkpoint and exit 0 (resubmitting the job resumes it)
set -euo pipefail
source "${SLURM_SUBMIT_DIR:-$PWD}/jobs/lib.sh"
ROOT=$(gpt_root)
cd "$ROOT"
[ $# -gt 0 ] || set -- 03_ddp.py

# environment, as OLCF documents it: a ROCm build of PyTorch in your own environment
module load PrgEnv-gnu rocm craype-accel-amd-gfx90a miniforge3
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"

NNODES=$SLURM_NNODES
RANKS_PER_NODE=8          # one rank per GCD
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
run_args "$@"             # + --resume when out_dir holds a checkpoint

export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # rank 0's node
export MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))                                # per job, no clashes
export NCCL_SOCKET_IFNAME=hsn0             # RCCL bootstrap over the Slingshot interface
export NCCL_NET_GDR_LEVEL=3                # GPUDirect RDMA between GCDs and NICs
export NCCL_CROSS_NIC=1                    # rings may leave through a different NIC than they enter
export FI_CXI_ATS=0                        # required by the aws-ofi-rccl plugin on Frontier
export FI_MR_CACHE_MONITOR=kdreg2          # memory-registration cache monitor recommended by OLCF
export MIOPEN_USER_DB_PATH=/tmp/${USER:-$(id -un)}-miopen  # MIOpen's kernel database on node-local storage
export MIOPEN_CUSTOM_CACHE_DIR=$MIOPEN_USER_DB_PATH
export OMP_NUM_THREADS=7

LOG=$(gpt_log "$ROOT" "gpt-parallel-${SLURM_JOB_ID}")
echo "frontier: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
srun -N "$NNODES" -n "$WORLD" -c7 --gpus-per-task=1 --gpu-bind=closest --kill-on-bad-exit=1 \
    python "${RUN_ARGS[@]}" 2>&1 | tee "$LOG"
