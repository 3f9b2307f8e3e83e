"""`engine_cpus` (`--engine-cpus`): the engine computes on the CPUs given, one thread each; the
threads that build and step it are kept to them, and the process's other CPUs are left to the rest
of it (the pipeline's event loop: tests/integration/test_engine_cpus_pipeline.py)."""

from __future__ import annotations

import argparse
import os
import threading

import pytest
import torch

from sluice.cli.generate import add_engine_arguments, engine_config_from_args
from sluice.engine.config import EngineConfig
from sluice.engine.cpus import parse_cpu_list
from sluice.engine.errors import ConfigError


def test_cpu_lists_read_as_taskset_writes_them():
    assert parse_cpu_list("0-2,5") == (0, 1, 2, 5)
    assert parse_cpu_list("3") == (3,)
    assert parse_cpu_list("1,0,1") == (0, 1)
    for bad in ("", "a", "3-1", "-1", "0-"):
        with pytest.raises(ConfigError) as err:
            parse_cpu_list(bad)
        assert err.value.field == "engine_cpus" and "CPU list" in str(err.value)


def test_the_flag_is_parsed_and_a_bad_one_refused(capsys):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).engine_cpus is None
    config = engine_config_from_args(parser.parse_args(["--engine-cpus", "0,1"]))
    assert config.engine_cpus == (0, 1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine-cpus", "zero"])
    assert "--engine-cpus" in capsys.readouterr().err


def test_cpus_outside_the_process_are_refused_by_name():
    from sluice.engine.engine import LLMEngine

    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError) as err:
        LLMEngine(config=EngineConfig(engine_cpus=(outside,), kv_cache_bytes=8 << 20))
    assert err.value.field == "engine_cpus" and str(outside) in str(err.value)
    with pytest.raises(ConfigError):
        EngineConfig(engine_cpus=(0,), tensor_parallel_size=2)


@pytest.fixture
def torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_engine_builds_and_steps_on_its_cpus_alone(torch_threads):
    """Built in one thread and stepped in another (as the pipeline does): both are kept to the
    engine's CPU, torch computes with one thread, and the tokens are those of an engine without
    the setting (the same arithmetic, one thread or two: greedy tokens agree)."""
    from sluice.engine.engine import LLMEngine
    from sluice.engine.sampling_params import SamplingParams

    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    config = dict(kv_cache_bytes=32 << 20, dtype="float32", kernels="native")
    seen: dict[str, object] = {}

    def build() -> None:
        seen["engine"] = LLMEngine(config=EngineConfig(engine_cpus=(cpu,), **config))
        seen["builder"] = os.sched_getaffinity(0)

    def step() -> None:
        engine = seen["engine"]
        engine.bind_thread()
        seen["stepper"] = os.sched_getaffinity(0)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        seen["tokens"] = engine.generate(["The capital of France is"], params)[0].token_ids
        seen["threads"] = torch.get_num_threads()

    for target in (build, step):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert seen["builder"] == {cpu} and seen["stepper"] == {cpu} and seen["threads"] == 1
    assert seen["engine"].other_cpus == allowed - {cpu}
    assert os.sched_getaffinity(0) == allowed  # this thread was neither
    torch.set_num_threads(2)
    plain = LLMEngine(config=EngineConfig(**config))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert plain.generate(["The capital of France is"], params)[0].token_ids == seen["tokens"]
