"""What the engine refuses at start because its kernel family cannot run it
(`startup.check_family`): each family says what it can do, and a refusal names the field."""

from __future__ import annotations

import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.errors import ConfigError
from sluice.engine.kernel_ops.deterministic_triton_ops import DeterministicTritonOps
from sluice.engine.kernel_ops.torch_ops import TorchOps
from sluice.engine.kernel_ops.triton_ops import TritonOps
from sluice.engine.startup import check_family


def test_cuda_graphs_only_with_a_family_whose_decode_steps_are_captured():
    graphs = EngineConfig(device="cuda", cuda_graphs=True)
    check_family(graphs, TritonOps())
    for ops in (TorchOps(), DeterministicTritonOps()):
        with pytest.raises(ConfigError, match=f"not the {ops.name} family's") as e:
            check_family(graphs, ops)
        assert e.value.field == "cuda_graphs"


def test_a_quantization_the_family_does_not_multiply_is_refused():
    check_family(EngineConfig(quantization="int4"), TorchOps())
    check_family(EngineConfig(quantization="auto"), DeterministicTritonOps())  # decided later
    with pytest.raises(ConfigError, match="do not run quantization 'int8'") as e:
        check_family(EngineConfig(quantization="int8"), DeterministicTritonOps())
    assert e.value.field == "quantization"
