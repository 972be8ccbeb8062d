"""tokenmill serve | generate | bench.

Every option of ``serve`` and ``generate`` is a field of a settings record
(``EngineConfig``, ``ServerConfig``, ``RequestLimits``, ``RayConfig``), made into a flag
by ``tokenmill.options``; the records validate the values. Bad input ends in one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys

from tokenmill import __version__
from tokenmill.config import API_KEY_ENV, EngineConfig, RequestLimits, ServerConfig
from tokenmill.model_hub import local_model
from tokenmill.options import add_options, options_from
from tokenmill.ray_serve.options import RAY_INSTALL_HINT, RayConfig
from tokenmill.sampling_params import SamplingParams

DESCRIPTION = ("tokenmill: an LLM inference server with an OpenAI-compatible API, exact "
               "token usage on every streamed chunk, and Prometheus metrics.")


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over the OpenAI-compatible API",
                       description="Serve a model over the OpenAI-compatible API.")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF folder, GGUF file, or Hugging Face Hub repository (org/repo, "
                        "or org/repo:QUANT for one GGUF file of it), as --model (default: "
                        "the embedded SmolLM2-135M-Instruct)")
    add_options(p.add_argument_group("server"), ServerConfig)
    add_options(p.add_argument_group("request limits"), RequestLimits)
    add_options(p.add_argument_group("engine"), EngineConfig)
    add_options(p.add_argument_group(f"Ray Serve ({RAY_INSTALL_HINT})"), RayConfig)
    p.set_defaults(func=_run_serve)
    return p


def _generate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="complete one prompt, streaming text to stdout",
                       description="Complete one prompt, streaming text to stdout.")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_options(p.add_argument_group("engine"), EngineConfig)
    p.set_defaults(func=_run_generate)
    return p


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of ``serve``'s or ``generate``'s flags; ``serve MODEL`` and
    ``serve --model MODEL`` name the same setting."""
    positional = getattr(args, "model_path", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"two models given: {positional} and --model {args.model}")
    return options_from(args, EngineConfig, model=positional or args.model)


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    """``serve``'s server settings; without ``--api-key`` the key is ``$TOKENMILL_API_KEY``."""
    keys = args.api_keys or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    return options_from(args, ServerConfig, api_keys=tuple(keys),
                        limits=options_from(args, RequestLimits))


def on_disk(config: EngineConfig, server_config: ServerConfig,
            ) -> tuple[EngineConfig, ServerConfig]:
    """``config`` with its model on disk, fetched first when it names a Hub repository
    (``model_hub``), before the engine process starts; a fetched model is served under the
    name it was given, as in vLLM, unless ``--served-model-name`` names another."""
    path = local_model(config.model)
    if path != config.model and server_config.served_model_name is None:
        server_config = dataclasses.replace(server_config, served_model_name=config.model)
    return dataclasses.replace(config, model=path), server_config


def _run_generate(args: argparse.Namespace) -> int:
    from tokenmill.frontend.llm import LLM

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)
    llm = LLM(**dataclasses.asdict(engine_config_from(args)))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    config, server_config = on_disk(engine_config_from(args), server_config_from(args))
    ray_config = options_from(args, RayConfig)
    if ray_config.ray:
        if importlib.util.find_spec("ray") is None:
            raise ValueError(f"--ray needs Ray Serve, which is not installed: "
                             f"{RAY_INSTALL_HINT}")
        from tokenmill.ray_serve.launch import serve_on_ray

        return serve_on_ray(ray_config, server_config, config)
    from tokenmill.server.run import serve

    return serve(server_config, config)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each subcommand's by name."""
    parser = argparse.ArgumentParser(prog="tokenmill", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench}")
    from tokenmill.bench.cli import register

    commands = {"serve": _serve_parser(sub), "generate": _generate_parser(sub),
                "bench": register(sub)}
    return parser, commands


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; a bad one exits with status 2 and the usage of the
    subcommand it names (not the top level's)."""
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
