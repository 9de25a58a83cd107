"""kvflow's Python API: offline generation through the serving engine's own loop.

from kvflow import LLM, SamplingParams

llm = LLM()  # the embedded SmolLM2-135M-Instruct; or LLM("/path/to/model", ...)
for result in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
    print(result.text)

`LLM.engine` is the engine loop itself (`EngineCore`: add_request, step, abort), for callers
that drive steps one by one, as the benchmarks do.
"""

from kvflow.llm import LLM
from kvflow.lora_request import LoRARequest
from kvflow.outputs import Completion, EmbeddingResult, GenerationResult
from services.scheduler.engine_core import EngineCore
from shared.protocol import EngineRequest, SamplingParams, TokenLogprob, TopLogprob
from shared.version import VERSION as __version__

__all__ = [
    "LLM",
    "Completion",
    "EmbeddingResult",
    "EngineCore",
    "EngineRequest",
    "GenerationResult",
    "LoRARequest",
    "SamplingParams",
    "TokenLogprob",
    "TopLogprob",
    "__version__",
]
