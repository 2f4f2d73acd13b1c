"""families.observe_all: a batch's delays observed with each bucket incremented once, the counts
those of observing them one by one (a backlog observed 500 delays a step, 2 us each)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from drain.observability import families

bounds = st.sampled_from(families.DELAY_BUCKETS)
amounts = st.lists(
    bounds | st.floats(allow_nan=True, allow_infinity=True) | st.floats(min_value=0, max_value=4000),
    max_size=30,
)


def samples(histogram: Histogram) -> list[tuple[str, dict[str, str], float]]:
    family = histogram.collect()[0]
    return [(s.name, s.labels, s.value) for s in family.samples if not s.name.endswith("_created")]


@given(amounts)
def test_the_buckets_are_those_of_observing_each(values: list[float]) -> None:
    one_by_one = Histogram("one", "d", buckets=families.DELAY_BUCKETS, registry=CollectorRegistry())
    batched = Histogram("all", "d", buckets=families.DELAY_BUCKETS, registry=CollectorRegistry())
    for value in values:
        one_by_one.observe(value)
    families.observe_all(batched, values)
    for (name, labels, want), (_, got_labels, got) in zip(samples(one_by_one), samples(batched), strict=True):
        assert got_labels == labels
        if name.endswith("_sum"):  # the batch's sum added once: equal to the rounding
            both_nan = math.isnan(got) and math.isnan(want)
            assert got == want or math.isclose(got, want, rel_tol=1e-9) or both_nan
        else:
            assert got == want, (name, labels)
