"""Tensor parallelism through the pipeline on the real broker: `sluice run --tensor-parallel-size
2` (rank 0 reads the requests, samples and publishes; a worker process holds the other half of
each layer) streams the greedy tokens of an engine at TP=1 in this process, for the default model
and a tiny Qwen2-shaped model (float32), with a prompt prefilled in chunks and a prefix-cache hit.
A worker that dies ends the process with an error (no restart can bring it back), and the process
started again serves what it held, each event once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from sluice.engine import EngineConfig, LLMEngine, SamplingParams
from sluice.engine.loader import load_model
from sluice.testing.pipeline_harness import PipelineProcess, Watcher, new_prefix, publish
from sluice.testing.pipeline_harness import request as message

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_TOKENS = 8
ENGINE = dict(dtype="float32", kv_cache_bytes=256 << 20, max_num_batched_tokens=512)
WORDS = "amber basin cedar delta ember fjord grove heron inlet juniper kestrel lagoon".split()
# The tiny model: 6 query heads over 3 KV heads (2+1 and 4+2 at TP=2), a word-level vocabulary.
QWEN2_VOCAB = 300


def smollm2_prompts() -> tuple[list[str], list[str]]:
    """A first wave (one prompt longer than the 512-token budget: prefilled in chunks) and a
    second whose prompt shares the first wave's long prefix (a prefix-cache hit)."""
    shared = "Notes: " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(120))
    long = "Story: " + " ".join(WORDS[(i * 5) % len(WORDS)] for i in range(400))
    first = [
        "The capital of France is",
        "def fibonacci(n):",
        long,
        shared + " First question?",
    ]
    return first, [shared + " Second question?"]


def qwen2_prompts() -> tuple[list[str], list[str]]:
    words = [f"t{(i * 37) % QWEN2_VOCAB}" for i in range(300)]
    shared = " ".join(words[:40])
    first = [" ".join(words[40:45]), " ".join(words[50:110]), shared + " t1 t2"]
    return first, [shared + " t3 t4 t5"]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    """A random-weight Qwen2 saved with a word-level tokenizer ("t0" .. "t299")."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("qwen2-tp-pipeline")
    torch.manual_seed(0)
    config = tf.Qwen2Config(
        hidden_size=192,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=32,
        vocab_size=QWEN2_VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = tf.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that greedy choices are not near-ties
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(QWEN2_VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def reference(model: Path | None, waves: tuple[list[str], list[str]]) -> list[list[int]]:
    """Greedy tokens of an engine at TP=1 in this process, wave by wave."""
    loaded = load_model(model) if model is not None else None
    engine = LLMEngine(config=EngineConfig(**ENGINE), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.token_ids for wave in waves for r in engine.generate(wave, params)]


async def serve(bootstrap: str, prefix: str, waves) -> dict[str, dict]:
    """Publish the waves one after the other; per request id, its token ids in seq order and
    its final event (each token event read once)."""
    out = {}
    async with Watcher(bootstrap, prefix) as watcher:
        for w, wave in enumerate(waves):
            ids = [f"w{w}-{i}" for i in range(len(wave))]
            bodies = [
                message(rid, prompt=p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
                for rid, p in zip(ids, wave)
            ]
            await publish(bootstrap, f"{prefix}.requests", bodies)
            streams = await watcher.wait_finals(set(ids), timeout=240)
            for rid in ids:
                (final,) = streams.finals(rid)
                assert final["type"] == "final", final
                tokens = [e for e in streams.events[rid] if e["type"] == "token"]
                assert [e["seq"] for e in tokens] == list(range(final["seq"])), rid
                out[rid] = {"ids": [t for e in tokens for t in e["token_ids"]], "final": final}
    return out


def tp_run(bootstrap: str, prefix: str, tmp_path: Path, model: Path | None, name: str):
    extra = ["--tensor-parallel-size", "2", "--no-sessions"]
    if model is not None:
        extra += ["--model", str(model)]
    return PipelineProcess(bootstrap, None, prefix, tmp_path, *extra, name=name)


@pytest.mark.parametrize("model", ["default", "qwen2"])
async def test_tp2_pipeline_streams_tp1s_greedy_tokens(bootstrap_servers, tmp_path, model, request):
    path = request.getfixturevalue("qwen2_dir") if model == "qwen2" else None
    waves = qwen2_prompts() if model == "qwen2" else smollm2_prompts()
    expected = reference(path, waves)
    prefix = new_prefix()
    process = tp_run(bootstrap_servers, prefix, tmp_path, path, f"tp2-{model}")
    try:
        process.wait_ready(timeout=240)
        got = await serve(bootstrap_servers, prefix, waves)
    finally:
        code = process.stop()
    assert code == 0, process.tail()
    assert "tensor parallel: 2 ranks over gloo" in process.text()
    assert [got[rid]["ids"] for rid in sorted(got)] == expected
    (again,) = [got[rid]["final"] for rid in got if rid.startswith("w1-")]
    assert again["usage"]["cached_tokens"] >= 32  # the shared prefix's blocks, from the cache


def worker_of(pid: int) -> int:
    """The tensor-parallel worker process `pid` started."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"sluice.engine.tensor_parallel.worker" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"process {pid} has no tensor-parallel worker")


async def test_a_dead_worker_ends_the_process_and_a_new_one_serves_its_requests(
    bootstrap_servers, tmp_path, qwen2_dir
):
    waves = qwen2_prompts()
    prefix = new_prefix()
    first = tp_run(bootstrap_servers, prefix, tmp_path, qwen2_dir, "tp2-first")
    try:
        first.wait_ready(timeout=240)
        os.kill(worker_of(first.pid), signal.SIGKILL)
        # Requests come after the worker died: the first step fails, and the runner does not
        # restart over an engine with half its layers gone.
        await publish(
            bootstrap_servers,
            f"{prefix}.requests",
            [message("lost-rank", prompt=waves[0][1], temperature=0, max_tokens=MAX_TOKENS)],
        )
        deadline = time.monotonic() + 120
        while first.proc.poll() is None:
            assert time.monotonic() < deadline, first.tail()
            time.sleep(0.3)
    finally:
        first.stop()
    assert first.proc.returncode == 1, first.tail()
    log = first.text()
    assert "TensorParallelError" in log and "a restart cannot mend it" in log, first.tail()

    second = tp_run(bootstrap_servers, prefix, tmp_path, qwen2_dir, "tp2-second")
    try:
        second.wait_ready(timeout=240)
        async with Watcher(bootstrap_servers, prefix) as watcher:
            streams = await watcher.wait_finals({"lost-rank"}, timeout=120)
    finally:
        assert second.stop() == 0, second.tail()
    (final,) = streams.finals("lost-rank")
    assert final["type"] == "final", final
    seqs = [e["seq"] for e in streams.events["lost-rank"] if e["type"] == "token"]
    assert seqs == list(range(final["seq"]))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engine = LLMEngine(config=EngineConfig(**ENGINE), loaded=load_model(qwen2_dir))
    assert final["text"] == engine.generate([waves[0][1]], params)[0].text
