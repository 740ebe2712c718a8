"""The synthetic traces: seeded, in order, at their shape's rate, clumps overdispersed."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.synthetic_traces import SHAPES, SLOS, generate


def _dispersion(arrivals: list[float], span_s: int) -> float:
    """Variance over mean of the per-second counts (1 for Poisson)."""
    counts = [0] * span_s
    for t in arrivals:
        counts[min(int(t), span_s - 1)] += 1
    return statistics.pvariance(counts) / statistics.fmean(counts)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_shape_is_seeded_ordered_and_at_its_rate(name):
    reqs = generate(name, seed=3, duration_s=600)
    assert reqs == generate(name, seed=3, duration_s=600)
    assert reqs != generate(name, seed=4, duration_s=600)
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= 600
    expected = sum(SHAPES[name].rate(t + 0.5) for t in range(600))
    assert len(reqs) == pytest.approx(expected, rel=0.1)
    cap = SHAPES[name].prompt[2]
    assert all(1 <= r.prompt_len <= cap and 1 <= r.output_len for r in reqs)
    assert name in SLOS


def test_clumps_are_overdispersed_and_the_flat_load_is_poisson():
    flat = [r.arrival_s for r in generate("flat", duration_s=600)]
    clumped = [r.arrival_s for r in generate("clumped", duration_s=600)]
    assert 0.8 < _dispersion(flat, 600) < 1.2
    assert _dispersion(clumped, 600) > 5


def test_a_shape_not_known_is_named_back():
    with pytest.raises(ValueError, match="unknown synthetic trace 'sawtooth'"):
        generate("sawtooth")
