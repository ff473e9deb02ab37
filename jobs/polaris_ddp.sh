#!/bin/bash
# ALCF Polaris, data parallelism: GPT-2 (124M) on 2 nodes = 8 A100.
#   qsub jobs/polaris_ddp.sh             (after setting the project below)
#PBS -A YOUR_PROJECT
#PBS -q debug
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:eagle
#PBS -k doe
#PBS -j oe
#PBS -N gpt-ddp
exec bash "${PBS_O_WORKDIR:-$PWD}/jobs/polaris.sh" 03_ddp.py --model gpt2 --data synthetic \
    --global_batch_size 96 --micro_batch_size 12 --max_iters 500 "$@"
