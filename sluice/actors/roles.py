"""The roles a pipeline process can take (`sluice run --role ROLE`), in the order a request meets
them, and what each one needs (`Role`): the pipeline asks a role, never compares its name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str  # as `--role` names it; "all": every actor in one process
    holds_engine: bool = False  # a runner: loads the model, keeps the progress changelog
    is_runner: bool = False  # with --routing: reads a work topic of its own, publishes KV events
    routes: bool = False  # the scheduler: with --routing, chooses among the runners
    needs_routing: bool = False  # runs only with --routing (prefill/decode separation)
    keeps_sessions: bool = False  # reads or writes the sessions in Redis
    finds_reply_topics: bool = False  # checks and creates the clients' reply topics

    @property
    def alone(self) -> bool:
        """One role of several processes, which talk through internal topics."""
        return self.name != "all"

    def __str__(self) -> str:
        return self.name


ALL = Role(
    "all", holds_engine=True, keeps_sessions=True, finds_reply_topics=True
)  # no --role: every actor in this process
TOKENIZER = Role("tokenizer", keeps_sessions=True, finds_reply_topics=True)
SCHEDULER = Role("scheduler", routes=True)
# "runner" serves a request whole; with prefill/decode separation a "prefill" runner computes
# prompts and passes each request on to a "decode" runner (`kv_handoff.py`).
RUNNER = Role("runner", holds_engine=True, is_runner=True)
PREFILL = Role("prefill", holds_engine=True, is_runner=True, needs_routing=True)
DECODE = Role("decode", holds_engine=True, is_runner=True, needs_routing=True)
STREAMER = Role("streamer", keeps_sessions=True)

BY_NAME = {r.name: r for r in (TOKENIZER, SCHEDULER, RUNNER, STREAMER, PREFILL, DECODE)}
ROLES = tuple(BY_NAME)  # the names `--role` takes


def role_named(name: str | None) -> Role:
    """The role `--role NAME` asks for (None: all of them); ValueError for an unknown name."""
    if name is None:
        return ALL
    if name not in BY_NAME:
        raise ValueError(f"unknown role {name!r}; choose from {', '.join(ROLES)}")
    return BY_NAME[name]
