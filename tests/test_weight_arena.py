"""`--weight-arena`: the weights the native kernel packs in place lie in one allocation
that starts on a huge page's boundary, packed in place there, and nothing the model
computes changes."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import huge_pages, weight_arena
from tokenmill.layers.linear import Linear

PROMPTS = ["def add(a, b):", "the quick brown fox", "x = [1, 2, 3]"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def model_of(llm: LLM):
    return llm.engine.executor.worker.runner.model


def native_layers(llm: LLM) -> list[Linear]:
    return [m for m in model_of(llm).modules()
            if isinstance(m, Linear) and hasattr(m, "native_weight")]


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_packed_weights_share_one_aligned_arena_and_generate_the_same(model_factory,
                                                                       family):
    model_dir = model_factory(family)
    laid_out = LLM(str(model_dir), cpu_blas="native", weight_arena=True, progress=False,
                   num_threads=1)
    one_by_one = LLM(str(model_dir), cpu_blas="native", weight_arena=False,
                     progress=False, num_threads=1)
    experts = {id(sub) for name, module in model_of(laid_out).named_modules()
               if ".experts." in f"{name}." for sub in module.modules()}
    packed = [m.native_weight for m in native_layers(laid_out)
              if m.out_features % 16 == 0 and id(m) not in experts]
    assert packed
    storages = {w.untyped_storage().data_ptr() for w in packed}
    assert len(storages) == 1
    spans = sorted((w.data_ptr(), w.data_ptr() + w.numel() * w.element_size())
                   for w in packed)
    assert spans[0][0] % weight_arena.BASE_ALIGN == 0
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert all(start % weight_arena.ALIGN == 0 for start, _ in spans)
    # Without the arena every weight keeps a storage of its own.
    apart = [m.native_weight for m in native_layers(one_by_one)]
    assert len({w.untyped_storage().data_ptr() for w in apart}) == len(apart)
    # Experts keep weights of their own (replication may swap them for other copies).
    for m in native_layers(laid_out):
        if id(m) in experts:
            storage = m.native_weight.untyped_storage()
            assert storage.nbytes() == m.native_weight.numel() * 4
    assert tokens(laid_out) == tokens(one_by_one)


def test_the_arena_is_advised_for_huge_pages(llama_dir, monkeypatch):
    advised: list[int] = []  # bytes of each advised storage
    real = huge_pages.advise

    def recording(tensor):
        if huge_pages._ENABLED.get():
            advised.append(tensor.untyped_storage().nbytes())
        return real(tensor)

    monkeypatch.setattr(huge_pages, "advise", recording)
    llm = LLM(str(llama_dir), cpu_blas="native", weight_arena=True, progress=False,
              num_threads=1)
    packed = [m.native_weight for m in native_layers(llm)]
    arena_bytes = packed[0].untyped_storage().nbytes()
    assert sum(w.numel() * w.element_size() for w in packed) <= arena_bytes
    assert arena_bytes in advised  # the whole arena, as one storage


def test_gather_outside_its_context_leaves_the_model_alone():
    layer = Linear(32, 64)
    before = layer.weight
    assert weight_arena.gather(layer) == 0
    assert layer.weight is before and not weight_arena.is_slot(layer.weight)


def test_the_setting_must_be_a_bool():
    from tokenmill.config import ModelConfig

    with pytest.raises(ValueError, match="weight_arena"):
        ModelConfig(weight_arena="yes")


def test_a_slot_is_its_own_bytes_for_packing_in_place():
    from tokenmill.layers import native_linear

    flat = weight_arena.arena(2 * 64 * 48 * 4, torch.float32)
    weight = torch.nn.Parameter(flat[:64 * 48].view(64, 48), requires_grad=False)
    assert not native_linear.packs_in_place(weight)  # shares its storage: not unless marked
    setattr(weight, weight_arena._SLOT, True)
    assert native_linear.packs_in_place(weight)
    expected = native_linear.pack(weight.detach().clone())
    assert torch.equal(native_linear.pack_in_place(weight), expected)
