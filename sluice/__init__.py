"""sluice: streaming LLM inference where the message queue is the interface."""

__version__ = "0.1.0"
