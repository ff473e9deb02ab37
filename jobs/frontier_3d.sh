#!/bin/bash
# OLCF Frontier, 3D parallelism: GPT-3 XL (1.3B, 16 heads, 24 layers) on 2 nodes = 16 GCDs as
# 2 data-parallel x 2 pipeline x 4 tensor-parallel (a TP group stays inside a node).
#   sbatch jobs/frontier_3d.sh           (after setting the account below)
#SBATCH -A YOUR_PROJECT
#SBATCH -p batch
#SBATCH -J gpt-3d
#SBATCH -N 2
#SBATCH -t 01:00:00
#SBATCH --signal=USR1@180
#SBATCH --network=disable_rdzv_get
#SBATCH -o gpt-3d-%j.out
# --signal: Slurm sends SIGUSR1 to every rank 3 minutes before the walltime; they finish the
# step, write a checkpoint and exit 0 (resubmitting the job resumes it)
# --network=disable_rdzv_get: frontier.sh sets FI_CXI_RDZV_PROTO=alt_read, which needs it
set -euo pipefail
exec bash "${SLURM_SUBMIT_DIR:-$PWD}/jobs/frontier.sh" 08_3d.py --tp 4 --pp 2 \
    --model gpt3-xl --block_size 1024 --data synthetic --global_batch_size 64 --micro_batch_size 4 --max_iters 200 "$@"
