# Compiler launcher, warnings and sanitizers shared by every apex-cpp target.
find_program(APEX_CCACHE ccache)
if(APEX_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  # Precompiled headers need these sloppiness settings to hit the cache.
  set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env
      CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime ${APEX_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${APEX_CCACHE})
endif()

add_library(apex_warnings INTERFACE)
target_compile_options(apex_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wshadow=local -Wnon-virtual-dtor
  -Wno-unused-parameter $<$<BOOL:${APEX_WERROR}>:-Werror>>)

if(APEX_SANITIZE)
  string(REPLACE ";" "," _apex_san "${APEX_SANITIZE}")
  add_compile_options(-fsanitize=${_apex_san} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${_apex_san})
endif()
