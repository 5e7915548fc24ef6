"""``observers.pick.first_least`` is ``argmin``'s answer: the first least value along a dimension,
a NaN counted least, on ties, infinities and either dimension."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from observers.pick import first_least

VALUES = st.sampled_from([0.0, 1.0, 2.0, -1.0, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 6),
    columns=st.integers(1, 40),
    data=st.data(),
    dim=st.sampled_from([0, 1, -1]),
    keepdim=st.booleans(),
)
def test_first_least_is_argmin(rows, columns, data, dim, keepdim):
    values = data.draw(st.lists(VALUES, min_size=rows * columns, max_size=rows * columns))
    errors = torch.tensor(values, dtype=torch.float32).reshape(rows, columns)
    assert torch.equal(first_least(errors, dim, keepdim), errors.argmin(dim=dim, keepdim=keepdim))


def test_first_least_keeps_the_first_of_a_tie():
    errors = torch.tensor([[3.0, 1.0], [1.0, 1.0], [1.0, 0.5]])
    assert first_least(errors, 0).tolist() == [1, 2]
    assert first_least(errors, 1).tolist() == [1, 0, 1]


def test_first_least_counts_nan_least_as_argmin_does():
    errors = torch.tensor([[1.0, float("nan"), 0.0]])
    assert first_least(errors, 1).tolist() == [1]
