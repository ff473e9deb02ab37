#!/bin/bash
# ALCF Polaris: give each rank the one GPU on its own NUMA domain, then run the command.
#   mpiexec -n N --ppn 4 --depth 8 --cpu-bind depth jobs/polaris_gpu_affinity.sh python train.py
# Polaris numbers its GPUs in reverse of the CPU's NUMA domains (ALCF's device affinity
# table: GPU 0 is local to cores 24-31, GPU 1 to 16-23, GPU 2 to 8-15, GPU 3 to 0-7), and
# `--depth 8 --cpu-bind depth` puts local rank r on cores 8r..8r+7, so local rank r must drive
# GPU 3 - r; ALCF's set_affinity_gpu_polaris.sh does the same. It has to happen before python
# starts (CUDA reads CUDA_VISIBLE_DEVICES once, at initialisation). Each rank then sees one
# GPU, which it uses as cuda:0 (common.py: local rank % device count).
# Sources (read 2026-11-25 from github.com/argonne-lcf/user-guides at 7d04a3f, 2026-08-19):
#   [alcf-gpus]  https://docs.alcf.anl.gov/polaris/running-jobs/using-gpus/ ("Binding MPI ranks to GPUs";
#                docs/polaris/running-jobs/using-gpus.md, last changed 2025-04-03)
#   [alcf-nodes] https://docs.alcf.anl.gov/polaris/hardware-overview/machine-overview/ ("Polaris Device
#                Affinity Information"; docs/polaris/hardware-overview/machine-overview.md, last changed 2025-02-05)
local_rank=${PALS_LOCAL_RANKID:-${PMI_LOCAL_RANK:-}}  # Cray PALS sets both; ALCF's script reads PMI_LOCAL_RANK
if [ -z "$local_rank" ]; then
    echo "error: $0: no PALS_LOCAL_RANKID or PMI_LOCAL_RANK: run it under Polaris' mpiexec (Cray PALS)" >&2
    exit 2
fi
num_gpus=4
export CUDA_VISIBLE_DEVICES=$(( num_gpus - 1 - local_rank % num_gpus ))  # [alcf-gpus] [alcf-nodes] the GPU of this rank's NUMA domain
exec "$@"
