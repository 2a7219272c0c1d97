"""What ``ggml_patches/build.py`` recorded about the llama.cpp it built, and the attention path that follows on Metal.

The patch series' Metal kernels (flash attention with the per-KV-head bias) are compiled by the Mac that builds
them, and only there: when they do not compile, build.py builds without that patch and says so in a record inside
llama-cpp-python's package (``llama_cpp/kvlocal_build.json``: the patches applied, those left out and why). Without
it ggml-metal's flash attention does not know the bias and would drop it, while the soft-max attention path adds
it on every backend: a cache that carries a bias (merges, head budgets) then keeps to the soft-max path on Metal.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from kvlocal.errors import UsageError
from kvlocal.runtime.kvquant import FLOAT_TYPES

# written by ggml_patches/build.py (its RECORD) into llama-cpp-python's package, beside the lib/ folder it describes
RECORD = "kvlocal_build.json"
METAL_REGISTRY = "MTL :"  # ggml-metal's backend registry in llama_print_system_info


@dataclass(frozen=True)
class MetalBias:
    """How an attention bias reaches a Metal build's attention: ``metal`` (the library has ggml-metal), ``flash`` (its
    flash attention adds the bias: the Metal patch is in), ``patches`` (that patch's number, or the ones left out)
    and ``why`` (what build.py said, for a soft-max fallback)."""

    metal: bool
    flash: bool
    patches: str = ""
    why: str = ""

    def describe(self) -> str:
        """``kvlocal doctor``'s line (its ``metal`` row)."""
        if not self.metal:
            return "not a Metal build"
        if self.flash:
            return f"bias: flash attention ({self.patches})"
        return f"bias: soft-max fallback ({self.why})"


def read_record(library: str, package: Path | None = None) -> dict | None:
    """build.py's record of the library at ``library`` (a path of libllama): the record in llama-cpp-python's package
    (``package``: the one imported) when the library is that package's own (``lib/``), else None (LLAMA_CPP_LIB_PATH
    named another)."""
    if package is None:
        import llama_cpp

        package = Path(llama_cpp.__file__).parent
    package = package.resolve()
    path = package / RECORD
    if Path(library).resolve().parent != package / "lib" or not path.is_file():
        return None
    return json.loads(path.read_text())


def metal_bias_of(system_info: str, record: dict | None, library: str = "") -> MetalBias:
    """The attention path for a bias on a library whose ``llama_print_system_info`` is ``system_info``, given build.py's
    ``record`` (None: none was found beside ``library``; then the Metal patch is taken as unverified)."""
    if METAL_REGISTRY not in system_info:
        return MetalBias(metal=False, flash=False)
    if record is None:
        return MetalBias(metal=True, flash=False, why=f"no kvlocal build record beside {library or 'the library'}: "
                                                      f"rebuild with `python ggml_patches/build.py --rebuild`")
    metal = record.get("metal_patches", [])
    if not metal:
        return MetalBias(metal=True, flash=False, why="the build has no Metal patch")
    left = [name for name in metal if name in record.get("left_out", {})]
    numbers = ", ".join(name[:4] for name in (left or metal))
    return MetalBias(metal=True, flash=not left, patches=numbers, why=f"{numbers} did not compile" if left else "")


@functools.lru_cache(maxsize=None)
def metal_bias() -> MetalBias:
    """:func:`metal_bias_of` for the loaded runtime."""
    from kvlocal.runtime.library import runtime_info

    info = runtime_info()
    return metal_bias_of(info.system_info, read_record(info.library), info.library)


def flash_attention(requested: bool, type_v: int | None, *, biased: bool, offloaded: bool,
                    metal: MetalBias | None = None, head_dims: tuple[int, int] | None = None,
                    cuda: bool | None = None) -> bool:
    """Whether a context runs flash attention: when ``requested``, or where llama.cpp stores the V cache (``type_v``)
    only with it (any type but the default F16) — except on the GPU (``offloaded``) where it would not run there:
    on a CUDA build (``cuda``; the loaded runtime's by default) for head sizes (``head_dims``: K, V) it has no kernel
    for (:mod:`kvlocal.runtime.fallbacks`: said once; the soft-max path instead, or the cost where llama.cpp needs
    flash attention), and for a cache that carries a bias (``biased``) on a Metal build whose flash attention lacks
    the bias (``metal``, :func:`metal_bias` by default): there the soft-max path adds it. UsageError for a quantized V
    cache there (llama.cpp stores it only with flash attention)."""
    wanted = requested or type_v not in (None, 1)
    if wanted and offloaded and head_dims is not None:
        from kvlocal.runtime.fallbacks import cuda_flash_gap, is_cuda_build, say_once

        gap = cuda_flash_gap(*head_dims) if (is_cuda_build() if cuda is None else cuda) else None
        if gap and type_v in (None, *FLOAT_TYPES):
            say_once(f"{gap}: attention takes the soft-max path, which runs on the GPU")
            return False
        if gap:
            say_once(f"{gap}, and a quantized V cache needs it: each layer's attention runs on the CPU, its K/V "
                     f"copied at every token (-ctv f16 keeps attention on the GPU)")
    if not (wanted and biased and offloaded):
        return wanted
    metal = metal or metal_bias()
    if not metal.metal or metal.flash:
        return True
    if type_v not in (None, *FLOAT_TYPES):
        raise UsageError(f"a quantized V cache needs flash attention, which on this Metal build has no attention bias "
                         f"({metal.why}): use an F16 V cache (-ctv f16), -ngl 0, or a method without a bias")
    return False
