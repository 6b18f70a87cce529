"""Builds the op library (python/CMakeLists.txt, part of apex-cpp's CMake project: the same kernels
as the C++ library) with CMake against the installed torch, and installs it as apex/_apex_cpp.so,
beside apex/_apex_cpp_stable.so (the multi-tensor ops on LibTorch's stable ABI, for any torch from
2.10 on) and apex/_eager.so (the norms' direct eager entry, a CPython module for the building
Python).

    pip install --no-build-isolation <checkout>/python
"""
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class CMakeBuild(build_ext):
    def get_ext_filename(self, ext_name):
        # A plain shared library loaded by torch.ops.load_library: no Python ABI tag.
        return os.path.join(*ext_name.split(".")) + ".so"

    def build_extension(self, ext):
        try:
            import torch
        except ImportError as err:
            raise RuntimeError("apex-cpp builds against the installed torch: install torch first "
                               "and use pip install --no-build-isolation") from err
        if not os.path.exists(os.path.join(ROOT, "src", "CMakeLists.txt")):
            raise RuntimeError(f"apex-cpp: {ROOT} is not an apex-cpp checkout (python/ builds from "
                               "its parent folder)")
        # One build folder per torch: a CMake cache keeps the LibTorch it first found, so a folder
        # shared between venvs would build for the wrong torch.
        import hashlib
        tag = hashlib.sha1(f"{torch.__version__} {torch.__file__}".encode()).hexdigest()[:10]
        build_dir = os.path.abspath(os.path.join(self.build_temp, f"apex-cpp-{tag}"))
        torch_dir = os.path.join(torch.utils.cmake_prefix_path, "Torch")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
        subprocess.check_call(
            ["cmake", "-S", ROOT, "-B", build_dir, *generator, "-DCMAKE_BUILD_TYPE=Release",
             f"-DAPEX_PYTHON_EXECUTABLE={sys.executable}", f"-DTorch_DIR={torch_dir}",
             "-DAPEX_BUILD_PYTHON=ON",
             "-DAPEX_BUILD_TESTS=OFF", "-DAPEX_BUILD_EXAMPLES=OFF", "-DAPEX_BUILD_BENCHMARKS=OFF",
             "-DAPEX_BUILD_TOOLS=OFF"])
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "apex_python_ops",
                               "apex_python_eager", "apex_python_stable", "--parallel", jobs])
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(build_dir, "python", "_apex_cpp.so"), target)
        # The multi-tensor ops on LibTorch's stable ABI (csrc/stable_ops.cpp): what apex loads
        # under a later torch than the one it was built for.
        shutil.copyfile(os.path.join(build_dir, "python", "_apex_cpp_stable.so"),
                        os.path.join(os.path.dirname(target), "_apex_cpp_stable.so"))
        # The norms' direct eager entry (csrc/eager.cpp): a CPython module for this Python, built
        # where Python's headers are (CMake warns otherwise, and the package uses torch.ops alone).
        eager = os.path.join(build_dir, "python", "_eager.so")
        eager_target = os.path.join(os.path.dirname(target), "_eager.so")
        if os.path.exists(eager):
            shutil.copyfile(eager, eager_target)
        elif os.path.exists(eager_target):
            os.remove(eager_target)  # one built for another torch must not be imported
        # The torch the op library was compiled against: apex refuses to load it under another.
        with open(os.path.join(os.path.dirname(target), "_build_info.py"), "w") as f:
            f.write(f"TORCH_VERSION = {torch.__version__!r}\n")


setup(ext_modules=[Extension("apex._apex_cpp", sources=[])], cmdclass={"build_ext": CMakeBuild})
