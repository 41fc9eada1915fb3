"""tokenmill: an LLM inference and serving engine where every optimization is a measured switch."""

from tokenmill.config import EngineConfig
from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "TokenLogprob"]
__version__ = "0.1.0"
