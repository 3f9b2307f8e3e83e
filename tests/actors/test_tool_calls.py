"""A request's tools in the pipeline: call ids that every reading of a completion agrees on, content
deltas that add up to the ended text's content however the text was cut into steps, the grammar
a call that must be made samples by, and (with Qwen2.5-Coder pulled) a real model's own call read
from its answer."""

from __future__ import annotations

import json

import pytest

from sluice.actors.conversation import build_prompt
from sluice.actors.output_reader import OutputReader
from sluice.actors.tool_calls import call_id, sampling_kwargs
from sluice.engine.errors import EngineError
from sluice.engine.loader import catalog, load_tokenizer
from sluice.schemas import GenerateRequest

PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
    },
}
TEXT = (
    "I will compute it.\n"
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
)


def chat(**fields) -> GenerateRequest:
    question = [{"role": "user", "content": "What is 123 * 457 + 19? Use the python tool."}]
    return GenerateRequest.model_validate(
        {"request_id": "r-1", "messages": question, "tools": [PYTHON], **fields}
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)[0]


def read_in_steps(reader: OutputReader, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    content, calls, before = "", [], ""
    bounds = [0, *cuts, len(text)]
    for start, end in zip(bounds, bounds[1:]):
        read = reader.step(0, before, text[start:end], final=end == len(text))
        assert read.reasoning == ""  # (no reasoning parser)
        content, calls, before = content + read.content, calls + read.calls, text[:end]
    return content, calls


def test_deltas_add_up_to_the_ended_text_however_it_is_cut(tokenizer):
    reader = OutputReader.for_request(chat(), tokenizer)
    assert reader is not None
    whole = read_in_steps(reader, TEXT, [])
    assert whole[0] == "I will compute it."
    assert [c["function"]["arguments"] for c in whole[1]] == [
        '{"code": "print(6 * 7)"}',
        '{"code": "print(1)"}',
    ]
    for cuts in ([5, 19, 30, 60, 100, 140], list(range(1, len(TEXT))), [len(TEXT) - 1]):
        assert read_in_steps(reader, TEXT, cuts) == whole
    # a reader made afresh (the request resumed elsewhere) reads the same calls under the same ids
    again = OutputReader.for_request(chat(), tokenizer)
    assert again is not None and read_in_steps(again, TEXT, [70]) == whole
    assert [c["id"] for c in whole[1]] == [call_id("r-1", 0, 0), call_id("r-1", 0, 1)]


def test_call_ids_tell_requests_completions_and_places_apart():
    ids = {call_id(r, i, p) for r in ("a", "b") for i in (0, 1) for p in (0, 1)}
    assert len(ids) == 8 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_only_a_request_that_must_call_samples_by_the_calls_grammar(tokenizer):
    assert sampling_kwargs(chat(), tokenizer)["response_format"] is None
    forced = sampling_kwargs(chat(tool_choice="required"), tokenizer)["response_format"]
    assert forced["type"] == "grammar" and '"python"' in forced["grammar"]
    # tool_choice none: the tools are still described, but the text is not read for calls
    assert OutputReader.for_request(chat(tool_choice="none"), tokenizer) is None
    prompt = build_prompt(tokenizer, chat(tool_choice="none"))
    assert "python" in tokenizer.decode(prompt.token_ids)


@pytest.mark.slow
def test_qwen_calls_the_python_tool_of_its_own_accord():
    try:
        path = catalog.locate("qwen2.5-coder-1.5b")
    except EngineError as e:
        pytest.skip(
            f"qwen2.5-coder-1.5b is not pulled (sluice models pull qwen2.5-coder-1.5b): {e}"
        )
    from sluice.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(str(path), EngineConfig(kv_cache_bytes=256 << 20))
    request = chat(temperature=0, max_tokens=60)  # tool_choice auto: nothing forces a call
    prompt = build_prompt(engine.tokenizer, request)
    params = SamplingParams(**sampling_kwargs(request, engine.tokenizer))
    (out,) = engine.generate(prompt_token_ids=[prompt.token_ids], params=[params])
    reader = OutputReader.for_request(request, engine.tokenizer)
    assert reader is not None
    view = reader.view(out.text, final=True)
    (call,) = view.tools.calls
    assert call.name == "python" and "123" in json.loads(call.arguments)["code"]
