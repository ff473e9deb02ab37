#!/bin/bash
# NERSC Perlmutter: Slurm, 4 NVIDIA A100 per GPU node, NCCL.
#   sbatch -A MYPROJECT_g -N 2 jobs/perlmutter.sh 03_ddp.py --model gpt2
#SBATCH -A YOUR_PROJECT_g
#SBATCH -C gpu
#SBATCH -q debug
#SBATCH -J gpt-parallel
#SBATCH -N 2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH -c 32
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

# environment, as NERSC documents it: the pytorch module (PyTorch, NCCL, mpi4py)
module load pytorch
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"

NNODES=$SLURM_NNODES
RANKS_PER_NODE=4          # one rank per A100
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
run_args "$@"             # + --resume when out_dir holds a checkpoint

export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # rank 0's node
export MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))                                # per job, no clashes
export NCCL_NET_GDR_LEVEL=PHB              # GPUDirect RDMA when GPU and NIC share a PCIe host bridge (not in NERSC's sources found: unverified)
export NCCL_SOCKET_IFNAME=hsn              # bootstrap over the Slingshot interfaces hsn0-3 (a prefix; unverified, as above)
export FI_MR_CACHE_MONITOR=userfaultfd     # memory-registration cache monitor NERSC's own job scripts set
# GPU affinity: `-c 32 --cpu-bind=cores` puts local rank r on cores 16r..16r+15 (NUMA domain r),
# whose GPU is 3 - r: NERSC's scripts reverse the GPU order "to match default CPU affinities
# from Slurm". Every rank sees all four GPUs (--gpu-bind=none, as NERSC's scripts do) and
# common.py takes cuda:(local rank), which this order makes physical GPU 3 - r.
export CUDA_VISIBLE_DEVICES=3,2,1,0
export OMP_NUM_THREADS=16                  # threads per rank = physical cores bound to it

LOG=$(gpt_log "$ROOT" "gpt-parallel-${SLURM_JOB_ID}")
echo "perlmutter: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
run_logged "$LOG" srun -N "$NNODES" -n "$WORLD" --ntasks-per-node "$RANKS_PER_NODE" -c 32 --cpu-bind=cores \
    --gpus-per-node 4 --gpu-bind=none --kill-on-bad-exit=1 python "${RUN_ARGS[@]}"
