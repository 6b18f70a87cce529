// The CUDA backend's multi-tensor kernels, compiled unchanged by the host compiler against the
// emulation (include/cuda_runtime.h shadows the toolkit's).
// (nvcc's `#pragma unroll` means nothing to g++: the build passes -Wno-unknown-pragmas here.)
#include "kernels/cuda/multi_tensor.cu"
