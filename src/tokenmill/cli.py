"""``tokenmill serve | generate | bench``.

Engine options share one definition (``EngineConfig``'s fields, spelled as vLLM's
flags), so every subcommand that runs the engine accepts and validates them alike.
Bad input ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from tokenmill import __version__
from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams

_ENGINE_HELP = {
    "dtype": "auto (bf16 where the hardware has it), float32, bfloat16 or float16",
    "device": "auto (CUDA when present), cpu or cuda[:N]",
    "max_model_len": "longest prompt + output in tokens (default: the model's, at most 8192)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (overrides --kv-cache-memory)",
    "kv_cache_memory": "memory for the KV cache, e.g. 1GiB",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "token budget of one step",
    "seed": "seed of the default random generator",
    "max_num_queued_requests": "answer 503 beyond this many waiting requests",
    "max_num_queued_tokens": "answer 503 beyond this many waiting prompt tokens",
}
_BOOL_OPTIONS = ("enable_prefix_caching", "enable_chunked_prefill")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for name, help_text in _ENGINE_HELP.items():
        kind = str if name in ("dtype", "device", "kv_cache_memory") else int
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    for name in _BOOL_OPTIONS:
        group.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                           default=None)


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    options = {name: getattr(args, name) for name in (*_ENGINE_HELP, *_BOOL_OPTIONS)
               if getattr(args, name, None) is not None}
    return EngineConfig(model=args.model, **options)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI-compatible API")
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--default-continuous-usage-stats", action="store_true",
                   help="streams without stream_options get usage on every chunk")
    p.add_argument("--metrics-vllm-names", action="store_true",
                   help="also export metrics under vLLM's names")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between the summary lines in the log")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no summary lines, and no engine or request stats in /metrics")
    add_engine_options(p)
    from tokenmill.ray_serve.launch import add_ray_options

    add_ray_options(p)
    p.set_defaults(func=_run_serve)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt, streaming text to stdout")
    p.add_argument("prompt")
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_options(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tokenmill.frontend.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    config = engine_config_from(args)
    llm = LLM(**dataclasses.asdict(config))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    if args.ray:
        from tokenmill.ray_serve.launch import serve_on_ray

        return serve_on_ray(args, engine_config_from(args))
    from tokenmill.server.run import serve

    return serve(args, engine_config_from(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _generate_parser(sub)
    from tokenmill.bench.cli import register

    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
