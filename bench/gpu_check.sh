#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py says what it runs and writes): build, first light, tests and
# benchmarks within a time budget, results appended to OUT/summary.md as each stage ends, then one
# table of issue 34's targets (PASS / FAIL / not measured) from the benchmarks' JSON.
#   bash bench/gpu_check.sh OUT                  on a machine with an NVIDIA GPU (nothing is downloaded)
#   bash bench/gpu_check.sh --dry-run OUT        the same stages on the CPU (interpreter, tiny shapes)
#   bash bench/gpu_check.sh --stages a,b OUT     only the named stages
#   SPECDEC_GPU_CHECK_BUDGET=seconds             the budget (default 480; a dry run 600)
#   PYTHON=...                                   the interpreter (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's specdec, installed or not
exec "${PYTHON:-python3}" bench/gpu_check.py "$@"
