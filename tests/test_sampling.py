"""Properties of the CPU sampler: each filter keeps only the tokens it promises, and draws follow softmax."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from fuselm.runtime.engine import SamplingParams
from fuselm.runtime.sampling import Sampler, filtered_probs, penalize_repetition

logit_vectors = arrays(np.float32, st.integers(2, 64),
                       elements=st.floats(-20, 20, width=32, allow_nan=False))
seeds = st.integers(0, 2**32 - 1)
temperatures = st.floats(0.05, 3.0)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@given(logit_vectors)
def test_greedy_is_argmax(logits):
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(np.argmax(logits))
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=0))(logits) == int(np.argmax(logits))


@given(logit_vectors, st.integers(1, 8), seeds, temperatures)
def test_top_k_stays_in_top_k(logits, k, seed, temp):
    sampler = Sampler(SamplingParams(temperature=temp, top_k=k, seed=seed))
    kth_largest = np.sort(logits)[::-1][min(k, logits.size) - 1]
    for _ in range(5):
        assert logits[sampler(logits)] >= kth_largest


def test_top_k_keeps_exactly_k_when_logits_tie():
    probs = filtered_probs(np.zeros(10), top_k=3)
    assert np.count_nonzero(probs) == 3 and np.allclose(probs[probs > 0], 1 / 3)


@given(logit_vectors, st.floats(0.05, 0.99), seeds, temperatures)
def test_top_p_stays_in_smallest_nucleus(logits, top_p, seed, temp):
    probs = softmax(logits.astype(np.float64) / temp)
    ranked = np.sort(probs)[::-1]
    # Nucleus size, with a hair of slack for float rounding at the boundary.
    n = min(int(np.searchsorted(np.cumsum(ranked), top_p + 1e-9)) + 1, probs.size)
    sampler = Sampler(SamplingParams(temperature=temp, top_p=top_p, seed=seed))
    for _ in range(5):
        assert probs[sampler(logits)] >= ranked[n - 1] * (1 - 1e-9)


def test_top_p_nucleus_on_known_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    kept = filtered_probs(np.log(probs), top_p=0.75)
    assert np.count_nonzero(kept) == 2 and np.allclose(kept[:2], [0.5 / 0.8, 0.3 / 0.8])
    assert np.count_nonzero(filtered_probs(np.log(probs), top_p=0.81)) == 3


@given(logit_vectors, st.floats(0.01, 0.99), seeds, temperatures)
def test_min_p_threshold(logits, min_p, seed, temp):
    probs = softmax(logits.astype(np.float64) / temp)
    sampler = Sampler(SamplingParams(temperature=temp, min_p=min_p, seed=seed))
    for _ in range(5):
        assert probs[sampler(logits)] >= min_p * probs.max() * (1 - 1e-9)


def test_min_p_on_known_distribution():
    kept = filtered_probs(np.log([0.5, 0.3, 0.2]), min_p=0.5)      # threshold 0.25
    np.testing.assert_allclose(kept, [0.625, 0.375, 0.0])


@given(logit_vectors, st.lists(st.integers(0, 63), max_size=20), st.floats(0.1, 5.0))
def test_repetition_penalty_formula(logits, history, penalty):
    history = [h % logits.size for h in history]
    got = penalize_repetition(logits, history, penalty)
    expected = logits.astype(np.float64).copy()
    for i in set(history):      # each seen id once, however often it was seen
        expected[i] = expected[i] / penalty if expected[i] > 0 else expected[i] * penalty
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert penalize_repetition(logits, history, 1.0).tolist() == logits.astype(np.float64).tolist()


def test_repetition_penalty_changes_greedy_choice():
    logits = np.array([2.0, 1.5, -1.0])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    assert sampler(logits, history=[]) == 0
    assert sampler(logits, history=[0]) == 1     # 2.0 / 2 = 1.0 < 1.5


@settings(max_examples=25)
@given(logit_vectors, seeds, temperatures)
def test_same_seed_same_sequence(logits, seed, temp):
    params = SamplingParams(temperature=temp, top_p=0.95, seed=seed)
    a, b = Sampler(params), Sampler(params)
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]


@pytest.mark.parametrize("temp,top_k", [(1.0, 0), (0.6, 0), (1.7, 3)])
def test_frequencies_follow_softmax(temp, top_k):
    logits = np.array([1.0, 0.2, -0.5, 0.8, -2.0])
    expected = softmax(logits / temp)
    if top_k:
        expected[np.argsort(-logits)[top_k:]] = 0
        expected /= expected.sum()
    sampler, draws = Sampler(SamplingParams(temperature=temp, top_k=top_k, seed=1234)), 20000
    counts = np.bincount([sampler(logits) for _ in range(draws)], minlength=logits.size)
    assert counts[expected == 0].sum() == 0
    nz = expected > 0
    chi2 = ((counts[nz] - draws * expected[nz]) ** 2 / (draws * expected[nz])).sum()
    assert chi2 < 20.5          # chi-square critical value for 4 degrees of freedom at p = 0.0004


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=1.0), dict(repetition_penalty=0), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-2.1), dict(presence_penalty=float("nan"))])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Sampler(SamplingParams(**bad))


def test_presence_and_frequency_penalties_count_only_the_answer():
    """OpenAI's rule on the ids this sampler produced: logit - presence - frequency * count; the
    history (the prompt) does not count."""
    logits = np.array([3.0, 2.9, 2.0, 0.0])
    sampler = Sampler(SamplingParams(presence_penalty=0.05, frequency_penalty=0.5))
    picks = [sampler(logits, history=[0, 0, 0, 1]) for _ in range(4)]
    # 0 first (3.0), then 1: 0's logit is down to 3.0 - 0.05 - 0.5 = 2.45 < 2.9
    assert picks[:2] == [0, 1] and sampler.counts == {i: picks.count(i) for i in set(picks)}
    expected = logits.copy()
    for i, n in sampler.counts.items():
        expected[i] -= 0.05 + 0.5 * n
    assert sampler(logits) == int(np.argmax(expected))


def test_the_allowed_mask_leaves_only_its_ids():
    logits = np.array([5.0, 1.0, 4.0, 3.0])
    allowed = np.array([False, True, False, True])
    assert Sampler(SamplingParams())(logits, allowed=allowed) == 3
    seeded = Sampler(SamplingParams(temperature=1.0, seed=3))
    assert {seeded(logits, allowed=allowed) for _ in range(200)} <= {1, 3}


PARAMS = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.6]),
                   top_k=st.sampled_from([0, 1, 3, 40]), top_p=st.sampled_from([1.0, 0.95, 0.5, 0.05]),
                   min_p=st.sampled_from([0.0, 0.05, 0.3]), repetition_penalty=st.sampled_from([1.0, 1.3]),
                   presence_penalty=st.sampled_from([0.0, 0.5]), frequency_penalty=st.sampled_from([0.0, 0.4]),
                   seed=st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(params=st.lists(PARAMS, min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1),
       vocab=st.sampled_from([7, 50, 300]), ties=st.booleans(), masks=st.booleans())
def test_rows_sampled_at_once_pick_what_each_sampler_picks(params, seed, vocab, ties, masks):
    """sample_rows (every row's filters at once, where the engine leaves the logits) picks, step
    after step, the ids each row's Sampler picks from its row: the same draws, the same counts
    for the answer's penalties, the same grammar masks (on some rows), ties and all."""
    from fuselm.runtime.sampling import sample_rows
    rng = np.random.default_rng(seed)
    one, many = [Sampler(p) for p in params], [Sampler(p) for p in params]
    history = [list(rng.integers(0, vocab, 5)) for _ in params]
    for _ in range(6):
        logits = rng.standard_normal((len(params), vocab)).astype(np.float32) * 3
        if ties:
            logits = np.round(logits)
        allowed = [rng.random(vocab) < 0.3 if masks and r % 2 == 0 else None for r in range(len(params))]
        for a in allowed:
            if a is not None:
                a[rng.integers(vocab)] = True
        want = [s(row, h, a) for s, row, h, a in zip(one, logits, history, allowed)]
        got = sample_rows(logits, [s.draw(h, a) for s, h, a in zip(many, history, allowed)])
        assert got.tolist() == want
        for s, h, t in zip(many, history, want):
            s.record(t)
            h.append(t)


@settings(max_examples=60, deadline=None)
@given(params=st.lists(PARAMS, min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1),
       vocab=st.sampled_from([7, 50, 300]), ties=st.booleans())
def test_rows_drawn_before_the_last_pick_is_known_count_it_in_their_penalties(params, seed, vocab, ties):
    """A draw made while the last pick is still on the engine (`pending`: neither in the history
    nor in the sampler's counts) picks, with that id as the row's `latest`, what the Sampler
    picks that knows it: presence, frequency and repetition penalties count it once."""
    from fuselm.runtime.sampling import sample_rows
    rng = np.random.default_rng(seed)
    one, many = [Sampler(p) for p in params], [Sampler(p) for p in params]
    history = [list(rng.integers(0, vocab, 5)) for _ in params]
    last = None
    for _ in range(8):
        logits = rng.standard_normal((len(params), vocab)).astype(np.float32) * 3
        if ties:
            logits = np.round(logits)
        want = [s(row, h) for s, row, h in zip(one, logits, history)]      # each knows every pick
        if last is None:
            got = sample_rows(logits, [s.draw(h) for s, h in zip(many, history)])
        else:   # the step before's picks still out: not in history[:-1], not recorded
            draws = [s.draw(h[:-1], pending=True) for s, h in zip(many, history)]
            for s, t in zip(many, last):
                s.record(t)
            got = sample_rows(logits, draws, latest=np.asarray(last))
        assert got.tolist() == want
        for h, t in zip(history, want):
            h.append(t)
        last = want
