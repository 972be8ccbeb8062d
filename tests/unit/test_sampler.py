"""Sampler: greedy, filters, penalties, seeds, banned ids and logprobs, on real tensors."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.sampler import Sampler, SamplingBatch
from tokenmill.kernels import choose_kernels
from tokenmill.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Logprobs by PyTorch's ops, and by the native logprob_rows where the kernels build.
LOGPROB_ROUTES = ["torch", "native"]


def logprob_sampler(route: str, device: str = "cpu") -> Sampler:
    if route == "torch":
        return Sampler()
    kernels = choose_kernels("auto", torch.device(device))
    if kernels is None:
        pytest.skip(f"no native kernels on {device} here")
    return Sampler(kernels)


def sample(logits: torch.Tensor, params: list[SamplingParams], device: str = "cpu",
           sampler: Sampler | None = None, **kwargs):
    logits = logits.to(device)
    batch = SamplingBatch.build(params, logits.shape[1], device, **kwargs)
    return (sampler or Sampler())(logits.clone(), batch)


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device) -> None:
    logits = random_logits(6, 500)
    expected = logits.argmax(dim=-1).tolist()
    assert sample(logits, [SamplingParams(temperature=0.0)] * 6, device).token_ids == expected
    # top_k=1 is greedy too; and greedy rows stay argmax next to sampling rows.
    mixed = [SamplingParams(temperature=0.0), SamplingParams(top_k=1),
             SamplingParams(temperature=1.0)] * 2
    out = sample(logits, mixed, device).token_ids
    assert [out[i] for i in (0, 1, 3, 4)] == [expected[i] for i in (0, 1, 3, 4)]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    logits = probs.log().expand(n, 4).contiguous()
    tokens = torch.tensor(sample(logits, [SamplingParams(temperature=1.0)] * n).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015)
    hot = torch.tensor(sample(logits, [SamplingParams(temperature=2.0)] * n).token_ids)
    expected_hot = (probs.log() / 2.0).softmax(dim=-1)
    assert torch.allclose(torch.bincount(hot, minlength=4).float() / n, expected_hot, atol=0.015)


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 3000) -> set[int]:
    logits = logits_row.expand(n, -1).contiguous()
    return set(sample(logits, [params] * n).token_ids)


def test_top_k_picks_only_the_k_best() -> None:
    row = random_logits(1, 200, seed=1)[0]
    allowed = set(row.topk(5).indices.tolist())
    assert draws(row, SamplingParams(top_k=5, temperature=5.0)) == allowed


def expected_top_p(row: torch.Tensor, top_p: float) -> set[int]:
    probs, ids = row.softmax(dim=-1).sort(descending=True)
    kept, mass = set(), 0.0
    for p, i in zip(probs.tolist(), ids.tolist(), strict=True):
        if mass >= top_p:
            break
        kept.add(i)
        mass += p
    return kept


def test_top_p_picks_only_the_nucleus() -> None:
    row = random_logits(1, 300, seed=2, scale=2.0)[0]
    allowed = expected_top_p(row, 0.6)
    assert 2 < len(allowed) < 40
    assert draws(row, SamplingParams(top_p=0.6), n=6000) == allowed


def test_top_p_beyond_the_candidate_window_sorts_everything() -> None:
    row = random_logits(1, 4096, seed=3, scale=0.1)[0]  # nearly flat: > 1024 tokens needed
    allowed = expected_top_p(row, 0.5)
    assert len(allowed) > 1100
    got = draws(row, SamplingParams(top_p=0.5), n=3000)
    assert got <= allowed
    assert got - set(row.topk(1024).indices.tolist())  # the tail of the nucleus is reachable


def test_min_p_drops_unlikely_tokens() -> None:
    row = random_logits(1, 100, seed=4, scale=2.0)[0]
    probs = row.softmax(dim=-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < 20
    assert draws(row, SamplingParams(min_p=0.2), n=4000) == allowed


def test_filters_apply_per_row() -> None:
    logits = random_logits(3, 200, seed=5)
    params = [SamplingParams(top_k=3), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.3)]
    for _ in range(30):
        a, b, c = sample(logits, params).token_ids
        assert a in logits[0].topk(3).indices.tolist()
        assert b == logits[1].argmax().item()
        assert c in expected_top_p(logits[2], 0.3)


def greedy_after(logits: list[float], prompt=(), output=(), **penalties) -> int:
    params = SamplingParams(temperature=0.0, **penalties)
    return sample(torch.tensor([logits]), [params], prompt_token_ids=[list(prompt)],
                  output_token_ids=[list(output)]).token_ids[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    assert greedy_after([2.0, 1.7, 0.0], prompt=[0], repetition_penalty=1.25) == 1  # 1.6
    assert greedy_after([2.0, 1.7, 0.0], prompt=[0], repetition_penalty=1.1) == 0  # 1.82
    assert greedy_after([2.0, 1.7, 0.0], output=[0], repetition_penalty=1.25) == 1
    assert greedy_after([-1.0, -1.1], prompt=[0], repetition_penalty=1.2) == 1  # -1.2
    assert greedy_after([-1.0, -1.1], prompt=[0], repetition_penalty=1.05) == 0  # -1.05
    assert greedy_after([2.0, 1.7, 0.0], prompt=[2], repetition_penalty=2.0) == 0


def test_frequency_penalty_scales_with_output_count() -> None:
    assert greedy_after([2.0, 1.6], output=[0], frequency_penalty=0.3) == 0  # 1.7
    assert greedy_after([2.0, 1.6], output=[0, 0], frequency_penalty=0.3) == 1  # 1.4
    assert greedy_after([2.0, 1.6], prompt=[0, 0, 0], frequency_penalty=2.0) == 0
    assert greedy_after([1.0, 1.6], output=[0, 0], frequency_penalty=-0.5) == 0  # 2.0


def test_presence_penalty_is_paid_once() -> None:
    assert greedy_after([2.0, 1.6], output=[0, 0, 0], presence_penalty=0.3) == 0  # 1.7
    assert greedy_after([2.0, 1.6], output=[0], presence_penalty=0.5) == 1  # 1.5
    assert greedy_after([2.0, 1.6], prompt=[0], presence_penalty=2.0) == 0


def test_penalties_touch_only_their_rows() -> None:
    logits = torch.tensor([[2.0, 1.7], [2.0, 1.7]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0),
              SamplingParams(temperature=0.0)]
    out = sample(logits, params, prompt_token_ids=[[0], [0]], output_token_ids=[[], []])
    assert out.token_ids == [1, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_banned_ids_are_never_sampled(device) -> None:
    logits = random_logits(4, 50, seed=6)
    best = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=3.0), SamplingParams(temperature=3.0)]
    banned = [{best[0]}, set(), set(range(40)), {999}]  # 999: outside the vocabulary
    for _ in range(20):
        out = sample(logits, params, device, banned_token_ids=banned).token_ids
        assert out[0] == logits[0].topk(2).indices[1].item()
        assert out[1] == best[1]
        assert out[2] >= 40


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    vocab = 1000
    target = random_logits(1, vocab, seed=7, scale=0.5)
    seeded = SamplingParams(seed=1234, top_p=0.95)

    def run(others: int, row: int, position: int) -> int:
        logits = random_logits(others + 1, vocab, seed=others)
        logits[row] = target[0]
        params = [SamplingParams(temperature=0.9, seed=i if i % 2 else None)
                  for i in range(others + 1)]
        params[row] = seeded
        outputs = [[5] * position] * (others + 1)
        return sample(logits, params, output_token_ids=outputs).token_ids[row]

    for position in range(5):
        alone = run(0, 0, position)
        assert run(3, 2, position) == alone
        assert run(7, 5, position) == alone
    sequence = [run(0, 0, p) for p in range(10)]
    assert len(set(sequence)) > 3  # each position draws fresh noise
    other_seed = [sample(target, [SamplingParams(seed=99, top_p=0.95)],
                         output_token_ids=[[0] * p]).token_ids[0] for p in range(10)]
    assert other_seed != sequence


@pytest.mark.parametrize("route", LOGPROB_ROUTES)
@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device, route) -> None:
    """Raw: from the logits before the penalty and the filters (the native route reads
    them after sampling from a copy)."""
    logits = random_logits(3, 300, seed=8)
    raw = torch.log_softmax(logits, dim=-1)
    params = [SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.5, logprobs=5),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0)]
    out = sample(logits, params, device, sampler=logprob_sampler(route, device),
                 prompt_token_ids=[[1, 2, 3], [], []], output_token_ids=[[4], [], []])
    assert out.logprobs[1] is None
    first, third = out.logprobs[0], out.logprobs[2]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-5)
    assert first.rank == int((raw[0] > raw[0, first.token_id]).sum()) + 1
    top_values, top_ids = raw[0].topk(5)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(top_values.tolist(), abs=1e-5)
    assert third.rank == 1 and third.top == ()
    assert third.token_id == logits[2].argmax().item()
    assert third.logprob == pytest.approx(raw[2].max().item(), abs=1e-5)


@pytest.mark.parametrize("route", LOGPROB_ROUTES)
def test_logprobs_over_a_large_vocabulary_with_ties(route) -> None:
    """A vocabulary of many blocks and a partial one, bfloat16 logits full of ties, rows
    that ask and rows that don't: the top-n are ``topk``'s values, equal values in id
    order; ranks count the larger logprobs; a second call (reusing the PyTorch route's
    scratch buffer) gives the same answers."""
    sampler = logprob_sampler(route)
    vocab = 70_000  # 273 blocks of 256 and 112 ids more
    logits = random_logits(5, vocab, seed=11).to(torch.bfloat16)
    logits[3, -5:] = logits[3].max() + 1  # the largest values in the partial block, tied
    raw = torch.log_softmax(logits.float(), dim=-1)
    params = [SamplingParams(temperature=1.0, seed=i, logprobs=None if i == 1 else 20)
              for i in range(5)]
    outs = [sample(logits, params, sampler=sampler, output_token_ids=[[]] * 5)
            for _ in range(2)]
    assert outs[0] == outs[1]
    out = outs[0]
    assert out.logprobs[1] is None
    for row in (0, 2, 3, 4):
        entry = out.logprobs[row]
        assert entry.rank == int((raw[row] > raw[row, entry.token_id]).sum()) + 1
        assert entry.logprob == pytest.approx(raw[row, entry.token_id].item(), abs=1e-5)
        values = raw[row].topk(20).values.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values, abs=1e-5)
        ids = [t for t, _ in entry.top]
        assert [v for _, v in entry.top] == pytest.approx([raw[row, t].item() for t in ids],
                                                          abs=1e-5)
        expected = sorted(range(vocab), key=lambda t: (-raw[row, t].item(), t))[:20]
        assert ids == expected
    assert [t for t, _ in out.logprobs[3].top[:5]] == list(range(vocab - 5, vocab))


def test_native_kernels_pick_what_pytorch_picks() -> None:
    """With the native kernels, an all-greedy batch takes ``argmax_rows`` and a batch of
    temperatures alone ``sample_rows``, over bfloat16 logits as they are: greedy tokens are
    PyTorch's exactly; sampled ones too at the same seeded u, but for a row whose u falls
    where the two float32 cumulative sums round to different sides of a boundary."""
    kernels = choose_kernels("auto", torch.device("cpu"))
    if kernels is None:
        pytest.skip("the native kernels do not build here")
    logits = random_logits(64, 500, seed=3).to(torch.bfloat16)
    for params in ([SamplingParams(temperature=0.0)] * 64,
                   [SamplingParams(temperature=0.8, seed=i) for i in range(64)],
                   [SamplingParams(temperature=0.0 if i % 3 else 1.2, seed=i)
                    for i in range(64)]):
        positions = [[]] * 64
        native = sample(logits, params, sampler=Sampler(kernels),
                        output_token_ids=positions).token_ids
        pytorch = sample(logits, params, output_token_ids=positions).token_ids
        assert sum(a != b for a, b in zip(native, pytorch, strict=True)) <= 1
        greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
        assert [native[i] for i in greedy] == [pytorch[i] for i in greedy]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_logprob_rows_is_log_softmax(dtype) -> None:
    """The native ``logprob_rows`` against ``log_softmax``: the token's logprob, its rank
    (1 + the number of larger logprobs) and the k largest (ties to the lower id), over rows
    with -inf logits (a grammar's mask: a whole block of them; a row of 3 finite logits,
    whose top 5 ends with -inf ones, the lowest ids), for k = 5 and k = 0."""
    kernels = choose_kernels("auto", torch.device("cpu"))
    if kernels is None:
        pytest.skip("the native kernels do not build here")
    vocab = 1000  # 3 blocks of 256 and a partial one
    logits = random_logits(4, vocab, seed=5).to(dtype)
    logits[1, 256:512] = float("-inf")
    logits[1, ::7] = float("-inf")
    logits[2] = float("-inf")
    logits[2, [3, 600, 999]] = torch.tensor([1.0, 2.0, 2.0], dtype=dtype)
    token_ids = torch.tensor([17, 3, 3, int(logits[3].float().argmax())])
    raw = torch.log_softmax(logits.float(), dim=-1)
    sampled = raw.gather(1, token_ids.unsqueeze(1))
    for k in (5, 0):
        values, top_ids, ranks = kernels.logprob_rows(logits, token_ids, k)
        assert values.shape == (4, 1 + k) and values.dtype == torch.float32
        assert top_ids.shape == (4, k) and top_ids.dtype == torch.int64
        torch.testing.assert_close(values[:, :1], sampled, atol=1e-5, rtol=0)
        assert ranks.tolist() == ((raw > sampled).sum(dim=-1) + 1).tolist()
        expected = [sorted(range(vocab), key=lambda t, r=r: (-raw[r, t].item(), t))[:k]
                    for r in range(4)]
        assert top_ids.tolist() == expected
        torch.testing.assert_close(values[:, 1:], raw.gather(1, top_ids), atol=1e-5, rtol=0)
    assert ranks.tolist()[2:] == [3, 1]
    assert top_ids.numel() == 0
    with pytest.raises(RuntimeError, match="token_ids"):
        kernels.logprob_rows(logits, torch.tensor([0, 0, 0, vocab]), 5)
    with pytest.raises(RuntimeError, match="k must be"):
        kernels.logprob_rows(logits, token_ids, vocab + 1)


@pytest.mark.parametrize("route", LOGPROB_ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_bias_moves_only_its_rows(route, dtype) -> None:
    logits = random_logits(4, 300, seed=5).to(dtype)
    plain = [SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=0.7, seed=3, logprobs=2)] * 2
    biased = list(plain)
    top = logits.float().argmax(dim=-1).tolist()
    biased[0] = SamplingParams(temperature=0.0, logit_bias={11: 100.0})
    biased[3] = SamplingParams(temperature=0.0, logit_bias={top[3]: -100.0})
    outputs = dict(output_token_ids=[[]] * 4)
    before = sample(logits, plain, sampler=logprob_sampler(route), **outputs)
    after = sample(logits, biased, sampler=logprob_sampler(route), **outputs)
    assert after.token_ids[0] == 11 and after.token_ids[3] != top[3]
    assert after.token_ids[1:3] == before.token_ids[1:3]
    assert after.logprobs[1:3] == before.logprobs[1:3]
