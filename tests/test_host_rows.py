"""Embedding tables in host memory (server/host_rows.py): staged or mapped, the module's rows bit for bit.

- On the CPU (CI): a table asked to map where there is no GPU stays staged and says why, or refuses
  when insisted on; the gather kernel's sm_90 code, compiled here, has the loads, the 64-bit row
  offsets and the rounding it should.
- Under Triton's interpreter (a subprocess; CI has no GPU): the gather kernel a mapped table runs
  gives the module's own rows (bf16 and fp32 tables, with and without a scale, widths that are not
  a multiple of a program's columns, the first and last rows, a repeated one); and a FastTarget whose per-layer
  table (and, with the int8 head, token embedding) is mapped stages nothing and gives the same
  logits, prefill and steps, as the same target with the tables staged; so do three lanes' steps
  in shared forwards.
- On CUDA (skipped without a GPU): the table read in place over PCIe inside captured graphs, the
  step kernels on: the same logits as staged tables, nothing staged per step, one registration per
  table whatever the lanes over it, released with the last of them.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def test_a_table_stays_staged_where_no_gpu_can_read_it():
    from server.host_rows import HostRowTable

    module = torch.nn.Embedding(50, 24)
    table = HostRowTable(module, torch.device("cpu"))
    assert not table.mapped and "no GPU" in table.note
    ids = torch.tensor([0, 7, 49])
    assert torch.equal(table(ids), module(ids))
    with pytest.raises(RuntimeError, match="cannot be mapped"):
        HostRowTable(torch.nn.Embedding(50, 24), torch.device("cpu"), mapped=True)


def test_mapped_tables_give_the_modules_rows_interpreted(tmp_path):
    pytest.importorskip("triton")
    from tests.interpreted import run_interpreted

    run_interpreted(__file__, tmp_path / "outputs.pt")
    results = torch.load(tmp_path / "outputs.pt")
    for name, ok in results["rows"]:
        assert ok, name
    for name, (mapped_flags, staged_buffers, same) in results["targets"].items():
        assert all(mapped_flags), name
        assert not staged_buffers, name
        assert same, name


@pytest.mark.parametrize("has_scale", [True, False])
def test_gather_kernel_reads_16_bytes_a_thread_with_64_bit_rows_ptx(has_scale):
    """The gather's sm_90 code (compiled here, no GPU needed): one 16-byte load and store a thread
    (each program's loads one PCIe round trip), the row offset a 64-bit product (E4B's per-layer
    table has 2.8e9 elements), and the scaled rows rounded to nearest even, as torch rounds them."""
    import re
    from collections import Counter

    from tests.test_stacked_step_ptx import sm90_ptx

    pytest.importorskip("triton")
    from server.gpu_kernels import _gather_rows

    sig = {"table_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16", "scale": "fp32", "width": "i32",
           "n_rows": "i32", "stride_table": "i32", "stride_out": "i32", "HAS_SCALE": "constexpr", "BLOCK": "constexpr"}
    ptx = sm90_ptx(_gather_rows, sig, {"HAS_SCALE": has_scale, "BLOCK": 1024})
    accesses = Counter(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))
    assert accesses == Counter({"ld.global.b64": 1, "ld.global.v4.b32": 1, "st.global.v4.b32": 1}), accesses
    assert "mul.lo.s64" in ptx
    conversions = set(re.findall(r"cvt\.\w+\.bf16x2\.f32", ptx))
    assert conversions == ({"cvt.rn.bf16x2.f32"} if has_scale else set()), conversions


def _scaled_embedding(vocab: int, width: int, dtype, scale: float | None):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    torch.manual_seed(vocab + width)
    if scale is None:
        module = torch.nn.Embedding(vocab, width)
    else:
        module = Gemma4TextScaledWordEmbedding(vocab, width, padding_idx=0, embed_scale=scale)
        torch.nn.init.normal_(module.weight)
    return module.to(dtype)


def main(out: str) -> int:
    """Under TRITON_INTERPRET=1: the checks the test above asserts, saved to `out`."""
    from tests.interpreted import interpreter_takes_numpy_2_scalars

    interpreter_takes_numpy_2_scalars()
    from server.fast_path import FastTarget
    from server.host_rows import HostRowTable
    from tests.test_engine_lossless import tiny_gemma4
    from tests.test_fast_path import _steps_logits, prompt_of

    rows = []
    cpu = torch.device("cpu")
    # The interpreter rounds fp32 to bf16 toward zero where the GPU rounds to nearest even (as torch
    # does): bf16 rows are scaled here by a power of two (as E4B's per-layer rows are, by 16), which
    # needs no rounding; the CUDA test below scales bf16 rows by 3.
    for dtype, cases in ((torch.bfloat16, ((2600, 16.0 ** 0.5), (1024, None))),
                         (torch.float32, ((2600, 16.0 ** 0.5), (1024, None), (40, 7.3)))):
        for width, scale in cases:
            module = _scaled_embedding(300, width, dtype, scale)
            ids = torch.tensor([0, 1, 299, 123, 123, 7])
            want = module(ids)
            table = HostRowTable(copy.deepcopy(module), cpu, mapped=True)
            rows.append((f"{dtype} width {width} scale {scale}", table.mapped and torch.equal(table(ids), want)))
            # ids outside the table read nothing: zero rows, the valid rows beside them as ever
            bad = table(torch.tensor([-1, 300, 5, 1 << 40]))
            rows.append((f"{dtype} width {width}: ids outside the table", bool((bad[[0, 1, 3]] == 0).all())
                         and torch.equal(bad[2], module(torch.tensor([5]))[0])))

    targets = {}
    ids = prompt_of(60, 512, seed=7)
    for name, kwargs in (("per-layer table", {}), ("and the int8 head's token embedding", {"lm_head_int8": True})):
        # a hidden size the int8 head's kernel tiles (K: 128); its head is tied to the token embedding
        model = tiny_gemma4(seed=1, sliding_window=8, hidden_size=128, intermediate_size=256)
        built = {mapped: FastTarget(copy.deepcopy(model), max_len=128, prefill_chunk=16, capture=False, min_kv_len=16,
                                    ple_on_host=True, map_host_tables=mapped, **kwargs) for mapped in (False, True)}
        mapped = built[True]
        flags = [mapped.embed_ple.mapped] + ([mapped.embed.mapped] if kwargs else [])
        staged = [hasattr(mapped, "ple_buf"), hasattr(mapped, "embed_buf"), mapped.ple_staged, mapped.embed_staged]
        targets[name] = (flags, any(staged), torch.equal(_steps_logits(built[False], ids), _steps_logits(mapped, ids)))
        targets[name + ", lanes"] = _lanes_mapped_and_staged(model, kwargs)
    torch.save({"rows": rows, "targets": targets}, out)
    return 0


def _lanes_mapped_and_staged(model, kwargs: dict):
    """Three lanes' steps in shared forwards (the uncaptured segments on the CPU), once with the
    tables mapped and once staged: (mapped flags, anything staged, the same logits)."""
    from server.fast_batch import LaneStep, fast_lanes
    from server.fast_path import FastTarget
    from tests.test_engine_lossless import prompts_for
    from tests.test_fast_batch import steps_of

    vocab = model.config.vocab_size
    prompts = prompts_for(vocab, (5, 20, 45), seed=1)
    logits, flags, staged = {}, [], False
    for mapped in (False, True):
        lead = FastTarget(copy.deepcopy(model), max_len=256, prefill_chunk=16, capture=False, min_kv_len=16,
                          ple_on_host=True, map_host_tables=mapped, **kwargs)
        lanes = fast_lanes(lead, 3)
        out = [lane.start(prompt, reuse=False).logits for lane, prompt in zip(lanes, prompts)]
        plans = [steps_of(vocab, seed) for seed in range(3)]
        for k in range(3):
            out += lead.batch.forward_batch([LaneStep(lane, *plan[k]) for lane, plan in zip(lanes, plans)])
        logits[mapped] = out
        if mapped:
            flags = [lane.embed_ple.mapped for lane in lanes]
            staged = any(lane.ple_staged or lane.embed_staged for lane in lanes)
    return flags, staged, all(torch.equal(a, b) for a, b in zip(logits[False], logits[True]))


# ---------------------------------------------------------------- CUDA

@needs_cuda
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("int8_head", [False, True])
def test_mapped_tables_change_no_logit_cuda(quant, int8_head):
    """Captured graphs and step kernels (bf16, int4): the tables read in place give the logits of
    the tables staged, and a step stages nothing but its ids and positions."""
    from server.fast_path import FastTarget
    from tests.test_fast_path import _steps_logits, cuda_model, prompt_of

    ids = prompt_of(60, 1024, seed=8)
    logits = {}
    for mapped in (False, True):
        fast = FastTarget(cuda_model(torch.bfloat16, quant=quant), max_len=256, prefill_chunk=16, min_kv_len=64,
                          ple_on_host=True, lm_head_int8=int8_head, map_host_tables=mapped)
        assert fast.step_kernels and fast.embed_ple.mapped == mapped, fast.host_table_note
        assert fast.ple_staged == (not mapped) and hasattr(fast, "ple_buf") == (not mapped)
        if int8_head:
            assert fast.embed.mapped == mapped and fast.embed_staged == (not mapped)
        logits[mapped] = _steps_logits(fast, ids)
    assert torch.equal(logits[True], logits[False])


@needs_cuda
def test_lanes_share_one_registration_released_with_the_last_cuda():
    import gc

    from server import host_rows

    module = _scaled_embedding(1000, 640, torch.bfloat16, 3.0)
    device = torch.device("cuda")
    first = host_rows.HostRowTable(module, device)
    second = host_rows.HostRowTable(module, device)
    assert first.mapped and second.mapped, first.note
    address = module.weight.data_ptr()
    assert host_rows._registered[address] == 2
    ids = torch.tensor([5, 999, 0], device=device)
    assert torch.equal(first(ids), module.to(device)(ids))  # the module moved: its rows computed on the GPU
    del first
    gc.collect()
    assert host_rows._registered[address] == 1
    del second
    gc.collect()
    assert address not in host_rows._registered


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))


@needs_cuda
@pytest.mark.parametrize("parallel", [1, 2])
def test_the_engine_maps_the_tables_of_a_lone_target_and_stages_the_lanes_cuda(parallel):
    """The engine's choice (server/engine.py _build_fast_path): mapped for a lone target, staged for
    lanes (16 lanes measured slower mapped on the H200)."""
    from tests.test_engine_lossless import IdTokenizer, engine_for
    from tests.test_fast_path import cuda_model

    engine = engine_for(cuda_model(torch.bfloat16, quant=True), IdTokenizer(), parallel=parallel, max_context=512)
    lanes = engine._lanes._free
    assert len(lanes) == parallel and all(lane.ple_on_host for lane in lanes)
    assert all(lane.embed_ple.mapped == (parallel == 1) for lane in lanes), engine.notes
    assert any("per-layer embeddings in host memory" in note for note in engine.notes)
