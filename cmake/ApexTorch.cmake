# Find LibTorch. Order: an explicit Torch_DIR / CMAKE_PREFIX_PATH, else the installed Python
# torch (torch.utils.cmake_prefix_path) of APEX_PYTHON_EXECUTABLE.
if(NOT APEX_PYTHON_EXECUTABLE)
  if(EXISTS /opt/apex-cpp/venv/bin/python)
    set(_apex_py /opt/apex-cpp/venv/bin/python)
  else()
    find_program(_apex_py NAMES python3 python)
  endif()
  set(APEX_PYTHON_EXECUTABLE ${_apex_py} CACHE FILEPATH "Python whose torch package is used")
endif()

# A CUDA LibTorch's config puts gencode flags for TORCH_CUDA_ARCH_LIST into CMAKE_CUDA_FLAGS (and
# turns CMAKE_CUDA_ARCHITECTURES off); left unset it probes the GPU and falls back to every
# architecture, some of which a newer nvcc refuses (compute_50 under CUDA 13). Derive the list from
# CMAKE_CUDA_ARCHITECTURES ("90" -> "9.0"), default 8.0 and 9.0 as the kernels' own default.
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(_apex_archs 80 90)
  if(CMAKE_CUDA_ARCHITECTURES)
    set(_apex_archs ${CMAKE_CUDA_ARCHITECTURES})
  endif()
  set(TORCH_CUDA_ARCH_LIST "")
  foreach(_arch IN LISTS _apex_archs)
    if(_arch STREQUAL "native")
      set(_arch "Auto")  # torch's name for the GPUs of this machine
    elseif(_arch MATCHES "^all")
      set(_arch "All")
    else()
      set(_ptx "")
      if(_arch MATCHES "-virtual$")
        set(_ptx "+PTX")  # keep the PTX a -virtual architecture asks for
      endif()
      string(REGEX REPLACE "-(real|virtual)$" "" _arch "${_arch}")
      string(REGEX REPLACE "^([0-9]+)([0-9])([a-z]?)$" "\\1.\\2\\3" _arch "${_arch}")
      string(APPEND _arch "${_ptx}")
    endif()
    list(APPEND TORCH_CUDA_ARCH_LIST "${_arch}")
  endforeach()
endif()

# The torch wheel links kineto into libtorch_cpu and ships no libkineto, so TorchConfig.cmake warns
# "library kineto not found" on every configure; naming libtorch_cpu as kineto's library is true
# and silences it (apex_cppConfig.cmake does the same for consumers).
if(NOT kineto_LIBRARY)
  set(_apex_torch_lib "")
  if(Torch_DIR)
    set(_apex_torch_lib "${Torch_DIR}/../../../lib")
  elseif(APEX_PYTHON_EXECUTABLE)
    execute_process(
      COMMAND ${APEX_PYTHON_EXECUTABLE} -c
              "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))"
      OUTPUT_VARIABLE _apex_torch_lib OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
  if(_apex_torch_lib AND EXISTS "${_apex_torch_lib}/libtorch_cpu.so"
     AND NOT EXISTS "${_apex_torch_lib}/libkineto.a")
    get_filename_component(_apex_torch_lib "${_apex_torch_lib}" REALPATH)
    set(kineto_LIBRARY "${_apex_torch_lib}/libtorch_cpu.so"
        CACHE FILEPATH "kineto is linked into this LibTorch's libtorch_cpu" FORCE)
  endif()
endif()

find_package(Torch QUIET CONFIG)
if(NOT Torch_FOUND)
  if(NOT APEX_PYTHON_EXECUTABLE)
    message(FATAL_ERROR "LibTorch not found: set Torch_DIR, or install torch into a Python "
                        "and pass -DAPEX_PYTHON_EXECUTABLE=/path/to/python (scripts/setup does this)")
  endif()
  execute_process(
    COMMAND ${APEX_PYTHON_EXECUTABLE} -c "import torch; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _apex_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "${APEX_PYTHON_EXECUTABLE} cannot import torch; run scripts/setup")
  endif()
  list(APPEND CMAKE_PREFIX_PATH ${_apex_torch_prefix})
  find_package(Torch REQUIRED CONFIG)
endif()

# Torch's config prepends its own flags to CMAKE_CXX_FLAGS; the imported target carries them too.
if(TARGET torch_cuda OR TARGET c10_cuda OR TORCH_CUDA_LIBRARIES)
  set(APEX_TORCH_HAS_CUDA ON)
else()
  set(APEX_TORCH_HAS_CUDA OFF)
endif()
