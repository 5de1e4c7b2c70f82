#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, build the CUDA extension, run the
# tests that need the GPU (gpu-marked tests and every kernel test's Triton path, now
# compiled), then the microbenchmarks in bench/, writing logs and tables into the folder
# given. A time budget (default 450 s) keeps the whole run under 8 minutes: whatever does
# not fit is listed in OUT/skipped.txt instead of being run.
#   usage: bash bench/gpu_check.sh OUT_DIR        (SPECDEC_GPU_CHECK_BUDGET=seconds to change)
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
budget=${SPECDEC_GPU_CHECK_BUDGET:-450}
export PYTHONUNBUFFERED=1
status=0
: >"$out/skipped.txt"

left() { echo $((budget - SECONDS)); }

echo "== build (CUDA extension, sm_90)"
SPECDEC_CUDA_ARCHS=${SPECDEC_CUDA_ARCHS:-9.0} timeout 240 $py -m pip install --no-build-isolation --no-deps -q -e . \
  >"$out/build.log" 2>&1 || { echo "build failed (see build.log)"; tail -30 "$out/build.log"; status=1; }
$py -m specdec info | tee "$out/info.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/info.txt"

echo "== tests on the GPU: gpu-marked, then the Triton paths"
timeout 120 $py -m pytest tests -q -m gpu -p no:cacheprovider 2>&1 | tee "$out/tests_gpu.log" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 180 $py -m pytest tests -q -k triton -m "not gpu" -p no:cacheprovider 2>&1 | tee "$out/tests_triton.log" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== microbenchmarks (kernels first)"
for name in bench_tree_attention bench_verify bench_kv_rollback bench_model_ops bench_model bench_e2e; do
  if [ "$(left)" -lt 30 ]; then
    echo "$name: not run, the ${budget}s budget was spent" | tee -a "$out/skipped.txt"
    continue
  fi
  limit=$(( $(left) < 120 ? $(left) : 120 ))
  timeout "$limit" $py "bench/$name.py" --out "$out" >"$out/$name.log" 2>&1 || { echo "$name failed or timed out"; status=1; }
  grep '^|' "$out/$name.log" | head -60
done
echo "== done in ${SECONDS}s (status $status)"
exit $status
