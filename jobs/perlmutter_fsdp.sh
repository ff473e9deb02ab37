#!/bin/bash
# NERSC Perlmutter, fully sharded data parallelism: GPT-2 XL (1.5B) on 4 nodes = 16 A100 as
# HSDP: sharded within each node (4 GPUs), replicated across the 4 nodes.
#   sbatch jobs/perlmutter_fsdp.sh        (after setting the account below)
#SBATCH -A YOUR_PROJECT_g
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH -J gpt-fsdp
#SBATCH -N 4
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH -c 32
#SBATCH -t 01:00:00
#SBATCH --signal=USR1@180
#SBATCH -o gpt-fsdp-%j.out
# --signal: Slurm sends SIGUSR1 to every rank 3 minutes before the walltime; they finish the
# step, write a checkpoint and exit 0 (resubmitting the job resumes it)
set -euo pipefail
exec bash "${SLURM_SUBMIT_DIR:-$PWD}/jobs/perlmutter.sh" 05_fsdp.py --model gpt2-xl --replicate 4 \
    --data synthetic --global_batch_size 64 --micro_batch_size 4 --max_iters 200 "$@"
