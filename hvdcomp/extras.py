"""The tools' optional dependencies: imported where a tool uses them, under :func:`required`, which turns a missing
one into an error naming the pip extra that installs it.

``pip install hvdcomp`` installs what :class:`hvdcomp.DistributedOptimizer` and the compressors need; the extras of
pyproject.toml add the tools' own dependencies, each imported by the feature that needs it and never by
``import hvdcomp``:

* ``digits``: scikit-learn, for ``hvdcomp train --workload digits`` (the data set ships with it);
* ``k8s``: jsonschema and kubernetes-validate, for ``hvdcomp k8s validate`` and ``hvdcomp k8s dry-run``;
* ``perf``: matplotlib, mpi4py and nvidia-ml-py, for the performance model's plots (``hvdcomp predict --plot``),
  its measurements across ranks (``hvdcomp probe`` and ``hvdcomp profile`` under mpirun) and its GPU readings;
* ``all``: the three.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class MissingExtra(ImportError):
    """A tool's optional dependency could not be imported; the message names the extra that installs it."""


@contextmanager
def required(extra: str, feature: str) -> Iterator[None]:
    """The imports in the block are those of ``feature`` (words: "hvdcomp k8s validate"), which pip installs with
    hvdcomp's ``extra``: an ImportError there (the package missing, or one of its own dependencies) becomes a
    :class:`MissingExtra` that says what to install.

        with extras.required("digits", "the digits workload"):
            from sklearn.datasets import load_digits
    """
    try:
        yield
    except ImportError as error:
        raise MissingExtra(f"{feature} needs the optional dependencies of hvdcomp's '{extra}' extra ({error}): "
                           f"pip install 'hvdcomp[{extra}]'", name=error.name) from error
