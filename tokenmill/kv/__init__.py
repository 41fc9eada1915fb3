"""KV cache storage: the paged tensors and their quantized forms (int8, fp8 e4m3)."""

from tokenmill.kv.cache import KVCache
from tokenmill.kv.quant import KV_CACHE_DTYPES, dequantize, quantize

__all__ = ["KV_CACHE_DTYPES", "KVCache", "dequantize", "quantize"]
