#!/usr/bin/env bash
# One prepared GPU check: build against the machine's own torch (CUDA build), run the cuda-labelled
# tests, DDP over NCCL, the Python package on CUDA and the GPU benchmarks, print a short table.
# Writes logs and JSON to $OUT if set. Steps run in order of importance (correctness first) and a
# step whose time limit would overrun APEX_GPU_BUDGET_S (default 570 s, under the device tool's
# 600 s per command) is skipped with a line saying so: rerun with APEX_GPU_STEPS naming the rest.
#
#   scripts/gpu_check.sh                                  # every step, within the budget
#   APEX_GPU_STEPS="bench-optim bench-norm" scripts/gpu_check.sh   # (the build is reused)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/apex-gpu}
mkdir -p "$OUT"
PY=${APEX_GPU_PYTHON:-python3}
BUDGET=${APEX_GPU_BUDGET_S:-570}
STEPS=${APEX_GPU_STEPS:-"cuda-tests ddp python train bench-optim bench-norm sanitizer"}
start=$(date +%s)

# step NAME LIMIT_S COMMAND...: runs COMMAND (under `timeout LIMIT_S`) if NAME is wanted and the
# budget allows it.
step() {
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local elapsed=$(($(date +%s) - start))
  if ((elapsed + limit > BUDGET)); then
    echo "== $name: skipped (${elapsed} s spent, it may take ${limit} s of a ${BUDGET} s budget)"
    return 0
  fi
  echo; echo "== $name (at ${elapsed} s) =="
  timeout "$limit" "$@"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DAPEX_PYTHON_EXECUTABLE="$(command -v "$PY")" \
  -DAPEX_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DAPEX_BUILD_EXAMPLES=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
grep -E "apex-cpp .*torch" "$OUT/configure.log"  # torch version; CUDA kernels, Gloo, NCCL found?
cmake --build build-gpu -j16 >"$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(($(date +%s) - start)) s"

step cuda-tests 200 bash -c 'cd build-gpu && ctest -L cuda -j4 --output-on-failure --timeout 150' 2>&1 |
  tee "$OUT/ctest-cuda.log" | tail -25
step ddp 90 build-gpu/tools/apex-train --device cuda --nproc 1 --opt-level O2 --steps 60 \
  --no-progress 2>&1 | tee "$OUT/train-ddp-cuda.txt" | tail -4
step python 300 bash -c "CMAKE_BUILD_PARALLEL_LEVEL=16 '$PY' -m pip install -q --no-build-isolation \
  --no-deps ./python >'$OUT/pip-install.log' 2>&1 || { tail -20 '$OUT/pip-install.log'; exit 1; }
  '$PY' -m pytest -q -p no:cacheprovider python/tests/test_devices.py -rs" 2>&1 |
  tee "$OUT/pytest-devices.txt" | tail -8
step train 90 build-gpu/tools/apex-train --device cuda --steps 100 --no-progress 2>&1 |
  tee "$OUT/train-cuda.txt" | tail -6
step bench-optim 150 build-gpu/tools/apex-bench optim --device cuda --repeats 20 --warmup 3 \
  --json "$OUT/bench-optim-cuda.json" 2>&1 | tee "$OUT/bench-optim-cuda.txt" | tail -14
step bench-norm 120 build-gpu/tools/apex-bench norm --device cuda --repeats 20 --warmup 3 \
  --json "$OUT/bench-norm-cuda.json" 2>&1 | tee "$OUT/bench-norm-cuda.txt" | tail -30
[ -f "$OUT/bench-norm-cuda.json" ] &&
  "$PY" scripts/norm_summary.py "$OUT/bench-norm-cuda.json" 2>&1 | tee "$OUT/bench-norm-summary.txt"
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    step sanitizer 60 bash -c "compute-sanitizer --tool $tool --error-exitcode 9 \
      build-gpu/tests/normalization/apex_norm_cuda_tests \
      --gtest_filter=NormCuda.MixedAndDeterministic >'$OUT/sanitizer-$tool.log' 2>&1;
      echo '$tool: exit' \$? '(log in $OUT/sanitizer-$tool.log)'"
  done
fi
if [ -f "$OUT/ctest-cuda.log" ]; then
  echo; echo "== cuda tests =="
  grep -E "Test +#" "$OUT/ctest-cuda.log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ \.+ */  /'
fi
echo "total: $(($(date +%s) - start)) s"
