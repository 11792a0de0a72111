"""Build the Cython extensions: every .pyx under pagedkv/ becomes one extension module.

The CUDA sources in the top-level cuda/ folder ship inside the wheel as the package
``pagedkv._cuda_src`` so that ``importlib.resources`` finds them after a non-editable
install.

The sdist ships the .pyx/.pxd/.h sources, never the generated .c files (MANIFEST.in), so
an install from it cythonizes here; a wheel carries the compiled modules and no .c files.
"""
import os
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
# pip gives no way to pass -j: every install (the README's, the sdist's, the vLLM venv's)
# would compile the ~10 modules one at a time. PAGEDKV_BUILD_JOBS overrides.
JOBS = int(os.environ.get("PAGEDKV_BUILD_JOBS") or os.cpu_count() or 1)


class ParallelBuildExt(build_ext):
    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = JOBS


COMPILER_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "nonecheck": False,
    "embedsignature": True,
}


def extensions():
    exts = []
    for pyx in sorted(ROOT.glob("pagedkv/**/*.pyx")):
        rel = pyx.relative_to(ROOT).with_suffix("")
        exts.append(
            Extension(
                ".".join(rel.parts),
                [str(pyx.relative_to(ROOT))],
                # cuda/ holds quant_scalar.h, the scalar quantization helpers the CPU
                # loops share with the kernels (ops/quant_rows.h includes it)
                include_dirs=[np.get_include(), str(pyx.parent), str(ROOT / "cuda")],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=["-O3", "-fno-strict-aliasing"],
            )
        )
    return cythonize(exts, compiler_directives=COMPILER_DIRECTIVES, quiet=True, nthreads=JOBS if JOBS > 1 else 0)


setup(
    packages=[
        "pagedkv",
        "pagedkv._core",
        "pagedkv.config",
        "pagedkv.manager",
        "pagedkv.groups",
        "pagedkv.format",
        "pagedkv.store",
        "pagedkv.tools",
        "pagedkv.sched",
        "pagedkv.ops",
        "pagedkv.kernels",
        "pagedkv.integrations",
        "pagedkv.compat",
        "pagedkv.tiers",
        "pagedkv.transfer",
        "pagedkv.cli",
        "pagedkv.testing",
        "pagedkv._cuda_src",
    ],
    package_dir={"pagedkv._cuda_src": "cuda"},
    package_data={
        "pagedkv": ["py.typed", "*.pyi"],
        "pagedkv._core": ["*.pxd", "*.pyi", "*.h"],
        "pagedkv.ops": ["*.pxd", "*.pyi", "*.h"],
        "pagedkv._cuda_src": ["*.cu", "*.cuh", "*.h"],
    },
    # cythonize writes its .c files beside the .pyx: they are build products, not package data
    exclude_package_data={"": ["*.c", "*.cpp"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": ParallelBuildExt},
    zip_safe=False,
)
