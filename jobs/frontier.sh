#!/bin/bash
# OLCF Frontier: Slurm, 4 MI250X per node = 8 GCDs (one rank each), RCCL (the nccl backend).
#   sbatch -A MYPROJECT -N 2 jobs/frontier.sh 03_ddp.py --model gpt2
#SBATCH -A YOUR_PROJECT
#SBATCH -p batch
#SBATCH -J gpt-parallel
#SBATCH -N 2
#SBATCH -t 00:30:00
#SBATCH --signal=USR1@180
#SBATCH --network=disable_rdzv_get
#SBATCH -o gpt-parallel-%j.out
# --signal: Slurm sends SIGUSR1 to every rank 3 minutes before the walltime; they finish the
# step, write a checkpoint and exit 0 (resubmitting the job resumes it)
# --network=disable_rdzv_get: the network half of RCCL's alternative rendezvous protocol
# (FI_CXI_RDZV_PROTO=alt_read below; OLCF: both or neither)
#
# Sources (each environment line below names its source in brackets; read 2026-11-25 from
# github.com/olcf/olcf-user-docs at 2745903, 2026-07-22, the source of docs.olcf.ornl.gov):
#   [olcf-pytorch]  https://docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html
#                   (software/analytics/pytorch_frontier.rst, last changed 2026-07-07: "update RCCL
#                   documentation with latest guidance and module information")
set -euo pipefail
source "${SLURM_SUBMIT_DIR:-$PWD}/jobs/lib.sh"
ROOT=$(gpt_root)
cd "$ROOT"
[ $# -gt 0 ] || set -- 03_ddp.py

# environment, as OLCF's PyTorch-on-Frontier guide gives it (its batch script): the modules its
# PyTorch installs were built with, a ROCm build of PyTorch in your own environment
# (ROCM_VERSION: the ROCm your torch wheel was built for), then the RCCL network plugin module,
# which must come after rocm. Override the pins when your environment was built under others.
module load "PrgEnv-gnu/${PRGENV_GNU_VERSION:-8.7.0}"  # [olcf-pytorch]
module load "cpe/${CPE_VERSION:-26.03}"                # [olcf-pytorch] a non-default Cray Programming Environment
module load miniforge3/23.11.0-0                       # [olcf-pytorch]
module load "rocm/${ROCM_VERSION:-7.1.1}"              # [olcf-pytorch]
module load rccl-net-plugin                            # [olcf-pytorch] after rocm; sets the plugin and some FI_*/NCCL_* variables
module load craype-accel-amd-gfx90a                    # [olcf-pytorch]
export LD_LIBRARY_PATH=${CRAY_LD_LIBRARY_PATH:-}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # [olcf-pytorch] "Because using a non-default CPE"
LD_LIBRARY_PATH=${LD_LIBRARY_PATH#:}                   # (no empty entry: it would mean the working directory)
[ -z "${VENV:-}" ] || source "$VENV/bin/activate"

NNODES=$SLURM_NNODES
RANKS_PER_NODE=8          # one rank per GCD
WORLD=$((NNODES * RANKS_PER_NODE))
check_layout "$RANKS_PER_NODE" "$WORLD" "$@"
run_args "$@"             # + --resume when out_dir holds a checkpoint

export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)  # [olcf-pytorch] rank 0's node (the page: the batch node's hostname -i)
export MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000))                                # [olcf-pytorch] "different Master Ports you can use": one per job (jobs 1000 ids apart on one node clash: refused in one line)
# RCCL's network plugin (aws-ofi-rccl): without it RCCL talks TCP sockets between nodes. It is
# your own build when RCCL_NET_PLUGIN_DIR is set (its install prefix or lib directory), else
# what the rccl-net-plugin module set up (NCCL_NET_PLUGIN as a path, or LD_LIBRARY_PATH)
PLUGIN_DIR=${RCCL_NET_PLUGIN_DIR:-}
[ -z "$PLUGIN_DIR" ] || [ ! -d "$PLUGIN_DIR/lib" ] || PLUGIN_DIR=$PLUGIN_DIR/lib
[ -n "$PLUGIN_DIR" ] || [ ! -f "${NCCL_NET_PLUGIN:-}" ] || PLUGIN_DIR=$(dirname "$NCCL_NET_PLUGIN")
[ -n "$PLUGIN_DIR" ] || PLUGIN_DIR=$(find_lib_dir 'librccl-net*.so') || PLUGIN_DIR=""
PLUGIN_LIB=$(compgen -G "$PLUGIN_DIR/librccl-net.so" || compgen -G "$PLUGIN_DIR/librccl-net*.so" | head -n 1) || PLUGIN_LIB=""
if [ -n "$PLUGIN_DIR" ] && [ -n "$PLUGIN_LIB" ]; then
    export NCCL_NET_PLUGIN=$PLUGIN_LIB                        # [olcf-pytorch] RCCL loads this plugin (OLCF's preferred way)
    export LD_LIBRARY_PATH=$PLUGIN_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}  # [olcf-pytorch] and finds it on the library path (the other way)
elif [ "$NNODES" -gt 1 ]; then
    echo "warning: no aws-ofi-rccl plugin (librccl-net*.so): load rccl-net-plugin or set RCCL_NET_PLUGIN_DIR; with NCCL_NET=OFI RCCL will stop instead of using TCP" >&2
fi
if [ "$NNODES" -gt 1 ]; then
    export NCCL_NET=OFI                    # [olcf-pytorch] the plugin or nothing: RCCL stops rather than fall back to TCP sockets
else
    export NCCL_NET=Socket                 # [olcf-pytorch] one node: OLCF's network is not set up for the plugin there (nothing leaves the node)
fi
export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3  # [olcf-pytorch] RCCL bootstrap over the Slingshot interfaces (if it hangs: hsn0 alone)
export NCCL_NET_GDR_LEVEL=PHB              # [olcf-pytorch] GPUDirect RDMA between a GCD and a NIC under the same PCIe host bridge
export NCCL_CROSS_NIC=1                    # [olcf-pytorch] rings may leave through a different NIC than they enter
# NCCL connects every peer, algorithm and protocol when a communicator is made, not at first use
# (NCCL_RUNTIME_CONNECT=1, the default since 2.22): the fit check then reads a room the
# communicators have already taken (a 4-byte warm-up would connect one protocol only)
export NCCL_RUNTIME_CONNECT=0              # [nccl-env] connect at init (RCCL too)
export HSA_FORCE_FINE_GRAIN_PCIE=1         # [olcf-pytorch] fine-grained PCIe memory, which the NIC's direct GPU access needs
export FI_MR_CACHE_MONITOR=kdreg2          # [olcf-pytorch] Frontier's default registration-cache monitor, safe with the plugin (never memhooks)
export FI_CXI_DISABLE_HOST_REGISTER=1      # [olcf-pytorch] avoids CXI registration-cache hangs with GPU memory
export FI_CXI_DEFAULT_CQ_SIZE=131072       # [olcf-pytorch] larger completion queue for many-rank collectives
export FI_CXI_DEFAULT_TX_SIZE=2048         # [olcf-pytorch] larger transmit queue
export FI_CXI_RX_MATCH_MODE=hybrid         # [olcf-pytorch] fall back to software matching instead of failing
export FI_CXI_RDZV_PROTO=alt_read          # [olcf-pytorch] alternative rendezvous protocol (needs #SBATCH --network=disable_rdzv_get)
export FI_CXI_RDZV_EAGER_SIZE=0            # [olcf-pytorch] rendezvous messages carry no eager data
export FI_CXI_RDZV_THRESHOLD=0             # [olcf-pytorch] every message larger than 0 bytes goes by rendezvous
export FI_CXI_RDZV_GET_MIN=0               # [olcf-pytorch] and is fetched by a get, whatever its size
export MIOPEN_USER_DB_PATH=/tmp/${USER:-$(id -un)}-miopen  # [olcf-pytorch] MIOpen's kernel database on node-local storage
export MIOPEN_CUSTOM_CACHE_DIR=$MIOPEN_USER_DB_PATH  # [olcf-pytorch]
export OMP_NUM_THREADS=7                  # [olcf-pytorch] threads per rank = the 7 cores of srun -c7
flight_recorder "$ROOT/logs/fr-${SLURM_JOB_ID}"  # a hang's Flight Recorder dumps (jobs/lib.sh)

LOG=$(gpt_log "$ROOT" "gpt-parallel-${SLURM_JOB_ID}")
echo "frontier: $NNODES nodes x $RANKS_PER_NODE ranks = $WORLD, log $LOG"
run_logged "$LOG" srun -N "$NNODES" -n "$WORLD" -c7 --gpus-per-task=1 --gpu-bind=closest --kill-on-bad-exit=1 \
    python "${RUN_ARGS[@]}"
