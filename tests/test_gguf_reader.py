"""checkpoints.gguf.open_reader reads a GGUF file's metadata as the gguf
library's own GGUFReader does (it parses arrays in fewer parts)."""
import numpy as np
from gguf import GGUFReader, GGUFWriter

from brisklm.checkpoints.gguf import metadata, open_reader


def library_metadata(path) -> dict:
    out = {}
    for key, field in GGUFReader(path).fields.items():
        try:
            out[key] = field.contents()
        except Exception:
            continue
    return out


def test_every_kind_of_field_reads_as_the_library_reads_it(tmp_path):
    path = str(tmp_path / "fields.gguf")
    w = GGUFWriter(path, "llama")
    w.add_string("t.string", "héllo")
    w.add_uint32("t.u32", 7)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_array("t.ints", [3, -1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.0, 1e-5])
    w.add_array("t.strings", ["", "a", "ñandú", "<|im_end|>", "x" * 300])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3, 4]])
    w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = metadata(open_reader(path))
    assert ours == library_metadata(path)
    assert ours["t.strings"] == ["", "a", "ñandú", "<|im_end|>", "x" * 300] and ours["t.ints"] == [3, -1, 4, 1, 5]
    t = open_reader(path).tensors[0]
    assert t.name == "w" and np.array_equal(np.asarray(t.data).reshape(3, 4), np.arange(12).reshape(3, 4))


def test_the_bundled_model_reads_as_the_library_reads_it(smollm2_gguf):
    ours = metadata(open_reader(smollm2_gguf))
    assert ours == library_metadata(smollm2_gguf)
    assert len(ours["tokenizer.ggml.tokens"]) == 49152
