"""Counter-based random numbers for sampling: each draw is a function of its key alone.

The key of a draw is (seed, completion index, position of the token being drawn). Its random word
is a keyed hash of that key (BLAKE2b, 64 bits), the way counter-based generators such as Philox or
Threefry turn a counter into random bits, so a draw does not depend on what was drawn before it:
not on the batch it ran in, not on the process, not on whether generation was interrupted and
resumed. A resumed request therefore draws exactly the tokens it would have drawn.

The request id is not part of the key: the same prompt with the same seed gives the same draws
whatever the request is called, as OpenAI and vLLM users expect of a seed. A request without a
seed is given one (`new_seed`) and reports it, so any output can be replayed.
"""

from __future__ import annotations

import hashlib
import secrets
import struct

SEED_BITS = 63  # assigned seeds fit a signed 64-bit integer (JSON readers in other languages)
_PERSON = b"sluice-draw-v1"  # a new scheme must change this: old seeds then name other draws


def new_seed() -> int:
    return secrets.randbits(SEED_BITS)


def draw_word(seed: int, index: int, position: int) -> int:
    """64 random bits for the token at `position` (0-based, prompt included) of completion
    `index` of a request seeded with `seed`."""
    digest = hashlib.blake2b(
        struct.pack("<QQQ", seed, index, position), digest_size=8, person=_PERSON
    ).digest()
    return int.from_bytes(digest, "little")


def uniform(word: int) -> float:
    """A uniform number in [0, 1) from a random word: its top 24 bits, exact in float32."""
    return (word >> 40) * 2.0**-24


def signed(word: int) -> int:
    """The word as a signed 64-bit integer (what a tensor of int64 holds)."""
    return word - (1 << 64) if word >= 1 << 63 else word
