"""EngineConfig: the one place every knob lives.

Each part is a frozen dataclass validated at construction; a bad value raises a
ValueError naming the field and its allowed range. The CLI builds its flags from
these fields (see `tokenmill.cli`), so a new knob is one new field here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenmill.config.attention import SPARSE_BACKENDS, AttentionConfig
from tokenmill.config.parallel import ParallelConfig
from tokenmill.config.validate import require as _require

CHUNK_POLICIES = ("fixed", "dynamic")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")

# The embedded default model, committed with the project.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "pycoder"




@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block geometry, storage dtype, memory budget and prefix caching."""

    block_size: int = 16
    # Bytes for the KV pool. None: derive from kv_cache_memory_fraction.
    kv_cache_memory: int | None = None
    # Fraction of free device memory given to the KV pool when kv_cache_memory is None.
    # On CPU the pool is further capped at what max_num_seqs full-length sequences need.
    kv_cache_memory_fraction: float = 0.25
    # Force an exact number of blocks (tests and benchmarks); overrides the budget.
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # auto: the model dtype. int8 / fp8 (e4m3): 1-byte codes with a float32 scale per
    # token per KV head, computed when the token is written (no calibration).
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = "auto"

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"one of {KV_CACHE_DTYPES}", self.kv_cache_dtype)
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
                 "a power of two in [1, 256]", self.block_size)
        if self.kv_cache_memory is not None:
            _require(self.kv_cache_memory > 0, "kv_cache_memory", "> 0 bytes", self.kv_cache_memory)
        _require(0.0 < self.kv_cache_memory_fraction <= 1.0, "kv_cache_memory_fraction",
                 "in (0, 1]", self.kv_cache_memory_fraction)
        if self.num_blocks is not None:
            _require(self.num_blocks >= 1, "num_blocks", ">= 1", self.num_blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget scheduler (Sarathi-style hybrid batches)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    chunk_policy: Literal["fixed", "dynamic"] = "fixed"
    # fixed: largest prefill chunk per request per step (None: the token budget).
    chunk_size: int | None = None
    # dynamic: prompts up to this many tokens run whole; longer ones split into at most
    # dynamic_max_chunks chunks.
    dynamic_chunk_threshold: int = 512
    dynamic_max_chunks: int = 4
    # Starvation control: prefills go before decodes when the waiting queue is longer
    # than this, or its oldest request has waited longer than starvation_wait_s.
    starvation_queue_threshold: int = 200
    starvation_wait_s: float = 5.0
    # Head-of-line blocking bound: how many waiting requests that do not fit may be
    # skipped per step to admit smaller ones behind them.
    max_admission_skips: int = 8
    # Fairness: once this many later requests have been admitted ahead of a waiting
    # request that does not fit, nothing behind it is admitted until it runs.
    fair_admission_passes: int = 8
    # A request preempted this many times is not chosen again while another running
    # request (other than the earliest arrival) can be.
    max_preemptions_per_request: int = 2

    def __post_init__(self) -> None:
        for name, least in (("max_num_batched_tokens", 1), ("max_num_seqs", 1),
                            ("dynamic_chunk_threshold", 1), ("dynamic_max_chunks", 1),
                            ("starvation_queue_threshold", 0), ("max_admission_skips", 0),
                            ("fair_admission_passes", 0), ("max_preemptions_per_request", 0)):
            _require(getattr(self, name) >= least, name, f">= {least}", getattr(self, name))
        _require(self.chunk_policy in CHUNK_POLICIES, "chunk_policy", f"one of {CHUNK_POLICIES}",
                 self.chunk_policy)
        if self.chunk_size is not None:
            _require(self.chunk_size >= 1, "chunk_size", ">= 1", self.chunk_size)
        _require(self.starvation_wait_s > 0, "starvation_wait_s", "> 0", self.starvation_wait_s)

    @property
    def prefill_chunk_size(self) -> int:
        """Largest fixed-policy chunk for one request in one step."""
        return min(self.chunk_size or self.max_num_batched_tokens, self.max_num_batched_tokens)


CPU_BLAS = ("auto", "onednn", "numpy", "native", "torch")
REASONING_PARSERS = ("auto", "none")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint, in which dtype, on which device."""

    # A Hugging Face model directory or a GGUF file.
    model: str = str(DEFAULT_MODEL_DIR)
    # A tokenizer directory (None: the model directory's, or a GGUF file's own metadata).
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # None: the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    seed: int = 0
    # Threads for CPU inference (None: torch's default).
    num_threads: int | None = None
    # Who multiplies matrices on the CPU: onednn (oneDNN on weights packed at load),
    # numpy (NumPy's OpenBLAS; torch's own work then runs on one thread during a step),
    # native (tokenmill's own kernel on weights packed at load), torch (its MKL build);
    # auto: for float32 on the CPU the one measured fastest on this host (`tokenmill
    # tune`, or a probe at first start), torch otherwise.
    cpu_blas: Literal["auto", "onednn", "numpy", "native", "torch"] = "auto"
    # Rows of a large batch (a prefill chunk) each MLP runs through at a time, so its
    # intermediate activations stay cache-sized and their buffers are reused rather
    # than fresh pages every layer (layers/row_slices.py). None: sized from this
    # host's last-level cache; 0: the whole batch at once.
    mlp_slice_rows: int | None = None
    # Ask Linux for transparent huge pages (2 MB) under the weights as they load
    # (layers/huge_pages.py): a decode step streams them faster. Nothing changes where
    # the system's THP setting is `never` or off Linux.
    huge_pages: bool = True
    # Lay out the weights the native kernel packs in place in one allocation aligned to
    # 2 MB (layers/weight_arena.py), so that nearly all of them are in huge pages, not
    # the ends and heap gaps of weights allocated one by one.
    weight_arena: bool = True
    # Keep the memory a step frees for the next step instead of handing it back to the
    # kernel and faulting it in again (glibc's malloc thresholds, layers/allocator.py).
    retain_freed_memory: bool = True
    # auto: split a reasoning model's thinking from its answer and accept thinking
    # budgets when the model declares thinking markers (tokenmill/reasoning.py); none:
    # treat its output as plain text.
    reasoning_parser: Literal["auto", "none"] = "auto"
    # Early exit (CALM-style, runner/early_exit.py): after this many decoder layers a
    # decode token whose next-token probability through the final norm and LM head
    # exceeds early_exit_threshold skips the rest (None: off; threshold 1: never).
    early_exit_layer: int | None = None
    early_exit_threshold: float = 0.9

    def __post_init__(self) -> None:
        _require(self.early_exit_layer is None or self.early_exit_layer >= 1,
                 "early_exit_layer", "None or >= 1", self.early_exit_layer)
        _require(0 <= self.early_exit_threshold <= 1, "early_exit_threshold", "in [0, 1]",
                 self.early_exit_threshold)
        _require(self.dtype in DTYPES, "dtype", f"one of {DTYPES}", self.dtype)
        _require(self.device in DEVICES, "device", f"one of {DEVICES}", self.device)
        if self.max_model_len is not None:
            _require(self.max_model_len >= 2, "max_model_len", ">= 2", self.max_model_len)
        if self.num_threads is not None:
            _require(self.num_threads >= 1, "num_threads", ">= 1", self.num_threads)
        _require(self.cpu_blas in CPU_BLAS, "cpu_blas", f"one of {CPU_BLAS}", self.cpu_blas)
        rows = self.mlp_slice_rows
        _require(rows is None or (type(rows) is int and rows >= 0), "mlp_slice_rows",
                 "None or an int >= 0", rows)
        _require(type(self.huge_pages) is bool, "huge_pages", "True or False",
                 self.huge_pages)
        _require(type(self.weight_arena) is bool, "weight_arena", "True or False",
                 self.weight_arena)
        _require(type(self.retain_freed_memory) is bool, "retain_freed_memory",
                 "True or False", self.retain_freed_memory)
        _require(self.reasoning_parser in REASONING_PARSERS, "reasoning_parser",
                 f"one of {REASONING_PARSERS}", self.reasoning_parser)


QUANTIZATIONS = ("none", "int8", "int4")
QUANTIZATION_METHODS = ("rtn", "hqq", "awq")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
QUANTIZATION_ACTIVATIONS = ("float32", "int8")


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization of the Linear layers (projections, experts, LM head), applied
    when the float checkpoint is loaded; activations float32 unless asked otherwise."""

    # none | int8: symmetric codes, one scale per output channel (or per group of
    # quantization_group_size input columns when set) | int4: asymmetric codes, a scale
    # and an offset per group of quantization_group_size input columns.
    quantization: Literal["none", "int8", "int4"] = "none"
    # Input columns per scale: 32, 64 or 128. None: per output channel for int8, 128
    # for int4. A layer the group size does not divide keeps float weights (logged).
    quantization_group_size: int | None = None
    # How int4 scales and zero points are chosen: rtn (round to nearest on each group's
    # min/max), hqq (half-quadratic zero points; no calibration data) or awq
    # (activation-aware input-channel scales, calibrated on quantization_calibration).
    quantization_method: Literal["rtn", "hqq", "awq"] = "rtn"
    # awq: a text file, or a directory of text files, the calibration runs on (its
    # first tokens; use text like the model's own data, never the evaluation set).
    quantization_calibration: str | None = None
    # Comma-separated fnmatch patterns of layer names kept in full precision, e.g.
    # "lm_head" or "lm_head,model.layers.0.*". A tied LM head is also the embedding:
    # quantized, both read its codes; excluded, both stay float. MoE routers are never
    # quantized (their scores pick experts).
    quantization_exclude: str = ""
    # float32: the products take float32 activations (equal to the dequantized
    # weight's products up to rounding) | int8: each row is rounded to int8 per 32
    # input columns and multiplied by AVX-512 VNNI integer dot products (W8A8 / W4A8,
    # as llama.cpp's quantized products do): faster, not exact. Quantized weights
    # only (--quantization, or a pre-quantized checkpoint); a CPU without VNNI keeps
    # float32 activations (logged).
    quantization_activations: Literal["float32", "int8"] = "float32"

    def __post_init__(self) -> None:
        _require(self.quantization in QUANTIZATIONS, "quantization", f"one of {QUANTIZATIONS}",
                 self.quantization)
        _require(self.quantization_method in QUANTIZATION_METHODS, "quantization_method",
                 f"one of {QUANTIZATION_METHODS}", self.quantization_method)
        _require(self.quantization_activations in QUANTIZATION_ACTIVATIONS,
                 "quantization_activations", f"one of {QUANTIZATION_ACTIVATIONS}",
                 self.quantization_activations)
        if self.quantization_group_size is not None:
            _require(self.quantization_group_size in QUANTIZATION_GROUP_SIZES,
                     "quantization_group_size", f"one of {QUANTIZATION_GROUP_SIZES} or None",
                     self.quantization_group_size)
        if self.quantization_exclude:
            patterns = [p.strip() for p in self.quantization_exclude.split(",")]
            _require(all(patterns), "quantization_exclude",
                     "comma-separated, non-empty layer-name patterns", self.quantization_exclude)
        if self.quantization == "none":
            _require(self.quantization_group_size is None and self.quantization_method == "rtn"
                     and not self.quantization_exclude
                     and self.quantization_calibration is None, "quantization",
                     "int8 or int4 when a quantization_* option is set", self.quantization)
        if self.quantization == "int8":
            _require(self.quantization_method == "rtn", "quantization_method",
                     "'rtn' for int8 (symmetric codes: no zero point to optimise)",
                     self.quantization_method)
        awq = self.quantization_method == "awq"
        _require((self.quantization_calibration is not None) == awq,
                 "quantization_calibration", "a text file or directory with "
                 "quantization_method 'awq', and only then", self.quantization_calibration)

    @property
    def exclude_patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.quantization_exclude.split(",") if p.strip())

    @property
    def group_size(self) -> int | None:
        """Input columns per scale (None: one scale per output channel)."""
        if self.quantization == "int4":
            return self.quantization_group_size or 128
        return self.quantization_group_size


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which proposer, how many tokens, when to back off."""

    # None: off. ngram: prompt lookup; draft: a small model with the same tokenizer;
    # eagle: a feature-level draft head trained for the target. The methods are the
    # registry's (tokenmill/speculative/registry.py), which checks the name.
    speculative_method: str | None = field(
        default=None, metadata={"registry": "tokenmill.speculative.registry:SPECULATIVE_METHODS"})
    # Most tokens proposed per request per step (k).
    # 7: a lone request's 1 + 7 rows are the most the CPU products compute without
    # padding (cpu_blas.onednn_rows; on the OpenBLAS path, one 8-row panel), and
    # measured better than 4 for n-gram (docs/BENCHMARKS.md).
    num_speculative_tokens: int = 7
    # draft: the draft model directory (default: "<model>-draft" beside the target);
    # eagle: the head directory (default: "<model>/eagle").
    speculative_model: str | None = None
    # ngram: longest and shortest suffix to look up in the prompt + output.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # draft / eagle: most requests per proposer forward (None: the whole batch).
    draft_micro_batch: int | None = None
    # Adaptive k: each request keeps an acceptance estimate and speculates only as
    # many tokens as pay for their proposing and verifying cost (measured online);
    # off: always k tokens.
    spec_adaptive: bool = True
    # While a request has stopped speculating, probe with one token every this many
    # steps so it resumes when its text becomes predictable again.
    spec_probe_interval: int = 16

    def __post_init__(self) -> None:
        if self.speculative_method is not None:
            _require(isinstance(self.speculative_method, str) and bool(self.speculative_method),
                     "speculative_method", "a registered method name or None",
                     self.speculative_method)
        _require(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens", "in [1, 16]",
                 self.num_speculative_tokens)
        _require(self.prompt_lookup_min >= 1, "prompt_lookup_min", ">= 1", self.prompt_lookup_min)
        _require(self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max",
                 ">= prompt_lookup_min", self.prompt_lookup_max)
        if self.draft_micro_batch is not None:
            _require(self.draft_micro_batch >= 1, "draft_micro_batch", ">= 1",
                     self.draft_micro_batch)
        _require(self.spec_probe_interval >= 1, "spec_probe_interval", ">= 1",
                 self.spec_probe_interval)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)

    def _check_prefill_pruning(self) -> None:
        """Prefill pruning drops K/V blocks in the upper layers: nothing that shares
        blocks, brings rows of its own or splits the layers may run with it."""
        _require(not self.cache.enable_prefix_caching, "enable_prefix_caching",
                 "False with prefill_pruning (a cached block's upper layers would lack "
                 "the dropped tokens; pass --no-enable-prefix-caching)",
                 self.cache.enable_prefix_caching)
        _require(self.parallel.world_size == 1 and self.spec.speculative_method is None
                 and self.model.early_exit_layer is None, "prefill_pruning",
                 "None with parallelism, speculative decoding or early exit",
                 self.attention.prefill_pruning)
        _require(self.attention.attention_backend not in SPARSE_BACKENDS,
                 "attention_backend", f"not a sparse backend {SPARSE_BACKENDS} with "
                 "prefill_pruning", self.attention.attention_backend)

    def __post_init__(self) -> None:
        if self.model.early_exit_layer is not None:
            _require(self.parallel.world_size == 1 and self.spec.speculative_method is None,
                     "early_exit_layer", "None with parallelism or speculative decoding",
                     self.model.early_exit_layer)
            _require(self.attention.attention_backend not in SPARSE_BACKENDS,
                     "attention_backend", f"not a sparse backend {SPARSE_BACKENDS} with "
                     "early_exit_layer (their key bounds and indexes are per layer)",
                     self.attention.attention_backend)
        if self.attention.prefill_pruning is not None:
            self._check_prefill_pruning()
        if self.parallel.tensor_parallel_size > 1:
            # Its calibration names global KV heads; a rank holds a slice of them.
            _require(self.attention.attention_backend != "retrieval-topp",
                     "attention_backend", "not 'retrieval-topp' with tensor_parallel_size > 1",
                     self.attention.attention_backend)
        if self.parallel.pipeline_parallel_size > 1:
            # A stage has neither the target's embedding nor its last hidden states at
            # hand, which the EAGLE head reads; AWQ calibrates on whole-model forwards.
            _require(self.spec.speculative_method != "eagle", "speculative_method",
                     "not 'eagle' with pipeline_parallel_size > 1", self.spec.speculative_method)
            _require(self.quant.quantization_method != "awq", "quantization_method",
                     "not 'awq' with pipeline_parallel_size > 1", self.quant.quantization_method)
        # A moved copy is rebuilt from its float weight: quantized codes would change.
        _require(not self.parallel.expert_redundant_slots or self.quant.quantization == "none",
                 "expert_redundant_slots", "0 with weight quantization",
                 self.parallel.expert_redundant_slots)
        sched = self.scheduler
        if not sched.enable_chunked_prefill and self.model.max_model_len is not None:
            _require(sched.max_num_batched_tokens >= self.model.max_model_len,
                     "max_num_batched_tokens", ">= max_model_len when chunked prefill is off",
                     sched.max_num_batched_tokens)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`block_size=32, max_num_seqs=8, ...`)."""
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        for key, value in kwargs.items():
            owner = _FIELD_OWNER.get(key)
            if owner is None:
                raise ValueError(f"unknown engine option {key!r}; known: {sorted(_FIELD_OWNER)}")
            parts[owner][key] = value
        return cls(**{name: _PARTS[name](**values) for name, values in parts.items()})

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """The same config with the context length resolved from the checkpoint."""
        model = dataclasses.replace(self.model, max_model_len=max_model_len)
        return dataclasses.replace(self, model=model)


_PARTS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig,
                           "scheduler": SchedulerConfig, "spec": SpecConfig,
                           "attention": AttentionConfig, "parallel": ParallelConfig,
                           "quant": QuantConfig}
_FIELD_OWNER: dict[str, str] = {
    f.name: part for part, klass in _PARTS.items() for f in dataclasses.fields(klass)
}


def config_fields() -> list[tuple[str, dataclasses.Field]]:
    """Every flat option with its dataclass field, for building CLI flags."""
    return [(part, f) for part, klass in _PARTS.items() for f in dataclasses.fields(klass)]
