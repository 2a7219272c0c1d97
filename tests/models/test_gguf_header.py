"""kvlocal's GGUF header reader against gguf-py's ``GGUFReader``, the independent implementation it replaces
for speed: the same metadata values, tensor table and tensor bytes; and damaged headers as HeaderError."""

from __future__ import annotations

import numpy as np
import pytest

from policy import need

gguf = need("gguf")

from kvlocal.models.gguf_header import HeaderError, read_header  # noqa: E402


def assert_same_as_gguf_py(path):
    ours, theirs = read_header(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.keys()) == list(fields)
    for key, f in fields.items():
        assert ours.get(key) == f.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape, a.n_bytes, a.data_offset) == \
            (b.tensor_type, tuple(int(d) for d in b.shape), int(b.n_bytes), int(b.data_offset)), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    return ours


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """A GGUF with a value of every metadata type (arrays of numbers, bools and strings,
    unicode) and tensors of plain and block types, at a non-default alignment."""
    from gguf.quants import quantize

    path = tmp_path_factory.mktemp("gguf") / "every-type.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("general.alignment", 64)
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -100), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -2_000_000_000), w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5), w.add_int64("t.i64", -(2**62)), w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True), w.add_string("t.str", "Grüße, 世界")
    w.add_array("t.ints", [1, -2, 3]), w.add_array("t.floats", [0.5, 1.25]), w.add_array("t.bools", [True, False])
    w.add_array("t.strs", ["a", "", "ü" * 300])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    for t in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        w.add_tensor(t.name.lower(), quantize(x, t), raw_dtype=t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_and_tensor_type_reads_as_gguf_py_reads_it(every_type):
    h = assert_same_as_gguf_py(every_type)
    assert h.get("t.strs") == ["a", "", "ü" * 300] and h.get("t.u64") == 2**63 + 5
    assert h.data_start % 64 == 0 and h.get("absent", 7) == 7


def test_a_real_model_reads_as_gguf_py_reads_it(smollm2):
    h = assert_same_as_gguf_py(smollm2)
    assert len(h.get("tokenizer.ggml.tokens")) == 49152


def test_a_damaged_header_is_a_header_error(every_type, tmp_path):
    raw = every_type.read_bytes()
    end = read_header(every_type).data_start
    for cut in range(0, end - 64, 7):  # cut anywhere before the alignment padding (< 64 bytes) at its end
        (tmp_path / "cut.gguf").write_bytes(raw[:cut])
        with pytest.raises(HeaderError):
            read_header(tmp_path / "cut.gguf")
    key = raw.index(b"t.u8")  # the value type that follows the first key, made unknown
    (tmp_path / "bad.gguf").write_bytes(raw[:key + 4] + (99).to_bytes(4, "little") + raw[key + 8:])
    with pytest.raises(HeaderError, match="unknown value type 99"):
        read_header(tmp_path / "bad.gguf")
    (tmp_path / "v9.gguf").write_bytes(raw[:4] + (9).to_bytes(4, "little") + raw[8:])
    with pytest.raises(HeaderError, match="version 9"):
        read_header(tmp_path / "v9.gguf")
