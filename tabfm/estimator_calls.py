"""How the estimators' public methods run: under the estimator's thread count (n_jobs), and, for fit, all or
nothing (a fit that raises leaves the estimator as it was). Decorators of TabFMClassifier's and TabFMRegressor's
fit / predict methods, apart from tabfm.estimator's shared machinery."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from tabfm.validation import torch_threads

Method = TypeVar("Method", bound=Callable)


def threaded(method: Method) -> Method:
    """Run an estimator method with torch's (and BLAS's) threads set by the estimator's n_jobs, restored after."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch_threads(self.n_jobs):
            return method(self, *args, **kwargs)
    return run


def fit_or_keep(fit: Method) -> Method:
    """A fit that raises leaves the estimator as it was before the call: fitted with its old model and classes, or
    unfitted (NotFittedError), never with the new classes or columns read before the error and the old contexts.
    The fitted attributes are rebound by a fit, never changed in place, so the old ones are whole."""
    @functools.wraps(fit)
    def run(self, *args, **kwargs):
        before = dict(self.__dict__)
        try:
            return fit(self, *args, **kwargs)
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise
    return run
