"""``tokenmill serve | generate | bench``.

Engine options share one definition (``EngineConfig``'s fields, spelled as vLLM's
flags), so every subcommand that runs the engine accepts and validates them alike.
Bad input ends in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from tokenmill import __version__
from tokenmill.config import EngineConfig, parse_size
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.limits import RequestLimits

_ENGINE_HELP = {
    "dtype": "auto (bf16 where the hardware has it), float32, bfloat16 or float16",
    "quantization": "none (default); int8 or int4 (GGUF Q4_1's layout): quantized weights, "
                    "activations in the dtype; w4a8: int4 weights times int8 activations, "
                    "the fastest on CPUs without bfloat16 arithmetic (CPU)",
    "device": "auto (CUDA when present), cpu or cuda[:N]",
    "num_threads": "the engine's compute threads (default: every core)",
    "kernels": "auto (native CPU kernels for attention, norms, rotary and SiLU where they "
               "build), native or torch",
    "max_model_len": "longest prompt + output in tokens (default: the model's, at most 8192)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (overrides --kv-cache-memory)",
    "kv_cache_memory": "memory for the KV cache, e.g. 1GiB",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "token budget of one step",
    "seed": "seed of the default random generator",
    "max_num_queued_requests": "answer 503 beyond this many waiting requests",
    "max_num_queued_tokens": "answer 503 beyond this many waiting prompt tokens",
    "speculative_ngram": "speculative decoding: draft up to K tokens per step by looking the "
                         "last tokens up in the prompt and output (default 0: off)",
    "ngram_min": "shortest run of last tokens a draft lookup may match (default 2)",
    "ngram_max": "longest run of last tokens a draft lookup tries first (default 4)",
    "speculative_disable_by_batch_size": "no drafts in a step while more than this many "
                                         "requests run (default 4)",
}
_BOOL_OPTIONS = ("enable_prefix_caching", "enable_chunked_prefill")
_LIMIT_HELP = {
    "max_n": "most choices (n) per request",
    "max_prompts_per_request": "most prompts in one completions request",
    "max_logprobs": "most top logprobs per token (logprobs, top_logprobs)",
    "max_stop_strings": "most stop strings, and most stop_token_ids, per request",
    "max_stop_string_length": "most characters in one stop string",
    "max_request_id_length": "most characters in an x-request-id header",
}
LIMIT_OPTIONS = tuple(_LIMIT_HELP)
API_KEY_ENV = "TOKENMILL_API_KEY"


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for name, help_text in _ENGINE_HELP.items():
        kind = str if name in ("dtype", "quantization", "kernels", "device",
                                 "kv_cache_memory") else int
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
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; repeat to accept "
                        f"several keys (default: ${API_KEY_ENV}, if set)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish after SIGTERM")
    limits = p.add_argument_group("request limits")
    limits.add_argument("--max-request-body-size", default=None,
                        help="largest request body, e.g. 8MiB (413 beyond it; default "
                             f"{RequestLimits().max_request_body_bytes >> 20}MiB)")
    defaults = RequestLimits()
    for name, help_text in _LIMIT_HELP.items():
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"{help_text} (default {getattr(defaults, name)})")
    p.add_argument("--default-continuous-usage-stats", action="store_true",
                   help="streams without stream_options get usage on every chunk")
    p.add_argument("--metrics-vllm-names", action="store_true",
                   help="also export metrics under vLLM's names")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between the summary lines in the log")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no summary lines, no engine or request stats in /metrics or the "
                        "dashboard")
    p.add_argument("--ui-show-text", action="store_true",
                   help="let /v1/requests/recent and the dashboard show prompts and outputs")
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

    return serve(args, engine_config_from(args), api_keys_from(args), request_limits_from(args))


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys of ``--api-key`` (all of them), else ``$TOKENMILL_API_KEY``, else none."""
    keys = args.api_key or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    if any(not key.strip() for key in keys):
        raise ValueError("--api-key must not be empty")
    return tuple(keys)


def request_limits_from(args: argparse.Namespace) -> RequestLimits:
    options = {name: getattr(args, name) for name in _LIMIT_HELP
               if getattr(args, name) is not None}
    if args.max_request_body_size is not None:
        options["max_request_body_bytes"] = parse_size(args.max_request_body_size,
                                                       "max_request_body_size")
    return RequestLimits(**options)


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
