"""tokenmill against llama.cpp on the same GGUF files: perplexity and greedy text.

For each GGUF file it measures:

- perplexity on a fixed text (``tests/data/public_domain.txt`` unless ``--text``), the
  way llama.cpp's ``llama-perplexity`` measures it: the text cut into chunks of ``--ctx``
  tokens (the first token of each chunk replaced by BOS where the vocabulary adds one),
  each token of a chunk's second half scored given the chunk before it, one estimate over
  all chunks. Three figures: ``llama-perplexity`` on the file; ``llama-perplexity`` on
  the file's float32 dequantization, made by llama.cpp's own ``llama-quantize ... F32``
  (llama.cpp computing on the file's exact values); and tokenmill in each configuration;
- greedy agreement with ``llama-server`` on the same file: the same prompt token ids
  (chat-templated questions), up to ``--max-tokens`` greedy tokens each (both stop at the
  end of the turn), in every configuration; how many outputs are equal token for token,
  the mean fraction of tokens before the first difference, and the median margin there:
  how much more likely tokenmill's model finds its token than llama.cpp's (a small margin
  is a near tie that any difference in arithmetic flips). Also ``llama-server`` on the
  float32 dequantization against tokenmill in float32: two engines computing on the same
  values. And ``llama-server`` against itself: its greedy text on the file again with
  ``--llama-cpp-variant`` added (by default ``-ctk bf16 -ctv bf16``, its KV cache in
  bfloat16): how often llama.cpp's own text survives a change that small, the floor under
  any other engine's agreement with it.

The configurations: ``float32`` (the file's values, exact), the dtype ``auto`` gives
with ``--quantization none`` and with ``--quantization gguf`` (the file's own blocks,
``serve``'s default for a quantized file) where the native kernels take it, and ``--quantization
gguf-llama-cpp`` (the file's values times activations rounded as llama.cpp rounds them).
llama.cpp runs with ``--no-repack`` (its repacked AMX kernels crash on some AMX hosts)
and its default float16 KV cache, or with what ``--llama-cpp-args`` adds to both
``llama-perplexity`` and ``llama-server`` (``"-ctk bf16 -ctv bf16"``: a bfloat16 KV cache,
as tokenmill's where the host computes in bfloat16). Prints one table and writes JSON.
Usage::

    python benchmarks/llama_cpp_agreement.py --llama-cpp LLAMA_CPP_BIN_DIR [--ctx 512]
        [--max-tokens 48] [--text FILE] [--llama-cpp-args ARGS] [--llama-cpp-variant ARGS]
        [--out FILE] GGUF [GGUF ...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import re
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator

import httpx
import torch
from accuracy import QUESTIONS, TEXT  # noqa: E402  (sibling module)
from offline import common_prefix  # noqa: E402  (sibling module)
from report_file import write_report  # noqa: E402  (sibling module)
from rich.console import Console
from rich.table import Table
from serve import free_port  # noqa: E402  (sibling module)

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import native_kernels
from tokenmill.models.perplexity import next_token_logprobs
from tokenmill.models.weights.formats import GGUFFormat
from tokenmill.models.weights.quantizations import resolve_dtype
from tokenmill.tokenizer.tokenizer import load_tokenizer

SERVER_START_S = 120


def configurations() -> dict[str, dict]:
    """The engine options of each configuration measured on this host."""
    configs = {"float32": {"dtype": "float32", "quantization": "none"},
               "none": {"dtype": "auto", "quantization": "none"},
               "gguf-llama-cpp": {"quantization": "gguf-llama-cpp"}}
    if GGUFFormat.supports(resolve_dtype("auto", torch.device("cpu")), native_kernels()):
        configs["gguf"] = {"dtype": "auto", "quantization": "gguf"}
    return configs


def text_chunks(token_ids: list[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """``llama-perplexity``'s chunks: whole chunks of ``ctx`` tokens, each one's first
    token replaced by BOS where the vocabulary adds one."""
    chunks = [token_ids[start:start + ctx] for start in range(0, len(token_ids) - ctx + 1, ctx)]
    if bos_id is not None:
        chunks = [[bos_id, *chunk[1:]] for chunk in chunks]
    return chunks


def chunked_perplexity(model: torch.nn.Module, chunks: list[list[int]]) -> float:
    """Each chunk's second half scored given the chunk before it, as ``llama-perplexity``
    scores: positions ``ctx // 2 + 1`` to ``ctx - 1`` of every chunk."""
    nll, count = 0.0, 0
    for chunk in chunks:
        first = len(chunk) // 2
        logprobs = next_token_logprobs(model, chunk)[first:]
        chosen = logprobs.gather(1, torch.tensor(chunk[first + 1:])[:, None])
        nll -= chosen.double().sum().item()
        count += len(chunk) - 1 - first
    return math.exp(nll / count)


def chat_prompts(path: str) -> list[list[int]]:
    """The chat-templated questions' token ids, as the file's tokenizer gives them."""
    tokenizer = load_tokenizer(path)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}])
            for q in QUESTIONS]


def margin_at_difference(model: torch.nn.Module, prompt: list[int], ours: list[int],
                         theirs: list[int]) -> float | None:
    """Where two greedy outputs first differ: how much more likely tokenmill's model finds
    its own token than llama.cpp's there (log-probability difference, nats; small means
    a near tie that any difference in arithmetic can flip). None if neither differs
    before one ends."""
    same = common_prefix(ours, theirs)
    if same == min(len(ours), len(theirs)):
        return None
    logprobs = next_token_logprobs(model, [*prompt, *ours[:same], 0])[-1]
    return (logprobs[ours[same]] - logprobs[theirs[same]]).item()


def measure_tokenmill(path: str, options: dict, text: str, ctx: int, prompts: list[list[int]],
                      theirs: list[list[int]], max_tokens: int) -> dict:
    """One configuration's perplexity, its greedy outputs' agreement with ``theirs`` and
    the margins where they differ."""
    llm = LLM(model=path, max_num_seqs=len(prompts), **options)
    prefix = llm.tokenizer.encode("")
    chunks = text_chunks(llm.tokenizer.encode(text), ctx, prefix[0] if prefix else None)
    if not chunks:
        raise SystemExit(f"the text has fewer than --ctx {ctx} tokens")
    model = llm.client.core.executor.model
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]
    margins = [margin_at_difference(model, prompt, ours, other)
               for prompt, ours, other in zip(prompts, outputs, theirs, strict=True)]
    result = {"options": options, "perplexity": chunked_perplexity(model, chunks),
              "outputs": outputs, "agreement": agreement(outputs, theirs),
              "margins": [m for m in margins if m is not None]}
    del llm, model
    gc.collect()
    return result


def llama_perplexity(bin_dir: str, path: str, text_path: str, ctx: int,
                     extra_args: list[str]) -> float:
    """``llama-perplexity``'s final estimate for ``path``."""
    result = subprocess.run(
        [os.path.join(bin_dir, "llama-perplexity"), "-m", path, "-f", text_path, "-c", str(ctx),
         "--no-repack", "-t", str(torch.get_num_threads()), *extra_args],
        capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        raise SystemExit(f"llama-perplexity printed no estimate for {path}:\n"
                         f"{result.stderr[-2000:]}")
    return float(found.group(1))


def dequantized_f32(bin_dir: str, path: str, out_path: str) -> str:
    """The file with every tensor dequantized to float32 by llama.cpp's ``llama-quantize``."""
    subprocess.run([os.path.join(bin_dir, "llama-quantize"), "--allow-requantize", path,
                    out_path, "F32"], capture_output=True, check=True)
    return out_path


@contextlib.contextmanager
def llama_server(bin_dir: str, path: str, extra_args: list[str]) -> Iterator[str]:
    """A ``llama-server`` with one slot serving ``path`` on a free loopback port."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [os.path.join(bin_dir, "llama-server"), "-m", path, "--host", "127.0.0.1",
             "--port", str(port), "-np", "1", "-c", "2048", "--no-repack",
             "-t", str(torch.get_num_threads()), *extra_args],
            stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(SERVER_START_S * 2):
                if server.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"llama-server exited:\n{log.read().decode()[-2000:]}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.5)
            else:
                raise SystemExit(f"llama-server did not start in {SERVER_START_S} s")
            yield base_url
        finally:
            server.terminate()
            server.wait(timeout=30)


def llama_server_greedy(bin_dir: str, path: str, extra_args: list[str],
                        prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """``llama-server``'s greedy tokens after each prompt's token ids."""
    with llama_server(bin_dir, path, extra_args) as base_url:
        outputs = []
        for prompt in prompts:
            response = httpx.post(base_url + "/completion", timeout=300, json={
                "prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                "cache_prompt": False, "return_tokens": True})
            response.raise_for_status()
            outputs.append(response.json()["tokens"])
    return outputs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many outputs are equal, and the mean fraction of tokens before the first
    difference."""
    pairs = list(zip(ours, theirs, strict=True))
    return {"identical": sum(a == b for a, b in pairs), "prompts": len(pairs),
            "common_prefix": sum(common_prefix(a, b) / max(len(b), 1)
                                 for a, b in pairs) / len(pairs)}


def measure_file(args: argparse.Namespace, path: str, text: str, scratch: str) -> dict:
    f32_path = dequantized_f32(args.llama_cpp, path,
                               os.path.join(scratch, "f32-" + os.path.basename(path)))
    prompts = chat_prompts(path)
    extra = shlex.split(args.llama_cpp_args)
    theirs = llama_server_greedy(args.llama_cpp, path, extra, prompts, args.max_tokens)
    theirs_f32 = llama_server_greedy(args.llama_cpp, f32_path, extra, prompts, args.max_tokens)
    variant = llama_server_greedy(args.llama_cpp, path,
                                  [*extra, *shlex.split(args.llama_cpp_variant)], prompts,
                                  args.max_tokens)
    report = {"file": os.path.basename(path),
              "llama_cpp_perplexity": llama_perplexity(args.llama_cpp, path, args.text,
                                                       args.ctx, extra),
              "llama_cpp_f32_perplexity": llama_perplexity(args.llama_cpp, f32_path,
                                                           args.text, args.ctx, extra),
              "llama_cpp_outputs": theirs,
              "llama_cpp_variant_agreement": agreement(variant, theirs), "configs": {}}
    os.remove(f32_path)
    for name, options in configurations().items():
        result = measure_tokenmill(path, options, text, args.ctx, prompts, theirs,
                                   args.max_tokens)
        result["vs_llama_cpp"] = result["perplexity"] / report["llama_cpp_perplexity"] - 1
        result["vs_llama_cpp_f32"] = (result["perplexity"]
                                      / report["llama_cpp_f32_perplexity"] - 1)
        if name == "float32":
            result["agreement_f32"] = agreement(result["outputs"], theirs_f32)
        report["configs"][name] = result
    return report


def print_table(reports: list[dict], args: argparse.Namespace) -> None:
    table = Table(title=f"tokenmill vs llama.cpp on the same file: perplexity (-c {args.ctx}) "
                        f"and greedy agreement ({len(QUESTIONS)} prompts x "
                        f"{args.max_tokens} tokens)")
    for column in ("file", "config", "perplexity", "llama.cpp", "diff", "llama.cpp F32",
                   "diff F32", "same text", "common prefix", "margin p50", "same text (F32)",
                   "llama.cpp variant"):
        table.add_column(column, justify="right")
    for report in reports:
        variant = report["llama_cpp_variant_agreement"]
        for name, r in report["configs"].items():
            a, f32 = r["agreement"], r.get("agreement_f32")
            table.add_row(report["file"], name, f"{r['perplexity']:.3f}",
                          f"{report['llama_cpp_perplexity']:.3f}", f"{r['vs_llama_cpp']:+.2%}",
                          f"{report['llama_cpp_f32_perplexity']:.3f}",
                          f"{r['vs_llama_cpp_f32']:+.2%}",
                          f"{a['identical']}/{a['prompts']}", f"{a['common_prefix']:.0%}",
                          f"{statistics.median(r['margins']):.3f}" if r["margins"] else "-",
                          f"{f32['identical']}/{f32['prompts']}" if f32 else "-",
                          f"{variant['identical']}/{variant['prompts']}")
    Console(width=180).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True,
                        help="folder with llama-perplexity, llama-quantize and llama-server")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--llama-cpp-args", default="",
                        help="more options for llama-perplexity and llama-server, "
                             "e.g. \"-ctk bf16 -ctv bf16\"")
    parser.add_argument("--llama-cpp-variant", default="-ctk bf16 -ctv bf16",
                        help="options that change llama-server a little, to measure how "
                             "often its greedy text stays its own")
    parser.add_argument("--out", default="benchmarks/results/llama_cpp_agreement.json")
    parser.add_argument("gguf", nargs="+")
    args = parser.parse_args()
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    with tempfile.TemporaryDirectory() as scratch:
        reports = [measure_file(args, path, text, scratch) for path in args.gguf]
    print_table(reports, args)
    write_report({"args": vars(args), "files": reports}, args.out)


if __name__ == "__main__":
    main()
