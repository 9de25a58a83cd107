"""The interval arithmetic behind the GPU busy fraction and the idle gaps of a profiled run."""

from hypothesis import given
from hypothesis import strategies as st

from benchmarks.step_profile import busy_fraction, idle_gaps


def test_gaps_are_the_uncovered_stretches_between_overlapping_kernels():
    kernels = [(0.0, 4.0), (1.0, 2.0), (6.0, 7.0), (6.5, 9.0), (12.0, 13.0)]
    assert idle_gaps(kernels) == [(4.0, 2.0), (9.0, 3.0)]
    assert busy_fraction(kernels) == (13.0 - 5.0) / 13.0


def test_no_gap_where_kernels_touch_or_nest_or_come_unsorted():
    assert idle_gaps([(5.0, 8.0), (0.0, 5.0), (1.0, 9.0)]) == []
    assert busy_fraction([(5.0, 8.0), (0.0, 5.0)]) == 1.0
    assert idle_gaps([]) == [] and busy_fraction([]) == 0.0


intervals = st.lists(
    st.tuples(st.integers(0, 1000), st.integers(1, 50)).map(lambda p: (p[0], p[0] + p[1])),
    min_size=1,
    max_size=40,
)


@given(intervals)
def test_gaps_and_kernels_tile_the_span_exactly(kernels):
    gaps = idle_gaps(kernels)
    span = (min(s for s, _ in kernels), max(e for _, e in kernels))
    covered = {t for s, e in kernels for t in range(s, e)}
    idle = {t for s, length in gaps for t in range(s, s + length)}
    assert covered.isdisjoint(idle)
    assert covered | idle == set(range(*span))
    assert [g[0] for g in gaps] == sorted(g[0] for g in gaps)
