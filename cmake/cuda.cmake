# What a CUDA build (-DGGML_CUDA=ON) needs before ggml's own CMake looks for it, so that it also
# builds on a machine that has nvcc but neither a GPU, nor cuBLAS, nor the driver:
#
# - GPU architectures: CMAKE_CUDA_ARCHITECTURES (or the CUDAARCHS environment variable) as given;
#   else "native" where nvidia-smi sees a
#   GPU; else DFLASH_LLAMA_CUDA_ARCHS (default: the data-centre and desktop GPUs of the last
#   generations, as real code, so no PTX is compiled at start).
# - cuBLAS (ggml-cuda links it): the toolkit's own; else the `nvidia-cublas` wheel of the toolkit's
#   major version in the Python environment (setup.sh installs it when the toolkit has none).
# - The driver library (libcuda, for ggml's virtual-memory pool): where it is missing, ggml-cuda is
#   built with GGML_CUDA_NO_VMM, which needs only the runtime library.

set(DFLASH_LLAMA_CUDA_ARCHS "80-real;86-real;89-real;90-real" CACHE STRING
    "CUDA architectures of a build on a machine where no GPU is visible")
if (NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND DEFINED ENV{CUDAARCHS})
    set(CMAKE_CUDA_ARCHITECTURES $ENV{CUDAARCHS})
endif()
if (NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    find_program(DFLASH_NVIDIA_SMI nvidia-smi)
    set(_gpu_visible OFF)
    if (DFLASH_NVIDIA_SMI)
        execute_process(COMMAND ${DFLASH_NVIDIA_SMI} -L RESULT_VARIABLE _smi_rc OUTPUT_VARIABLE _smi_out ERROR_QUIET)
        if (_smi_rc EQUAL 0 AND _smi_out MATCHES "GPU [0-9]")
            set(_gpu_visible ON)
        endif()
    endif()
    if (_gpu_visible)
        set(CMAKE_CUDA_ARCHITECTURES native)
    else()
        set(CMAKE_CUDA_ARCHITECTURES ${DFLASH_LLAMA_CUDA_ARCHS})
    endif()
endif()
message(STATUS "dflash-llama: CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")

find_package(CUDAToolkit REQUIRED)

if (NOT CUDA_cublas_LIBRARY)
    execute_process(
        COMMAND ${Python_EXECUTABLE} -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        OUTPUT_VARIABLE _purelib OUTPUT_STRIP_TRAILING_WHITESPACE)
    set(_wheel ${_purelib}/nvidia/cu${CUDAToolkit_VERSION_MAJOR})
    set(_so ${CUDAToolkit_VERSION_MAJOR})
    if (NOT EXISTS ${_wheel}/lib/libcublas.so.${_so} OR NOT EXISTS ${_wheel}/include/cublas_v2.h)
        message(FATAL_ERROR "CUDA build: the CUDA toolkit at ${CUDAToolkit_LIBRARY_DIR} has no cuBLAS, and "
                            "${_wheel} holds none either: install the toolkit's cuBLAS, or "
                            "pip install 'nvidia-cublas==${CUDAToolkit_VERSION_MAJOR}.*' (setup.sh does)")
    endif()
    message(STATUS "dflash-llama: cuBLAS from the nvidia-cublas wheel, ${_wheel}")
    set(CUDA_cublas_LIBRARY   ${_wheel}/lib/libcublas.so.${_so}   CACHE FILEPATH "" FORCE)
    set(CUDA_cublasLt_LIBRARY ${_wheel}/lib/libcublasLt.so.${_so} CACHE FILEPATH "" FORCE)
    # FindCUDAToolkit made its imported targets before these were known: point them at the wheel
    foreach(_lib cublas cublasLt)
        if (NOT TARGET CUDA::${_lib})
            add_library(CUDA::${_lib} SHARED IMPORTED GLOBAL)
        endif()
        set_target_properties(CUDA::${_lib} PROPERTIES
            IMPORTED_LOCATION ${CUDA_${_lib}_LIBRARY}
            INTERFACE_INCLUDE_DIRECTORIES "${_wheel}/include;${CUDAToolkit_INCLUDE_DIRS}")
    endforeach()
    set_property(TARGET CUDA::cublas APPEND PROPERTY INTERFACE_LINK_LIBRARIES CUDA::cublasLt)
    # the module and the CLI find the wheel's libraries where they are installed
    list(APPEND CMAKE_BUILD_RPATH ${_wheel}/lib)
    list(APPEND CMAKE_INSTALL_RPATH ${_wheel}/lib)
endif()

if (NOT TARGET CUDA::cuda_driver AND NOT GGML_CUDA_NO_VMM)
    message(STATUS "dflash-llama: no CUDA driver library here: ggml-cuda built with GGML_CUDA_NO_VMM")
    set(GGML_CUDA_NO_VMM ON CACHE BOOL "" FORCE)
endif()
