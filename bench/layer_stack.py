"""A single request's decode, the decoder layers as one native call against layer by layer.

The native family runs a step's whole stack of layers in one C call where every matmul weight is
packed for its kernels (`cpu_kernels/decoder_layers.c`: int8 or int4 weights), and a decode step
from token ids to logits in one (`forward.NativeStack`). This times one
request (a 40-token prompt by default, then 64 greedy tokens) both ways in one engine, the two
interleaved round by round (this machine's speed drifts), and reports the medians and their
ratio, and each against the weight-read floor: the bytes of weights a step reads (every matrix as
stored, norms; of an untied embedding table only a row) over this machine's memory read rate,
measured here (a 512 MiB sum on the same threads, median of 8).

    .venv/bin/python -m bench.layer_stack --quantization int4 --rounds 6
    .venv/bin/python -m bench.layer_stack --quantization int4 --prompt-len 2000   # long context
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.engine_throughput import cpu_model
from sluice.engine import LLMEngine
from sluice.engine.config import EngineConfig
from sluice.engine.cpu_kernels.block_int8_linear import dot_path
from sluice.engine.forward import LayerByLayer, NativeStack
from sluice.engine.memory import weight_bytes
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.weights import BlockInt8Embedding

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "layer_stack.json"

MODES = ("one call", "layer by layer")


def decode_ms_per_token(
    engine: LLMEngine, request: int, output_len: int, prompt_len: int = 40
) -> float:
    """ms per decode step of one request, its prefill left out."""
    params = SamplingParams(max_tokens=output_len + 1, temperature=0.0, ignore_eos=True)
    prompt = [100 + (request * 7 + j) % 3000 for j in range(prompt_len)]
    engine.add_request(f"r{request}", prompt_token_ids=prompt, params=params)
    engine.step()  # the prefill and the first token (--prompt-len fits one step's budget)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return 1000 * (time.perf_counter() - start) / steps


def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Bytes of weights one decode step reads: all of them, but only a row of an embedding table
    that is not the LM head's matrix too."""
    model = engine.runner.model
    total = weight_bytes(model)
    if not isinstance(model.embed_tokens, BlockInt8Embedding):
        total -= weight_bytes(model.embed_tokens)
    return total


def memory_read_gb_s(repeats: int = 8) -> float:
    """This machine's memory read rate on torch's threads: a sum over 512 MiB, median."""
    x = torch.ones(128 << 20)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.nbytes / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.layer_stack",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--quantization", choices=["int8", "int4"], default="int4")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--prompt-len",
        type=int,
        default=40,
        help="tokens of context before the decode (attention's share grows with it; <= 2048)",
    )
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        dtype=args.dtype, quantization=args.quantization, kv_cache_bytes=256 << 20
    )
    engine = LLMEngine(config=config)
    runner = engine.runner
    if not isinstance(runner.route, NativeStack):
        p.error(f"the engine's forward runs {runner.route.name}, not as one native call")
    layered = LayerByLayer(runner.model, runner.attention, runner.kv_caches, runner.embed)
    routes = {MODES[0]: runner.route, MODES[1]: layered}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    if not 1 <= args.prompt_len <= config.max_num_batched_tokens:
        p.error(f"--prompt-len must be 1..{config.max_num_batched_tokens} (one prefill step)")
    decode_ms_per_token(engine, -1, args.output_len, args.prompt_len)  # warm-up
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            runner.route = routes[mode]
            times[mode].append(
                decode_ms_per_token(
                    engine, 2 * r + len(times[mode]), args.output_len, args.prompt_len
                )
            )
            print(f"round {r + 1}/{args.rounds} {mode}: {times[mode][-1]:.2f} ms/token", flush=True)
    runner.route = routes[MODES[0]]
    medians = {m: statistics.median(v) for m, v in times.items()}
    step_bytes = weight_bytes_per_step(engine)
    read_gb_s = memory_read_gb_s()
    floor_ms = step_bytes / read_gb_s / 1e6
    cpu = cpu_model()
    print(
        f"\n{cpu}, {args.threads} threads, dot path {dot_path()}; {args.quantization} weights, "
        f"{args.dtype} activations, batch 1 after a {args.prompt_len}-token prompt; weight-read "
        f"floor {step_bytes / 1e6:.1f} MB a token / {read_gb_s:.1f} GB/s = {floor_ms:.2f} ms"
    )
    print("| layers | ms/token (median) | x one call | x floor |\n|---|---|---|---|")
    for m in MODES:
        print(
            f"| {m} | {medians[m]:.2f} | {medians[m] / medians[MODES[0]]:.2f} "
            f"| {medians[m] / floor_ms:.2f} |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "cpu": cpu,
                "threads": args.threads,
                "dot_path": dot_path(),
                "quantization": args.quantization,
                "dtype": args.dtype,
                "prompt_len": args.prompt_len,
                "ms_per_token": times,
                "median": medians,
                "weight_bytes_per_step": step_bytes,
                "memory_read_gb_s": read_gb_s,
                "floor_ms": floor_ms,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
