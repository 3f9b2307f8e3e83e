"""The GGUF header reader (`loader.gguf_file`) against gguf's own `GGUFReader`: the same metadata
values and tensor data, for the default model and for a file with every kind of value; a damaged
file is a clear error."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from sluice.engine.loader.default import default_model_path
from sluice.engine.loader.gguf_file import GGUFFile, GGUFFormatError


def assert_same_as_gguf(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # (its header, as fields)
    assert list(ours.fields) == keys
    for key in keys:
        want = theirs.fields[key].contents()
        assert ours.fields[key] == want and type(ours.fields[key]) is type(want), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in ref.shape), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data.view(np.uint8), ref.data.view(np.uint8)), mine.name
    return ours


def test_the_default_model_reads_as_gguf_reads_it():
    f = assert_same_as_gguf(default_model_path())
    assert len(f.fields["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type.name for t in f.tensors} >= {"Q4_1", "F32"}


def write_every_kind(path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.strs", ["a", "", "ü b"])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    data = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", data)
    w.add_tensor("f16", data.astype(np.float16))
    w.add_tensor("i32", np.arange(24, dtype=np.int32).reshape(2, 3, 4))
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16):
        w.add_tensor(kind.name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_kind_of_value_and_tensor_reads_as_gguf_reads_it(tmp_path, alignment):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path, alignment)
    f = assert_same_as_gguf(path)
    assert f.fields["t.str"] == "héllo ▁wörld" and f.fields["t.strs"] == ["a", "", "ü b"]
    assert f.fields["t.u64"] == 2**63 + 5 and f.fields["t.bool"] is True
    by_name = {t.name: t for t in f.tensors}
    assert by_name["i32"].shape == (4, 3, 2) and by_name["i32"].data.shape == (2, 3, 4)
    assert by_name["Q8_0"].data.shape == (4, 64 // 32 * 34)


def test_a_damaged_file_is_a_clear_error(tmp_path):
    path = tmp_path / "kinds.gguf"
    write_every_kind(path)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in (0, 3, 20, 300, len(whole) - 100):
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFFormatError):
            GGUFFile(cut)
    cut.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(GGUFFormatError, match="bad magic"):
        GGUFFile(cut)
    cut.write_bytes(whole[:4] + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFFile(cut)
