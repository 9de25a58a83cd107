"""kvflow's public Python API: offline generation and its parameters."""

from services.launcher.llm import LLM, Completion, GenerationResult
from shared.protocol import SamplingParams

__all__ = ["LLM", "Completion", "GenerationResult", "SamplingParams"]
