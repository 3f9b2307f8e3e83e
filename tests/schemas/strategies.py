"""Hypothesis strategies for wire messages."""

from __future__ import annotations

from hypothesis import strategies as st

from sluice.schemas import (
    Choice,
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    Message,
    Timings,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)

ids = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40
)
topics = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-",
    min_size=1,
    max_size=60,
).filter(lambda t: t not in (".", ".."))
texts = st.text(max_size=200)
finite = dict(allow_nan=False, allow_infinity=False)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(**finite)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)
metadata = st.dictionaries(st.text(max_size=12), json_values, max_size=6)

messages = st.lists(
    st.builds(
        Message, role=st.sampled_from(["system", "user", "assistant", "tool"]), content=texts
    ),
    min_size=1,
    max_size=5,
)

_optional = {
    "request_id": ids,
    "session_id": st.none() | ids,
    "tenant": st.none() | ids.map(lambda s: s[:64]),
    "reply_topic": st.none() | topics,
    "priority": st.integers(-(2**31), 2**31 - 1),
    "deadline": st.none() | st.floats(min_value=0, max_value=4e9, **finite),
    "temperature": st.floats(min_value=0, max_value=100, **finite),
    "top_p": st.floats(min_value=0, max_value=1, exclude_min=True, **finite),
    "top_k": st.integers(-1, 100_000),
    "min_p": st.floats(min_value=0, max_value=1, **finite),
    "repetition_penalty": st.floats(min_value=0, max_value=10, exclude_min=True, **finite),
    "presence_penalty": st.floats(min_value=-2, max_value=2, **finite),
    "frequency_penalty": st.floats(min_value=-2, max_value=2, **finite),
    "max_tokens": st.integers(1, 1_000_000),
    "stop": st.lists(st.text(min_size=1, max_size=10), max_size=16),
    "stop_token_ids": st.lists(st.integers(0, 200_000), max_size=20),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 16),
    "logprobs": st.none() | st.integers(0, 20),
    "seed": st.none() | st.integers(0, 2**64 - 1),
    "skip_special_tokens": st.booleans(),
    "metadata": st.none() | metadata,
    "stream": st.booleans(),
    "event_format": st.none() | st.sampled_from(["sluice", "openai"]),
}


@st.composite
def requests(draw: st.DrawFn) -> GenerateRequest:
    kwargs = draw(st.fixed_dictionaries({}, optional=_optional))
    if draw(st.booleans()):
        kwargs["prompt"] = draw(st.text(min_size=1, max_size=200))
    else:
        kwargs["messages"] = draw(messages)
    return GenerateRequest(**kwargs)


logprob = st.floats(min_value=-9999, max_value=0, **finite)
spelling = {
    "token": st.none() | st.text(max_size=8),
    "bytes": st.none() | st.lists(st.integers(0, 255), max_size=8),
}
token_logprobs = st.builds(
    TokenLogprob,
    token_id=st.integers(0, 200_000),
    logprob=logprob,
    top=st.lists(
        st.builds(TopLogprob, token_id=st.integers(0, 200_000), logprob=logprob, **spelling),
        max_size=3,
    ),
    **spelling,
)
token_events = st.builds(
    TokenEvent,
    request_id=ids,
    seq=st.integers(0, 10**6),
    index=st.integers(0, 15),
    token_ids=st.lists(st.integers(0, 200_000), max_size=4),
    text=texts,
    logprobs=st.none() | st.lists(token_logprobs, max_size=3),
    session_id=st.none() | ids,
    metadata=st.none() | metadata,
)
seconds = st.floats(min_value=0, max_value=1e5, **finite)
choices = st.lists(
    st.builds(
        Choice,
        index=st.integers(0, 15),
        text=texts,
        finish_reason=st.sampled_from(["stop", "length", "abort", "error"]),
        stop_reason=st.none() | st.text(min_size=1, max_size=5) | st.integers(0, 10**5),
        completion_tokens=st.integers(0, 10**6),
        logprobs=st.none() | st.lists(token_logprobs, max_size=3),
    ),
    min_size=2,
    max_size=4,
)
final_events = st.builds(
    FinalEvent,
    request_id=ids,
    seq=st.integers(0, 10**6),
    finish_reason=st.sampled_from(["stop", "length", "abort", "error"]),
    stop_reason=st.none() | st.text(min_size=1, max_size=5) | st.integers(0, 200_000),
    usage=st.builds(
        Usage,
        prompt_tokens=st.integers(0, 10**6),
        cached_tokens=st.integers(0, 10**6),
        completion_tokens=st.integers(0, 10**6),
    ),
    timings=st.builds(
        Timings,
        queue_s=seconds,
        ttft_s=st.none() | seconds,
        tpot_s=st.none() | seconds,
        total_s=seconds,
    ),
    model=st.text(max_size=30),
    text=texts,
    choices=st.none() | choices,
    logprobs=st.none() | st.lists(token_logprobs, max_size=3),
    session_id=st.none() | ids,
    metadata=st.none() | metadata,
)
error_events = st.builds(
    ErrorEvent,
    request_id=st.none() | ids,
    seq=st.none() | st.integers(0, 10**6),
    code=st.sampled_from(["invalid_json", "invalid_request", "internal", "some_future_code"]),
    message=texts,
    field=st.none() | st.text(min_size=1, max_size=20),
)
events = token_events | final_events | error_events
