#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, build the CUDA extension, run the
# test suite on the GPU (gpu-marked tests and every kernel test's Triton path) and
# every microbenchmark in bench/, writing logs and tables into the folder given.
#   usage: bash bench/gpu_check.sh OUT_DIR        (about 8 minutes on an H200)
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

echo "== build (CUDA extension, sm_90)"
SPECDEC_CUDA_ARCHS=${SPECDEC_CUDA_ARCHS:-9.0} timeout 300 $py -m pip install --no-build-isolation --no-deps -q -e . \
  >"$out/build.log" 2>&1 || { echo "build failed (see build.log)"; tail -30 "$out/build.log"; status=1; }
$py -m specdec info | tee "$out/info.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/info.txt"

echo "== tests on the GPU"
timeout 240 $py -m pytest tests -q -x -p no:cacheprovider --timeout=120 2>&1 | tee "$out/tests.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== microbenchmarks"
for script in bench/bench_*.py; do
  name=$(basename "$script" .py)
  timeout 120 $py "$script" --out "$out" >"$out/$name.log" 2>&1 || { echo "$name failed"; status=1; }
  tail -n +1 "$out/$name.log" | grep '^|' | head -60
done
exit $status
