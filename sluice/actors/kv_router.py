"""Which runner serves a request: the routing index the scheduler builds from the KV events.

For each runner the index holds the blocks it has cached (`kv_events.py`) and its load. A request
goes to the runner holding the longest cached prefix of its prompt, unless that runner's load
exceeds the least loaded one's by more than `load_margin` requests (then to the least loaded); a
session's next turn goes where its last turn went, while that runner lives and is not overloaded.
A runner whose messages stopped for `dead_after_s`, or that said it was leaving, is not chosen
(and `failover.py` moves what it left unfinished).

With prefill/decode separation (`kv_handoff.py`) new requests go to "prefill" runners (or
"unified" ones, which do both), never to "decode" runners; a prefill runner passes each request
on to the decode runner `choose_decode` picks: the least loaded, then the one with most free KV.

A request's blocks are counted as cached on the runner chosen for it at once, before the runner
reports them: the next request with the same prefix, arriving before the first one's prefill is
done, then goes to the same runner (and its engine finds the blocks once they are computed).
Every instance of the scheduler reading the same events builds the same index; what each adds
for its own choices lasts until the runner's next snapshot.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from sluice.actors.kv_events import KvEventsMessage, RunnerLoad, short_hash, unpack_hashes
from sluice.actors.messages import TokenizedRequest
from sluice.engine.block_manager import prefix_block_hashes

log = logging.getLogger(__name__)

ROUTINGS = ("session", "kv", "round-robin")  # `sluice run --routing`
NEW_REQUEST_KINDS = ("unified", "prefill")  # runners that take a request from its start
DECODE_KINDS = ("decode",)
DEAD_AFTER_S = 10.0
LOAD_MARGIN = 8
MAX_SESSIONS = 100_000  # sessions whose runner is remembered


@dataclass
class RunnerView:
    """What the index knows of one runner."""

    runner_id: str
    work_topic: str
    work_group: str
    kind: str
    incarnation: str
    block_size: int
    heard_at: float  # monotonic, of its last message
    load: RunnerLoad
    blocks: set[bytes] = field(default_factory=set)  # short hashes
    routed_since_report: int = 0  # requests sent to it since its last report of its load
    left: bool = False  # it said it stopped

    @property
    def pending(self) -> int:
        return self.load.running + self.routed_since_report


@dataclass
class Choice:
    runner_id: str
    work_topic: str
    cached_blocks: int  # of the prompt, on that runner (as the index believes)
    why: str  # "prefix", "session", "least loaded", "round robin"


class KvRouter:
    def __init__(
        self,
        *,
        policy: str = "kv",
        load_margin: int = LOAD_MARGIN,
        dead_after_s: float = DEAD_AFTER_S,
        clock=time.monotonic,
    ):
        if policy not in ("kv", "round-robin"):
            raise ValueError(f"the router's policy is kv or round-robin, not {policy!r}")
        self.policy = policy
        self.load_margin = load_margin
        self.dead_after_s = dead_after_s
        self._clock = clock
        self.runners: dict[str, RunnerView] = {}
        # routing key of a session -> the runner of its last turn (the most recent sessions)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._turn = itertools.count()
        self._heard = asyncio.Event()  # set on every message; cleared by whoever waits

    # -- the events ----------------------------------------------------------------------------

    def apply(self, message: KvEventsMessage) -> None:
        now = self._clock()
        view = self.runners.get(message.runner_id)
        if view is None or view.incarnation != message.incarnation:
            if view is not None:
                log.info("runner %s restarted: its cached blocks are gone", message.runner_id)
            else:
                log.info("runner %s joined (work topic %s)", message.runner_id, message.work_topic)
            view = RunnerView(
                message.runner_id,
                message.work_topic,
                message.work_group,
                message.kind,
                message.incarnation,
                message.block_size,
                now,
                message.load,
            )
            self.runners[message.runner_id] = view
        view.heard_at, view.load, view.routed_since_report = now, message.load, 0
        if message.leaving:
            log.info("runner %s stopped: no longer routed to", message.runner_id)
            view.left = True
        if message.snapshot:
            view.blocks = set(unpack_hashes(message.stored))
        else:
            view.blocks.update(unpack_hashes(message.stored))
            view.blocks.difference_update(unpack_hashes(message.removed))
        self._heard.set()

    def is_live(self, view: RunnerView) -> bool:
        return not view.left and self._clock() - view.heard_at < self.dead_after_s

    def live(self, kinds: tuple[str, ...] | None = None) -> list[RunnerView]:
        views = [v for v in self.runners.values() if kinds is None or v.kind in kinds]
        return sorted(filter(self.is_live, views), key=lambda v: v.runner_id)

    async def wait_for_runner(self, kinds: tuple[str, ...] = NEW_REQUEST_KINDS) -> None:
        """Until some runner of those kinds is alive."""
        while not self.live(kinds):
            self._heard.clear()
            try:
                await asyncio.wait_for(self._heard.wait(), timeout=1.0)
            except TimeoutError:
                pass

    # -- the choice ----------------------------------------------------------------------------

    def choose(self, work: TokenizedRequest, key: str) -> Choice | None:
        """The runner for `work` (whose routing key is `key`); None when no runner is alive."""
        live = self.live(NEW_REQUEST_KINDS)
        if not live:
            return None
        prompt = _Prompt(work)
        if self.policy == "round-robin":
            view = live[next(self._turn) % len(live)]
            return self._chose(view, prompt, key, self._cached(view, prompt), "round robin")
        least = min(live, key=lambda v: (v.pending, v.runner_id))
        bound = least.pending + self.load_margin
        cached = {v.runner_id: self._cached(v, prompt) for v in live}
        if work.request.session_id is not None:
            earlier = self._sessions.get(key)
            sticky = next((v for v in live if v.runner_id == earlier), None)
            if sticky is not None and sticky.pending <= bound:
                return self._chose(sticky, prompt, key, cached[sticky.runner_id], "session")
        best = max(live, key=lambda v: (cached[v.runner_id], -v.pending))
        if cached[best.runner_id] == 0 or best.pending > bound:
            return self._chose(least, prompt, key, cached[least.runner_id], "least loaded")
        return self._chose(best, prompt, key, cached[best.runner_id], "prefix")

    def choose_decode(
        self, work: TokenizedRequest, key: str, prefer: str | None = None
    ) -> Choice | None:
        """The decode runner to continue `work` after its prefill: `prefer` when it is alive, else
        the least loaded, then the one with most free KV blocks; None when no decode runner is
        alive."""
        live = self.live(DECODE_KINDS)
        if not live:
            return None
        view = next((v for v in live if v.runner_id == prefer), None) or min(
            live, key=lambda v: (v.pending, -v.load.free_blocks, v.runner_id)
        )
        prompt = _Prompt(work)
        return self._chose(view, prompt, key, self._cached(view, prompt), "decode")

    def _cached(self, view: RunnerView, prompt: _Prompt) -> int:
        """How many of the prompt's leading blocks the runner holds (as far as the index knows)."""
        n = 0
        for h in prompt.hashes(view.block_size):
            if h not in view.blocks:
                break
            n += 1
        return n

    def _chose(self, view: RunnerView, prompt: _Prompt, key: str, cached: int, why: str) -> Choice:
        view.routed_since_report += 1
        view.blocks.update(prompt.hashes(view.block_size))
        if prompt.work.request.session_id is not None:
            self._sessions[key] = view.runner_id
            self._sessions.move_to_end(key)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return Choice(view.runner_id, view.work_topic, cached, why)


class _Prompt:
    """A request's prompt blocks by their short hashes, made once per block size."""

    def __init__(self, work: TokenizedRequest):
        self.work = work
        self._hashes: dict[int, list[bytes]] = {}

    def hashes(self, block_size: int) -> list[bytes]:
        if block_size not in self._hashes:
            ids, salt = self.work.prompt_token_ids, self.work.request.tenant
            full = prefix_block_hashes(ids, block_size, salt)
            self._hashes[block_size] = [short_hash(h) for h in full]
        return self._hashes[block_size]
