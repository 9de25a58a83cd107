"""kvflow's Python API: offline generation through the serving engine's own loop.

from kvflow import LLM, SamplingParams

llm = LLM()  # the embedded SmolLM2-135M-Instruct; or LLM("/path/to/model", ...)
for result in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
    print(result.text)
"""

from kvflow.llm import LLM
from kvflow.outputs import Completion, GenerationResult
from shared.protocol import SamplingParams, TokenLogprob, TopLogprob
from shared.version import VERSION as __version__

__all__ = [
    "LLM",
    "Completion",
    "GenerationResult",
    "SamplingParams",
    "TokenLogprob",
    "TopLogprob",
    "__version__",
]
