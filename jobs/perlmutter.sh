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
#
# Sources (each environment line below names its source in brackets; read 2026-11-25):
#   [nersc-launchers] https://docs.nersc.gov/machinelearning/launchers (read 2026-11-25; the copy
#                     shows no date of its own): srun with one task per GPU, -c 32, MASTER_ADDR the first node of
#                     `scontrol show hostnames`, and NCCL's network plugin from NERSC's container
#                     (`#SBATCH --module=gpu,nccl-plugin` with the nersc/pytorch image)
#   [nersc-sc25]      https://github.com/NERSC/sc25-dl-tutorial/blob/main/submit_pm.sh (NERSC's SC25
#                     tutorial, at 6f7a074, read 2026-11-25): CUDA_VISIBLE_DEVICES=3,2,1,0,
#                     FI_MR_CACHE_MONITOR=userfaultfd, with the nersc/pytorch:25.06.01 image
#   [nersc-pytorch]   https://docs.nersc.gov/machinelearning/pytorch/ (read 2026-11-25: no current copy
#                     could be read; `module load pytorch` and that it brings NCCL's libfabric plugin
#                     are unverified, as are NCCL_NET_GDR_LEVEL and NCCL_SOCKET_IFNAME below)
set -euo pipefail
source "${SLURM_SUBMIT_DIR:-$PWD}/jobs/lib.sh"
ROOT=$(gpt_root)
cd "$ROOT"
[ $# -gt 0 ] || set -- 03_ddp.py

# environment: the pytorch module (PyTorch, NCCL, mpi4py); NERSC's pages now show its container instead
module load pytorch                        # [nersc-pytorch] (unverified: see above)
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"

NNODES=$SLURM_NNODES
RANKS_PER_NODE=4          # one rank per A100
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
run_args "$@"             # + --resume when out_dir holds a checkpoint

export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # [nersc-launchers] rank 0's node
export MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))                                # [nersc-launchers] its 29500, + a per-job offset (jobs 1000 ids apart on one node clash: refused in one line)
export NCCL_NET_GDR_LEVEL=PHB              # [nersc-pytorch] GPUDirect RDMA when GPU and NIC share a PCIe host bridge (unverified)
export NCCL_SOCKET_IFNAME=hsn              # [nersc-pytorch] bootstrap over the Slingshot interfaces hsn0-3 (a prefix; unverified)
export FI_MR_CACHE_MONITOR=userfaultfd     # [nersc-sc25] memory-registration cache monitor
# NCCL connects every peer, algorithm and protocol when a communicator is made, not at first use
# (NCCL_RUNTIME_CONNECT=1, the default since 2.22): the fit check then reads a room the
# communicators have already taken (a 4-byte warm-up would connect one protocol only)
export NCCL_RUNTIME_CONNECT=0              # [nccl-env] connect at init (RCCL too)
# GPU affinity: `-c 32 --cpu-bind=cores` puts local rank r on cores 16r..16r+15 (NUMA domain r),
# whose GPU is 3 - r: NERSC's scripts reverse the GPU order "to match default CPU affinities
# from Slurm". Every rank sees all four GPUs (--gpu-bind=none, as NERSC's scripts do) and
# common.py takes cuda:(local rank), which this order makes physical GPU 3 - r.
export CUDA_VISIBLE_DEVICES=3,2,1,0        # [nersc-sc25] "Reversing order of GPUs to match default CPU affinities from Slurm"
export OMP_NUM_THREADS=16                  # [nersc-launchers] threads per rank = the 16 physical cores of -c 32
flight_recorder "$ROOT/logs/fr-${SLURM_JOB_ID}"  # a hang's Flight Recorder dumps (jobs/lib.sh)

LOG=$(gpt_log "$ROOT" "gpt-parallel-${SLURM_JOB_ID}")
echo "perlmutter: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
run_logged "$LOG" srun -N "$NNODES" -n "$WORLD" --ntasks-per-node "$RANKS_PER_NODE" -c 32 --cpu-bind=cores \
    --gpus-per-node 4 --gpu-bind=none --kill-on-bad-exit=1 python "${RUN_ARGS[@]}"
