include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS apex EXPORT apex_cppTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/apex DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT apex_cppTargets NAMESPACE apex:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/apex_cpp)

set(APEX_TORCH_DIR_HINT ${Torch_DIR})
configure_package_config_file(cmake/apex_cppConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/apex_cppConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/apex_cpp)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/apex_cppConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/apex_cppConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/apex_cppConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/apex_cpp)
