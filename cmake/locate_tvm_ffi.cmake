# Locate tvm-ffi's CMake package via the Python interpreter that will import the package.
# Honours a preset tvm_ffi_DIR or Python_EXECUTABLE (setup.py passes the latter).
if(NOT tvm_ffi_DIR)
  find_package(Python COMPONENTS Interpreter REQUIRED)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -m tvm_ffi.config --cmakedir
    OUTPUT_VARIABLE _tvm_ffi_cmakedir
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _tvm_ffi_rc
    ERROR_VARIABLE _tvm_ffi_err)
  if(NOT _tvm_ffi_rc EQUAL 0 OR NOT _tvm_ffi_cmakedir)
    message(FATAL_ERROR
      "Could not run `${Python_EXECUTABLE} -m tvm_ffi.config --cmakedir` "
      "(install apache-tvm-ffi==0.1.14.post1): ${_tvm_ffi_err}")
  endif()
  set(tvm_ffi_DIR "${_tvm_ffi_cmakedir}" CACHE PATH "tvm-ffi CMake package directory")
endif()
find_package(tvm_ffi CONFIG REQUIRED)
message(STATUS "tvm_ffi found at ${tvm_ffi_DIR}")
