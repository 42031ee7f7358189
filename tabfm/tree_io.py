"""The fitted trees (tabfm.tree_base.TreeModel) to and from bytes for a saved estimator, without pickle.

skops (a kept library for scikit-learn objects) writes scikit-learn's own objects as JSON and numpy arrays, and
rebuilds only the types it is told to trust: beyond its defaults, the three that HistGradientBoosting holds
(TRUSTED_TREE_TYPES), so no code runs that tabfm did not name. That is not enough for trees: scikit-learn's
compiled predict follows each node's child and column indices without checking them (skops leaves TreePredictor
untrusted for that reason), and a file with a node pointing past the array crashed the process at predict. So
every loaded model is checked against what predict will index before it is used (check_trees): its column count,
classes and loss, and every node's children, column and category bitset, a child always after its parent (so
no walk loops). Saved files are untrusted input, as checkpoints are.
"""

from __future__ import annotations

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

from tabfm.tree_base import TreeModel

TRUSTED_TREE_TYPES = ("functools.partial", "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
                      "sklearn.utils.validation.check_array")
"""The types beyond skops' own defaults that fitted HistGradientBoosting models hold, and all that trees_from_bytes
accepts."""


def tree_bytes(trees: TreeModel) -> bytes:
    """The fitted trees in skops' format (a zip of JSON and numpy arrays; no pickle)."""
    import skops.io

    return skops.io.dumps(trees.model)


def trees_from_bytes(data: bytes, n_classes: int | None, n_columns: int) -> TreeModel:
    """The trees tree_bytes wrote, for class ids 0..n_classes-1 or real targets (None), reading n_columns columns
    (tabfm.tree_base.tree_design); ValueError where the data is not skops', names a type outside
    TRUSTED_TREE_TYPES, or holds anything but trees predict can walk safely on such rows (check_trees)."""
    import skops.io

    if not data:
        raise ValueError("the file is empty")
    try:
        untrusted = sorted(set(skops.io.get_untrusted_types(data=data)) - set(TRUSTED_TREE_TYPES))
    except Exception as e:  # skops' and zipfile's own errors for a garbled file
        raise ValueError(f"they are not readable skops data ({type(e).__name__}: {e})") from None
    if untrusted:
        raise ValueError(f"they name types tabfm does not write ({', '.join(untrusted[:3])})")
    try:
        model = skops.io.loads(data, trusted=list(TRUSTED_TREE_TYPES))
    except Exception as e:
        raise ValueError(f"they are not readable skops data ({type(e).__name__}: {e})") from None
    check_trees(model, n_classes, n_columns)
    return TreeModel(model, n_classes)


def check_trees(model: object, n_classes: int | None, n_columns: int) -> None:
    """ValueError unless `model` is a fitted HistGradientBoosting model of the kind the estimator fits (classifier
    of class ids within 0..n_classes-1, or regressor) on n_columns columns, whose every node predict will follow
    stays inside its tree, its columns and its category bitsets."""
    from sklearn._loss.loss import HalfBinomialLoss, HalfMultinomialLoss, HalfSquaredError
    from sklearn.ensemble._hist_gradient_boosting.common import PREDICTOR_RECORD_DTYPE
    from sklearn.ensemble._hist_gradient_boosting.predictor import TreePredictor

    expected = HistGradientBoostingRegressor if n_classes is None else HistGradientBoostingClassifier
    if type(model) is not expected:
        raise ValueError(f"they hold a {type(model).__name__}, not a {expected.__name__}")
    fitted = ("_predictors", "_baseline_prediction", "n_trees_per_iteration_", "_bin_mapper", "_loss", "n_features_in_")
    if any(not hasattr(model, name) for name in fitted):
        raise ValueError("they hold a model that is not fitted")
    if model.n_features_in_ != n_columns:
        raise ValueError(f"they read {model.n_features_in_} columns, not the {n_columns} columns of this estimator's "
                         "cells")
    _check_preprocessing(model, n_columns)
    if n_classes is None:
        per_iteration, loss = 1, HalfSquaredError
    else:
        classes = np.asarray(model.classes_)
        if (classes.ndim != 1 or not np.issubdtype(classes.dtype, np.integer) or len(classes) < 1
                or classes.min() < 0 or classes.max() >= n_classes or (np.diff(classes) <= 0).any()):
            raise ValueError(f"their classes are not class ids within 0..{n_classes - 1}")
        per_iteration = 1 if len(classes) <= 2 else len(classes)
        loss = HalfBinomialLoss if per_iteration == 1 else HalfMultinomialLoss
    baseline = np.asarray(model._baseline_prediction)
    if model.n_trees_per_iteration_ != per_iteration or type(model._loss) is not loss or baseline.shape != (
            1, per_iteration):
        raise ValueError("their trees per round, loss or baseline do not match their classes")
    categorical = np.asarray(model._bin_mapper.is_categorical_)  # uint8 0 / 1 in scikit-learn
    if (categorical.shape != (n_columns,) or not np.isin(categorical, (0, 1)).all()
            or len(model._bin_mapper.bin_thresholds_) != n_columns):
        raise ValueError("their column binning does not match their columns")
    categorical = categorical.astype(bool)
    for trees in model._predictors:
        if len(trees) != per_iteration:
            raise ValueError("a round of theirs has the wrong number of trees")
        for tree in trees:
            if type(tree) is not TreePredictor:
                raise ValueError(f"they hold a {type(tree).__name__} among their trees")
            _check_nodes(tree, categorical, PREDICTOR_RECORD_DTYPE)


def _check_preprocessing(model: object, n_columns: int) -> None:
    """ValueError unless the model's own column preprocessing (scikit-learn's, where some columns are categorical:
    categories to ordinal codes, placed first) gives predict n_columns columns: the compiled walk reads a node's
    column without checking the row's width. A fitted transformer's width does not depend on its input, so one
    row tells."""
    pre = getattr(model, "_preprocessor", None)
    if pre is None:
        return
    try:
        width = np.asarray(pre.transform(np.zeros((1, n_columns)))).shape
    except Exception as e:
        raise ValueError(f"their column preprocessing does not run ({type(e).__name__}: {e})") from None
    if width != (1, n_columns):
        raise ValueError(f"their column preprocessing gives {width} for one row of {n_columns} columns")


def _check_nodes(tree: object, categorical: np.ndarray, record: np.dtype) -> None:
    """ValueError unless every split node of `tree` points to children after it within the tree, a column of the
    model's, and (a categorical split) a column binned as categories and a bitset row of the tree's."""
    nodes, bitsets = tree.nodes, np.asarray(tree.raw_left_cat_bitsets)
    if not isinstance(nodes, np.ndarray) or nodes.dtype != record or nodes.ndim != 1 or len(nodes) == 0:
        raise ValueError("a tree of theirs is not an array of scikit-learn's nodes")
    if (bitsets.dtype != np.uint32 or bitsets.ndim != 2 or bitsets.shape[1] != 8
            or np.asarray(tree.binned_left_cat_bitsets).shape != bitsets.shape):
        raise ValueError("a tree of theirs has malformed category bitsets")
    split = np.flatnonzero(nodes["is_leaf"] == 0)
    node = nodes[split]
    feature = node["feature_idx"]
    inside = ((node["left"] > split) & (node["left"] < len(nodes)) & (node["right"] > split)
              & (node["right"] < len(nodes)) & (feature >= 0) & (feature < len(categorical)))
    if not inside.all():
        raise ValueError("a node of theirs points outside its tree or its columns")
    is_cat = node["is_categorical"] != 0
    if not (categorical[feature[is_cat]].all() and (node["bitset_idx"][is_cat] < len(bitsets)).all()):
        raise ValueError("a categorical split of theirs points outside its bitsets or at a numeric column")
