"""Tensor parallelism: one engine's model split over N processes, Megatron-style
(`EngineConfig.tensor_parallel_size`).

  sharding.py  which heads and MLP columns each rank holds, and its slices of the weights
  group.py     the process group: all-reduce, broadcast, weight transfer (gloo / NCCL)
  launcher.py  rank 0 (the engine's process): starts the workers, sends them each step
  worker.py    ranks 1..N-1: a process that runs its share of every step rank 0 sends

Rank 0 is the whole engine (scheduler, block manager, sampler, detokenizer); the workers only run
the decoder layers over their heads and columns, with their share of the KV cache.
"""
