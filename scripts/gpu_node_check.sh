#!/usr/bin/env bash
# One pass over a GPU node, inside a time budget: the device and package versions, the GPU
# correctness checks (scripts/gpu_check.py), the one_gpu benchmark suite, then XLA flag variants
# of its first row. Everything lands in OUT_DIR (at most 8 files, so a short lease can fetch them).
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
timeout "$(stage_timeout 200 300)" $python scripts/gpu_check.py --json "$out/gpu_check.json" 2>&1 \
  | tee "$out/gpu_check.log" | grep -E "^(PASS|FAIL|INFO|device)|Error"

echo "== one_gpu suite ($(seconds_left) s left)"
rows=/tmp/gpu_node_check_rows
rm -rf "$rows"
timeout "$(stage_timeout 360 60)" $python scripts/benchmark.py --suite one_gpu --steps 10 --warmup 2 \
  --out "$rows" --row-timeout 150 >"$out/suite.log" 2>&1
cp "$rows"/results.json "$rows"/results.md "$out"/ 2>/dev/null
grep -h -E "Error|error:" "$rows"/*.log | tail -5
cat "$out/results.md" 2>/dev/null

# XLA flag variants of the suite's first row (same overrides; its default-flags result is above).
echo "== XLA flag variants ($(seconds_left) s left)"
for flags in "--xla_gpu_enable_triton_gemm=false" "--xla_gpu_enable_command_buffer="; do
  (( $(seconds_left) > 90 )) || { echo "no time left for $flags"; break; }
  name=$(echo "$flags" | tr -c 'a-z0-9\n' '_' | sed 's/^_*//')
  XLA_FLAGS="$flags" timeout "$(stage_timeout 150 10)" $python scripts/benchmark.py configs/llama3_8b.py:bf16 \
    --steps 10 --warmup 2 --json "$rows/flags_$name.json" --config.model.n_layers=8 --config.model.remat=none \
    --config.model.attention=cudnn --config.checkpoint.enabled=false --config.output_dir="$rows/flags_$name" \
    >"$rows/flags_$name.log" 2>&1
  tail -1 "$rows/flags_$name.log"
done
$python - "$rows" "$out/flags.json" <<'EOF'
import glob, json, os, sys
rows, out = sys.argv[1], sys.argv[2]
found = {os.path.basename(p)[6:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{rows}/flags_*.json"))}
json.dump(found, open(out, "w"), indent=2)
for name, r in found.items():
    print(f"{r['xla_flags']}: {r['tokens_per_s_per_device']:,.0f} tokens/s, MFU {100 * (r['mfu'] or 0):.1f}%")
EOF
cat "$rows"/*.log > "$out/rows.log" 2>/dev/null
echo "done in ${SECONDS} s"
