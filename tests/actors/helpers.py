import asyncio

from sluice.actors.runtime import Actor

BOUND = 10.0  # seconds: only there to turn a hang into a failure, never a timing assertion


async def settle(rounds: int = 10) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def eventually(predicate, timeout: float = BOUND) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


class Recorder(Actor):
    """Records what it handles; `fail_on` messages raise; `gate` (if set) must open per message."""

    def __init__(self, name=None, *, fail_on=(), gate=None, forward_to=None, **kwargs):
        super().__init__(name, **kwargs)
        self.fail_on = set(fail_on)
        self.gate = gate
        self.forward_to = forward_to
        self.handled = []
        self.events = []
        self.failures = []
        self.left = []
        self.in_hand = None

    async def handle(self, message):
        self.in_hand = message
        if self.gate is not None:
            await self.gate.wait()
        self.in_hand = None
        if message in self.fail_on:
            raise ValueError(f"cannot handle {message!r}")
        self.handled.append(message)
        if self.forward_to is not None:
            await self.forward_to.tell(message)

    async def on_start(self):
        self.events.append("start")

    async def on_stop(self):
        self.events.append("stop")

    async def on_restart(self, exc):
        self.events.append(f"restart:{type(exc).__name__}")

    async def on_failure(self, message, exc):
        self.failures.append((message, exc))

    def on_unprocessed(self, messages):
        self.left.extend(messages)


def tiny_engine(path, max_position_embeddings: int):
    """A real engine on a tiny random-weight Llama saved under `path` (seeded: the same weights
    every time)."""
    import torch
    import transformers as tf

    from sluice.engine import EngineConfig, LLMEngine
    from sluice.engine.loader import load_model

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=max_position_embeddings,
    )
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return LLMEngine(
        config=EngineConfig(kv_cache_bytes=4 << 20, block_size=4),
        loaded=load_model(path, load_tokenizer=False),
    )
