"""The engine's grammar compiler: constraints compiled for the model's vocabulary on a
background thread, off the engine's step, and cached by ``StructuredOutput``.

    EngineCore.add_request --start(constraint)--> cache hit: a compiled grammar, at once
                                                  miss: a compile job on the worker thread
    Scheduler: a constrained request waits until its grammar is ready; the others run.

A compiled grammar is an llguidance matcher in its initial state (its first mask already
computed, which builds the lexer states every request of that grammar starts with); a
request gets a copy of it (about a microsecond). Failed compilations are cached too, so a
bad grammar sent again fails at once. A compilation that takes longer than ``timeout_s``
fails its requests (the job itself runs on, and a later request may find it done);
other requests never wait for one.

The vocabulary comes from whoever tokenises (``set_vocabulary``, sent once over the pipe
by the server): the engine process loads no tokenizer of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from tokenmill.sampling_params import StructuredOutput
from tokenmill.structured.grammar import GrammarError, grammar_text
from tokenmill.structured.matcher import RequestGrammar

logger = logging.getLogger("tokenmill")

DEFAULT_COMPILE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What the grammar matchers need of the tokenizer (it crosses the pipe once)."""

    tokenizer_json: str  # the ``tokenizers`` library's serialisation of the tokenizer
    vocab_size: int  # the model's output rows: the width of every mask (>= the tokenizer's ids)
    eos_token_ids: tuple[int, ...]  # allowed where the grammar may end


class GrammarCompiler:
    """Compiles and caches grammars; see the module docstring. ``on_compiled``, when given,
    is called (on the worker thread) after each compilation: the engine loop's wake-up."""

    def __init__(self, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_size: int = 128,
                 num_threads: int = 1, on_compiled: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.num_threads = num_threads
        self._on_compiled = on_compiled
        self._vocabulary: Vocabulary | None = None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._times_lock = threading.Lock()
        self._compile_times: list[float] = []

    @property
    def vocabulary(self) -> Vocabulary | None:
        return self._vocabulary

    def set_vocabulary(self, vocabulary: Vocabulary) -> None:
        """Use ``vocabulary`` from now on; its llguidance tokenizer (a fraction of a second
        to build) is built at once on the worker thread, ahead of the first grammar."""
        with self._tokenizer_lock:
            self._vocabulary, self._tokenizer = vocabulary, None
        self._cache.clear()
        self._worker().submit(self._ll_tokenizer)

    def start(self, constraint: StructuredOutput) -> RequestGrammar:
        """A request's grammar for ``constraint``: ready now on a cache hit, else once the
        worker thread has compiled it (``RequestGrammar.poll``)."""
        future = self._cache.get(constraint)
        if future is not None:
            self._cache.move_to_end(constraint)
        else:
            future = self._submit(constraint)
        return RequestGrammar(future, time.monotonic() + self.timeout_s, self.timeout_s)

    def take_compile_times(self) -> tuple[float, ...]:
        """Seconds each compilation took, since the last call (for the metrics)."""
        with self._times_lock:
            times, self._compile_times = tuple(self._compile_times), []
        return times

    def _submit(self, constraint: StructuredOutput) -> Future:
        if self._vocabulary is None:
            future: Future = Future()
            future.set_exception(GrammarError(
                "structured output needs the tokenizer, which this engine was not given"))
            return future
        future = self._worker().submit(self._compile, constraint)
        future.add_done_callback(self._compiled)  # NOTE: runs once the result is set
        self._cache[constraint] = future
        while len(self._cache) > self.cache_size:
            oldest = next(iter(self._cache))
            if not self._cache[oldest].done():
                break  # NOTE: jobs in flight stay (a later request may be waiting for them)
            del self._cache[oldest]
        return future

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads,
                                            thread_name_prefix="tokenmill-grammar")
        return self._pool

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """On the worker thread: the compiled grammar, or ``GrammarError``."""
        start = time.monotonic()
        try:
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar_text(constraint),
                                           log_level=0)
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            matcher.compute_bitmask()  # build the first step's lexer states now, not in a step
            return matcher
        except GrammarError as e:
            logger.warning("a %s grammar did not compile: %s", constraint.kind, e)
            raise
        finally:
            with self._times_lock:
                self._compile_times.append(time.monotonic() - start)

    def _compiled(self, _future: Future) -> None:
        if self._on_compiled is not None:
            self._on_compiled()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                vocab = self._vocabulary
                assert vocab is not None, "checked when the job was submitted"
                self._tokenizer = llguidance.LLTokenizer(
                    vocab.tokenizer_json, n_vocab=vocab.vocab_size,
                    eos_token=list(vocab.eos_token_ids) or None)
            return self._tokenizer

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
