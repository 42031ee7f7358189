"""Saving a fitted estimator (tabfm.persist): loaded back it predicts exactly as before without re-encoding its train
rows, damaged or foreign files are refused with one clear ValueError, and pickling still works."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.exceptions import NotFittedError

from tabfm import estimator as estimator_module
from tabfm.estimator import TabFMClassifier, TabFMRegressor
from tabfm.estimator_model import DEFAULT_CHECKPOINT
from tabfm.persist import ARRAYS_FILE, FORMAT_VERSION, JSON_DIGEST, META_FILE, _Decoder, _Encoder
from tabfm.validation import torch_threads


def table(n: int, seed: int = 0) -> pd.DataFrame:
    """Two numeric columns (one with a missing cell) and a string-categorical one."""
    rng = np.random.default_rng(seed)
    df = pd.DataFrame({"x": rng.normal(size=n), "colour": rng.choice(["red", "green", "blue"], n),
                       "z": rng.normal(size=n) * 10})
    df.loc[3, "x"] = np.nan
    return df


def no_encoding(monkeypatch) -> None:
    """Make any encoding of train rows fail: a loaded estimator must predict from its saved caches."""
    def refuse(*args, **kwargs):
        raise AssertionError("the train rows were encoded again")
    monkeypatch.setattr(estimator_module, "encode_context", refuse)


def assert_same(a: np.ndarray, b: np.ndarray, dtype: str) -> None:
    if dtype == "float64":
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    else:
        np.testing.assert_array_equal(a, b)


def fit_classifier(dtype: str) -> tuple[TabFMClassifier, pd.DataFrame]:
    """A classifier of string labels fitted on 60 rows, and 20 test rows."""
    X = table(80)
    y = np.where(X["x"].fillna(0) + (X["colour"] == "red") > 0.3, "yes", "no")
    return TabFMClassifier(n_estimators=2, calibrate=False, dtype=dtype).fit(X[:60], y[:60]), X[60:]


@pytest.fixture(scope="module")
def fitted_classifier():
    return fit_classifier("float32")


@pytest.fixture(scope="module")
def saved_classifier(fitted_classifier, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "clf"
    fitted_classifier[0].save(path)
    return path


@pytest.fixture
def copy_of(saved_classifier, tmp_path) -> Path:
    """A copy of the saved classifier that a test may damage."""
    return Path(shutil.copytree(saved_classifier, tmp_path / "copy"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_classifier_round_trip_predicts_the_same_without_encoding(dtype, fitted_classifier, tmp_path, monkeypatch):
    clf, X_test = fitted_classifier if dtype == "float32" else fit_classifier(dtype)
    clf.save(tmp_path / "clf")
    no_encoding(monkeypatch)
    loaded = TabFMClassifier.load(tmp_path / "clf")
    assert "model_" not in json.loads((tmp_path / "clf" / META_FILE).read_text())["attributes"]["fields"]
    assert next(loaded.model_.parameters()).dtype == getattr(torch, dtype)  # rebuilt from the checkpoint at load
    assert_same(loaded.predict_proba(X_test), clf.predict_proba(X_test), dtype)
    assert (loaded.predict(X_test) == clf.predict(X_test)).all()
    assert loaded.classes_.dtype == clf.classes_.dtype and loaded.get_params() == clf.get_params()
    assert loaded.contexts_[0][1].caches[0].k.dtype == clf.contexts_[0][1].caches[0].k.dtype


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_regressor_round_trip_predicts_the_same_without_encoding(dtype, tmp_path, monkeypatch):
    X = table(70, seed=1)
    y = np.exp(X["z"].to_numpy() / 10) + (X["colour"] == "blue")
    reg = TabFMRegressor(n_estimators=2, dtype=dtype, numeric_transforms=("robust", "quantile"),
                         target_transforms=("quantile", "power")).fit(X[:50], y[:50])
    reg.save(tmp_path / "reg")
    no_encoding(monkeypatch)
    loaded = TabFMRegressor.load(tmp_path / "reg")
    assert_same(loaded.predict(X[50:]), reg.predict(X[50:]), dtype)
    assert_same(loaded.predict_quantiles(X[50:], (0.1, 0.5, 0.9)), reg.predict_quantiles(X[50:], (0.1, 0.5, 0.9)),
                dtype)


def test_more_classes_than_the_head_round_trip(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    X = rng.normal(size=(90, 3))
    y = rng.integers(0, 12, 90)  # 12 integer classes > 10: error-correcting codes over more members
    clf = TabFMClassifier(n_estimators=2, calibrate=False).fit(X[:70], y[:70])
    assert clf.n_members_ > 2
    clf.save(tmp_path / "many")
    no_encoding(monkeypatch)
    loaded = TabFMClassifier.load(tmp_path / "many")
    np.testing.assert_array_equal(loaded.predict_proba(X[70:]), clf.predict_proba(X[70:]))
    assert loaded.classes_.dtype == clf.classes_.dtype and (loaded.class_codes_ == clf.class_codes_).all()


@pytest.mark.parametrize("values", [np.array(["b", "a"]), np.array(["b", "a"], dtype=object), np.array([3, 1]),
                                    np.array([0.5, -2.0]), np.array([True, False]),
                                    np.array(["2020-01-01", "2021-06-01"], dtype="datetime64[D]")])
def test_class_label_arrays_keep_their_dtype(values):
    encoder = _Encoder()
    node = json.loads(json.dumps(encoder.encode(values, "classes_")))  # through JSON text, as on disk
    back = _Decoder(encoder.arrays, torch.device("cpu")).decode(node)
    assert back.dtype == values.dtype and (back == values).all()


def test_estimators_pickled_before_the_classifier_moved_still_load(fitted_classifier):
    """TabFMClassifier moved from tabfm.estimator to tabfm.classifier; a pickle names its class by module path, so
    one written before the move (naming tabfm.estimator) must still find it, with its fitted state."""
    clf, X_test = fitted_classifier
    old_name = pickle.dumps(TabFMClassifier, protocol=0).replace(b"tabfm.classifier", b"tabfm.estimator")
    assert b"tabfm.estimator" in old_name and pickle.loads(old_name) is TabFMClassifier
    state = pickle.dumps(clf, protocol=0)
    assert b"ctabfm.classifier\nTabFMClassifier" in state
    old = pickle.loads(state.replace(b"ctabfm.classifier\nTabFMClassifier", b"ctabfm.estimator\nTabFMClassifier"))
    np.testing.assert_array_equal(old.predict_proba(X_test), clf.predict_proba(X_test))


def test_pickling_still_works_and_an_unpickled_estimator_saves_its_caches(fitted_classifier, tmp_path,
                                                                            monkeypatch):
    clf, X_test = fitted_classifier
    restored = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(restored.predict_proba(X_test), clf.predict_proba(X_test))
    again = pickle.loads(pickle.dumps(restored))
    again.save(tmp_path / "from_pickle")  # contexts_ is None after unpickling: encoded once, at save
    loaded = TabFMClassifier.load(tmp_path / "from_pickle")
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(loaded)).predict_proba(X_test), clf.predict_proba(X_test))
    no_encoding(monkeypatch)
    np.testing.assert_array_equal(loaded.predict_proba(X_test), clf.predict_proba(X_test))


def _write_json(path: Path, text: str, seal: bool = True) -> None:
    """Write a saved estimator's JSON as a writer of such a file would: with its SHA-256 in the arrays file's header
    (`seal`), or without one, as tabfm wrote before the digests."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    (path / META_FILE).write_text(text)
    arrays_file = str(path / ARRAYS_FILE)
    with safe_open(arrays_file, framework="pt") as f:
        header = dict(f.metadata() or {})
    header.pop(JSON_DIGEST, None)
    if seal:
        header[JSON_DIGEST] = hashlib.sha256(text.encode()).hexdigest()
    save_file(load_file(arrays_file), arrays_file, metadata=header)


def _edit_json(path: Path, edit, seal: bool = True) -> None:
    meta = json.loads((path / META_FILE).read_text())
    edit(meta)
    _write_json(path, json.dumps(meta), seal)


def test_another_format_version_is_refused(copy_of):
    _edit_json(copy_of, lambda meta: meta.update(format_version=FORMAT_VERSION + 98))
    with pytest.raises(ValueError, match=f"format version {FORMAT_VERSION + 98} .* reads version {FORMAT_VERSION}"):
        TabFMClassifier.load(copy_of)


def test_bf16_estimator_round_trips_its_precision_and_bfloat16_caches(tmp_path, monkeypatch):
    X = table(80)
    y = np.where(X["x"].fillna(0) + (X["colour"] == "red") > 0.3, "yes", "no")
    clf = TabFMClassifier(n_estimators=1, calibrate=False, precision="bf16").fit(X[:60], y[:60])
    clf.save(tmp_path / "bf16")
    meta = json.loads((tmp_path / "bf16" / META_FILE).read_text())
    assert meta["format_version"] == FORMAT_VERSION == 3 and meta["params"]["fields"]["precision"] == "bf16"
    no_encoding(monkeypatch)
    loaded = TabFMClassifier.load(tmp_path / "bf16")
    assert (loaded.precision, loaded.precision_) == ("bf16", "bf16")
    assert loaded.contexts_[0][1].caches[0].k.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model_.parameters()} == {torch.float32}
    np.testing.assert_array_equal(loaded.predict_proba(X[60:]), clf.predict_proba(X[60:]))


def _as_version_2(meta: dict) -> None:
    """What tabfm wrote before precision existed: format version 2, no precision parameter or attribute (and no
    digests: _edit_json(..., seal=False))."""
    meta["format_version"] = 2
    del meta["params"]["fields"]["precision"], meta["attributes"]["fields"]["precision_"]
    for entry in meta["arrays"].values():
        del entry["sha256"]


def test_version_2_files_load_as_fp32(copy_of, fitted_classifier, monkeypatch):
    _edit_json(copy_of, _as_version_2, seal=False)
    no_encoding(monkeypatch)
    loaded = TabFMClassifier.load(copy_of)
    assert (loaded.precision, loaded.precision_) == ("fp32", "fp32")
    clf, X_test = fitted_classifier
    np.testing.assert_array_equal(loaded.predict_proba(X_test), clf.predict_proba(X_test))


def test_version_2_files_of_bfloat16_weights_are_refused(copy_of):
    _edit_json(copy_of, lambda meta: (_as_version_2(meta), meta["params"]["fields"].update(dtype="bfloat16")),
               seal=False)
    with pytest.raises(ValueError, match="fitted with dtype='bfloat16' .* fit it again with precision='bf16'"):
        TabFMClassifier.load(copy_of)


def test_a_classifier_is_not_loaded_as_a_regressor(saved_classifier):
    with pytest.raises(ValueError, match="holds a TabFMClassifier, not a TabFMRegressor"):
        TabFMRegressor.load(saved_classifier)


def test_a_missing_or_damaged_arrays_file_is_refused(copy_of):
    arrays = copy_of / ARRAYS_FILE
    blob = arrays.read_bytes()
    arrays.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        TabFMClassifier.load(copy_of)
    arrays.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        TabFMClassifier.load(copy_of)
    arrays.unlink()
    with pytest.raises(ValueError, match=f"{ARRAYS_FILE} is missing"):
        TabFMClassifier.load(copy_of)


def test_a_saved_estimator_missing_a_file_is_called_damaged_not_foreign(copy_of):
    """An audit's finding: a saved estimator whose arrays file was lost was called 'not a saved estimator' and the
    user told to save one, as for a folder that never held one."""
    (copy_of / ARRAYS_FILE).unlink()
    with pytest.raises(ValueError) as e:
        TabFMClassifier.load(copy_of)
    assert str(e.value) == f"{str(copy_of)!r} is a damaged saved estimator: {ARRAYS_FILE} is missing; save the " \
                           "estimator again"
    (copy_of / META_FILE).unlink()  # no JSON: nothing says it was one
    with pytest.raises(ValueError, match=f"is not a saved estimator: {META_FILE} is missing"):
        TabFMClassifier.load(copy_of)


def test_a_flipped_bit_in_an_array_or_an_edit_of_the_json_is_refused(copy_of, saved_classifier):
    """A bit flipped in an array's data (the preprocessor's column peaks) loaded and moved predictions; the arrays'
    and the JSON's SHA-256 now refuse it, and the intact copy still loads."""
    from safetensors import safe_open

    arrays = copy_of / ARRAYS_FILE
    blob = bytearray(arrays.read_bytes())
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + header_len])
    name = next(k for k in header if k.startswith("preprocessor_.peak_"))
    start = 8 + header_len + header[name]["data_offsets"][0]
    blob[start + 6] ^= 0x10  # an exponent bit of the first float64
    arrays.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=f"array '{name}' .* does not have the SHA-256"):
        TabFMClassifier.load(copy_of)
    shutil.copy(saved_classifier / ARRAYS_FILE, arrays)
    text = (copy_of / META_FILE).read_text()
    (copy_of / META_FILE).write_text(text.replace('"temperature_": ', '"temperature_":  ', 1))  # same meaning
    with pytest.raises(ValueError, match=f"{META_FILE} .* is not the file saved with {ARRAYS_FILE}"):
        TabFMClassifier.load(copy_of)
    with safe_open(str(saved_classifier / ARRAYS_FILE), framework="pt") as f:
        assert f.metadata()[JSON_DIGEST] == hashlib.sha256((saved_classifier / META_FILE).read_bytes()).hexdigest()
    TabFMClassifier.load(saved_classifier)


@pytest.mark.parametrize("tensor", [torch.zeros(0, dtype=torch.int64).expand(0),
                                    torch.arange(2.0)[:, None].expand(2, 3), torch.ones(1).expand(1),
                                    torch.arange(4, dtype=torch.bfloat16), torch.tensor(3)])
def test_digests_read_the_bytes_safetensors_writes_whatever_the_strides(tensor):
    """An empty tensor of stride 0 (a fitted estimator at 1,000 rows holds one) could not be viewed as bytes."""
    from tabfm.persist import _digest

    laid_out = tensor.contiguous().clone()
    assert _digest(tensor) == _digest(laid_out) == hashlib.sha256(laid_out.reshape(-1).view(torch.uint8).numpy()
                                                                    .tobytes()).hexdigest()


def test_save_through_a_link_replaces_its_target_and_a_file_in_the_way_is_one_line(fitted_classifier, tmp_path):
    """Saving through a link to a saved estimator replaced the link by a folder and left '.link.old-PID' behind;
    a file where a parent folder should be raised a bare FileExistsError."""
    clf, X_test = fitted_classifier
    clf.save(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    clf.save(tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    np.testing.assert_array_equal(TabFMClassifier.load(tmp_path / "link").predict_proba(X_test),
                                  clf.predict_proba(X_test))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="cannot save to .*a_file/m'.*choose a path"):
        clf.save(tmp_path / "a_file" / "m")
    assert (tmp_path / "a_file").read_text() == "x"


@pytest.mark.parametrize("edit, message", [
    (lambda meta: meta["params"]["fields"].update(n_estimators="abc"), "'n_estimators' parameter"),
    (lambda meta: meta["attributes"]["fields"].update(device_={"kind": "device", "value": "xyz"}), "is damaged"),
    (lambda meta: meta["attributes"]["fields"].update(tree_weight_=2.0), r"tree_weight_ = 2.0, which no fit gives"),
    (lambda meta: meta["attributes"]["fields"].update(temperature_="x"), r"temperature_ = 'x', which no fit gives"),
])
def test_parameters_and_devices_a_fit_would_refuse_are_refused_at_load(copy_of, edit, message):
    """Found by a hunt over damaged folders: n_estimators='abc' loaded and predicted, a device 'xyz' raised torch's
    own RuntimeError (both in a JSON whose digest was written to match)."""
    _edit_json(copy_of, edit)
    with pytest.raises(ValueError, match=f"cannot load .*{message}") as e:
        TabFMClassifier.load(copy_of)
    assert "\n" not in str(e.value)


def test_an_array_parameter_saves_as_a_list(tmp_path):
    """categorical_features=np.array([...]) fitted, but save refused the parameter."""
    X = table(60)
    clf = TabFMClassifier(n_estimators=1, categorical_features=np.array(["colour"])).fit(X, np.arange(60) % 2)
    clf.save(tmp_path / "m")
    loaded = TabFMClassifier.load(tmp_path / "m")
    assert loaded.categorical_features == ["colour"]
    np.testing.assert_array_equal(loaded.predict_proba(X), clf.predict_proba(X))


def test_torch_device_and_dtype_parameters_save_as_their_names(tmp_path):
    X = table(60)
    clf = TabFMClassifier(n_estimators=1, device=torch.device("cpu"), dtype=torch.float64).fit(X, np.arange(60) % 2)
    clf.save(tmp_path / "m")
    loaded = TabFMClassifier.load(tmp_path / "m")
    assert (loaded.device, loaded.dtype) == ("cpu", "float64")
    np.testing.assert_array_equal(loaded.predict_proba(X), clf.predict_proba(X))


def test_a_json_nested_past_python_s_recursion_limit_is_refused_in_one_line(copy_of):
    _write_json(copy_of, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nests too deeply"):
        TabFMClassifier.load(copy_of)


def test_arrays_that_do_not_match_the_json_are_refused(copy_of):
    _edit_json(copy_of, lambda meta: meta["arrays"]["context_rows_"].update(shape=[2, 7]))
    with pytest.raises(ValueError, match="array 'context_rows_' .* says int64 \\[2, 7\\]"):
        TabFMClassifier.load(copy_of)


def test_an_unknown_transformer_class_is_refused(copy_of):
    text = (copy_of / META_FILE).read_text()
    assert '"sklearn.preprocessing.StandardScaler"' in text
    _write_json(copy_of, text.replace('"sklearn.preprocessing.StandardScaler"',
                                      '"sklearn.preprocessing.FunctionTransformer"'))
    with pytest.raises(ValueError, match="'sklearn.preprocessing.FunctionTransformer', which tabfm does not load"):
        TabFMClassifier.load(copy_of)


def test_a_file_linking_outside_the_folder_is_refused(copy_of, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    (copy_of / ARRAYS_FILE).rename(outside)
    (copy_of / ARRAYS_FILE).symlink_to(outside)
    with pytest.raises(ValueError, match="links outside the folder"):
        TabFMClassifier.load(copy_of)


def test_save_refuses_an_unfitted_estimator_and_a_foreign_path(fitted_classifier, tmp_path):
    with pytest.raises(NotFittedError):
        TabFMClassifier().save(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a saved estimator"):
        fitted_classifier[0].save(other)
    assert other.read_text() == "keep me"
    odd = copy.copy(fitted_classifier[0])
    odd.extra_ = {1, 2}  # a set: not something the format knows
    with pytest.raises(ValueError, match="cannot save extra_ .*set"):
        odd.save(tmp_path / "odd")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written


def test_saving_again_replaces_the_earlier_save(fitted_classifier, saved_classifier, tmp_path):
    path = Path(shutil.copytree(saved_classifier, tmp_path / "again"))
    (path / ARRAYS_FILE).write_bytes(b"stale")
    fitted_classifier[0].save(path)
    assert sorted(p.name for p in path.iterdir()) == sorted([META_FILE, ARRAYS_FILE])
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # nothing left beside it
    clf, X_test = fitted_classifier
    np.testing.assert_array_equal(TabFMClassifier.load(path).predict_proba(X_test), clf.predict_proba(X_test))


def test_a_path_under_the_home_folder_is_read_as_a_shell_reads_it(fitted_classifier, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    clf, X_test = fitted_classifier
    clf.save("~/model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # not ./~/model
    np.testing.assert_array_equal(TabFMClassifier.load("~/model").predict_proba(X_test), clf.predict_proba(X_test))


def test_the_checkpoint_path_is_kept_and_must_exist_at_load(tmp_path):
    checkpoint = tmp_path / "model.safetensors"
    shutil.copy(DEFAULT_CHECKPOINT, checkpoint)
    X = table(60)
    clf = TabFMClassifier(n_estimators=1, calibrate=False, checkpoint=checkpoint).fit(X, X["colour"])
    clf.save(tmp_path / "clf")
    assert TabFMClassifier.load(tmp_path / "clf").checkpoint == str(checkpoint)
    checkpoint.unlink()
    with pytest.raises(ValueError, match="which does not exist here"):
        TabFMClassifier.load(tmp_path / "clf")


def _other_weights(source: Path, out: Path) -> Path:
    """A model file of the same architecture as `source` with other weights (every float tensor moved)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(source), "pt") as f:
        metadata = f.metadata()
    save_file({k: v + 0.5 * v.std() if v.is_floating_point() and v.numel() > 1 else v
               for k, v in load_file(str(source)).items()}, str(out), metadata=metadata)
    return out


def test_weights_replaced_at_the_checkpoint_path_are_refused_at_load(tmp_path):
    """The cached train rows belong to the weights fit used: a checkpoint file replaced since (training went on,
    re-merged) used to pair them silently with the new weights (probabilities 0.65 off)."""
    checkpoint = tmp_path / "model.safetensors"
    shutil.copy(DEFAULT_CHECKPOINT, checkpoint)
    X = table(60)
    clf = TabFMClassifier(n_estimators=1, calibrate=False, checkpoint=checkpoint).fit(X, X["colour"])
    expected = clf.predict_proba(X)
    clf.save(tmp_path / "clf")
    pickled = pickle.dumps(clf)
    _other_weights(DEFAULT_CHECKPOINT, checkpoint)
    with pytest.raises(ValueError, match="which now names other weights .* put those back at that path, or refit"):
        TabFMClassifier.load(tmp_path / "clf")
    with pytest.raises(ValueError, match="which now names other weights"):
        pickle.loads(pickled).predict_proba(X)  # the model is loaded on the first predict after unpickling
    assert np.abs(clf.fit(X, X["colour"]).predict_proba(X) - expected).max() > 1e-3  # a refit takes the new ones
    shutil.copy(DEFAULT_CHECKPOINT, checkpoint)  # the old weights back: the saved estimator loads again
    np.testing.assert_array_equal(TabFMClassifier.load(tmp_path / "clf").predict_proba(X), expected)
    np.testing.assert_array_equal(pickle.loads(pickled).predict_proba(X), expected)


def test_save_refuses_a_checkpoint_set_after_fit(fitted_classifier, tmp_path):
    """An audit's finding: set_params(checkpoint=...) after fit was saved, and the folder then refused at load
    ('was fitted with checkpoint ..., which does not exist here', or 'now names other weights')."""
    odd = copy.copy(fitted_classifier[0])
    other = _other_weights(DEFAULT_CHECKPOINT, tmp_path / "other.safetensors")
    for checkpoint in (tmp_path / "missing.safetensors", other):
        odd.set_params(checkpoint=checkpoint)
        with pytest.raises(ValueError) as e:
            odd.save(tmp_path / "odd")
        assert str(e.value) == (f"checkpoint={str(checkpoint)!r} does not name the weights this TabFMClassifier was "
                                "fitted with (set after fit, or the file replaced since), so load would refuse the "
                                "folder: set checkpoint back, or fit again, before saving")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other.safetensors"]  # nothing written
    odd.set_params(checkpoint=DEFAULT_CHECKPOINT)  # the same weights by their path: saved, and loaded
    odd.save(tmp_path / "odd")
    X_test = fitted_classifier[1]
    np.testing.assert_array_equal(TabFMClassifier.load(tmp_path / "odd").predict_proba(X_test),
                                  odd.predict_proba(X_test))


def test_a_relative_checkpoint_read_from_another_folder_is_refused(tmp_path, monkeypatch):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    shutil.copy(DEFAULT_CHECKPOINT, tmp_path / "a" / "ck.safetensors")
    _other_weights(DEFAULT_CHECKPOINT, tmp_path / "b" / "ck.safetensors")
    X = table(60)
    monkeypatch.chdir(tmp_path / "a")
    TabFMRegressor(n_estimators=1, checkpoint="ck.safetensors").fit(X, X["z"]).save(tmp_path / "reg")
    monkeypatch.chdir(tmp_path / "b")  # another project's file of the same name
    with pytest.raises(ValueError, match=r"checkpoint='ck.safetensors' .* which now names other weights"):
        TabFMRegressor.load(tmp_path / "reg")
    monkeypatch.chdir(tmp_path / "a")
    assert TabFMRegressor.load(tmp_path / "reg").predict(X).shape == (60,)


def test_other_shipped_weights_are_refused_at_load(saved_classifier, tmp_path, monkeypatch):
    """A newer tabfm that ships other weights cannot predict with an estimator fitted on the old ones."""
    from tabfm import estimator_model

    monkeypatch.setattr(estimator_model, "DEFAULT_CHECKPOINT", _other_weights(DEFAULT_CHECKPOINT,
                                                                              tmp_path / "new.safetensors"))
    with pytest.raises(ValueError, match="fitted with other shipped weights .* load it with the tabfm version"):
        TabFMClassifier.load(saved_classifier)


@pytest.mark.parametrize("random_state", [np.random.RandomState(0), np.random.default_rng(0)],
                         ids=["RandomState", "Generator"])
def test_an_estimator_fitted_with_a_random_generator_saves_its_seed(random_state, tmp_path):
    """A RandomState or Generator (as GridSearchCV's best_estimator_ may carry) was refused by save; it is saved as
    the seed fit drew from it, so the loaded estimator predicts the same and refits as this one was fitted."""
    X = table(60)
    clf = TabFMClassifier(n_estimators=2, random_state=random_state).fit(X, X["colour"])
    clf.save(tmp_path / "clf")
    loaded = TabFMClassifier.load(tmp_path / "clf")
    assert loaded.random_state == clf.seed_ and isinstance(loaded.random_state, int)
    np.testing.assert_array_equal(loaded.predict_proba(X), clf.predict_proba(X))
    np.testing.assert_array_equal(loaded.fit(X, X["colour"]).predict_proba(X), clf.predict_proba(X))


def test_weights_from_a_checkpoint_folder_are_named_by_its_manifest(tmp_path):
    """A checkpoint folder (one file per rank) is named by its manifest, which holds each rank file's SHA-256: the
    same folder loads, the folder saved again with other weights is refused."""
    from builders import tiny_model

    from tabfm import checkpoint as ckpt

    folder = ckpt.save_checkpoint(tmp_path / "step", tiny_model(seed=1).float())
    X = table(60)
    clf = TabFMClassifier(n_estimators=1, calibrate=False, checkpoint=folder).fit(X, X["colour"])
    expected = clf.predict_proba(X)
    clf.save(tmp_path / "clf")
    np.testing.assert_array_equal(TabFMClassifier.load(tmp_path / "clf").predict_proba(X), expected)
    shutil.rmtree(folder)
    ckpt.save_checkpoint(folder, tiny_model(seed=2).float())
    with pytest.raises(ValueError, match="which now names other weights"):
        TabFMClassifier.load(tmp_path / "clf")


def test_an_unpickled_estimator_saves_the_caches_its_own_threads_give(tmp_path):
    """A fuzzer's finding: save encoded an unpickled estimator's contexts on the process's threads, not n_jobs's,
    so the forwards split differently and the loaded regressor moved its predictions by 3e-9."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 5))
    y = X[:, 0] * 3 + np.sin(X[:, 1] * 3) + rng.normal(size=300) * 0.3
    reg = TabFMRegressor(n_jobs=1, random_state=7).fit(X, y)
    with torch_threads(2):  # the process's threads, as a script's default
        pickle.loads(pickle.dumps(reg)).save(tmp_path / "reg")
    np.testing.assert_array_equal(TabFMRegressor.load(tmp_path / "reg").predict(X[:30]), reg.predict(X[:30]))


def test_save_refuses_parameters_load_would_refuse(fitted_classifier, tmp_path):
    """A fuzzer's finding: batch_size=0 set after fit was saved, and the folder then refused at load."""
    odd = copy.copy(fitted_classifier[0])
    odd.set_params(batch_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        odd.save(tmp_path / "odd")
    assert not (tmp_path / "odd").exists()


def test_a_folder_holding_a_folder_of_an_estimator_file_s_name_is_not_replaced(fitted_classifier, tmp_path):
    """A fuzzer's finding: the check read names only, so a folder holding a folder named trees.skops (with the
    user's files in it) was replaced by a save."""
    path = tmp_path / "mine"
    (path / "trees.skops").mkdir(parents=True)
    (path / "trees.skops" / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a saved estimator"):
        fitted_classifier[0].save(path)
    assert (path / "trees.skops" / "precious.txt").read_text() == "keep me"


def test_a_save_inside_a_saved_estimator_is_refused(fitted_classifier, saved_classifier, tmp_path):
    """An audit's finding: a save to a folder inside a saved estimator was written there, and the outer folder, no
    longer only an estimator's files, was then refused by every later save to it."""
    outer = Path(shutil.copytree(saved_classifier, tmp_path / "outer"))
    before = sorted(p.name for p in outer.iterdir())
    clf, X_test = fitted_classifier
    for inner in (outer / "inner", outer / "a" / "b", outer / ARRAYS_FILE / "x", outer / ".." / "outer" / "inner"):
        with pytest.raises(ValueError) as e:
            clf.save(inner)
        assert str(e.value) == f"{str(inner.absolute())!r} is inside the saved estimator {str(outer)!r}: choose a " \
                               "path outside it"
        assert sorted(p.name for p in outer.iterdir()) == before  # nothing written
    clf.save(outer)  # the outer one is still replaced by a save
    clf.save(tmp_path / "outer_sibling")  # a name that only begins like it is outside it
    np.testing.assert_array_equal(TabFMClassifier.load(outer).predict_proba(X_test), clf.predict_proba(X_test))


def test_save_to_the_current_folder_by_a_dot(fitted_classifier, tmp_path, monkeypatch):
    """A fuzzer's finding: est.save('.') failed in pathlib ('.' has an empty name)."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    clf, X_test = fitted_classifier
    clf.save(".")
    np.testing.assert_array_equal(TabFMClassifier.load(tmp_path / "here").predict_proba(X_test),
                                  clf.predict_proba(X_test))


@pytest.mark.parametrize("edit, message", [
    (lambda f: f["train_cells_"]["params"]["fields"].update(encoded=None), "train rows' target encodings"),
    (lambda f: f["category_encoding_"]["params"]["fields"].update(columns=f["train_cells_"]["params"]["fields"]
                                                                  ["n_cats"]), "does not fit 2 columns"),
])
def test_a_target_encoding_that_does_not_fit_the_train_cells_is_refused(tmp_path, edit, message):
    rng = np.random.default_rng(0)
    X = pd.DataFrame({"g": [f"l{v}" for v in rng.integers(0, 200, 300)], "a": rng.normal(size=300)})
    TabFMRegressor(n_estimators=1, n_jobs=1).fit(X, rng.normal(size=300)).save(tmp_path / "est")
    _edit_json(tmp_path / "est", lambda meta: edit(meta["attributes"]["fields"]))
    with pytest.raises(ValueError, match=f"cannot load .*damaged .*{message}"):
        TabFMRegressor.load(tmp_path / "est")
