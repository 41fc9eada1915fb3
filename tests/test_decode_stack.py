"""The compiled decoder stack (model/decode_stack.py): decode-only steps through one C++
loop over the layers' kernels change no bit (logprobs equal the layers' path, with
requests arriving and finishing at different steps and a block size that splits
contexts), it runs on every such step, and it steps aside wherever it would not
reproduce the layers' path (other families, product paths, backends, hooks, patched
methods)."""

from __future__ import annotations

import pytest
import torch

from tests.engine_run import run_staggered
from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.layers import native_linear
from tokenmill.layers.linear import Linear
from tokenmill.model import decode_stack

pytestmark = pytest.mark.skipif(not native_linear.available() or decode_stack.library() is None,
                                reason="the native kernels cannot be built here")

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(20, 61)), list(range(100, 130))]


def logprobs(llm: LLM) -> list[list[tuple]]:
    return [[(step.token_id, step.logprob, *step.top) for step in output.outputs[0].logprobs]
            for output in llm.generate(PROMPTS, PARAMS)]


def model_of(engine: LLMEngine):
    return engine.executor.worker.runner.model


@pytest.fixture
def steps_taken(monkeypatch) -> list[int]:
    """Rows of every step the stack ran."""
    taken: list[int] = []
    real = decode_stack.DecodeStack.run_step

    def counted(self, hidden, rope, attention):
        out = real(self, hidden, rope, attention)
        if out is not None:
            taken.append(hidden.shape[0])
        return out

    monkeypatch.setattr(decode_stack.DecodeStack, "run_step", counted)
    return taken


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])  # qwen2: biases, tied head
def test_stack_changes_no_bit(model_factory, family, steps_taken):
    llm = LLM(str(model_factory(family)), progress=False, cpu_blas="native")
    model = model_of(llm.engine)
    assert model.decode_stack is not None
    stacked = logprobs(llm)
    # One prefill step, then every decode step (all three requests in each) stacked.
    assert steps_taken == [len(PROMPTS)] * (PARAMS.max_tokens - 1)
    model.decode_stack = None
    assert logprobs(llm) == stacked
    assert len(steps_taken) == PARAMS.max_tokens - 1  # none while it was unset


def test_timed_operations_sum_their_seconds(llama_dir, steps_taken):
    """`timed` (bench_step_overhead.py --ops) sums each operation's seconds over the
    stacked steps and changes no output; off, nothing is summed; `spent` resets."""
    llm = LLM(str(llama_dir), progress=False, cpu_blas="native")
    kernel = model_of(llm.engine).decode_stack.kernel
    untimed = logprobs(llm)
    assert set(kernel.spent()) == {"norms", "qkv", "attention", "o", "gate_up", "down"}
    assert not any(kernel.spent().values())
    kernel.timed = True
    assert logprobs(llm) == untimed
    spent = kernel.spent()
    assert all(seconds > 0 for seconds in spent.values()), spent
    assert not any(kernel.spent().values())  # the first read reset them
    kernel.timed = False


def test_kept_buffers_equal_fresh_tensors(llama_dir, steps_taken):
    """The stack's kept activation buffers against a new tensor for every output (as
    kernels that return theirs make them): the same bits, and the kept ones survive a
    change of row count (requests finishing at different steps)."""
    llm = LLM(str(llama_dir), progress=False, cpu_blas="native")
    kernel = model_of(llm.engine).decode_stack.kernel
    prompts = PROMPTS + [[9, 8, 7]]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=3, ignore_eos=True)
              for n in (8, 3, 6, 2)]

    def run() -> list[list[tuple]]:
        return [[(step.token_id, step.logprob, *step.top) for step in out.outputs[0].logprobs]
                for out in llm.generate(prompts, params)]

    kept = run()
    assert sorted(set(steps_taken)) == [1, 2, 3, 4]
    kernel.fresh = True
    try:
        assert run() == kept
    finally:
        kernel.fresh = False
    assert run() == kept


@pytest.mark.parametrize("options", [{}, {"speculative_method": "ngram",
                                          "prompt_lookup_min": 1, "spec_adaptive": False}])
def test_staggered_requests_equal_the_layers_path(llama_dir, steps_taken, options):
    prompts = [[5, 17, 42, 99, 3, 8, 1, 2, 3, 4, 5, 6, 7], list(range(20, 61)), [7, 7, 7],
               [300, 12]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (20, 9, 14, 5)]

    def run(stack: bool) -> list[list[int]]:
        engine = LLMEngine.from_kwargs(str(llama_dir), progress=False, block_size=8,
                                       max_num_batched_tokens=24, cpu_blas="native",
                                       **options)
        if not stack:
            model_of(engine).decode_stack = None
        return run_staggered(engine, prompts, params, arrivals=[0, 1, 1, 4])

    stacked = run(True)
    assert len(set(steps_taken)) > 1  # decode steps of different row counts (draft tokens)
    assert run(False) == stacked


@pytest.mark.parametrize("family, options", [
    ("qwen3", {"cpu_blas": "native"}),  # per-head q/k norms
    ("mixtral", {"cpu_blas": "native"}),  # experts, not one gated MLP
    ("llama", {"cpu_blas": "torch"}),  # products not on the native kernel
    ("llama", {"cpu_blas": "native", "attention_backend": "paged"}),  # no whole-step entry
    ("llama", {"cpu_blas": "native", "kv_cache_dtype": "int8"}),  # a quantized cache
])
def test_declined_where_it_would_not_reproduce_the_layers(model_factory, family, options):
    llm = LLM(str(model_factory(family)), progress=False, **options)
    assert model_of(llm.engine).decode_stack is None


def test_a_hook_or_a_patched_method_sees_every_call(llama_dir, monkeypatch, steps_taken):
    llm = LLM(str(llama_dir), progress=False, cpu_blas="native")
    model = model_of(llm.engine)
    reference = logprobs(llm)
    assert steps_taken
    steps_taken.clear()

    seen: list[int] = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[0]))
    assert logprobs(llm) == reference
    handle.remove()
    assert not steps_taken and seen.count(len(PROMPTS)) == PARAMS.max_tokens - 1

    handle = model.model.norm.register_forward_pre_hook(lambda module, args: None)
    assert logprobs(llm) == reference
    handle.remove()
    assert not steps_taken  # a hook on any module the stack covers, the final norm's too

    products: list[int] = []
    real = Linear.forward

    def spying(self, x, silu_mul=False):
        products.append(x.shape[0])
        return real(self, x, silu_mul=silu_mul)

    with monkeypatch.context() as patch:
        patch.setattr(Linear, "forward", spying)
        assert logprobs(llm) == reference
    assert not steps_taken and products.count(len(PROMPTS)) > 0
    assert logprobs(llm) == reference and steps_taken  # and back once unpatched


def test_kernel_errors_name_what_is_wrong():
    kernel = decode_stack.library()
    norm = torch.ones(8)
    with pytest.raises(RuntimeError, match="no entry point named f32_linear"):
        kernel.Stack({}, norm, 1e-6)
    entries = {**native_linear.library().entry_points(),
               **decode_stack.native_row_ops().entry_points()}
    stack = kernel.Stack(entries, norm, 1e-6)
    with pytest.raises(RuntimeError, match="one key and one value pool per layer"):
        stack.set_pools([torch.zeros(1)], [torch.zeros(1)])
    norms = (torch.ones(8), 1e-6, torch.ones(8), 1e-6, 2, 0.5)
    square = [native_linear.pack(torch.randn(n, 8)) for n in (32, 8, 32, 8)]
    with pytest.raises(RuntimeError, match="outputs must fill its packed blocks"):
        stack.add_layer(*norms, square, [None] * 4, [24, 8, 32, 8])
    stack.add_layer(*norms, square, [None] * 4, [32, 16, 32, 16])
    wider = [native_linear.pack(torch.randn(n, 8)) for n in (48, 8, 32, 8)]
    with pytest.raises(RuntimeError, match="every layer must have the first one's shapes"):
        stack.add_layer(*norms, wider, [None] * 4, [48, 16, 32, 16])
    stack = kernel.Stack(entries, norm, 1e-6)
    with pytest.raises(RuntimeError, match="no layers"):
        stack.run(torch.zeros(1, 8), torch.zeros(1, 4), torch.zeros(1, 4), 1,
                  torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
                  torch.ones(1, dtype=torch.int32))
