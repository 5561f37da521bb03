"""VelocityLLM: an LLM gateway and scheduler in front of vLLM engines."""

__version__ = "0.1.0"
