"""Only the native part of the build lives here: cffi compiles kernels/cpu into kvlocal._kernels.

Everything else is in pyproject.toml. A missing C compiler fails here, at install, with the
compiler's own message — not later at import.
"""

from setuptools import setup

setup(cffi_modules=["kernels/build_cpu.py:ffibuilder"])
