"""A session's conversation: the prompt of its next turn (`build_prompt`), and what to remember
once a turn is answered (`remembered_turn`). The store itself is `connectors.sessions`.

The prefix cache matches token ids, not text: re-tokenizing the whole conversation can split the
earlier reply differently than the model generated it, and then nothing is reused. So a new turn
is the stored ids of the conversation so far (earlier prompts and generated tokens) followed by the
tokens of only the new text the chat template adds for this turn, and a turn is remembered as the
ids the model saw and generated.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.actors.messages import TokenizedRequest
from sluice.actors.tool_calls import template_tools
from sluice.engine.tokenizer import Tokenizer
from sluice.schemas import GenerateRequest


@dataclass
class Prompt:
    token_ids: list[int]
    messages: list[dict]  # the whole conversation including this turn (chat requests)
    history_tokens: int  # how many of token_ids are the stored earlier turns


def build_prompt(
    tokenizer: Tokenizer,
    request: GenerateRequest,
    history_messages: list[dict] | None = None,
    history_token_ids: list[int] | None = None,
) -> Prompt:
    history_messages = list(history_messages or [])
    history_ids = list(history_token_ids or [])
    if request.messages is not None:
        new = [m.model_dump(exclude_none=True) for m in request.messages]
        messages = history_messages + new
        tools = template_tools(request)
        if history_ids:
            continuation = _continue_chat(tokenizer, history_ids, messages, tools)
            if continuation is not None:
                return Prompt(history_ids + continuation, messages, len(history_ids))
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return Prompt(tokenizer.encode(text, add_special_tokens=False), messages, 0)
    # A plain-text session continues the text: earlier ids, then the new prompt's tokens.
    assert request.prompt is not None  # the schema requires exactly one of prompt, messages
    if history_ids:
        return Prompt(
            history_ids + tokenizer.encode(request.prompt, add_special_tokens=False),
            history_messages,
            len(history_ids),
        )
    return Prompt(tokenizer.encode(request.prompt), history_messages, 0)


def _continue_chat(
    tokenizer: Tokenizer,
    history_ids: list[int],
    messages: list[dict],
    tools: list[dict] | None,
) -> list[int] | None:
    """Tokens to append to history_ids for the new messages, or None when the template does not
    extend the earlier rendering (then the caller renders everything afresh)."""
    before = tokenizer.decode(history_ids, skip_special_tokens=False)
    after = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    if not after.startswith(before):
        return None
    return tokenizer.encode(after[len(before) :], add_special_tokens=False)


def remembered_turn(
    work: TokenizedRequest, reply: str, reply_token_ids: list[int]
) -> tuple[list[dict], list[int]]:
    """(messages, token ids) of the conversation after this turn's reply: a chat turn adds the
    reply as the assistant's message; every turn adds its prompt and the generated ids."""
    messages = work.conversation
    if work.request.messages is not None:
        messages = messages + [{"role": "assistant", "content": reply}]
    return messages, work.prompt_token_ids + reply_token_ids
