#!/bin/bash
# OLCF Frontier, expert parallelism: GPT-2 (124M) with 8 experts per block, top-2 (Mixtral's
# routing; 0.48B parameters, 0.14B active per token), on 2 nodes = 16 GCDs as 2 data-parallel
# x 8 expert-parallel: each GCD holds one expert per block, and the all-to-alls of an EP
# group stay inside a node (Infinity Fabric); the data-parallel all-reduce crosses nodes.
#   sbatch jobs/frontier_moe.sh          (after setting the account below)
#SBATCH -A YOUR_PROJECT
#SBATCH -p batch
#SBATCH -J gpt-moe
#SBATCH -N 2
#SBATCH -t 01:00:00
#SBATCH --signal=USR1@180
#SBATCH --network=disable_rdzv_get
#SBATCH -o gpt-moe-%j.out
# --signal: Slurm sends SIGUSR1 to every rank 3 minutes before the walltime; they finish the
# step, write a checkpoint and exit 0 (resubmitting the job resumes it)
# --network=disable_rdzv_get: frontier.sh sets FI_CXI_RDZV_PROTO=alt_read, which needs it
set -euo pipefail
exec bash "${SLURM_SUBMIT_DIR:-$PWD}/jobs/frontier.sh" 10_expert_parallel.py --ep 8 \
    --model gpt2 --n_expert 8 --top_k 2 --data synthetic --global_batch_size 64 --micro_batch_size 4 \
    --max_iters 200 "$@"
