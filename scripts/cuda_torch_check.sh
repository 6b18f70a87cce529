#!/usr/bin/env bash
# Builds apex-cpp against a CUDA build of torch on a machine without a GPU, and runs the CPU
# tests on it: what a lent GPU machine would build (its torch is 2.11.0+cu130), checked before
# device time is spent. Needs nvcc (CUDA 13 here) and network access to Python's registry.
#
#   scripts/cuda_torch_check.sh            # torch 2.11.0, build in build-cuda-torch
#   APEX_CUDA_TORCH=2.12.0 scripts/cuda_torch_check.sh
#
# The wheel is unpacked (not installed) under $APEX_CUDA_TORCH_DIR; the CUDA libraries it links
# (cuBLAS, cuDNN, NCCL, ...) are not needed to run CPU code, so empty stand-ins with their sonames
# satisfy the loader. Nothing here touches ./build.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${APEX_CUDA_TORCH:-2.11.0}
ROOT=${APEX_CUDA_TORCH_DIR:-/opt/apex-cpp/cuda-torch-$VERSION}
BUILD=${APEX_BUILD_DIR:-build-cuda-torch}
PIP=${APEX_PIP:-/opt/apex-cpp/venv/bin/pip}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=${CUDACXX:-$CUDA_HOME/bin/nvcc}

if [ ! -f "$ROOT/.torch" ]; then  # (a marker: an unpack cut short is redone)
  mkdir -p "$ROOT/wheels"
  "$PIP" download --no-deps -d "$ROOT/wheels" "torch==$VERSION"
  python3 -m zipfile -e "$(ls "$ROOT"/wheels/torch-"$VERSION"[-+]*.whl | head -1)" "$ROOT"
  touch "$ROOT/.torch"
fi
# The headers that a CUDA torch's own headers include (cuBLAS, cuSPARSE, cuSOLVER, NCCL), from
# the wheels torch's metadata pins, unpacked beside torch where pip would install them.
if [ ! -f "$ROOT/.headers" ]; then
  specs=$(sed -n 's/^Requires-Dist: \(cuda-toolkit\|nvidia-nccl-cu[0-9]*\)\(\[[^]]*\]\)\{0,1\}\(==[^;]*\);.*/\1\2\3/p' \
          "$ROOT"/torch-*.dist-info/METADATA | sed 's/\[.*\]/[cublas,cusolver,cusparse]/')
  set -f  # the specs hold [extras]: no globbing
  # shellcheck disable=SC2086
  "$PIP" download -d "$ROOT/wheels" $specs
  set +f
  python3 - "$ROOT" <<'EOF'
import glob, sys, zipfile
root = sys.argv[1]
for wheel in glob.glob(f"{root}/wheels/nvidia_*.whl"):
    z = zipfile.ZipFile(wheel)
    for name in z.namelist():
        if "/include/" in name:
            z.extract(name, root)
EOF
  touch "$ROOT/.headers"
fi
# Empty libraries under the sonames libtorch_cuda asks for and the toolkit here lacks, each with
# the symbol-version names torch's libraries need from it (CUDA's libraries version by soname).
mkdir -p "$ROOT/stubs"
echo 'void apex_cuda_stub(void) {}' >"$ROOT/stubs/stub.c"
for lib in $(LD_LIBRARY_PATH="$ROOT/stubs:$CUDA_HOME/lib64" ldd "$ROOT"/torch/lib/*.so 2>/dev/null |
             awk '/not found/ {print $1}' | sort -u); do
  versions=$(for so in "$ROOT"/torch/lib/*.so; do readelf -V --wide "$so"; done |
             awk -v lib="$lib" '/Version needs section/ {file = ""} /File:/ {file = $5}
                                  /Name:/ && file == lib {print $3}' | sort -u)
  : >"$ROOT/stubs/$lib.map"
  for v in ${versions:-$lib}; do
    printf '%s { global: apex_cuda_stub; };\n' "$v" >>"$ROOT/stubs/$lib.map"
  done
  gcc -shared -fPIC -Wl,-soname,"$lib" -Wl,--version-script,"$ROOT/stubs/$lib.map" \
    -o "$ROOT/stubs/$lib" "$ROOT/stubs/stub.c"
done
export LD_LIBRARY_PATH="$ROOT/stubs:$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

link="-Wl,--allow-shlib-undefined -Wl,-rpath-link,$ROOT/stubs"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$ROOT/torch/share/cmake" -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_HOME" \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES=90 -DAPEX_WITH_CUDA=ON \
  -DAPEX_WITH_NCCL=ON -DAPEX_WERROR=ON \
  -DAPEX_BUILD_EXAMPLES=OFF -DCMAKE_EXE_LINKER_FLAGS="$link" -DCMAKE_SHARED_LINKER_FLAGS="$link" \
  | grep -E "apex-cpp .*torch"
cmake --build "$BUILD" -j"$(nproc)"
(cd "$BUILD" && ctest -LE cuda -j"$(nproc)" --timeout 600 --output-on-failure)
