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
