"""tabfm.tree_io: the fitted trees to and from skops bytes, read back only as trusted types and only where every
node predict will follow stays inside its tree, its columns and its bitsets."""

import hashlib
import json
import os

import numpy as np
import pandas as pd
import pytest
import skops.io
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import FunctionTransformer

from tabfm import TabFMClassifier
from tabfm.preprocess import TablePreprocessor
from tabfm.tree_base import fit_trees
from tabfm.tree_io import TRUSTED_TREE_TYPES, tree_bytes, trees_from_bytes


def _trees(n_classes: int = 2, categorical: bool = False):
    rng = np.random.default_rng(1)
    X = pd.DataFrame(rng.normal(size=(200, 3)), columns=["a", "b", "c"])
    if categorical:
        X["c"] = rng.choice(["x", "y", "z"], 200)
    y = (X["a"] > 0).astype(np.int64).to_numpy() + (n_classes > 2) * (X["b"] > 0).to_numpy()
    pre = TablePreprocessor().fit(X)
    cells = pre.transform(X)
    return fit_trees(cells, y, n_classes, seed=0), cells


def _crafted(trees, change) -> bytes:
    """The trees' bytes after change(model) edits the loaded model (as one who can write the folder could)."""
    model = skops.io.loads(tree_bytes(trees), trusted=list(TRUSTED_TREE_TYPES))
    change(model)
    return skops.io.dumps(model)


@pytest.mark.parametrize("n_classes, categorical", [(2, False), (3, True)])
def test_trees_round_trip_through_bytes(n_classes, categorical):
    trees, cells = _trees(n_classes, categorical)
    back = trees_from_bytes(tree_bytes(trees), n_classes, cells.values.shape[1])
    np.testing.assert_array_equal(back.predict_proba(cells), trees.predict_proba(cells))


def test_other_types_other_models_and_garbled_bytes_are_refused():
    trees, cells = _trees()
    X, y = cells.values, np.arange(len(cells.values)) % 2
    with pytest.raises(ValueError, match=r"name types tabfm does not write \(posix.system\)"):
        trees_from_bytes(skops.io.dumps(FunctionTransformer(os.system)), 2, 3)
    with pytest.raises(ValueError, match="hold a LogisticRegression, not a HistGradientBoostingClassifier"):
        trees_from_bytes(skops.io.dumps(LogisticRegression().fit(X, y)), 2, 3)
    with pytest.raises(ValueError, match="not a HistGradientBoostingRegressor"):
        trees_from_bytes(tree_bytes(trees), None, 3)
    with pytest.raises(ValueError, match="not readable skops data"):
        trees_from_bytes(b"not a zip", 2, 3)
    with pytest.raises(ValueError, match="the file is empty"):
        trees_from_bytes(b"", 2, 3)


def _first_split(model):
    nodes = model._predictors[0][0].nodes
    return nodes, int(np.flatnonzero(nodes["is_leaf"] == 0)[0])


def _child_past_the_tree(model):
    nodes, i = _first_split(model)
    nodes["left"][i] = 10**8


def _child_before_its_parent(model):  # a loop: predict would walk forever
    nodes, i = _first_split(model)
    nodes["right"][i] = i


def _column_past_the_table(model):
    nodes, i = _first_split(model)
    nodes["feature_idx"][i] = 10**7


def _leaf_made_a_split(model):  # the fuzzer's crash: a leaf turned into a split pointing nowhere
    nodes = model._predictors[0][0].nodes
    nodes["is_leaf"][0], nodes["feature_idx"][0], nodes["left"][0], nodes["right"][0] = 0, 10**7, 10**8, 10**8


def _bitset_past_the_bitsets(model):
    nodes, i = _first_split(model)
    nodes["is_categorical"][i], nodes["bitset_idx"][i] = 1, 10**6


def _classes_past_the_estimators(model):
    model.classes_ = np.array([0, 7])


@pytest.mark.parametrize("change, message", [
    (_child_past_the_tree, "points outside its tree"), (_child_before_its_parent, "points outside its tree"),
    (_column_past_the_table, "outside its tree or its columns"), (_leaf_made_a_split, "outside its tree"),
    (_bitset_past_the_bitsets, "categorical split"), (_classes_past_the_estimators, "not class ids within 0..1")])
def test_trees_predict_could_not_walk_safely_are_refused(change, message):
    trees, cells = _trees()
    with pytest.raises(ValueError, match=message):
        trees_from_bytes(_crafted(trees, change), 2, 3)


def test_trees_of_another_column_count_are_refused():
    trees, cells = _trees()
    with pytest.raises(ValueError, match="read 3 columns, not the 5 columns"):
        trees_from_bytes(tree_bytes(trees), 2, 5)


def test_column_preprocessing_of_another_width_is_refused():
    """With categorical columns scikit-learn's trees hold their own column transformer; one that drops columns
    would let predict read past each row."""
    from sklearn.compose import ColumnTransformer

    trees, cells = _trees(3, categorical=True)

    def narrow(model):
        model._preprocessor = ColumnTransformer([("one", "passthrough", [0])]).fit(np.zeros((2, 3)))

    with pytest.raises(ValueError, match=r"preprocessing gives \(1, 1\) for one row of 3 columns"):
        trees_from_bytes(_crafted(trees, narrow), 3, 3)


def test_a_saved_estimator_with_crafted_trees_and_matching_digests_is_refused_at_load(tmp_path):
    """A fuzzer's finding: trees whose first node points past its tree, written with every digest recomputed
    (one who can write the folder can), loaded without a word and crashed the process at predict."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 5))
    y = (X[:, 0] > 0).astype(int)
    folder = tmp_path / "clf"
    clf = TabFMClassifier(n_estimators=4, local_context_rows=64, n_jobs=1, random_state=1).fit(X, y)
    assert clf.tree_weight_ > 0
    clf.save(folder)
    data = _crafted(clf.tree_model_, _leaf_made_a_split)
    (folder / "trees.skops").write_bytes(data)
    meta = json.loads((folder / "estimator.json").read_text())
    meta["trees"]["sha256"] = hashlib.sha256(data).hexdigest()
    text = json.dumps(meta, indent=1).encode()
    (folder / "estimator.json").write_bytes(text)
    with safe_open(str(folder / "arrays.safetensors"), "pt") as f:
        header = f.metadata()
    header["estimator_json_sha256"] = hashlib.sha256(text).hexdigest()
    save_file(load_file(str(folder / "arrays.safetensors")), str(folder / "arrays.safetensors"), metadata=header)
    with pytest.raises(ValueError, match="trees.skops is damaged: a node of theirs points outside its tree"):
        TabFMClassifier.load(folder)
