"""Load the target model: a local directory, a cached Hugging Face id, a `.gguf` file, or the bundled model.

Contract: `load_target(model, quant, dtype, device)` returns a `LoadedTarget` whose `model` is an
eval-mode causal LM ready for `model(input_ids, cache=...)` and whose `notes` explain every default
that was chosen (the server logs them at start-up). Nothing is ever downloaded:

- `None`: the bundled Gemma 3 270M base model (`common.bundled_model`).
- an existing directory: a Hugging Face model directory.
- an existing `*.gguf` file: dequantized through transformers once, saved as safetensors under the
  Sailfish cache and reloaded from there afterwards.
- anything else: a model id looked up in the local Hugging Face cache only (`local_files_only`);
  when absent the error says how to fetch it on a connected machine.

Gemma 4 checkpoints (`model_type` "gemma4", `Gemma4ForConditionalGeneration`) load text-only into
`Gemma4ForCausalLM`: the `model.language_model.*` weights are renamed to `model.*` and the vision
and audio towers are never instantiated.

Defaults (each logged in `notes`): device cuda when available, else cpu (on cuda, the caching
allocator's expandable segments unless PYTORCH_CUDA_ALLOC_CONF is set: server.cuda_allocator); dtype bf16 on cuda, fp32
on cpu; weights int4 (optimum-quanto, lm_head excluded) for Gemma 4 targets, none otherwise: int4
breaks the 270M model's greedy output and quanto's CPU kernels give it no speed. Generation must run
under `torch.no_grad()`, not `inference_mode` (quanto fails under the latter).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

E4B_ID = "google/gemma-4-E4B-it"
QUANT_CHOICES = ("int4", "int8", "none")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_GEMMA4_TEXT_KEYS = {r"^model\.language_model\.": "model."}


@dataclass
class LoadedTarget:
    model: Any
    tokenizer: Any
    model_id: str
    quant: str
    dtype: torch.dtype
    device: torch.device
    notes: list[str] = field(default_factory=list)


class ModelNotFoundError(FileNotFoundError):
    pass


def load_target(model: str | None = None, quant: str | None = None,
                dtype: str | torch.dtype | None = None, device: str | None = None) -> LoadedTarget:
    if quant is not None and quant not in QUANT_CHOICES:
        raise ValueError(f"unknown quant {quant!r}; choose one of {QUANT_CHOICES}")
    notes: list[str] = []
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device is None:
        notes.append(f"device {dev.type} (auto)")
    if dev.type == "cuda":
        from server.cuda_allocator import configure_cuda_allocator

        configure_cuda_allocator(notes)  # before any weight reaches the card
    torch_dtype = _resolve_dtype(dtype, dev, notes)

    model_dir, model_id = _resolve_model_dir(model, notes)
    config = json.loads((model_dir / "config.json").read_text())
    is_gemma4 = config.get("model_type") in ("gemma4", "gemma4_text")
    quant = _resolve_quant(quant, is_gemma4, dev, notes)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lm = _load_weights(model_dir, config, torch_dtype, notes).eval()
    note = place_on_device(lm, dev, quant)
    if note:
        notes.append(note)
    if quant == "none" and dev.type == "cpu" and torch_dtype == torch.float32:
        _use_column_linears(lm)
        notes.append("cpu fp32: linear layers computed as W @ x^T (MKL is 2-5x faster so for 2-16 rows)")
    notes.extend(_e4b_hint(model_id))
    return LoadedTarget(lm, tokenizer, model_id, quant, torch_dtype, dev, notes)


def _resolve_dtype(dtype, dev: torch.device, notes: list[str]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        chosen = torch.bfloat16 if dev.type == "cuda" else torch.float32
        notes.append(f"dtype {str(chosen).removeprefix('torch.')} (auto for {dev.type})")
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _resolve_quant(quant: str | None, is_gemma4: bool, dev: torch.device, notes: list[str]) -> str:
    if quant is not None:
        return quant
    if is_gemma4:
        notes.append("quant int4 (auto: Gemma 4 target; quanto int4 weights, lm_head kept unquantized)")
        return "int4"
    notes.append("quant none (auto: int4 breaks small models' greedy output; quanto gives no CPU speed-up)")
    return "none"


def _resolve_model_dir(model: str | None, notes: list[str]) -> tuple[Path, str]:
    if model is None:
        from common.bundled_model import bundled_model_dir

        notes.append("model: bundled Gemma 3 270M base (not instruction-tuned; speed-ups on it are inflated by looping)")
        return bundled_model_dir(), "gemma-3-270m"
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a directory without config.json: not a Hugging Face model directory")
        return path, path.name
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        return _converted_gguf_dir(path, notes), path.stem
    return _cached_hub_dir(model), model


def _cached_hub_dir(model_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as exc:  # LocalEntryNotFoundError, or an invalid repo id
        raise ModelNotFoundError(
            f"model {model_id!r} is neither a local directory, a .gguf file nor in the local Hugging Face "
            f"cache (nothing is downloaded). On a machine with network access run "
            f"`hf download {model_id}` (`huggingface-cli download` with an older huggingface_hub; accept the "
            f"licence on huggingface.co first), then copy "
            f"the cache (~/.cache/huggingface/hub) here or pass the downloaded directory."
        ) from exc


def _converted_gguf_dir(gguf: Path, notes: list[str]) -> Path:
    """Dequantize a GGUF once into fp32 safetensors under the Sailfish cache; reuse afterwards."""
    from common.bundled_model import cache_root, converted_gguf_dir

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"gguf-{gguf.stem}-{key}"
    if not (target / "sailfish-complete").exists():
        notes.append(f"converted {gguf.name} to safetensors (first use)")
    return converted_gguf_dir(gguf, target, gguf.name, "once; later starts load the converted copy")


def _load_weights(model_dir: Path, config: dict, dtype: torch.dtype, notes: list[str]):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if config.get("model_type") != "gemma4":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    from transformers import Gemma4ForCausalLM

    text_config = AutoConfig.from_pretrained(model_dir).text_config
    notes.append("Gemma 4 checkpoint loaded text-only (Gemma4ForCausalLM; vision and audio towers skipped)")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the skipped towers are reported as "unexpected keys"
    try:
        return Gemma4ForCausalLM.from_pretrained(model_dir, config=text_config, dtype=dtype,
                                                 key_mapping=_GEMMA4_TEXT_KEYS)
    finally:
        hf_logging.set_verbosity(verbosity)


def place_on_device(lm, dev: torch.device, quant: str, layerwise: bool | None = None) -> str:
    """Move a model loaded on the host to `dev` and quantize it (`quant`: int4, int8 or none); returns
    a note, or "". On the GPU with quantized weights this goes one decoder layer at a time (moved in
    the checkpoint's dtype, then quantized there), so the card never holds more than one layer's
    unquantized weights: E4B, loaded whole in bf16 and then quantized, peaked at 15.9 GiB; an 8 GB
    card could not start it. Gemma 4's per-layer embedding table (E4B: 5.25 GiB in bf16, a lookup of
    a few rows a token) stays on the host: the GPU fast path looks it up there, and the engine moves
    it to the card only for the transformers forward (`move_host_tables`). quanto quantizes each
    linear on its own weights, so the result is what quantizing the whole model at once gives.
    `layerwise` (default: on CUDA with quantized weights) forces the choice (tests)."""
    ple = getattr(getattr(lm, "model", None), "embed_tokens_per_layer", None)
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layerwise is None:
        layerwise = dev.type == "cuda" and quant != "none"
    if not layerwise or layers is None:
        lm.to(dev)
        if quant != "none":
            _quantize(lm, quant)
        return ""
    for layer in layers:
        layer.to(dev)
        _quantize(layer, quant)
    _move_except(lm, dev, keep=(ple,) if ple is not None else ())
    _quantize(lm, quant, exclude=["lm_head", "model.layers.*"])  # the linears outside the layers
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ("weights placed one decoder layer at a time" +
            ("; the per-layer embedding table kept on the host" if ple is not None else ""))


def move_host_tables(lm, dev: torch.device) -> None:
    """What `place_on_device` left on the host, onto `dev` (for transformers' own forward)."""
    ple = getattr(getattr(lm, "model", None), "embed_tokens_per_layer", None)
    if ple is not None and ple.weight.device != dev:
        ple.to(dev)


def _move_except(module: torch.nn.Module, dev: torch.device, keep: tuple) -> None:
    """module.to(dev), except the modules in `keep` (and what they hold), which stay where they are."""
    if any(module is k for k in keep):
        return
    if not any(m is k for m in module.modules() for k in keep):
        module.to(dev)
        return
    module._apply(lambda t: t.to(dev), recurse=False)  # this module's own parameters and buffers
    for child in module.children():
        _move_except(child, dev, keep)


def _quantize(lm, quant: str, exclude: list[str] | None = None) -> None:
    from optimum.quanto import freeze, qint4, qint8, quantize

    quantize(lm, weights=qint4 if quant == "int4" else qint8, exclude=exclude or ["lm_head"])
    freeze(lm)


def _column_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    y = torch.matmul(self.weight, flat.t()).t()
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], self.weight.shape[0])


def _use_column_linears(lm) -> None:
    """Compute every plain nn.Linear as (W @ x^T)^T. Same maths; on CPU, MKL's fp32 GEMM for a few
    rows (a 2-16 token verify) is far slower in the x @ W^T layout (measured: lm_head 16 rows 317 ms
    vs 138 ms; 1 row unchanged)."""
    import types

    for module in lm.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_column_linear, module)


def _e4b_hint(model_id: str) -> list[str]:
    if model_id == E4B_ID:
        return []
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(E4B_ID, "config.json")
    except Exception:
        return []
    if isinstance(cached, str):
        return [f"{E4B_ID} is in the local Hugging Face cache: start with `--model {E4B_ID}` to serve it"]
    return []

