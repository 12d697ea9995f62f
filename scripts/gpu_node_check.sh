#!/usr/bin/env bash
# One pass over a GPU node, inside a time budget: the device and package versions, the GPU
# correctness checks (scripts/gpu_check.py; GPU_CHECKS=a,b runs only those), the attention rows
# (the Pallas kernels' correctness, then pallas vs cudnn vs blockwise vs xla at 2 x 8,192 tokens;
# ATTENTION_CHECKS=a,b, or "none"), the one_gpu benchmark suite, then variants of its rows (XLA
# flags, batch, loss chunks). Everything lands in OUT_DIR (at most 8 files, so a short lease can
# fetch them; the attention rows are lines of gpu_check.log).
#
#   bash scripts/gpu_node_check.sh OUT_DIR [BUDGET_SECONDS=540]
#
# Stages run in order of importance, each stopped where it would overrun the budget; a stage
# that is stopped or fails leaves the earlier stages' files intact.
set -u
out=${1:?usage: bash scripts/gpu_node_check.sh OUT_DIR [BUDGET_SECONDS]}
budget=${2:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX takes 75% of the GPU's memory by default; the 8B-shaped rows want more headroom.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
python=${PYTHON:-python3}

seconds_left() { echo $((budget - SECONDS)); }
# A stage's timeout: at most $1 seconds, and never past the budget less $2 seconds kept for later.
stage_timeout() { local t=$(( $(seconds_left) - $2 )); (( t > $1 )) && t=$1; echo $(( t > 0 ? t : 1 )); }

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
  $python -c "import jax, flax, optax, orbax.checkpoint as ocp, ml_collections, sys; \
print('python', sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', \
optax.__version__, 'orbax', ocp.__version__); print(jax.devices())"
} >"$out/node.txt" 2>&1
cat "$out/node.txt"

echo "== gpu_check ($(seconds_left) s left)"
timeout "$(stage_timeout 200 300)" $python scripts/gpu_check.py --json "$out/gpu_check.json" \
  --checks "${GPU_CHECKS:-matmul_rate,trainer_parity,fp8_dot,attention_causal,attention_documents}" 2>&1 \
  | tee "$out/gpu_check.log" | grep -E "^(PASS|FAIL|INFO|device)|Error"

# Its own stage, so a Triton compilation that hangs or fails costs only this stage's time.
attention_checks=${ATTENTION_CHECKS:-attention_pallas_causal,attention_pallas_documents_window,attention_speed}
if [[ $attention_checks != none ]]; then
  echo "== attention ($(seconds_left) s left)"
  timeout "$(stage_timeout 150 240)" $python scripts/gpu_check.py --checks "$attention_checks" 2>&1 \
    | tee -a "$out/gpu_check.log" | grep -E "^(PASS|FAIL|INFO)|Error"
fi

echo "== one_gpu suite ($(seconds_left) s left)"
rows=/tmp/gpu_node_check_rows
rm -rf "$rows"
timeout "$(stage_timeout 360 60)" $python scripts/benchmark.py --suite one_gpu --steps 10 --warmup 2 \
  --out "$rows" --row-timeout 150 >"$out/suite.log" 2>&1
cp "$rows"/results.json "$rows"/results.md "$out"/ 2>/dev/null
grep -h -E "Error|error:" "$rows"/*.log | tail -5
cat "$out/results.md" 2>/dev/null

# Variants of the suite's rows: XLA flags, larger batches, loss chunks (one line each: a name,
# XLA_FLAGS or "-", CONFIG[:VARIANT], overrides). The suite's rows above are the baselines.
echo "== variants ($(seconds_left) s left)"
base="--config.model.n_layers=8 --config.model.remat=none"  # attention "auto": cuDNN on CUDA, blockwise on ROCm
while read -r name flags spec overrides; do
  (( $(seconds_left) > 60 )) || { echo "no time left for $name"; break; }
  [[ $flags == - ]] && flags=""
  XLA_FLAGS="$flags" timeout "$(stage_timeout 150 10)" $python scripts/benchmark.py "configs/${spec%%:*}.py:${spec#*:}" \
    --steps 10 --warmup 2 --json "$rows/variant_$name.json" $base $overrides --config.checkpoint.enabled=false \
    --config.output_dir="$rows/variant_$name" >"$rows/variant_$name.log" 2>&1 </dev/null
  echo "$name: $(tail -1 "$rows/variant_$name.log")"
done <<'VARIANTS'
bf16_blockwise_attention - llama3_8b:bf16 --config.model.attention=blockwise
fp8_batch4 - llama3_8b:fp8 --config.train.per_device_batch_size=4
bf16_loss_chunk4096 - llama3_8b:bf16 --config.model.loss_chunk_len=4096
bf16_batch4_no_command_buffer --xla_gpu_enable_command_buffer= llama3_8b:bf16 --config.train.per_device_batch_size=4
bf16_no_triton_gemm --xla_gpu_enable_triton_gemm=false llama3_8b:bf16
VARIANTS
$python - "$rows" "$out/variants.json" <<'EOF'
import glob, json, os, sys
rows, out = sys.argv[1], sys.argv[2]
found = {os.path.basename(p)[8:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{rows}/variant_*.json"))}
json.dump(found, open(out, "w"), indent=2)
for name, r in found.items():
    print(f"{name}: {r['tokens_per_s_per_device']:,.0f} tokens/s/GPU, MFU {100 * (r['mfu'] or 0):.1f}%, "
          f"device peak {r['device_peak_mib'] or 0:,.0f} MiB, {r['library_calls']}")
EOF
cat "$rows"/*.log > "$out/rows.log" 2>/dev/null
echo "done in ${SECONDS} s"
