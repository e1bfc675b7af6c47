"""Loading: Gemma 4 multimodal checkpoints load text-only; ids resolve offline; defaults are logged."""
from __future__ import annotations

import pytest
import torch

from server.model_loading import ModelNotFoundError, _use_column_linears, load_target


def _tiny_multimodal_checkpoint(path):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=32, num_kv_shared_layers=2,
                hidden_size_per_layer_input=16, vocab_size_per_layer_input=512, sliding_window=8,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32)
    torch.manual_seed(0)
    full = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=audio))
    full.eval().save_pretrained(path)
    return full


def test_gemma4_checkpoint_loads_text_only(tmp_path, monkeypatch):
    full = _tiny_multimodal_checkpoint(tmp_path)
    # any tokenizer will do: the point is the weights
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: "tokenizer")
    target = load_target(str(tmp_path), quant="none", dtype="fp32", device="cpu")
    from transformers import Gemma4ForCausalLM

    assert type(target.model) is Gemma4ForCausalLM
    names = [n for n, _ in target.model.named_modules()]
    assert not any("vision" in n or "audio" in n for n in names)
    assert any("text-only" in note for note in target.notes)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    _use_column_linears(full)  # the same CPU linear layout the loader applied: bitwise comparable
    with torch.no_grad():
        assert torch.equal(full(ids).logits, target.model(ids).logits)


def test_gemma4_defaults_to_int4(tmp_path, monkeypatch):
    _tiny_multimodal_checkpoint(tmp_path)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: "tokenizer")
    target = load_target(str(tmp_path), dtype="fp32", device="cpu")
    assert target.quant == "int4" and any("quant int4" in note for note in target.notes)
    from optimum.quanto import QLinear

    assert any(isinstance(m, QLinear) for m in target.model.modules())
    assert not isinstance(target.model.lm_head, QLinear)


def test_missing_model_id_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="hf download google/gemma-4-E4B-it"):
        load_target("google/gemma-4-E4B-it", device="cpu")


def test_bad_options_are_rejected():
    with pytest.raises(ValueError):
        load_target("whatever", quant="int3")
    with pytest.raises(ModelNotFoundError):
        load_target("missing.gguf")


@pytest.mark.slow
def test_bundled_default_is_fp32_unquantized_with_notes():
    target = load_target(None, device="cpu")
    assert target.quant == "none" and target.dtype == torch.float32
    assert any("bundled" in note for note in target.notes) and any("quant none" in note for note in target.notes)


def test_layerwise_placement_quantizes_as_the_whole_model_does():
    """server.model_loading.place_on_device's GPU route (a decoder layer at a time, then the linears
    outside the layers), forced on the CPU: the same quantized weights and the same logits as
    quantizing the whole model at once, every linear but the head quantized once."""
    from optimum.quanto import QTensor

    from server.model_loading import place_on_device
    from tests.test_engine_lossless import tiny_gemma4

    whole, layerwise = tiny_gemma4(seed=3), tiny_gemma4(seed=3)
    assert place_on_device(whole, torch.device("cpu"), "int4", layerwise=False) == ""
    note = place_on_device(layerwise, torch.device("cpu"), "int4", layerwise=True)
    assert "one decoder layer at a time" in note and "per-layer embedding table kept on the host" in note
    quantized = lambda m: {n: mod.weight for n, mod in m.named_modules() if isinstance(getattr(mod, "weight", None), QTensor)}
    a, b = quantized(whole), quantized(layerwise)
    assert a.keys() == b.keys() and "model.per_layer_model_projection" in a and "lm_head" not in a
    assert any(".layers.3.mlp." in n for n in a)
    for name in a:
        assert torch.equal(a[name].dequantize(), b[name].dequantize()), name
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(whole(ids).logits, layerwise(ids).logits)


def test_placement_leaves_the_kept_tables_where_they_are():
    """_move_except (meta stands in for the GPU): every parameter moves but the per-layer embedding
    table's; move_host_tables then moves that one too."""
    from server.model_loading import _move_except, move_host_tables
    from tests.test_engine_lossless import tiny_gemma4

    model = tiny_gemma4(seed=4)
    table = model.model.embed_tokens_per_layer
    _move_except(model, torch.device("meta"), keep=(table,))
    where = {n: p.device.type for n, p in model.named_parameters()}
    assert where.pop("model.embed_tokens_per_layer.weight") == "cpu"
    assert set(where.values()) == {"meta"}, where
    assert all(b.device.type == "meta" for n, b in model.named_buffers() if "embed_tokens_per_layer" not in n)
    move_host_tables(model, torch.device("meta"))
    assert table.weight.device.type == "meta"
