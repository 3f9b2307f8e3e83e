"""Tools a model calls through the queue, and the sandbox the shipped `python` tool runs code in."""
