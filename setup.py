"""Build script: compiles the C++ core (``libtvm_cascade_core.so``) with CMake.

The library is placed at ``tvm_cascade/lib/libtvm_cascade_core.so`` inside the package,
for regular wheels (``pip install .``) and in the source tree for editable installs
(``pip install -e .``).  Metadata lives in pyproject.toml.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIB_FILE = "libtvm_cascade_core.so"


class CMakeExtension(Extension):
    """An extension whose single output file is produced by CMake."""

    def __init__(self, name: str, target: str):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    """build_ext that configures/builds the CMake project and copies the shared library."""

    def get_ext_filename(self, fullname):
        # Called both with the full dotted name and with its last component only.
        for ext in self.extensions:
            if isinstance(ext, CMakeExtension):
                if fullname == ext.name:
                    return os.path.join(*fullname.split(".")[:-1], LIB_FILE)
                if fullname == ext.name.rsplit(".", 1)[-1]:
                    return LIB_FILE
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self):
        # Editable installs copy the library into python/tvm_cascade/lib/, which is a
        # build output directory (git-ignored) and may not exist yet.
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if isinstance(ext, CMakeExtension):
                package = ".".join(ext.name.split(".")[:-1])
                Path(build_py.get_package_dir(package)).mkdir(parents=True, exist_ok=True)
        super().copy_extensions_to_source()

    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake (>= 3.18) is required to build tvm-cascade's C++ core")
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        # Named on every configure: an isolated build environment (pip install .) is
        # deleted afterwards, and a cache naming its tvm-ffi would fail the next build.
        tvm_ffi_dir = subprocess.check_output(
            [sys.executable, "-m", "tvm_ffi.config", "--cmakedir"], text=True
        ).strip()
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_temp),
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dtvm_ffi_DIR={tvm_ffi_dir}",
        ]
        # A cache from another interpreter/env would point at the wrong tvm-ffi.
        cache = build_temp / "CMakeCache.txt"
        if cache.exists() and sys.executable not in cache.read_text(errors="ignore"):
            cache.unlink()
        subprocess.check_call(configure)
        jobs = str(self.parallel or os.cpu_count() or 1)
        subprocess.check_call(
            [cmake, "--build", str(build_temp), "--config", cfg, "--target", ext.target,
             "--parallel", jobs]
        )
        built = build_temp / "lib" / LIB_FILE
        if not built.is_file():
            raise RuntimeError(f"CMake did not produce {built}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, dest)


setup(
    ext_modules=[CMakeExtension("tvm_cascade.lib.libtvm_cascade_core", "tvm_cascade_core")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
