"""The paged engine: a library with no network code."""
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionDelta, CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
    "CompletionDelta",
]
