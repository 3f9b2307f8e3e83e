"""The request bodies the official `openai` client sends, caught before they leave: what an
OpenAI user's code would publish, built by OpenAI's own code."""

from __future__ import annotations

import json
from typing import Any

import openai

try:  # the HTTP library the openai client is built on (httpx2 in its newer releases)
    import httpx2 as httpx
except ImportError:
    # (not installed beside a newer openai: then mypy cannot find it, hence unused-ignore)
    import httpx  # type: ignore[no-redef, import-not-found, unused-ignore]


class _Caught(Exception):
    pass


def sent_by_client(endpoint: str, **params: Any) -> dict[str, Any]:
    """The JSON body `client.chat.completions.create(**params)` (endpoint "chat") or
    `client.completions.create(**params)` (endpoint "completions") sends."""
    bodies: list[dict[str, Any]] = []

    def capture(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "caught"}})

    client = openai.OpenAI(
        api_key="unused",
        base_url="http://sluice.invalid/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(capture)),
    )
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    try:
        create(**params)
    except openai.BadRequestError:
        pass
    assert len(bodies) == 1, bodies
    return bodies[0]
