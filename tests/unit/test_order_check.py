"""The per-key order check of the end-to-end tests (tests.support.ordering.check_order) catches
what it is there to catch: a key's job first seen before an earlier one, the wrong key handed to
the consumer, a key split over queues; duplicates are counted, not failures."""

from __future__ import annotations

import uuid

import pytest

from tests.support import ordering

A, B, C, D = (uuid.UUID(int=n) for n in range(1, 5))
STAGED = {A: (10, "k1"), B: (11, "k1"), C: (12, "k2"), D: (13, None)}


def test_staging_order_per_key_passes_with_duplicates_counted() -> None:
    report = ordering.check_order(STAGED, {"q": [(C, "k2"), (A, "k1"), (D, None), (A, "k1"), (B, "k1")]})
    report.check()
    assert (report.keys, report.first_deliveries, report.duplicates) == (2, 4, 1)


def test_a_later_row_first_is_out_of_order_even_if_the_earlier_comes_again() -> None:
    report = ordering.check_order(STAGED, {"q": [(B, "k1"), (A, "k1"), (B, "k1")]})
    assert report.out_of_order == [f"k1: row 10 ({A}) came after row 11"]
    assert not report.late_copies
    with pytest.raises(AssertionError, match="per-key order broken"):
        report.check()


def test_the_wrong_key_and_a_key_over_two_queues_are_caught() -> None:
    wrong = ordering.check_order(STAGED, {"q": [(A, "k2"), (D, "k1")]})
    assert len(wrong.wrong_key) == 2
    split = ordering.check_order(STAGED, {"q1": [(A, "k1")], "q2": [(B, "k1")]})
    assert split.split_keys == ["k1: ['q1', 'q2']"]
    with pytest.raises(AssertionError, match="several queues"):
        split.check()


def test_a_copy_after_a_later_job_of_its_key_is_caught() -> None:
    report = ordering.check_order(STAGED, {"q": [(A, "k1"), (B, "k1"), (A, "k1")]})
    assert not report.out_of_order
    assert report.late_copies == [f"k1: a copy of row 10 ({A}) came after row 11"]
    with pytest.raises(AssertionError, match="a copy came after a later job"):
        report.check()
