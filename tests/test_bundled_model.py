"""common/bundled_model.py: the GGUF conversion's reader is built once per file (transformers asks
for one three times: tokenizer, config, weights), and the real reader is back afterwards. The
conversion itself runs in every CI run (the first test that needs the bundled model)."""
from __future__ import annotations

import numpy as np
import pytest


def _tiny_gguf(path):
    import gguf

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_uint32("gemma3.context_length", 32)
    writer.add_token_list(["<pad>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_one_gguf_parse_serves_every_reader_of_a_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    from common.bundled_model import _one_gguf_parse

    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path)
    real = gguf.GGUFReader
    with _one_gguf_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # a str or a Path: the same file, one parse
        assert len(first.fields["tokenizer.ggml.tokens"].data) == 3
        assert np.array_equal(first.tensors[0].data.reshape(3, 4), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert gguf.GGUFReader is real
    assert gguf.GGUFReader(path) is not first


def test_the_shared_reader_reads_what_the_real_one_reads(tmp_path):
    """The shared reader parses a plain array view of the memory map (faster slices): every field's
    parts and every tensor's bytes are the real reader's."""
    gguf = pytest.importorskip("gguf")
    from common.bundled_model import _one_gguf_parse

    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path)
    real = gguf.GGUFReader(path)
    with _one_gguf_parse():
        shared = gguf.GGUFReader(path)
    assert type(shared.data) is np.ndarray and isinstance(real.data, np.memmap)
    assert list(shared.fields) == list(real.fields)
    for name, field in real.fields.items():
        other = shared.fields[name]
        assert other.types == field.types and other.data == field.data
        assert all(np.array_equal(a, b) for a, b in zip(other.parts, field.parts, strict=True))
    assert [t.name for t in shared.tensors] == [t.name for t in real.tensors]
    for a, b in zip(shared.tensors, real.tensors):
        assert a.tensor_type == b.tensor_type and np.array_equal(a.data, b.data)
