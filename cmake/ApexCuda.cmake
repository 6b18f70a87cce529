# CUDA kernels are compiled by nvcc alone (they take plain structs, no ATen), so they build on a
# machine whose torch is a CPU build. Host code calls them only when torch itself has CUDA.
include(CheckLanguage)
set(APEX_CUDA_ENABLED OFF)
if(NOT APEX_WITH_CUDA STREQUAL "OFF")
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 has no CUDA20 dialect for nvcc; the kernels need only C++17
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(APEX_CUDA_ENABLED ON)
  elseif(APEX_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "APEX_WITH_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER)")
  endif()
endif()
