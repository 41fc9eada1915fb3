"""`--isa avx2`: tokenmill's kernels and the libraries beneath run their AVX2 paths on an
AVX-512 host, with the same results (the kernels', parity with transformers), and every
measured choice and build keyed apart from the host's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill import cli
from tokenmill.layers import isa
from tokenmill.layers.native import build_extension, build_key
from tokenmill.layers.timing import cpu_signature

ROOT = Path(__file__).resolve().parent.parent


def test_the_caps_and_when_the_process_must_start_again():
    capped = isa.capped_environment("avx2", {"PATH": "/bin"})
    assert capped["TOKENMILL_ISA"] == "avx2" and capped["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert capped["ATEN_CPU_CAPABILITY"] == "avx2" and capped["OPENBLAS_CORETYPE"] == "Haswell"
    assert capped["PATH"] == "/bin"
    assert isa.needs_restart("avx2", {"PATH": "/bin"})
    assert not isa.needs_restart("avx2", capped)
    assert not isa.needs_restart("native", {"PATH": "/bin"})
    # Back to native: the caps this module set are taken away, a user's own kept.
    assert isa.capped_environment("native", capped) == {"PATH": "/bin"}
    own = {**capped, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    assert isa.capped_environment("native", own)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert isa.split_isa_argument(["--isa", "avx2", "tune"]) == ("avx2", ["tune"])
    assert isa.split_isa_argument(["--isa=avx2", "tune"]) == ("avx2", ["tune"])
    assert isa.split_isa_argument(["tune", "--isa", "avx2"]) == (None, ["tune", "--isa", "avx2"])


def test_a_bad_cap_is_named(monkeypatch, capsys):
    assert cli.main(["--isa", "sse9", "tune", "--help"]) == 2
    assert "sse9" in capsys.readouterr().err
    monkeypatch.setenv("TOKENMILL_ISA", "avx1024")
    assert cli.main(["tune", "--help"]) == 2
    assert "TOKENMILL_ISA='avx1024'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="TOKENMILL_ISA"):
        isa.capped_isa()


def test_a_capped_run_keys_its_own_builds_and_choices(monkeypatch):
    from tokenmill.layers.native_linear import SOURCE

    native_signature, native_key = cpu_signature(), build_key(SOURCE)
    assert isa.kernel_flags() == () and isa.llamacpp_build_name() == "build"
    monkeypatch.setenv("TOKENMILL_ISA", "avx2")
    assert cpu_signature() == native_signature + "|capped at avx2"
    assert isa.kernel_flags() == ("-mno-avx512f",)
    # The llama.cpp peer: a build of its own, AVX2 and no AVX-512.
    assert isa.llamacpp_build_name() == "build-avx2"
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=OFF"} <= set(
        isa.LLAMACPP_CMAKE["avx2"])
    assert build_key(SOURCE, isa.kernel_flags()) != native_key


def avx512_instructions(module) -> int:
    """Instructions naming a 512-bit register in a compiled module."""
    listing = subprocess.run(["objdump", "-d", module.__file__], capture_output=True,
                             text=True, check=True).stdout
    return sum("%zmm" in line for line in listing.splitlines())


@pytest.mark.skipif("avx512f" not in cpu_signature(), reason="the host has no AVX-512")
def test_the_kernels_and_the_engine_run_their_avx2_paths_with_the_same_results(monkeypatch):
    """Under the cap, in a process of its own (the libraries read their caps when they
    load): the product, quantized product and decode kernels against their references
    (torch, the dequantized weight in float64), and greedy tokens and log
    probabilities against transformers through the native products (AVX2 tiles, the
    decode tiles bit-identical to the wide ones), the
    in-place decode kernel and the sparse backends' list kernel (8-lane register fold),
    the causal prefill kernel (8-lane tiles), the fused gate/up activation,
    oneDNN and OpenBLAS (capped)."""
    selected = [
        "tests/test_cpu_blas.py::test_native_kernel_at_odd_widths_equals_torch",
        "tests/test_cpu_blas.py::test_fused_gate_up_activation_is_bit_identical_to_the_"
        "product_then_silu_mul",
        "tests/test_cpu_blas.py::test_decode_sized_tiles_equal_the_wide_ones_bit_for_bit",
        "tests/kv/test_paged_native.py::test_the_kernel_equals_gathered_attention",
        "tests/kv/test_prefill_native.py::test_the_kernel_equals_sdpa_per_chunk",
        "tests/kv/test_block_sparse_native.py::test_native_list_attention_is_the_gathered_route",
        "tests/quant/test_kernels.py::test_quantized_product_equals_the_dequantized_reference",
        "tests/test_parity.py::test_greedy_tokens_and_logprobs_match_transformers"
        "[qwen2-native]",
        "tests/test_parity.py::test_greedy_tokens_and_logprobs_match_transformers"
        "[qwen3-onednn]",
        "tests/test_parity.py::test_greedy_tokens_and_logprobs_match_transformers"
        "[llama-numpy]",
        "tests/test_parity.py::test_attention_backends_match_transformers"
        "[llama-paged-native]",
    ]
    env = isa.capped_environment("avx2")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *selected], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
    # The builds that ran have no AVX-512 in them (the host's own decode kernel does).
    from tokenmill.attention.paged_native import SOURCE as DECODE
    from tokenmill.attention.prefill_native import FLAGS as PREFILL_FLAGS
    from tokenmill.attention.prefill_native import SOURCE as PREFILL
    from tokenmill.layers.native_linear import FLAGS as PRODUCT_FLAGS
    from tokenmill.layers.native_linear import SOURCE as PRODUCTS
    from tokenmill.quant.kernels import SOURCE as QUANTIZED

    native = build_extension("paged_decode", DECODE, ("-ffast-math",))
    monkeypatch.setenv("TOKENMILL_ISA", "avx2")
    for name, source, flags in (("f32_linear", PRODUCTS, PRODUCT_FLAGS),
                                ("qlinear", QUANTIZED, ()),
                                ("paged_decode", DECODE, ("-ffast-math",)),
                                ("prefill_causal", PREFILL, PREFILL_FLAGS)):
        assert avx512_instructions(build_extension(name, source, flags)) == 0
    monkeypatch.delenv("TOKENMILL_ISA")
    assert avx512_instructions(native) > 0


def test_capped_processes_report_the_cap():
    env = isa.capped_environment("avx2", dict(os.environ))
    code = ("import torch, numpy; from threadpoolctl import threadpool_info; "
            "print(torch.backends.cpu.get_cpu_capability(), "
            "[i.get('architecture') for i in threadpool_info() "
            "if i.get('internal_api') == 'openblas'])")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.startswith("AVX2") and "Haswell" in done.stdout
