"""The engine's report types and the wire's: the engine (a library that imports nothing of the
pipeline) and the schemas (which import nothing of sluice) each define their own, and the runner
maps one onto the other. These tests keep the two from drifting apart: a field the engine adds
reaches the wire, or the wire says on purpose that it leaves it out."""

from __future__ import annotations

import dataclasses

from sluice.engine import outputs, provenance
from sluice.schemas import events


def _fields(engine_type) -> set[str]:
    return {f.name for f in dataclasses.fields(engine_type)}


def test_provenance_carries_every_field_the_engine_records():
    assert _fields(provenance.Provenance) == set(events.Provenance.model_fields)


def test_usage_carries_every_count_the_engine_keeps():
    assert _fields(outputs.Usage) == set(events.Usage.model_fields)


def test_timings_on_the_wire_are_the_engines_and_the_time_in_the_topic():
    # the wire's are shifted to the client's clock by the runner; `in_topic_s` is the pipeline's
    assert set(events.Timings.model_fields) == _fields(outputs.Timings) | {"in_topic_s"}
