#!/usr/bin/env bash
# Every training script's first steps on one GPU, at one rank each (NCCL initialised, the
# device paths run: bf16 autocast, fused kernels, pinned host copies and side streams of
# --offload, the fit check against the device's free memory, Muon's iteration on the device),
# all at once on the one GPU; then the host syncs a GPU step really makes, as CUDA reports them
# (torch.cuda.set_sync_debug_mode), for 01. Not part of the CPU suite: run it on a GPU node,
#   bash tests/gpu/smoke.sh OUT_DIR
# and read OUT_DIR/summary.txt (one line per run: its exit status and its last step line).
set -u
out=${1:-/tmp/gpu-smoke}; mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi -L > "$out/summary.txt" 2>&1
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" >> "$out/summary.txt" 2>&1
T="--device ${SMOKE_DEVICE:-cuda} --eval_interval 0 --max_iters 8 --log_interval 1 --timeout 120"
port=29600
# the default model alone first, so that its fit check and "fit after step 0" see the GPU alone
MASTER_PORT=29599 timeout ${RUN_TIMEOUT:-150} $py 01_single_gpu.py $T --dtype bfloat16 --micro_batch_size auto \
    --metrics "$out/01_default_bf16.jsonl" --out_dir "$out/ckpt-01_default" > "$out/01_default_bf16.log" 2>&1
echo "01_default_bf16 rc=$? | $(grep -E '^(error|step 7:|fit after)' "$out/01_default_bf16.log" | head -3 | tr '\n' ' ')" >> "$out/summary.txt"
run() {  # name, script, flags...
  local name=$1 script=$2; shift 2; port=$((port + 1))
  (MASTER_PORT=$port timeout ${RUN_TIMEOUT:-150} $py "$script" $T --metrics "$out/$name.jsonl" --out_dir "$out/ckpt-$name" "$@" \
     > "$out/$name.log" 2>&1; echo "$name rc=$? | $(grep -E '^(error|step 7:)' "$out/$name.log" | head -2 | tr '\n' ' ')" >> "$out/summary.txt") &
}
run 01_tiny_fp32 01_single_gpu.py --model tiny --dtype float32
run 01_muon_bf16 01_single_gpu.py --dtype bfloat16 --optimizer muon
run 03 03_ddp.py --model tiny --dtype bfloat16
run 04_s1 04_zero.py --model tiny --dtype bfloat16 --stage 1
run 04_s3_offload 04_zero.py --model tiny --dtype bfloat16 --stage 3 --offload
run 04_s3_muon 04_zero.py --model tiny --dtype bfloat16 --stage 3 --optimizer muon
run 05_offload 05_fsdp.py --model tiny --dtype bfloat16 --offload
run 06_muon 06_tensor_parallel.py --model tiny --dtype bfloat16 --optimizer muon
run 07_measure 07_pipeline.py --model tiny --dtype bfloat16 --measure_bubble
run 08 08_3d.py --model tiny --dtype bfloat16
run 09 09_context_parallel.py --model tiny --dtype bfloat16
run 10 10_expert_parallel.py --model tiny --dtype bfloat16 --n_expert 4 --top_k 2
wait
# the host syncs CUDA sees in 01's steps (warn mode: one warning per synchronizing call)
MASTER_PORT=29700 timeout ${RUN_TIMEOUT:-150} $py - --device cuda --dtype bfloat16 --max_iters 6 --log_interval 100 --eval_interval 0 --sample_tokens 0 \
    --out_dir "$out/ckpt-syncs" > "$out/syncs.log" 2>&1 <<'PY'
import runpy, sys, warnings
import torch
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
sys.argv[0] = "01_single_gpu.py"
runpy.run_path("01_single_gpu.py", run_name="__main__")
PY
echo "syncs rc=$? | synchronizing calls CUDA warned of in 6 steps (start-up included; the loss logged at the last step only), by line: $(grep -oE '[^/ ]+\.py:[0-9]+: UserWarning: called a synchronizing' "$out/syncs.log" | sed 's/: UserWarning.*//' | sort | uniq -c | sort -rn | tr '\n' ';')" >> "$out/summary.txt"
cat "$out/summary.txt"
