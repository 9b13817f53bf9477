"""Sluice: an OpenAI-compatible gateway for chat models when GPUs are scarce."""

__version__ = "0.1.0"
