"""tabfm.predict_stream: rows re-cut into the estimator's chunks whatever the batches read, and data-parallel
predict on 2 gloo ranks: the one-process answer on rank 0, in order, and an input error on one rank raised on
both with its message (no rank left waiting)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from tabfm.predict_stream import outputs_of, predict_chunks, predict_data_parallel, rechunk


def test_rechunk_cuts_any_batches_into_the_same_chunks():
    frame = pl.DataFrame({"i": range(23)})
    for sizes in ([23], [7, 7, 7, 2], [1] * 23, [10, 0, 13]):
        starts = np.cumsum([0, *sizes])
        batches = [frame.slice(int(a), int(b - a)) for a, b in zip(starts[:-1], starts[1:], strict=True)]
        chunks = list(rechunk(batches, 8))
        assert [c.height for c in chunks] == [8, 8, 7]
        assert pl.concat(chunks)["i"].to_list() == list(range(23))


class _Rows:
    """A fake fitted classifier: the probability of class 'b' is the row's value; a negative value is refused."""

    classes_ = np.array(["a", "b"])
    batch_size = 4

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        if (X < 0).any():
            raise ValueError(f"row value {X[X < 0][0]} is negative")
        p = np.asarray(X, np.float64).reshape(-1)
        return np.stack([1 - p, p], 1)


def _split_rows(values: np.ndarray) -> tuple[list, str | None]:
    """Each rank's predict_chunks over chunks of 4 rows of `values`, and the error it raised (if any)."""
    import torch.distributed as dist

    chunks = [values[i:i + 4] for i in range(0, len(values), 4)]
    try:
        return list(predict_chunks(_Rows(), chunks, dist.group.WORLD)), None
    except ValueError as e:
        return [], str(e)


def test_chunks_split_over_two_ranks_come_back_in_order(ranks):
    values = np.linspace(0, 1, 18)  # 5 chunks: ranks 0, 1, 0, 1, 0
    (on_0, err_0), (on_1, err_1) = ranks(2).run(_split_rows, values)
    assert err_0 is None and err_1 is None
    assert on_1 == [None] * 5
    np.testing.assert_array_equal(np.concatenate(on_0), outputs_of(_Rows(), values))
    # rank 1's second chunk (rows 12..15) holds a bad row: both ranks stop with rank 1's message
    values[13] = -3.0
    (on_0, err_0), (on_1, err_1) = ranks(2).run(_split_rows, values)
    assert err_0 == err_1 == "row value -3.0 is negative"


def _fit_and_split(n_train: int) -> tuple[np.ndarray | None, np.ndarray]:
    """predict_data_parallel on this rank, and the same estimator's one-process outputs."""
    from tabfm.estimator import TabFMRegressor

    rng = np.random.default_rng(5)
    X = rng.normal(size=(n_train + 21, 3))
    y = X[:, 0] * 2 + np.sin(X[:, 1])
    reg = TabFMRegressor(n_estimators=1, dtype="float64", batch_size=4).fit(X[:n_train], y[:n_train])
    return predict_data_parallel(reg, X[n_train:]), outputs_of(reg, X[n_train:])


def test_data_parallel_predict_equals_one_process(ranks):
    (split, whole), (other, _) = ranks(2).run(_fit_and_split, 40)
    assert other is None and split.shape == (21, 1)
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-10)


def test_data_parallel_predict_without_a_process_group_is_the_plain_answer():
    est = _Rows()
    values = np.linspace(0, 1, 9)
    np.testing.assert_array_equal(predict_data_parallel(est, values), outputs_of(est, values))
    with pytest.raises(ValueError, match="negative"):
        predict_data_parallel(est, -values)
