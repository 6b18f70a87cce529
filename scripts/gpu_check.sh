#!/usr/bin/env bash
# One prepared GPU check: build against the machine's own torch (CUDA build), run the cuda-labelled
# tests and the GPU benchmarks, print a short table. Writes logs and JSON to $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/apex-gpu}
mkdir -p "$OUT"
PY=${APEX_GPU_PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DAPEX_PYTHON_EXECUTABLE="$(command -v "$PY")" \
  -DAPEX_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DAPEX_BUILD_EXAMPLES=OFF >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
grep -E "apex-cpp .*torch" "$OUT/configure.log"  # torch version; CUDA kernels, Gloo, NCCL found?
cmake --build build-gpu -j16 >"$OUT/build.log" 2>&1 || { grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
echo "build: $(($(date +%s) - start)) s"
(cd build-gpu && ctest -L cuda --output-on-failure --timeout 300) 2>&1 | tee "$OUT/ctest-cuda.log" | tail -25
(cd build-gpu && ctest -L unit -j8 --timeout 300) 2>&1 | tail -3
echo; echo "== apex-bench optim --device cuda =="
timeout 240 build-gpu/tools/apex-bench optim --device cuda --repeats 20 --warmup 3 \
  --json "$OUT/bench-optim-cuda.json" 2>&1 | tee "$OUT/bench-optim-cuda.txt" | tail -14
echo; echo "== apex-bench norm --device cuda =="
timeout 150 build-gpu/tools/apex-bench norm --device cuda --repeats 20 --warmup 3 \
  --json "$OUT/bench-norm-cuda.json" 2>&1 | tee "$OUT/bench-norm-cuda.txt" | tail -30
"$PY" scripts/norm_summary.py "$OUT/bench-norm-cuda.json" 2>&1 | tee "$OUT/bench-norm-summary.txt"
echo; echo "== apex-train --device cuda (transformer, O0/O1/O2, fp16) =="
timeout 120 build-gpu/tools/apex-train --device cuda --steps 100 --no-progress 2>&1 |
  tee "$OUT/train-cuda.txt" | tail -6
echo; echo "== apex-train --device cuda --nproc 1 (DDP over NCCL, O2) =="
timeout 120 build-gpu/tools/apex-train --device cuda --nproc 1 --opt-level O2 --steps 60 \
  --no-progress 2>&1 | tee "$OUT/train-ddp-cuda.txt" | tail -4
echo; echo "== Python package on CUDA (pip install ./python, python/tests/test_devices.py) =="
( CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 400 "$PY" -m pip install -q --no-build-isolation --no-deps \
    ./python >"$OUT/pip-install.log" 2>&1 || { tail -20 "$OUT/pip-install.log"; exit 1; }
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider python/tests/test_devices.py -rs 2>&1 |
    tee "$OUT/pytest-devices.txt" | tail -8 )
if command -v compute-sanitizer >/dev/null; then
  echo; echo "== compute-sanitizer (memcheck, racecheck) on one norm case =="
  for tool in memcheck racecheck; do
    timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      build-gpu/tests/normalization/apex_norm_cuda_tests --gtest_filter=NormCuda.MixedAndDeterministic \
      >"$OUT/sanitizer-$tool.log" 2>&1
    echo "$tool: exit $? (log in $OUT/sanitizer-$tool.log)"
  done
fi
echo; echo "== cuda tests =="
grep -E "Test +#" "$OUT/ctest-cuda.log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ \.+ */  /'
