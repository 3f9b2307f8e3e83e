"""Deterministic mode's recorded outputs (`sluice.testing.golden_numerics`): the same token ids
and logprob bits as the golden file, in float32, bfloat16, int8 and int4 weights, on whatever CPU
and build of the kernels this runs (`scripts/test_isa_levels.sh` reruns it with the kernels built
for each instruction-set level the CPU has). A change of numerics fails here until the numerics
version is raised and the file recorded again."""

from __future__ import annotations

import os

import pytest

from sluice.engine import cpu_kernels
from sluice.engine.provenance import NUMERICS_VERSION
from sluice.testing import golden_numerics

# (under CI a machine without the kernels fails here: these tests are what the promise rests on)
pytestmark = pytest.mark.skipif(
    cpu_kernels.library() is None and os.environ.get("CI", "").lower() not in ("1", "true", "yes"),
    reason="the native CPU kernels are unavailable here",
)


def test_the_golden_file_is_of_this_numerics_version():
    assert golden_numerics.recorded()["numerics"] == NUMERICS_VERSION, (
        "the golden outputs were recorded under another numerics version: record them again "
        "(python -m sluice.testing.golden_numerics --record)"
    )


@pytest.mark.parametrize("variant", list(golden_numerics.VARIANTS))
def test_deterministic_outputs_are_the_recorded_bits(variant):
    if variant == "bfloat16" and cpu_kernels.uses_bf16_dot():
        pytest.skip("this CPU's bfloat16 dot instruction adds products in pairs: bits of its own")
    want = golden_numerics.recorded()["variants"][variant]
    got = golden_numerics.outputs(variant)
    for g, w in zip(got, want, strict=True):
        where = f"prompt {w['prompt']}, params {w['params']}"
        assert g["token_ids"] == w["token_ids"], where
        differ = [i for i, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"])) if a != b]
        assert not differ, f"{where}: logprobs differ from position {differ[:1]}"
