"""Prompts to send: synthetic ones of a given token length, or a JSONL dataset.

A source answers ``await get(index) -> Prompt`` and ``await warmup() -> Prompt``.
Prompt ``index`` depends only on (seed, index), never on timing, so two runs with
the same seed send the same prompts in the same order.

Synthetic prompts are random words from a fixed list of common English words
(random, so prompts share no prefix a cache could serve). Lengths are uniform in
``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM's random dataset rule).
``fit_words`` picks how many words make ``input_len`` tokens by the best available
``TokenCounter``: it scales the word count by the observed tokens per word, then
steps one word at a time, keeping the closest count found.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenmill.bench.config import BenchSetupError
from tokenmill.bench.tokenizers import TokenCounter

WORDS = tuple(
    "the of and to in is you that it he was for on are as with his they at be this have"
    " from or one had by word but not what all were we when your can said there use an"
    " each which she do how their if will up other about out many then them these so some"
    " her would make like him into time has look two more write go see number no way could"
    " people my than first water been call who oil its now find long down day did get come"
    " made may part over new sound take only little work know place year live me back give"
    " most very after thing our just name good sentence man think say great where help"
    " through much before line right too mean old any same tell boy follow came want show"
    " also around form three small set put end does another well large must big even such"
    " because turn here why ask went men read need land different home us move try kind hand"
    " picture again change off play spell air away animal house point page letter mother"
    " answer found study still learn should world high every near add food between own"
    " below country plant last school father keep tree never start city earth eye light"
    " thought head under story saw left few while along might close something seem next"
    " hard open example begin life always those both paper together got group often run".split()
)
MAX_FIT_STEPS = 12
WARMUP_INDEX = -1
WARMUP_MAX_TOKENS = 8


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int  # as measured by the source's counter
    max_tokens: int


def spread(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    low = max(1, int(length * (1 - range_ratio)))
    return rng.randint(low, max(low, int(length * (1 + range_ratio))))


async def fit_words(words: list[str], target: int,
                    count: Callable[[str], Awaitable[int]]) -> tuple[str, int]:
    """The prefix of ``words`` whose token count is ``target``, or the closest found.

    Ties prefer the shorter prompt. Invariant: the returned count is ``count(text)``.
    """
    n = min(target, len(words))
    tried: dict[int, int] = {}
    for _ in range(MAX_FIT_STEPS):
        tried[n] = await count(" ".join(words[:n]))
        if tried[n] == target:
            break
        step = round((target - tried[n]) * n / max(tried[n], 1))
        if step == 0:
            step = 1 if tried[n] < target else -1
        n = min(max(n + step, 1), len(words))
        if n in tried:
            break
    best = min(tried, key=lambda k: (abs(tried[k] - target), tried[k] > target, k))
    return " ".join(words[:best]), tried[best]


class SyntheticPrompts:
    def __init__(self, counter: TokenCounter, input_len: int, output_len: int,
                 range_ratio: float, seed: int) -> None:
        self._counter = counter
        self._input_len, self._output_len = input_len, output_len
        self._range_ratio, self._seed = range_ratio, seed

    async def get(self, index: int) -> Prompt:
        rng = random.Random(f"{self._seed}/{index}")
        input_len = spread(rng, self._input_len, self._range_ratio)
        output_len = spread(rng, self._output_len, self._range_ratio)
        words = [rng.choice(WORDS) for _ in range(2 * input_len + 8)]
        text, num_tokens = await fit_words(words, input_len, self._counter.count)
        return Prompt(text, num_tokens, output_len)

    async def warmup(self) -> Prompt:
        prompt = await self.get(WARMUP_INDEX)
        return Prompt(prompt.text, prompt.num_tokens, min(prompt.max_tokens, WARMUP_MAX_TOKENS))


class DatasetPrompts:
    """Entries of a JSONL file, cycled when a run sends more requests than it has."""

    def __init__(self, entries: list[tuple[str, int | None]], counter: TokenCounter,
                 output_len: int) -> None:
        assert entries, "load_dataset rejects an empty file"
        self._entries, self._counter, self._output_len = entries, counter, output_len

    async def get(self, index: int) -> Prompt:
        text, max_tokens = self._entries[index % len(self._entries)]
        num_tokens = await self._counter.count(text)
        return Prompt(text, num_tokens, max_tokens or self._output_len)

    async def warmup(self) -> Prompt:
        prompt = await self.get(0)
        return Prompt(prompt.text, prompt.num_tokens, min(prompt.max_tokens, WARMUP_MAX_TOKENS))


def load_dataset(path: str) -> list[tuple[str, int | None]]:
    """(prompt, max_tokens or None) per line of a JSONL file; blank lines are skipped.

    A line holds ``{"prompt": str}`` and optionally ``"max_tokens"`` or ``"output_len"``
    (a positive integer). Anything else raises ``BenchSetupError`` naming the line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchSetupError(f"cannot read dataset {path}: {exc}") from exc
    entries = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            entries.append(_parse_entry(line, f"{path}:{number}"))
    if not entries:
        raise BenchSetupError(f"dataset {path} has no prompts")
    return entries


def _parse_entry(line: str, where: str) -> tuple[str, int | None]:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BenchSetupError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
        raise BenchSetupError(f'{where}: needs a "prompt" string')
    max_tokens = entry.get("max_tokens", entry.get("output_len"))
    if max_tokens is not None and (isinstance(max_tokens, bool)
                                   or not isinstance(max_tokens, int) or max_tokens <= 0):
        raise BenchSetupError(f"{where}: max_tokens/output_len must be a positive integer")
    return entry["prompt"], max_tokens
