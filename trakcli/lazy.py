"""PEP 562 lazy exports: a package names what it exports and imports each name's module on first use.

`trakcli.config` (pydantic stays unimported for ``trak --help``) and `trakcli.store`
(zarr is imported on the first store open) use it. Imports nothing of trakcli.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, MutableMapping


def lazy_getattr(package: str, modules: dict[str, str], namespace: MutableMapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``package``.

    Args:
        package: the package's ``__name__`` (named in the error).
        modules: exported name -> the module that defines it.
        namespace: the package's ``globals()``; a name, once imported, is put there, so
            later lookups do not call ``__getattr__`` again.

    Returns:
        ``__getattr__(name)``: the exported object.

    Raises (from the returned function):
        AttributeError: ``name`` is not one of ``modules`` (as for any missing attribute).
    """

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
