"""tabfm.yeo_johnson against scikit-learn's PowerTransformer and scipy's likelihood: the same exponents where the
likelihood has one clear maximum, never a worse likelihood, the same transformed values and inverse."""

import warnings

import numpy as np
import pytest
from scipy import stats
from sklearn.preprocessing import PowerTransformer

from tabfm.yeo_johnson import YeoJohnson, fit_lambdas, row_subset, yeo_johnson

N = 400


def _columns(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"normal": rng.normal(size=N), "lognormal": rng.lognormal(size=N), "neg_lognormal": -rng.lognormal(size=N),
            "shifted_exponential": rng.exponential(size=N) - 1, "binary": rng.integers(0, 2, N).astype(float),
            "counts": rng.poisson(2, N).astype(float), "student_t2": rng.standard_t(2, size=N),
            "wide": rng.normal(size=N) * 100, "cubed_chi2": rng.chisquare(1, N) ** 3}


def _sklearn(X: np.ndarray) -> PowerTransformer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return PowerTransformer(method="yeo-johnson").fit(X)


@pytest.mark.parametrize("missing", [0.0, 0.2])
def test_exponents_transform_and_inverse_match_scikit_learn(missing):
    rng = np.random.default_rng(0)
    cols = _columns(rng)
    X = np.stack(list(cols.values()), 1)
    X[rng.random(X.shape) < missing] = np.nan
    ours, theirs = YeoJohnson().fit(X), _sklearn(X)
    np.testing.assert_allclose(ours.lambdas_, theirs.lambdas_, rtol=1e-6, atol=1e-6)
    for c, name in enumerate(cols):  # never a worse likelihood than scipy's search
        x = X[:, c][~np.isnan(X[:, c])]
        assert stats.yeojohnson_llf(ours.lambdas_[c], x) >= stats.yeojohnson_llf(theirs.lambdas_[c], x) - 1e-9, name
    Y = ours.transform(X)
    np.testing.assert_array_equal(np.isnan(Y), np.isnan(X))
    np.testing.assert_allclose(Y, theirs.transform(X), atol=1e-5)
    np.testing.assert_allclose(np.nanmean(Y, 0), 0, atol=1e-12)
    np.testing.assert_allclose(np.nanstd(Y, 0), 1, atol=1e-12)
    np.testing.assert_allclose(ours.inverse_transform(Y), X, rtol=1e-8, atol=1e-8)


def test_the_transform_is_scipys_at_any_exponent_including_zero_and_two():
    x = np.random.default_rng(1).normal(size=200) * 3
    for lmbda in (-3.0, -0.5, 0.0, 0.7, 1.0, 2.0, 2.5, 1e-14, 2 - 1e-14):
        np.testing.assert_allclose(yeo_johnson(x[:, None], np.array([lmbda]))[:, 0], stats.yeojohnson(x, lmbda),
                                   rtol=1e-12, atol=1e-12)


def test_columns_of_different_exponents_are_each_scipys_when_transformed_together():
    """The transform is built for all columns at once (masks, and log1p|x| patched in only in the columns whose
    exponent makes a power 0): each column still equals scipy's alone, NaN cells stay NaN."""
    rng = np.random.default_rng(5)
    lmbdas = np.array([-3.0, 0.0, 0.7, 2.0, 1e-14, 2 - 1e-14, 1.0])
    X = rng.normal(size=(120, len(lmbdas))) * 3
    X[rng.random(X.shape) < 0.1] = np.nan
    Y = yeo_johnson(X, lmbdas)
    np.testing.assert_array_equal(np.isnan(Y), np.isnan(X))
    for c, lmbda in enumerate(lmbdas):
        seen = ~np.isnan(X[:, c])
        np.testing.assert_allclose(Y[seen, c], stats.yeojohnson(X[seen, c], lmbda), rtol=1e-12, atol=1e-12)


def test_columns_without_two_distinct_values_keep_the_identity():
    X = np.c_[np.full(50, 3.0), np.full(50, np.nan), np.r_[1.0, np.full(49, np.nan)], np.linspace(-1, 2, 50)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from the empty and constant columns
        est = YeoJohnson().fit(X)
        Y = est.transform(X)
    np.testing.assert_array_equal(est.lambdas_[:3], 1.0)
    assert est.lambdas_[3] != 1.0
    np.testing.assert_array_equal(np.isnan(Y), np.isnan(X))
    np.testing.assert_array_equal(Y[:, 0], 0.0)  # constant: centred, not divided by a zero deviation


def test_the_exponent_is_the_best_of_the_whole_range():
    """Fitting looks at the whole exponent range before refining, so it cannot stop at a lesser local maximum:
    on mixtures of differently scaled normal and lognormal halves, no exponent of a scan of scipy's likelihood
    over [-10, 10] beats it."""
    rng = np.random.default_rng(2)
    X = np.stack([np.r_[rng.normal(size=30) * s, rng.lognormal(size=30) * t] for s, t in
                  rng.uniform(0.1, 5, size=(8, 2))], 1)
    lmbdas = fit_lambdas(X)
    scan = np.linspace(-10, 10, 401)
    for c in range(X.shape[1]):
        best = max(stats.yeojohnson_llf(lmbda, X[:, c]) for lmbda in scan)
        assert stats.yeojohnson_llf(lmbdas[c], X[:, c]) >= best - 1e-9


def test_refuses_a_different_number_of_columns():
    est = YeoJohnson().fit(np.random.default_rng(3).normal(size=(20, 2)))
    with pytest.raises(ValueError, match="fitted on 2 columns"):
        est.transform(np.zeros((5, 3)))


def test_fit_rows_searches_the_exponents_on_a_fixed_subset_and_standardises_on_every_row():
    """With fit_rows the exponents are the subset's (the same subset at every fit) and close to every row's, and the
    transform of every fit row still has mean 0 and deviation 1."""
    rng = np.random.default_rng(4)
    X = np.c_[rng.lognormal(size=3000), rng.exponential(size=3000) - 1, rng.normal(size=3000)]
    est = YeoJohnson(fit_rows=1000).fit(X)
    subset = row_subset(X, 1000)
    assert subset.shape == (1000, 3) and np.isin(subset[:, 0], X[:, 0]).all()
    np.testing.assert_array_equal(est.lambdas_, fit_lambdas(subset))
    np.testing.assert_array_equal(est.lambdas_, YeoJohnson(fit_rows=1000).fit(X).lambdas_)
    np.testing.assert_allclose(est.lambdas_, YeoJohnson().fit(X).lambdas_, atol=0.1)
    Y = est.transform(X)
    np.testing.assert_allclose(Y.mean(0), 0.0, atol=1e-12)
    np.testing.assert_allclose(Y.std(0), 1.0, rtol=1e-12)
    assert row_subset(X, 3000) is X


def test_row_subset_keeps_every_row_where_a_sparse_column_would_lose_its_values():
    X = np.c_[np.arange(2000.0), np.full(2000, np.nan), np.full(2000, np.nan)]
    X[7, 2] = 5.0  # one value: almost surely not among 100 drawn rows
    assert not (~np.isnan(X[np.sort(np.random.default_rng(0).choice(2000, 100, replace=False)), 2])).any()
    assert row_subset(X, 100) is X
    assert len(row_subset(X[:, :2], 100)) == 100  # a column with no value anywhere keeps none in any subset
