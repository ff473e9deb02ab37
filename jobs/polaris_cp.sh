#!/bin/bash
# ALCF Polaris, context parallelism: GPT-2 (124M) at a 16k-token context on 2 nodes = 8 A100:
# ring attention over the 4 GPUs of a node (each holds 4k tokens of every sequence),
# 2 data-parallel replicas across the nodes. --cp_impl ulysses works too (4 divides 12 heads).
#   qsub jobs/polaris_cp.sh             (after setting the project below)
#PBS -A YOUR_PROJECT
#PBS -q debug
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:eagle
#PBS -k doe
#PBS -j oe
#PBS -N gpt-cp
exec bash "${PBS_O_WORKDIR:-$PWD}/jobs/polaris.sh" 09_context_parallel.py --model gpt2 --block_size 16384 \
    --cp 4 --cp_impl ring --data synthetic --global_batch_size 8 --micro_batch_size 1 --max_iters 200 \
    --eval_interval 100 --eval_iters 5 "$@"
