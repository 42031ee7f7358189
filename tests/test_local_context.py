"""Local contexts (tabfm.local_context): how they are drawn and routed, and that an estimator using them predicts
each test row from its routed context exactly, independently of the other test rows, saved and loaded, and on a
tensor-parallel mesh as in one process."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from builders import mixed_frame

from tabfm.data.encode import IGNORE_LABEL
from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.local_context import (OVERLAP, ROUTE_NEIGHBOURS, SPACE_LIMIT, LocalContexts, _kmeans, column_relevance,
                                 padded_chunks)
from tabfm.preprocess import TablePreprocessor


def _cells(X):
    import pandas as pd

    frame = pd.DataFrame(X, columns=[f"x{i}" for i in range(X.shape[1])])
    return TablePreprocessor().fit(frame).transform(frame)


def test_each_member_gets_overlapping_contexts_that_hold_every_train_row():
    rng = np.random.default_rng(0)
    cells = _cells(rng.normal(size=(500, 3)))
    local = LocalContexts.fit(cells, np.ones((500, 1)), n_members=3, rows=64, rng=rng)
    per_member = math.ceil(OVERLAP * 500 / 64)
    assert local.rows.shape == (3 * per_member, 64)
    assert list(local.members) == [m for m in range(3) for _ in range(per_member)]  # consecutive per member
    assert all(len(np.unique(r)) == 64 and np.all(np.diff(r) > 0) for r in local.rows)  # sorted, no repeats
    assert local.home.shape == (3, 500)
    for m in range(3):
        assert np.all(local.members[local.home[m]] == m)
        # every train row is in its home context, so no row is lost to the model
        assert all(r in local.rows[local.home[m, r]] for r in range(500))
    assert not np.array_equal(local.rows[:per_member], local.rows[per_member:2 * per_member])  # own anchors


def test_the_first_members_leave_the_held_rows_out_of_every_context():
    rng = np.random.default_rng(1)
    cells = _cells(rng.normal(size=(400, 3)))
    held = np.sort(rng.choice(400, 80, replace=False))
    local = LocalContexts.fit(cells, np.ones((400, 1)), n_members=4, rows=64, rng=rng, held=held, held_members=2)
    for m in range(4):
        used = np.unique(local.rows[local.members == m])
        assert np.all(local.members[local.home[m]] == m)  # every row, held or not, has a home to route by
        if m < 2:
            assert not np.isin(held, used).any() and len(used) == 320  # every other row is in some context
            assert (local.members == m).sum() == math.ceil(OVERLAP * 320 / 64)  # anchors over the kept rows
        else:
            assert len(used) == 400
    with pytest.raises(ValueError, match="60 rows are left once the held rows are out: local contexts of 64"):
        LocalContexts.fit(cells, np.ones((400, 1)), n_members=4, rows=64, rng=rng, held=np.arange(340),
                          held_members=2)


def test_kmeans_puts_one_centre_in_each_separated_blob_and_follows_the_numpy_rng():
    rng = np.random.default_rng(4)
    offsets = np.array([[0, 0], [40, 0], [0, 40], [40, 40]], np.float32)
    blobs = torch.from_numpy(np.concatenate([rng.normal(size=(150, 2)).astype(np.float32) + o for o in offsets]))
    centres = _kmeans(blobs, 4, np.random.default_rng(0)).numpy()
    nearest_offset = np.linalg.norm(centres[:, None] - offsets[None], axis=2).argmin(1)
    assert sorted(nearest_offset) == [0, 1, 2, 3]                    # k-means++ spreads them, Lloyd centres them
    assert np.abs(centres - offsets[nearest_offset]).max() < 0.5
    again = _kmeans(blobs, 4, np.random.default_rng(0)).numpy()
    assert np.array_equal(centres, again)                             # the draws are the given rng's alone


def test_a_table_of_constant_columns_warns_nothing():
    cells = _cells(np.zeros((300, 2)))  # the preprocessor keeps one column without values in their place
    assert np.isnan(cells.values).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" reached users fitting such tables
        local = LocalContexts.fit(cells, np.ones((300, 1)), n_members=1, rows=64, rng=np.random.default_rng(5))
    assert np.all(local.points == 0) and local.rows.shape == (1, 64)  # one distinct point: one anchor


def test_rows_are_routed_to_contexts_of_their_own_neighbourhood():
    rng = np.random.default_rng(1)
    blobs = np.concatenate([rng.normal(size=(200, 2)), rng.normal(size=(200, 2)) + 50])  # far apart
    cells = _cells(blobs)
    local = LocalContexts.fit(cells, np.ones((400, 1)), n_members=2, rows=48, rng=rng)
    route = local.route(cells)  # the train rows themselves, as test rows
    far_side = np.arange(400) >= 200
    for m in range(2):
        in_far = (local.rows[route[m]] >= 200).all(1)
        in_near = (local.rows[route[m]] < 200).all(1)
        assert np.array_equal(in_far, far_side) and np.array_equal(in_near, ~far_side)


def test_columns_that_explain_the_target_weigh_most_in_the_distance():
    rng = np.random.default_rng(2)
    n = 600
    X = np.stack([rng.uniform(-3, 3, n), rng.normal(size=n) * 1000, rng.normal(size=n)], 1)
    y = np.sin(2 * X[:, 0]) + 0.1 * X[:, 2]           # not monotone in x0: a correlation would miss it
    cells = _cells(X)
    relevance = column_relevance(cells, ((y - y.mean()) / y.std())[:, None])
    assert relevance[0] > 0.9 and relevance[1] < 0.2  # noise explains only what its 16 bins fit by chance
    classes = (X[:, 0] > 0).astype(int)
    onehot = np.eye(2)[classes]
    assert column_relevance(cells, onehot)[0] > 0.9 > 0.2 > column_relevance(cells, onehot)[1]
    local = LocalContexts.fit(cells, ((y - y.mean()) / y.std())[:, None], n_members=1, rows=60, rng=rng)
    assert local.weight[0] == 1.0 and local.weight[1] < 0.2  # the noise column barely moves the neighbours
    spread = np.ptp(X[local.rows][..., 0], axis=1)        # each context is a narrow slice of x0
    assert np.median(spread) < 1.5
    flat = LocalContexts.fit(cells, np.ones((n, 1)), n_members=1, rows=60, rng=rng)
    assert np.all(flat.weight == 1.0)                     # nothing explains a constant target: equal weights


def test_padded_chunks_cover_every_routed_table_once_within_the_slack():
    counts = [10, 0, 9, 1, 5, 5, 40, 2]
    chunks = padded_chunks(counts)
    flat = np.concatenate(chunks)
    assert sorted(flat.tolist()) == [t for t, c in enumerate(counts) if c > 0]
    for chunk in chunks:
        real = sum(counts[t] for t in chunk)
        assert len(chunk) == 1 or len(chunk) * max(counts[t] for t in chunk) <= 1.5 * real


def _table(n, seed=0):
    df, y = mixed_frame(n, seed=seed)
    return df, y, df["x"].to_numpy() * 2 + (y == "yes") + df["noise"].to_numpy() / 100


@pytest.mark.parametrize("Est, mix", [(TabFMClassifier, False), (TabFMClassifier, True), (TabFMRegressor, False),
                                      (TabFMRegressor, True)])
def test_each_test_row_is_predicted_from_its_routed_contexts(Est, mix):
    """One member, float64: the estimator's output for a test row is the model run on the train rows of the
    context the row is routed to, followed by that row (no cache); with mix_contexts (the classifier's), where
    the row has a second context, the mixture of both contexts' class probabilities (the regressor's
    distributions, each in its context's bins) weighted by their votes."""
    df, y, target = _table(160, seed=3)
    labels = y if Est is TabFMClassifier else target
    kwargs = (dict(calibrate=False, linear_blend=False, mix_contexts=mix) if Est is TabFMClassifier
              else dict(linear_base=False, mix_contexts=mix))
    est = Est(n_estimators=1, local_context_rows=40, dtype="float64", **kwargs).fit(df[:120], labels[:120])
    assert est.local_ is not None and len(est.context_rows_) == math.ceil(OVERLAP * 120 / 40)
    test_cells = est._cells_of(df[120:])
    first, second, share = (a[0] for a in est.local_.routes(test_cells))
    np.testing.assert_array_equal(first, est.local_.route(test_cells)[0])
    assert 0 < (share > 0).sum() < 40  # rows near an edge and rows inside one context, both checked
    got = est.predict_proba(df[120:]) if Est is TabFMClassifier else est.predict(df[120:])
    model = est._model()

    def alone(i: int, u: int) -> torch.Tensor:
        """The model's logits of test row i after the train rows of context u."""
        train = est._unit_values(est.train_cells_, np.array([u]), est.context_rows_[[u]])
        row = est._unit_values(test_cells, np.array([u]), np.array([[i]]))
        parts = {k: torch.cat([train[k], row[k]], 1) if train[k].dim() == 3 else train[k] for k in train}
        y_ctx = est._member_labels(0, est.y_train_[est.context_rows_[u]])
        if Est is TabFMClassifier:
            lab = torch.cat([torch.from_numpy(y_ctx), torch.tensor([IGNORE_LABEL])])[None]
        else:
            lab = torch.cat([torch.from_numpy(y_ctx), torch.zeros(1, dtype=torch.float64)])[None]
        batch = est._batch(parts, lab, 40, est._n_outputs())
        with torch.no_grad():
            return model(batch)[0, -1].double()

    for i in range(40):  # every row: rows of one padded group come from contexts in any order
        u = int(first[i])
        if Est is TabFMClassifier:
            want = alone(i, u)[:est.n_groups_].softmax(-1).numpy()
            if mix and share[i] > 0:
                assert second[i] != u
                other = alone(i, int(second[i]))[:est.n_groups_].softmax(-1).numpy()
                want = (1 - share[i]) * want + share[i] * other
            np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-10)
        else:
            want = alone(i, u).softmax(-1).numpy() @ est.bin_points_y_[u].mean(-1)
            if mix and share[i] > 0:
                v = int(second[i])
                other = alone(i, v).softmax(-1).numpy() @ est.bin_points_y_[v].mean(-1)
                want = (1 - share[i]) * want + share[i] * other
            np.testing.assert_allclose(got[i], want, rtol=1e-10, atol=1e-10)


def test_a_row_is_shared_between_two_contexts_by_their_votes():
    """routes: the first context is home to most of a row's ROUTE_NEIGHBOURS nearest train rows, the second to
    the next most, and the second's share is its part of the two's votes (0, second = first, for a row whose
    neighbours all live in one context)."""
    rng = np.random.default_rng(3)
    cells = _cells(rng.normal(size=(500, 2)))
    local = LocalContexts.fit(cells, np.ones((500, 1)), n_members=2, rows=64, rng=rng)
    test = _cells(rng.normal(size=(300, 2)))
    first, second, share = local.routes(test)
    near = torch.cdist(torch.from_numpy(local.space(test)).double(),
                       torch.from_numpy(local.points).double()).topk(ROUTE_NEIGHBOURS, largest=False).indices.numpy()
    for m in range(2):
        homes = local.home[m][near]  # [300, k] the home context of each neighbour
        votes = np.stack([(homes == u).sum(1) for u in range(len(local.rows))], 1)
        top = votes.max(1)
        assert np.array_equal(votes[np.arange(300), first[m]], top)
        one = share[m] == 0
        assert np.array_equal(one, (votes > 0).sum(1) == 1) and np.array_equal(second[m][one], first[m][one])
        runner_up = np.sort(votes, 1)[:, -2]
        assert np.array_equal(votes[np.arange(300), second[m]][~one], runner_up[~one])
        np.testing.assert_allclose(share[m], runner_up / (top + runner_up), atol=4e-3)  # tie weights: within 1.5%
        assert (share[m] <= 0.5 + 1e-3).all() and 0.1 < one.mean() < 0.9
    assert (local.members[first] == np.arange(2)[:, None]).all()  # each member's own contexts
    assert (local.members[second] == np.arange(2)[:, None]).all()


@pytest.mark.parametrize("Est", [TabFMClassifier, TabFMRegressor])
def test_local_predictions_do_not_depend_on_the_other_test_rows(Est):
    df, y, target = _table(200, seed=5)
    labels = y if Est is TabFMClassifier else target
    est = Est(n_estimators=3, local_context_rows=50, dtype="float64").fit(df[:150], labels[:150])
    predict = est.predict_proba if Est is TabFMClassifier else est.predict
    whole = predict(df[150:])
    perm = np.random.default_rng(0).permutation(50)
    np.testing.assert_allclose(predict(df[150:].iloc[perm]), whole[perm], rtol=1e-12, atol=1e-12)
    est.set_params(batch_size=3)  # other batches, other padded groups
    np.testing.assert_allclose(predict(df[150:]), whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(predict(df[150:].iloc[[7]])[0], whole[7], rtol=1e-12, atol=1e-12)
    if Est is TabFMRegressor:
        q = est.predict_quantiles(df[150:], [0.1, 0.5, 0.9])
        assert np.all(np.diff(q, axis=1) >= 0) and np.isfinite(q).all()


def test_small_tables_keep_one_context_per_member():
    df, y, _ = _table(120)
    clf = TabFMClassifier(n_estimators=2).fit(df[:100], y[:100])  # 100 <= 256 train rows
    assert clf.local_ is None and clf.context_rows_.shape == (2, 100)
    assert list(clf.context_members_) == [0, 1]
    with pytest.raises(ValueError, match="local_context_rows"):
        TabFMClassifier(local_context_rows=1).fit(df[:100], y[:100])


def test_saved_estimator_with_local_contexts_predicts_the_same(tmp_path):
    df, y, target = _table(200, seed=6)
    for est, X_fit in ((TabFMClassifier(n_estimators=2, local_context_rows=60).fit(df[:150], y[:150]), df),
                       (TabFMClassifier(n_estimators=2, local_context_rows=60, mix_contexts=True)
                        .fit(df[:150], y[:150]), df),
                       (TabFMRegressor(n_estimators=2, local_context_rows=60).fit(df[:150], target[:150]), df)):
        path = tmp_path / f"{type(est).__name__}{len(list(tmp_path.iterdir()))}"
        est.save(path)
        loaded = type(est).load(path)
        assert loaded.local_ is not None and loaded.get_params() == est.get_params()
        if isinstance(est, TabFMClassifier):
            np.testing.assert_array_equal(loaded.predict_proba(X_fit[150:]), est.predict_proba(X_fit[150:]))
        else:
            np.testing.assert_array_equal(loaded.predict(X_fit[150:]), est.predict(X_fit[150:]))
            np.testing.assert_array_equal(loaded.predict_quantiles(X_fit[150:]), est.predict_quantiles(X_fit[150:]))


def _sharded_local(tp: tuple[int, int] | None, sp: bool) -> tuple[np.ndarray, np.ndarray]:
    """Local contexts' classifier probabilities and regressor predictions with tensor_parallel=tp (None: one
    process); 4 members, so both calibrate from the first two members' held rows (tabfm.calibration)."""
    df, y, target = _table(150, seed=2)
    kwargs = dict(n_estimators=4, dtype="float64", batch_size=16, local_context_rows=40, tensor_parallel=tp,
                  sequence_parallel=sp)
    clf = TabFMClassifier(**kwargs).fit(df[:110], y[:110])
    reg = TabFMRegressor(**kwargs).fit(df[:110], target[:110])
    assert reg._held_rows(110, 4, reg._calibration_rng())[1] == 2 and clf._held_members(4, 88) == 2
    return np.append(clf.predict_proba(df[110:]), clf.temperature_), np.append(reg.predict(df[110:]),
                                                                                reg.correction_weight_)


@pytest.mark.parametrize("world,d0,d1,sp", [(2, 2, 1, True), (4, 2, 2, False)])
def test_sharded_local_contexts_equal_one_process(ranks, world, d0, d1, sp):
    # the one-process reference here, once, while the ranks work
    (clf, reg), results = ranks(world).submit(_sharded_local, (d0, d1), sp).beside(lambda: _sharded_local(None, sp))
    for tp_clf, tp_reg in results:
        np.testing.assert_allclose(tp_clf, clf, rtol=0, atol=1e-10)
        np.testing.assert_allclose(tp_reg, reg, rtol=1e-10, atol=1e-10)


def test_values_near_float64_s_limit_are_routed_to_their_edge_without_warnings():
    """1e308 overflows the distance space's division: it sits at SPACE_LIMIT deviations, so the row goes to the
    context of the largest train rows of its column (it went to the centre's, as a missing cell does, with
    overflow warnings)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 2))
    clf = TabFMClassifier(n_estimators=2, n_jobs=1).fit(X, (X[:, 0] > 0).astype(int))
    test = np.array([[1e308, 0.0], [-1e308, 0.0], [50.0, 0.0], [-50.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow; only the warning that these values are far out, as meant
        warnings.filterwarnings("ignore", "numeric columns hold mostly values over 10 times", UserWarning)
        cells = clf.preprocessor_.transform(test)
        space = clf.local_.space(cells)
        proba = clf.predict_proba(test)
    assert np.isfinite(space).all() and abs(space[0, 0]) <= SPACE_LIMIT and space[0, 0] > 0 > space[1, 0]
    route = clf.local_.route(cells)
    np.testing.assert_array_equal(route[:, 0], route[:, 2])  # with the largest rows, as 50 deviations is
    np.testing.assert_array_equal(route[:, 1], route[:, 3])
    assert proba[0, 1] > 0.9 and proba[1, 0] > 0.9


@pytest.mark.parametrize("mix", [True, False])
def test_the_speed_benchmarks_no_cache_reference_predicts_as_the_estimator(mix):
    """benchmarks/inference.py checks its timings' estimator against full forwards without the cache; that
    reference must route and mix as predict_proba does (float64: to 1e-10), or its max|dp| column means nothing."""
    from builders import benchmark_module

    bench = benchmark_module("inference")
    X, y, X_test, _ = bench.make_data(300, 40, features=4)
    est = TabFMClassifier(n_estimators=2, local_context_rows=64, dtype="float64", n_jobs=1,
                          mix_contexts=mix).fit(X, y)
    assert (est.local_.routes(est._cells_of(X_test))[2] > 0).any()  # some rows do mix
    np.testing.assert_allclose(bench.full_forward_proba(est, X_test), est.predict_proba(X_test), rtol=0, atol=1e-10)
