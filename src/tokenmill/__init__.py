"""tokenmill: an LLM inference server with exact token accounting."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutput", "__version__"]

if TYPE_CHECKING:
    from tokenmill.frontend.llm import LLM
    from tokenmill.sampling_params import SamplingParams, StructuredOutput


def __getattr__(name: str):
    """``LLM``, ``SamplingParams`` and ``StructuredOutput`` load on first use, so light
    imports (the benchmark client, ``tokenmill --version``) never pay for torch."""
    if name == "LLM":
        from tokenmill.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutput":
        from tokenmill.sampling_params import StructuredOutput

        return StructuredOutput
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
