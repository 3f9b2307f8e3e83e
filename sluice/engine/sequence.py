"""One sequence being generated: its tokens, how many of them are in the KV cache, and its blocks.

A request is just `num_computed_tokens` catching up with `len(token_ids)`: a prefill is a step that
computes many tokens of a sequence, a decode one that computes the single token sampled last step.
After a preemption `num_computed_tokens` drops to 0 and the same mechanism recomputes prompt and
output alike. A request with n > 1 samples becomes n sequences (see `fork`).

A sequence is the one record of one completion: besides its tokens and cache bookkeeping it holds
what the engine accumulates for the client (text, logprobs, timings, why it finished).
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from sluice.engine.draws import draw_word

if TYPE_CHECKING:
    from sluice.engine.detokenizer import IncrementalDetokenizer
    from sluice.engine.sampler import TokenLogprobs
    from sluice.engine.structured import Matcher


class SequenceStatus(enum.Enum):
    """Where a sequence stands; a finished one also says how it ended (`finish_reason`)."""

    WAITING = "waiting"  # in the scheduler's waiting queue, holds no blocks
    RUNNING = "running"  # holds blocks; scheduled every step it fits in the budget
    # Finished: blocks freed (they stay in the prefix cache); never scheduled again.
    FINISHED_STOPPED = "finished_stopped"  # an end-of-sequence or stop token, or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens, or the model's context, reached
    FINISHED_ABORTED = "finished_aborted"  # its client (or a runner's reset) gave it up
    FINISHED_ERROR = "finished_error"  # a fault while serving it

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        """What a finished status reports as its finish reason (OpenAI's and vLLM's words);
        None before it has finished. The one place the two are tied together."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


_seq_ids = itertools.count()


class Sequence:
    """Prompt plus generated tokens of one sample, and its place in the paged KV cache.

    The engine owns `token_ids` growth (`append_token`) and the completion's record; the
    scheduler and block manager own `num_computed_tokens`, `num_cached_tokens`, `block_table`,
    `status` and the bookkeeping below.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int = 16,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        seq_id: int | None = None,
        index: int = 0,
        keep_kv: tuple[str, float] | None = None,
    ):
        self.seq_id: int = next(_seq_ids) if seq_id is None else seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache the first time the seq got blocks (for usage).
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # (key, seconds): once finished, its KV stays pinned under the key for that long, or
        # until the next seq with the key takes its prefix (BlockManager.pin)
        self.keep_kv = keep_kv
        self.status = SequenceStatus.WAITING
        self.max_tokens = max_tokens
        # Block-manager bookkeeping follows below; first the completion's record (the engine's).
        self.index = index  # which of its request's n samples
        self.detokenizer: IncrementalDetokenizer | None = None
        self.matcher: Matcher | None = None  # where its output stands in its response format
        self.seed = 0  # its request's seed: with `index` and the position, it keys every draw
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.stop_reason: str | int | None = None  # the stop string or token id that ended it
        # Block-manager bookkeeping. Hashes depend only on tokens and salt, so they survive
        # preemption; `num_committed_blocks` counts leading blocks registered in the prefix cache.
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.got_first_blocks = False  # num_cached_tokens is set once, at the first allocation

    # --- sizes ------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_len(self) -> int:
        """Longest the sequence may grow (prompt + max_tokens); the engine also caps it at
        max_model_len."""
        return self.num_prompt_tokens + self.max_tokens

    # --- state ------------------------------------------------------------------------------
    @property
    def is_prefill_done(self) -> bool:
        """True once every prompt token is in the KV cache (after a preemption it turns False
        again)."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_decode(self) -> bool:
        """Exactly one sampled token is waiting to be computed."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        """From its status: once finished "stop", "length", "abort" or "error", else None."""
        return self.status.finish_reason

    def finish(
        self, status: SequenceStatus, now: float, stop_reason: str | int | None = None
    ) -> None:
        """Record how the completion ended: the one place a sequence gets a finished status.
        The scheduler calls it once it has let go of the sequence (`BatchScheduler.finish`)."""
        if not status.is_finished:
            raise ValueError(f"{status} is not an end")
        self.status, self.finished_time, self.stop_reason = status, now, stop_reason

    def draw_word(self) -> int:
        """The random word of the token to draw next (at position `num_tokens`)."""
        return draw_word(self.seed, self.index, self.num_tokens)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def fork(
        self,
        request_id: str,
        num_tokens: int | None = None,
        seq_id: int | None = None,
        index: int = 0,
    ) -> Sequence:
        """A new sequence with this one's first `num_tokens` tokens (default: all) and settings,
        as sample `index` of the request (its record of the completion starts empty).

        For n > 1 samples: after the parent's prefill step, fork each child at the prompt length,
        append the child's own first sample, then hand it to `BatchScheduler.fork`.
        """
        n = len(self.token_ids) if num_tokens is None else num_tokens
        if not self.num_prompt_tokens <= n <= len(self.token_ids):
            raise ValueError(
                f"fork at {n} tokens: must keep the prompt and not exceed {len(self.token_ids)}"
            )
        child = Sequence(
            request_id,
            self.token_ids[:n],
            max_tokens=self.max_tokens,
            priority=self.priority,
            arrival_time=self.arrival_time,
            cache_salt=self.cache_salt,
            seq_id=seq_id,
            index=index,
            keep_kv=self.keep_kv,
        )
        child.num_prompt_tokens = self.num_prompt_tokens
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.name}, "
            f"tokens={self.num_tokens} (prompt {self.num_prompt_tokens}), "
            f"computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )
