"""trakcli: gradient-based data attribution (TRAK) as a command-line tool and library.

The library's entry points (docs/guides/python-api.md), imported on first use: every
``trak`` command imports this package, and ``trak --help`` must not import torch:

- :class:`Attributor` (:mod:`trakcli.api`): your ``nn.Module`` and batches (e.g. a DataLoader).
- :func:`load_config`, :func:`featurize`, :func:`score`: the ``trak featurize`` / ``trak score``
  jobs on a config (``featurize(load_config("run.yaml", ["projector.proj_dim=512"]))``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_LAZY = {
    "Attributor": "trakcli.api",
    "load_config": "trakcli.config",
    "featurize": "trakcli.jobs.featurize",
    "score": "trakcli.jobs.score",
}

__all__ = ["Attributor", "featurize", "load_config", "score", "__version__"]


def __getattr__(name: str) -> Any:
    """Import :data:`_LAZY` names on first access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trakcli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
