"""A Mac install that cannot fail on the patch series' Metal kernels (ggml_patches/build.py, kvlocal.runtime.buildinfo).

No Mac here: build.py's fallback runs on the real source package and the real patches with the compile step
simulated (a Metal library that does not compile while 0006's kernels are in the tree, as ggml-metal reports it
when it compiles its embedded kernels at load); the record that build leaves in its wheel then drives
``kvlocal doctor``'s line and the engine's choice of attention path, with the Metal registry the loaded library
would list. The engine runs the real llama.cpp on a tiny model: on the soft-max path the cache stores V
transposed, with flash attention in rows — what llama.cpp did is read from its own state.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import REPO
from policy import missing

sys.path.insert(0, str(REPO / "ggml_patches"))
sys.path.insert(0, str(REPO / "tests" / "reference"))

import build  # noqa: E402
import tiny_gguf  # noqa: E402

from kvlocal.cli import main as cli  # noqa: E402
from kvlocal.errors import UsageError  # noqa: E402
from kvlocal.runtime import Model, buildinfo, flash_attention  # noqa: E402
from kvlocal.runtime.buildinfo import MetalBias, metal_bias_of  # noqa: E402
from kvlocal.runtime.state import read_seq  # noqa: E402

# what llama_print_system_info says on a Mac: ggml-metal's registry before the CPU's
METAL_INFO = "MTL : EMBED_LIBRARY = 1 | CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | ACCELERATE = 1 |"
METAL_PATCH = next(p for p in build.patches() if build.metal_only(p))
# a Metal kernel file the patch changes: which version a build's tree holds tells whether the patch was applied
KERNEL = "vendor/llama.cpp/" + next(line.split()[2][2:] for line in METAL_PATCH.read_text().splitlines()
                                    if line.startswith("diff --git") and line.endswith(".metal"))
# ggml-metal's report when its kernels do not compile (ggml_metal_library_compile_all, at load)
METAL_ERROR = "ggml_metal_library_compile_all: error compiling source: program_source:291:21: error: use of undeclared identifier 'kvb'"


def sdist() -> Path:
    path = build.cache_dir() / "src" / build.SDIST
    if not path.exists():
        missing(f"the llama-cpp-python source package is not in {path.parent}: run ./setup.sh")
    return path


class SimulatedBuild:
    """build.py's compile step on a machine without a Mac: each call notes the tree's Metal kernel file; with
    ``fails_on_patch`` a tree holding the patch's version fails as ggml-metal reports it (``log``), any other tree
    gives a wheel of the tree's package (its build record included), as pip's build of the real tree would."""

    def __init__(self, log: str | None = METAL_ERROR):
        self.log, self.kernels = log, []

    def __call__(self, tree: Path, env: dict, out: Path, metal: bool) -> str | None:
        kernel = (tree / KERNEL).read_bytes()
        self.kernels.append(hashlib.sha256(kernel).hexdigest())
        if self.log is not None and kernel != pristine_kernel():
            return self.log
        with zipfile.ZipFile(out / f"llama_cpp_python-{build.VERSION}-py3-none-any.whl", "w") as z:
            for f in (tree / "llama_cpp").rglob("*"):
                if f.is_file():
                    z.write(f, f.relative_to(tree).as_posix())
        return None


@functools.lru_cache(maxsize=None)
def pristine_kernel() -> bytes:
    with tarfile.open(sdist()) as tar:
        return tar.extractfile(f"llama_cpp_python-{build.VERSION}/{KERNEL}").read()


@pytest.mark.slow(22)
def test_a_metal_build_that_fails_with_the_metal_patch_is_built_without_it(tmp_path, capsys, monkeypatch):
    """The first build (every patch) fails in ggml-metal; the second leaves out the Metal-only patch and no other,
    and its wheel's record says so with ggml-metal's line. ``kvlocal doctor`` on that record says the soft-max
    fallback; the same record without a patch left out, flash attention."""
    simulated = SimulatedBuild()
    wheel = build.build_wheel(sdist(), ["-DGGML_NATIVE=OFF"], tmp_path / "out", 2, compile_tree=simulated, metal=True)
    assert len(simulated.kernels) == 2 and simulated.kernels[0] != simulated.kernels[1]
    assert simulated.kernels[1] == hashlib.sha256(pristine_kernel()).hexdigest()  # built without the patch
    record = build.wheel_record(wheel)
    everything = [p.name for p in build.patches()]
    assert record == {"patches": [n for n in everything if n != METAL_PATCH.name], "metal_patches": [METAL_PATCH.name],
                      "left_out": {METAL_PATCH.name: METAL_ERROR}}
    out = capsys.readouterr().out
    assert f"ggml-metal failed with {METAL_PATCH.name} ({METAL_ERROR}): building again without it" in out

    number = METAL_PATCH.name[:4]
    assert doctor_line(monkeypatch, capsys, record) == f"bias: soft-max fallback ({number} did not compile)"
    assert doctor_line(monkeypatch, capsys, {**record, "left_out": {}}) == f"bias: flash attention ({number})"


def doctor_line(monkeypatch, capsys, record: dict) -> str:
    """``kvlocal doctor``'s ``metal`` row for a library whose system info lists ggml-metal, built as ``record`` says."""
    monkeypatch.setattr("kvlocal.runtime.metal_bias", lambda: metal_bias_of(METAL_INFO, record))
    cli(["doctor"])
    return next(line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("metal "))


@pytest.mark.parametrize("metal,log", [(True, "ggml/src/ggml-cpu/ops.cpp:12:1: error: expected ';'"), (False, METAL_ERROR)],
                         ids=["not-ggml-metal", "not-a-metal-build"])
def test_other_build_failures_are_not_retried(tmp_path, metal, log):
    """A failure elsewhere than in ggml-metal, or any failure of a build without Metal (Linux, CUDA: CI's path),
    ends the build as before: exit 2 after one compile."""
    simulated = SimulatedBuild(log)
    with pytest.raises(SystemExit) as e:
        build.build_wheel(sdist(), [], tmp_path / "out", 2, compile_tree=simulated, metal=metal)
    assert e.value.code == 2 and len(simulated.kernels) == 1 and not (tmp_path / "out").exists()


def test_the_runtime_reads_the_record_of_the_library_it_loaded(tmp_path):
    """The record in llama-cpp-python's package describes the package's own lib/: a library loaded from elsewhere
    (LLAMA_CPP_LIB_PATH) has none."""
    package = tmp_path / "llama_cpp"
    (package / "lib").mkdir(parents=True)
    record = {"patches": [], "metal_patches": [METAL_PATCH.name], "left_out": {METAL_PATCH.name: METAL_ERROR}}
    (package / buildinfo.RECORD).write_text(json.dumps(record))
    assert buildinfo.read_record(str(package / "lib" / "libllama.dylib"), package) == record
    assert buildinfo.read_record(str(tmp_path / "build" / "bin" / "libllama.dylib"), package) is None
    assert buildinfo.RECORD == build.RECORD  # the name build.py writes


def test_metal_failure_reads_the_lines_ggml_metal_reports():
    """The lines that decide a rebuild: a compiler error in ggml-metal's sources, the build tool's failed target and the
    library's own report at load; not a compile command's -Werror flag, nor an error in another backend."""
    assert build.metal_failure(f"ok\n{METAL_ERROR}\nmore") == METAL_ERROR
    for line in ("ggml/src/ggml-metal/ggml-metal-ops.cpp:3295:9: error: no member named 'kvb'",
                 "FAILED: ggml/src/ggml-metal/CMakeFiles/ggml-metal.dir/ggml-metal-ops.cpp.o",
                 "ggml_metal_device_init: error: failed to create library"):
        assert build.metal_failure(line) == line
    for line in ("/usr/bin/cc -Werror=implicit-int -c ggml/src/ggml-metal/ggml-metal-device.m",
                 "ggml/src/ggml-cpu/ops.cpp:12:1: error: expected ';'", "ggml_metal_device_init: GPU name: Apple M2"):
        assert build.metal_failure(line) is None


def test_a_build_loads_its_wheel_as_kvlocal_does():
    """The load that makes ggml-metal compile its kernels on a Mac, on this machine's own wheel: the real library
    registers its backends in a fresh Python (here the CPU's)."""
    wheels = sorted((build.cache_dir() / "wheels").glob("[0-9a-f]*/llama_cpp_python-*.whl"))
    if not wheels:
        missing(f"no patched wheel in {build.cache_dir() / 'wheels'}: run ./setup.sh")
    rc, log = build.load_wheel(wheels[0])
    assert rc == 0 and "CPU :" in log and build.metal_failure(log) is None


FALLBACK = MetalBias(metal=True, flash=False, patches="0006", why="0006 did not compile")
FLASH = MetalBias(metal=True, flash=True, patches="0006")
CPU = MetalBias(metal=False, flash=False)


def test_flash_attention_rule():
    """Only a biased cache on the GPU of a Metal build without the Metal patch leaves flash attention; a quantized V
    cache there is refused in one line naming the fixes (llama.cpp stores it only with flash attention)."""
    assert flash_attention(True, None, biased=True, offloaded=True, metal=FALLBACK) is False
    assert flash_attention(True, 0, biased=True, offloaded=True, metal=FALLBACK) is False  # an F32 V: soft-max works
    for metal in (FLASH, CPU):
        assert flash_attention(True, None, biased=True, offloaded=True, metal=metal) is True
    assert flash_attention(True, None, biased=False, offloaded=True, metal=FALLBACK) is True
    assert flash_attention(True, None, biased=True, offloaded=False, metal=FALLBACK) is True  # -ngl 0: the CPU's
    assert flash_attention(False, None, biased=True, offloaded=True, metal=FLASH) is False
    assert flash_attention(False, 8, biased=False, offloaded=True, metal=FALLBACK) is True
    with pytest.raises(UsageError, match=r"quantized V cache needs flash attention.*0006 did not compile.*-ctv f16"):
        flash_attention(False, 8, biased=True, offloaded=True, metal=FALLBACK)
    assert metal_bias_of(METAL_INFO, None, "/x/libllama.dylib").describe().startswith(
        "bias: soft-max fallback (no kvlocal build record beside /x/libllama.dylib")
    assert metal_bias_of("CPU : AVX2 = 1 |", None).describe() == "not a Metal build"


def test_cuda_head_sizes_without_a_flash_kernel_keep_attention_on_the_gpu(capsys):
    """On a CUDA build with the model offloaded, a head size ggml-cuda has no flash-attention kernel for (the tiny
    models' 32) would send every layer's attention to the CPU: the soft-max path instead, said once; with a quantized
    V cache (which needs flash attention) the cost is said. Head size 128, the CPU's -ngl 0 and a non-CUDA build: as
    asked."""
    from kvlocal.runtime.fallbacks import say_once

    say_once.cache_clear()
    assert flash_attention(True, None, biased=False, offloaded=True, metal=CPU, head_dims=(32, 32), cuda=True) is False
    assert flash_attention(True, None, biased=True, offloaded=True, metal=CPU, head_dims=(32, 32), cuda=True) is False
    err = capsys.readouterr().err
    assert err.count("no flash-attention kernel for head size 32: attention takes the soft-max path") == 1
    assert flash_attention(True, 8, biased=False, offloaded=True, metal=CPU, head_dims=(96, 64), cuda=True) is True
    assert "head size 96 (K) and 64 (V), and a quantized V cache needs it" in capsys.readouterr().err
    assert flash_attention(True, None, biased=False, offloaded=True, metal=CPU, head_dims=(128, 128), cuda=True) is True
    assert flash_attention(True, None, biased=False, offloaded=False, metal=CPU, head_dims=(32, 32), cuda=True) is True
    assert flash_attention(True, None, biased=False, offloaded=True, metal=CPU, head_dims=(32, 32), cuda=False) is True
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("method,metal,fa", [("kvslimmer", FALLBACK, False), ("kvslimmer", FLASH, True),
                                             ("criticalkv", FALLBACK, True)])
def test_the_engine_keeps_biased_caches_off_flash_attention_on_metal_without_the_patch(tmp_path, monkeypatch, method, metal, fa):
    """``flash_attn=True`` with -ngl 99: a merging method (a bias) on a Metal build as the record says decodes on the
    soft-max path — llama.cpp's cache holds V transposed — unless the Metal patch compiled; a method without a bias
    keeps flash attention (V in rows)."""
    from kvlocal.engine import Engine

    monkeypatch.setattr(buildinfo, "metal_bias", lambda: metal)
    model = Model(tiny_gguf.write_tiny(tmp_path / "llama.gguf", arch="llama"), n_gpu_layers=99)
    eng = Engine(model, 0.5, method, max_tokens=256, n_threads=2, flash_attn=True)
    eng.prefill(model.tokenize("The quick brown fox jumps over the lazy dog. " * 3))
    assert read_seq(eng.ctx).v_trans is (not fa)
