"""Structured outputs below the server: llguidance grammars and their check, the engine's
compiler and per-request matchers, the sampler's bitmask, and the core's scheduling of
constrained requests (with stand-in grammars over the fake model)."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from fake_executor import expected_continuation, make_core, make_request, run_to_completion

from tokenmill.core.records import FinishReason
from tokenmill.engine.sampler import Sampler, SamplingBatch
from tokenmill.sampling_params import SamplingParams, StructuredOutput
from tokenmill.structured.compiler import GrammarCompiler, Vocabulary
from tokenmill.structured.grammar import GrammarError, check_structured_output
from tokenmill.structured.matcher import RequestGrammar, bitmask_width, fill_bitmasks
from tokenmill.tokenizer.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


def json_constraint(schema=SCHEMA, whitespace=None) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema), whitespace)


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def compiler(smol) -> GrammarCompiler:
    compiler = GrammarCompiler()
    compiler.set_vocabulary(Vocabulary(smol.backend.to_str(), 49152,
                                       tuple(sorted(smol.eos_token_ids))))
    return compiler


def ready(grammar: RequestGrammar, timeout: float = 10.0) -> RequestGrammar:
    deadline = time.monotonic() + timeout
    while not grammar.poll():
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return grammar


# ------------------------------------------------------------------ grammars and checks


@pytest.mark.parametrize("constraint", [
    json_constraint(), json_constraint({"type": "object"}), json_constraint(True),
    StructuredOutput("regex", r"[a-z]+@[a-z]+\.com"),
    StructuredOutput("choice", json.dumps(["yes", "no", 'a "quoted" \\ choice', "café"])),
    StructuredOutput("grammar", 'root ::= "(" [0-9]+ ")"'),  # GBNF
    StructuredOutput("grammar", 'start: "yes" | "no"'),  # Lark
])
def test_good_constraints_check(constraint) -> None:
    check_structured_output(constraint)


@pytest.mark.parametrize("constraint,message", [
    (StructuredOutput("json", "{not json"), "not valid JSON"),
    (StructuredOutput("json", "[1, 2]"), "must be an object"),
    (StructuredOutput("json", "false"), "must be an object"),
    (json_constraint({"type": "foo"}), "foo"),
    (json_constraint({"type": "string", "format": "telephone"}), "telephone"),
    (json_constraint({"properties": {"a": {"not": {}}}}), "not"),
    (StructuredOutput("regex", "a(b"), "unclosed group"),
    (StructuredOutput("regex", "(?=a)b"), "look-around"),
    (StructuredOutput("choice", "[]"), "non-empty"),
    (StructuredOutput("choice", '["a", ""]'), "non-empty"),
    (StructuredOutput("grammar", "root ::= missing"), "missing"),
    (StructuredOutput("grammar", "start: foo"), "foo"),
])
def test_bad_constraints_say_why(constraint, message) -> None:
    with pytest.raises(GrammarError, match=message):
        check_structured_output(constraint)


def test_structured_output_record_checks_its_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(structured_output="json")  # type: ignore[arg-type]


# ------------------------------------------------------------ the compiler and matchers


def test_compiled_grammars_are_cached_and_copied_per_request(compiler, smol) -> None:
    constraint = json_constraint()
    first = ready(compiler.start(constraint))
    assert compiler.take_compile_times()  # one compilation, timed
    second = compiler.start(constraint)
    assert second.poll(), "a cached grammar is ready at once"
    assert compiler.take_compile_times() == ()
    ids = smol.encode('{"a": 12, "b": "y"}', add_special_tokens=False)
    for token in ids[:3]:
        assert first.accept(token)
    assert second.num_tokens == 0 and second.matcher.validate_tokens(ids) == len(ids), \
        "each request has its own matcher"
    for token in ids[3:]:
        assert first.accept(token)
    assert first.is_finished()  # a closed object admits nothing more


def test_default_json_whitespace_is_bounded(compiler, smol) -> None:
    grammar = ready(compiler.start(json_constraint()))

    def accepts(text: str) -> bool:
        ids = smol.encode(text, add_special_tokens=False)
        return grammar.matcher.validate_tokens(ids) == len(ids)

    assert accepts('{"a":1,"b":"x"}') and accepts('{"a": 1, "b": "x"}')
    assert accepts(json.dumps({"a": 1, "b": "x"}, indent=2))
    assert not accepts('{"a":   1}') and not accepts(' {"a":1')
    compact = ready(compiler.start(json_constraint(whitespace="")))
    ids = smol.encode('{"a": 1', add_special_tokens=False)
    assert compact.matcher.validate_tokens(ids) < len(ids)


def test_a_failed_compilation_is_cached_and_raises(compiler) -> None:
    bad = json_constraint({"type": "foo"})
    with pytest.raises(GrammarError, match="foo"):
        ready(compiler.start(bad))
    grammar = compiler.start(bad)
    with pytest.raises(GrammarError):
        grammar.poll()


def test_a_compilation_past_its_deadline_fails_its_request() -> None:
    never: Future = Future()
    grammar = RequestGrammar(never, time.monotonic() - 1, timeout_s=0.5)
    with pytest.raises(GrammarError, match="longer than 0.5 s"):
        grammar.poll()


def test_no_vocabulary_fails_cleanly() -> None:
    with pytest.raises(GrammarError, match="tokenizer"):
        GrammarCompiler().start(json_constraint()).poll()


def test_bitmasks_with_drafts_and_draft_cutting(compiler, smol) -> None:
    grammar = ready(compiler.start(json_constraint()))
    ids = smol.encode('{"a": 7, "b": "x"}', add_special_tokens=False)
    # drafts past the end of the grammar, or off it, are cut
    assert grammar.valid_drafts(ids) == len(ids) - 1  # the closing token is sampled
    assert grammar.valid_drafts(ids[:2] + [smol.encode("zzz", add_special_tokens=False)[0]]) == 2
    assert grammar.num_tokens == 0 and grammar.matcher.validate_tokens(ids) == len(ids)
    mask = np.zeros((4, bitmask_width(49152)), dtype=np.int32)
    fill_bitmasks([(grammar, 0, ids[:3])], mask)
    for j in range(4):  # row j allows the next token after drafts 1..j
        assert mask[j, ids[j] // 32] >> (ids[j] % 32) & 1
    assert (mask[0] != mask[1]).any()


def test_sync_replays_the_output_into_a_fresh_matcher(compiler, smol) -> None:
    grammar = ready(compiler.start(json_constraint()))
    ids = smol.encode('{"a": 7, "b": "x"}', add_special_tokens=False)
    grammar.sync(ids[:4])  # as if the state had been lost: rebuilt from the output
    assert grammar.num_tokens == 4
    assert grammar.matcher.validate_tokens(ids[4:]) == len(ids) - 4
    grammar.sync(ids[:4])  # in step: nothing to do
    assert grammar.num_tokens == 4


# ------------------------------------------------------------------------ the sampler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_masks_constrained_rows_only_in_the_logits_dtype(dtype) -> None:
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    allowed = [7, 42, 99]
    bitmask = np.zeros((1, bitmask_width(vocab)), dtype=np.int32)
    for token in allowed:
        bitmask[0, token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    params = [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=1.0)]
    for rows in ([1], [2]):
        batch = SamplingBatch.build(params, vocab, "cpu", output_token_ids=[[]] * 3,
                                    grammar=(rows, bitmask))
        work = logits.clone()
        out = Sampler()(work, batch)
        assert work.dtype == dtype
        assert out.token_ids[rows[0]] in allowed
        assert torch.equal(work[0], logits[0]), "an unconstrained row is untouched"
        assert torch.isinf(work[rows[0]]).sum() == vocab - len(allowed)


def test_bitmask_rows_report_logprobs_of_allowed_tokens() -> None:
    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))
    bitmask = np.zeros((1, 2), dtype=np.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3
    batch = SamplingBatch.build([SamplingParams(temperature=0.0, logprobs=3)], vocab, "cpu",
                                output_token_ids=[[]], grammar=([0], bitmask))
    out = Sampler()(logits.clone(), batch)
    assert out.token_ids[0] in (1, 3)
    top = out.logprobs[0].top
    assert {t for t, _ in top[:2]} == {1, 3} and top[2][1] == float("-inf")
    assert abs(sum(np.exp(lp) for _, lp in top[:2]) - 1.0) < 1e-5


# -------------------------------------------------- the core, with stand-in grammars


class StubGrammar:
    """A grammar over the fake model: ready after ``polls`` polls; complete after
    ``length`` tokens; rejects ``reject``; fails with ``error``."""

    def __init__(self, polls: int = 0, length: int | None = None, reject: int | None = None,
                 error: str | None = None, drafts_ok: int = 99) -> None:
        self.polls, self.length, self.reject, self.failure = polls, length, reject, error
        self.drafts_ok = drafts_ok
        self.ready = False
        self.num_tokens = 0
        self.error = "rejected"

    def poll(self) -> bool:
        if self.failure:
            raise GrammarError(self.failure)
        self.polls -= 1
        self.ready = self.polls < 0
        return self.ready

    def accept(self, token: int) -> bool:
        assert self.ready
        self.num_tokens += 1
        return token != self.reject

    def is_finished(self) -> bool:
        return self.length is not None and self.num_tokens >= self.length

    def valid_drafts(self, drafts) -> int:
        return min(len(drafts), self.drafts_ok)


def constrained(core, grammar: StubGrammar, prompt, **kwargs):
    request = make_request(prompt, structured_output=StructuredOutput("regex", "x"), **kwargs)
    core.grammars.start = lambda constraint: grammar  # type: ignore[method-assign]
    core.add_request(request)
    return request


def test_a_request_waits_for_its_grammar_while_others_run() -> None:
    core = make_core()
    grammar = StubGrammar(polls=3)
    slow = constrained(core, grammar, [1, 2, 3], max_tokens=4)
    free = make_request([4, 5, 6], max_tokens=4)
    core.add_request(free)
    first = core.step()
    assert {o.req_id for o in first.outputs} == {free.req_id}, "the free request ran"
    assert core.scheduler.num_waiting == 1
    tokens = run_to_completion(core)
    assert tokens[slow.req_id] == expected_continuation([1, 2, 3], 4)
    assert grammar.num_tokens == 4


def test_only_compiling_requests_left_means_no_step() -> None:
    core = make_core()
    grammar = StubGrammar(polls=2)
    constrained(core, grammar, [1, 2])
    assert core.has_work() and not core.can_step()
    assert not core.can_step()
    assert core.can_step(), "ready on the third poll"


def test_a_failed_grammar_ends_its_request_with_the_reason() -> None:
    core = make_core()
    request = constrained(core, StubGrammar(error="bad schema"), [1, 2])
    outputs = core.step().outputs
    [out] = [o for o in outputs if o.req_id == request.req_id]
    assert out.finish_reason is FinishReason.ERROR and "bad schema" in out.error
    assert not core.has_work()
    core.check_integrity()


def test_a_complete_grammar_stops_its_request() -> None:
    core = make_core()
    request = constrained(core, StubGrammar(length=3), [1, 2], max_tokens=10, min_tokens=5)
    outputs = []
    while core.has_work():
        outputs += [o for o in core.step().outputs if o.req_id == request.req_id]
    assert sum(len(o.new_token_ids) for o in outputs) == 3
    assert outputs[-1].finish_reason is FinishReason.STOP


def test_a_rejected_token_is_an_error() -> None:
    core = make_core()
    prompt = [1, 2]
    second = expected_continuation(prompt, 2)[1]
    request = constrained(core, StubGrammar(reject=second), prompt, max_tokens=10)
    outputs = []
    while core.has_work():
        outputs += [o for o in core.step().outputs if o.req_id == request.req_id]
    assert outputs[-1].finish_reason is FinishReason.ERROR
    assert "rejected" in outputs[-1].error


def test_drafts_are_cut_to_what_the_grammar_accepts() -> None:
    core = make_core(speculative_ngram=3, ngram_min=1, ngram_max=2,
                     next_token=lambda sequence: sequence[-2])  # 5 6 5 6 ...: drafts match
    grammar = StubGrammar(drafts_ok=1)
    constrained(core, grammar, [5, 6, 5, 6, 5, 6, 5], max_tokens=12)
    executor = core.executor
    run_to_completion(core)
    drafted = [r.draft_token_ids for step in executor.steps for r in step.requests]
    assert drafted and all(len(d) <= 1 for d in drafted)
    assert any(drafted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_numpy_and_torch_masks_agree(dtype) -> None:
    from tokenmill.engine.grammar_mask import apply_bitmask

    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2)).to(dtype)
    bitmask = torch.from_numpy(np.random.default_rng(0).integers(
        -2**31, 2**31, size=(2, bitmask_width(vocab)), dtype=np.int64).astype(np.int32))
    rows = torch.tensor([1, 3])
    on_cpu = logits.clone()
    with torch.inference_mode():
        apply_bitmask(on_cpu, rows, bitmask)  # contiguous: the numpy path
    wide = torch.zeros(4, vocab * 2, dtype=dtype)
    wide[:, :vocab] = logits
    strided = wide[:, :vocab]  # not contiguous: the torch path
    apply_bitmask(strided, rows, bitmask)
    assert torch.equal(on_cpu, strided)
    assert torch.equal(on_cpu[[0, 2]], logits[[0, 2]])
    bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert [bool(torch.isinf(on_cpu[1, t])) for t in range(vocab)] == [b == 0 for b in bits]
