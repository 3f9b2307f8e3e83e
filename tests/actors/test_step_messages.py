"""Step messages as the streamer and the progress log read them: the request's handle once per
message, and a final kept by an earlier version (its handle's fields flat) still read whole."""

from __future__ import annotations

from sluice.actors.messages import RequestHandle, StepMessage
from sluice.actors.progress import Progress, request_digest
from sluice.schemas import GenerateRequest


def test_a_final_kept_with_flat_request_fields_resumes_with_its_handle():
    # What a progress record held before the handle: the request's fields beside the step's.
    kept = (
        '{"request_id":"r","digest":"d","seed":7,"final":{"request_id":"r","seq":3,'
        '"finished":true,"finish_reason":"stop","full_text":"Hi","reply_topic":"mine",'
        '"session_id":"s","tenant":"t","model":"m","runner_id":"runner-1","stream":false,'
        '"event_format":"openai","chat":true,"created":1234}}'
    )
    final = Progress.model_validate_json(kept).final
    assert final is not None
    assert final.request == RequestHandle(
        reply_topic="mine",
        session_id="s",
        tenant="t",
        model="m",
        runner_id="runner-1",
        stream=False,
        event_format="openai",
        chat=True,
        created=1234,
    )
    assert (final.seq, final.full_text) == (3, "Hi")


def test_a_step_message_round_trips_with_its_handle():
    message = StepMessage(
        request_id="r", seq=0, token_ids=[5], request=RequestHandle(reply_topic="mine", chat=True)
    )
    again = StepMessage.model_validate_json(message.model_dump_json(exclude_none=True))
    assert again == message


def test_a_request_recorded_before_tools_existed_keeps_its_digest():
    # Digests an earlier version (before tools) wrote into progress records: the same request
    # read by this version must match them, or it would not resume after an upgrade.
    chat = GenerateRequest.model_validate(
        {
            "request_id": "r-1",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "max_tokens": 5,
            "seed": 3,
        }
    )
    plain = GenerateRequest.model_validate(
        {"request_id": "r-2", "prompt": "Once upon a time", "temperature": 0}
    )
    assert request_digest(chat) == "1f64604dd36a79e8c34a5d8ce21fe1de"
    assert request_digest(plain) == "118f1c33b74559739afacb79e7082c2b"
    # ... and a request with tools is told apart from the same one without
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = GenerateRequest.model_validate(
        {**chat.model_dump(exclude_none=True), "tools": tools}
    )
    assert request_digest(with_tools) != request_digest(chat)
