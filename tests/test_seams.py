"""The plug-in points the next capabilities build on: an attention backend registered
at run time and a linear method chosen for every layer both run through the engine
unchanged, and are token-identical to the built-in ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine_run import run_staggered
from tokenmill import SamplingParams
from tokenmill.attention.base import AttentionBackend, BatchLayout
from tokenmill.attention.registry import ATTENTION_BACKENDS, register_attention_backend
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers.linear import Linear
from tokenmill.layers.linear_method import PlainLinearMethod
from tokenmill.layers.moe import Expert
from tokenmill.layers.products import ProductPolicy
from tokenmill.worker import worker as worker_module

PROMPTS = [[5, 17, 42, 99, 3, 8, 1, 2, 3, 4, 5, 6, 7], list(range(20, 61)), [7, 7, 7], [300, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


class PerRequestAttention(AttentionBackend):
    """A deliberately different backend: every request's whole context gathered from
    the cache and attended with an explicit softmax, one request at a time. It keeps
    per-layer state (how many tokens each layer wrote) to show the seam carries it."""

    name = "test-per-request"

    def allocate_state(self, kv_caches):
        self.tokens_written = [0] * len(kv_caches)

    def build_metadata(self, layout: BatchLayout):
        return layout

    def forward(self, layer_index, q, k, v, kv_cache, layout, scale):
        kv_cache.write(k, v, layout.slot_mapping)
        self.tokens_written[layer_index] += q.shape[0]
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for row in range(layout.num_requests):
            start, end = layout.query_start[row], layout.query_start[row + 1]
            context = layout.context_lens[row]
            keys, values = kv_cache.gather(torch.tensor(layout.block_tables[row]))
            seq_len = context + end - start
            keys = keys[:seq_len].repeat_interleave(group, dim=1)  # [L, H, D]
            values = values[:seq_len].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scale
            visible = (torch.arange(seq_len)[None, :]
                       <= torch.arange(context, seq_len)[:, None])
            probs = F.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
        return out


@pytest.fixture
def per_request_backend():
    register_attention_backend(PerRequestAttention)
    yield PerRequestAttention.name
    ATTENTION_BACKENDS.pop(PerRequestAttention.name)


def run(model_dir, **options) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine.from_kwargs(str(model_dir), progress=False, block_size=8,
                                   max_num_batched_tokens=24, **options)
    return run_staggered(engine, PROMPTS, GREEDY, arrivals=[0, 1, 1, 4]), engine


@pytest.mark.parametrize("options", [{}, {"speculative_method": "ngram",
                                          "prompt_lookup_min": 1, "spec_adaptive": False}])
def test_a_backend_registered_at_run_time_runs_without_runner_changes(
        llama_dir, per_request_backend, options):
    reference, _ = run(llama_dir, **options)
    tokens, engine = run(llama_dir, attention_backend=per_request_backend, **options)
    assert tokens == reference
    backend = engine.executor.worker.runner.backend
    assert isinstance(backend, PerRequestAttention)
    written = backend.tokens_written
    assert len(written) == engine.arch.num_layers and len(set(written)) == 1 and written[0] > 0


def test_an_unknown_backend_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="attention_backend must be one of .*paged"):
        LLMEngine.from_kwargs(str(llama_dir), progress=False, attention_backend="nope")


class CountingMethod(PlainLinearMethod):
    """The plain layout, counting the rows each layer multiplies."""

    name = "test-counting"

    def create_weights(self, layer: Linear) -> None:
        super().create_weights(layer)
        layer.rows_seen = 0

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        layer.rows_seen += x.reshape(-1, x.shape[-1]).shape[0]
        return super().apply(layer, x)


class CountingPolicy(ProductPolicy):
    name = "test-counting"

    def select(self, prefix: str, layer: Linear):
        return CountingMethod()


@pytest.mark.parametrize("family", ["llama_mqa_tied", "mixtral"])
def test_a_linear_method_is_picked_up_by_every_projection_and_expert(
        model_factory, monkeypatch, family):
    model_dir = model_factory(family)
    reference, _ = run(model_dir, cpu_blas="torch")
    monkeypatch.setattr(worker_module, "product_policy",
                        lambda setting, device, dtype: CountingPolicy(device))
    tokens, engine = run(model_dir)
    assert tokens == reference
    model = engine.executor.worker.runner.model
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    experts = [m for m in model.modules() if isinstance(m, Expert)]
    assert all(isinstance(m.method, CountingMethod) for m in layers.values())
    unused = [name for name, m in layers.items() if m.rows_seen == 0]
    assert not unused, unused  # every projection, router, expert and the LM head ran
    assert len(experts) == (engine.arch.num_experts * engine.arch.num_layers)
