"""cffi builder of ``kvlocal._kernels`` from kernels/cpu/*.c (run by setup.py at install time)."""

from pathlib import Path

from cffi import FFI

CPU = Path(__file__).resolve().parent / "cpu"
HEADER = CPU / "kvlocal_kernels.h"

ffibuilder = FFI()
ffibuilder.cdef(HEADER.read_text())  # cffi strips the comments
ffibuilder.set_source(
    "kvlocal._kernels",
    '#include "kvlocal_kernels.h"',
    sources=[str(p.relative_to(CPU.parent.parent)) for p in sorted(CPU.glob("*.c"))],
    include_dirs=[str(CPU.relative_to(CPU.parent.parent))],
    # the SIMD templates (*.inc) and headers are #included: an edit to one must rebuild the extension too
    depends=[str(p.relative_to(CPU.parent.parent)) for p in sorted([*CPU.glob("*.inc"), *CPU.glob("*.h")])],
    extra_compile_args=["-O3", "-std=c11"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
