"""tokenmill: an LLM inference server with exact token accounting."""

__version__ = "0.1.0"
