"""The warm-pool runtime agent: supervises LLM engine processes in a GPU Pod."""

__version__ = "0.1.0"
