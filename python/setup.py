"""Builds the op library (python/CMakeLists.txt, part of apex-cpp's CMake project: the same kernels
as the C++ library) with CMake against the installed torch, and installs it as apex/_apex_cpp.so.

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
            import torch  # noqa: F401
        except ImportError as err:
            raise RuntimeError("apex-cpp builds against the installed torch: install torch first "
                               "and use pip install --no-build-isolation") from err
        if not os.path.exists(os.path.join(ROOT, "src", "CMakeLists.txt")):
            raise RuntimeError(f"apex-cpp: {ROOT} is not an apex-cpp checkout (python/ builds from "
                               "its parent folder)")
        build_dir = os.path.abspath(os.path.join(self.build_temp, "apex-cpp"))
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
        subprocess.check_call(
            ["cmake", "-S", ROOT, "-B", build_dir, *generator, "-DCMAKE_BUILD_TYPE=Release",
             f"-DAPEX_PYTHON_EXECUTABLE={sys.executable}", "-DAPEX_BUILD_PYTHON=ON",
             "-DAPEX_BUILD_TESTS=OFF", "-DAPEX_BUILD_EXAMPLES=OFF", "-DAPEX_BUILD_BENCHMARKS=OFF",
             "-DAPEX_BUILD_TOOLS=OFF"])
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "apex_python_ops",
                               "--parallel", jobs])
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(build_dir, "python", "_apex_cpp.so"), target)


setup(ext_modules=[Extension("apex._apex_cpp", sources=[])], cmdclass={"build_ext": CMakeBuild})
