"""tabfm: a tabular foundation model with ATP adaptive 2D tensor parallelism built in.

The public surface is what this module exports; everything else is internal. The estimators are imported on
first use, so `import tabfm` (and the `tabfm` command) stays light.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["TabFMClassifier", "TabFMRegressor", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "TabFMClassifier":
        from tabfm.classifier import TabFMClassifier

        return TabFMClassifier
    if name == "TabFMRegressor":
        from tabfm.regressor import TabFMRegressor

        return TabFMRegressor
    raise AttributeError(f"module 'tabfm' has no attribute {name!r}")
