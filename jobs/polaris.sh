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
#
# Sources (each environment line below names its source in brackets; read 2026-11-25 from
# github.com/argonne-lcf/user-guides at 7d04a3f, 2026-08-19, the source of docs.alcf.anl.gov):
#   [alcf-pytorch]  https://docs.alcf.anl.gov/polaris/data-science/frameworks/pytorch/
#                   (docs/polaris/data-science/frameworks/pytorch.md, last changed 2026-03-11)
#   [alcf-nccl]     https://docs.alcf.anl.gov/polaris/applications-and-libraries/libraries/nccl/
#                   (docs/polaris/applications-and-libraries/libraries/nccl.md, last changed 2025-01-21)
#   [alcf-gpus]     https://docs.alcf.anl.gov/polaris/running-jobs/using-gpus/
#                   (docs/polaris/running-jobs/using-gpus.md, last changed 2025-04-03)
set -euo pipefail
source "${PBS_O_WORKDIR:-$PWD}/jobs/lib.sh"
ROOT=$(gpt_root)
cd "$ROOT"
[ $# -gt 0 ] || set -- ${ARGS:-03_ddp.py}

# environment, as ALCF documents it: the conda module holds PyTorch and mpi4py
module use /soft/modulefiles      # [alcf-pytorch]
module load conda                 # [alcf-pytorch]
conda activate                    # [alcf-pytorch]
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"   # your own venv on top, if any

NNODES=$(wc -l < "$PBS_NODEFILE")
RANKS_PER_NODE=4          # one rank per A100
DEPTH=8                   # 32 cores / 4 ranks: CPU cores per rank = one NUMA domain each
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
TIME_LIMIT_MINUTES=$(pbs_time_limit)   # stop with a checkpoint before the walltime
run_args "$@"                          # + --resume when out_dir holds a checkpoint

# NCCL and libfabric as ALCF's NCCL page gives them ("the best environment setup"): the
# aws-ofi-nccl plugin and hwloc on LD_LIBRARY_PATH, then the variables. The page no longer says
# that the conda module sets them (that sentence has been commented out since 2024-11-07).
export LD_LIBRARY_PATH=${AWS_OFI_NCCL_LIB:-/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # [alcf-nccl] the plugin (AWS_OFI_NCCL_LIB: your own build)
export LD_LIBRARY_PATH=/soft/libraries/hwloc/lib/:$LD_LIBRARY_PATH  # [alcf-nccl] hwloc, which the plugin needs
find_lib_dir 'libnccl-net*.so' > /dev/null ||
    echo "warning: no aws-ofi-nccl plugin (libnccl-net*.so) on LD_LIBRARY_PATH: with NCCL_NET set, NCCL will stop at start-up instead of using TCP" >&2
export NCCL_NET_GDR_LEVEL=PHB              # [alcf-nccl] GPUDirect RDMA when GPU and NIC share a PCIe host bridge
export NCCL_CROSS_NIC=1                    # [alcf-nccl] rings may leave through a different NIC than they enter
export NCCL_COLLNET_ENABLE=1               # [alcf-nccl] use the Slingshot collective offload where available
export NCCL_NET="AWS Libfabric"            # [alcf-nccl] NCCL over libfabric (the aws-ofi-nccl plugin), never TCP sockets
export FI_CXI_DISABLE_HOST_REGISTER=1      # [alcf-nccl] avoids CXI registration-cache hangs with CUDA
export FI_MR_CACHE_MONITOR=userfaultfd     # [alcf-nccl] memory-registration cache monitor
export FI_CXI_DEFAULT_CQ_SIZE=131072       # [alcf-nccl] larger completion queue for many-rank collectives
# NCCL connects every peer, algorithm and protocol when a communicator is made, not at first use
# (NCCL_RUNTIME_CONNECT=1, the default since 2.22): the fit check then reads a room the
# communicators have already taken (a 4-byte warm-up would connect one protocol only)
export NCCL_RUNTIME_CONNECT=0              # [nccl-env] connect at init (RCCL too)
# The page warns: "For some applications such as Megatron-DeepSpeed, enabling the AWS plugin will
# cause a hang or NCCL timeout issue" (Megatron-DeepSpeed's pipeline sends and receives between
# stages, as 07 and 08 do); its remedy, NCCL_PLUGIN=off here, unsets the four NCCL variables.
if [ "${NCCL_PLUGIN:-on}" = off ]; then
    unset NCCL_NET_GDR_LEVEL NCCL_CROSS_NIC NCCL_COLLNET_ENABLE NCCL_NET  # [alcf-nccl] its remedy for such hangs
else
    case " $* " in
        *" 07_pipeline.py "*|*" 08_3d.py "*)
            echo "note: ALCF warns that pipeline-parallel jobs (Megatron-DeepSpeed) may hang with the aws-ofi-nccl plugin: if this one hangs in NCCL, resubmit with NCCL_PLUGIN=off (qsub -v NCCL_PLUGIN=off,ARGS=...)" ;;
    esac
fi
export OMP_NUM_THREADS=$DEPTH              # [alcf-pytorch] threads per rank = cores bound to it (--depth)
flight_recorder "$ROOT/logs/fr-${PBS_JOBID:-local}"  # a hang's Flight Recorder dumps (jobs/lib.sh)
# MASTER_ADDR/PORT are not needed: under mpiexec, rank 0 broadcasts them through mpi4py

LOG=$(gpt_log "$ROOT" "gpt-parallel-${PBS_JOBID:-local}")
echo "polaris: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
# --depth 8 --cpu-bind depth: local rank r on cores 8r..8r+7 (NUMA domain r); the wrapper gives
# it the GPU of that domain, 3 - r (Polaris numbers its GPUs in reverse of the NUMA domains)
run_logged "$LOG" mpiexec -n "$WORLD" --ppn "$RANKS_PER_NODE" --depth "$DEPTH" --cpu-bind depth \
    "$ROOT/jobs/polaris_gpu_affinity.sh" python "${RUN_ARGS[@]}"
