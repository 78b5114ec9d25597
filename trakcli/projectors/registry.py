"""The projector kinds: one :class:`ProjectorKind` subclass per ``projector.kind``, registered by name.

A kind carries its name, the options it takes beyond the common ones (:data:`COMMON_OPTIONS`), the implementations it
supports, its memory check and how it builds a projector. :func:`~trakcli.projectors.make_projector` and the config
schema (``projector.kind``) ask this registry and name no kind themselves. The built-in kinds live in
:mod:`trakcli.projectors.kinds`.

Adding a kind, with an example: docs/guides/projectors.md, "Adding a projector kind".

This module imports no torch: the config validates ``projector.kind`` with it.
"""

from __future__ import annotations

import difflib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from trakcli.errors import ProjectorError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from trakcli.projectors.base import Projector

#: Every implementation a kind may support, and ``auto`` (the best available for the kind).
IMPLEMENTATIONS = ("auto", "single_block", "basic", "chunked", "cuda")

#: The kind of a config that leaves ``projector.kind`` unset, and of ``make_projector()``.
DEFAULT_KIND = "sjlt"

#: Options every kind built from a gradient dimension takes (besides kind, implementation, grad_dim, proj_dim, seed).
COMMON_OPTIONS: dict[str, str] = {
    "dtype": "accumulation dtype: float32 (default) or float64",
    "block_size": "basic: gradient columns processed per step (default 262144)",
    "max_chunk_size": "chunked: most gradient entries per chunk (default 262144)",
    "cache_bytes": ("basic/chunked: byte budget for caching generated matrix blocks; 'auto' (default) caches "
                    "the whole matrix of a model when it fits min(4 GiB, RAM/4), else nothing; 0 disables"),
}

#: The arguments of ``make_projector`` that are no option.
ARGUMENTS = ("kind", "implementation", "grad_dim", "proj_dim", "seed")


class ProjectorKind:
    """One projector kind: a subclass per kind, registered with :func:`register_projector_kind`.

    Class attributes:
        name: the ``kind`` value (``projector.kind`` in a config).
        summary: one line on the matrix, for docs and messages.
        options: the kind's own options beyond :data:`COMMON_OPTIONS`, name -> meaning
            (e.g. sjlt's ``s``); an option of another kind is refused with the kind it belongs to.
        implementations: the implementations it supports, a subset of :data:`IMPLEMENTATIONS`
            without ``auto``; ``auto`` picks ``cuda`` where it runs, else ``basic`` (else the first).
        needs_proj_dim: False for a kind whose width follows from ``grad_dim`` (``noop``).
        built_from_model: for a kind built from the model instead of a gradient dimension
            (``kronecker``): the message ``make_projector`` raises, pointing to what builds it; None otherwise.

    An instance is one resolved request: :func:`~trakcli.projectors.make_projector` checks the
    common arguments, makes the kind with them and its own options (``__init__`` validates those),
    runs :meth:`check_memory` and calls :meth:`build`.

    Args:
        grad_dim: gradient coordinates, an int >= 1 (checked).
        proj_dim: features, an int >= 1 (checked), or None for a kind with ``needs_proj_dim`` False.
        seed: base seed, an int >= 0 (checked).
        dtype: the accumulation dtype, ``torch.float32`` or ``torch.float64``.
        **options: the given values of the kind's :attr:`options` (only those), kept in ``given``.

    Raises:
        ProjectorError: (subclasses) a bad option value.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[Mapping[str, str]] = {}
    implementations: ClassVar[tuple[str, ...]] = ("single_block", "basic", "chunked")
    needs_proj_dim: ClassVar[bool] = True
    built_from_model: ClassVar[str | None] = None

    def __init__(self, *, grad_dim: int, proj_dim: int | None, seed: int, dtype: "torch.dtype", **options: Any):
        self.grad_dim, self.seed, self.dtype = grad_dim, seed, dtype
        self.proj_dim = proj_dim if proj_dim is not None else grad_dim
        self.given = dict(options)

    @classmethod
    def implementation_error(cls, implementation: str) -> str | None:
        """Why a config's ``projector.implementation`` cannot go with this kind, or None to leave it to
        :meth:`resolve_implementation` (a kind built from the model checks it here)."""
        return None

    def resolve_implementation(self, implementation: str) -> str:
        """The implementation to build: ``auto`` resolved (``cuda`` where it runs, else ``basic``, else the
        kind's first; logged), any other one checked against :attr:`implementations` (``cuda``: by ``make_projector``).

        Raises:
            ProjectorError: the kind lacks ``implementation``.
        """
        from trakcli.projectors.factory import pick_auto

        if implementation == "auto":
            return pick_auto(self)
        if implementation not in self.implementations and implementation != "cuda":  # cuda: make_projector says why
            raise ProjectorError(f"projector kind {self.name!r} has no {implementation} implementation; use "
                                 f"implementation: {', '.join(self.implementations)} or auto")
        return implementation

    def matrix_bytes(self) -> int:
        """Bytes of the whole matrix (what ``cache_bytes: auto`` and ``single_block`` hold): dense by default."""
        return self.grad_dim * self.proj_dim * self.dtype.itemsize

    def memory_floor(self, implementation: str) -> tuple[int, str]:
        """The least memory one example needs beside the gradient, and what it is, for :meth:`check_memory`.

        Default (a dense matrix): one ``proj_dim`` accumulator and, for ``single_block``, the whole
        matrix, else one generated block of ``GEN_ROWS`` gradient coordinates.
        """
        from trakcli.projectors.matrices import GEN_ROWS

        row = self.proj_dim * self.dtype.itemsize
        if implementation == "single_block":
            return row + self.matrix_bytes(), f"the whole {self.grad_dim} x {self.proj_dim} matrix"
        rows = min(GEN_ROWS, self.grad_dim)
        return row + rows * self.proj_dim * self.dtype.itemsize, f"a {rows} x {self.proj_dim} block of the matrix"

    def check_memory(self, implementation: str) -> None:
        """Refuse a projector that cannot project even one example in this machine's memory.

        Raises:
            ProjectorError: naming ``proj_dim``, the memory it would need and the memory here.
        """
        from trakcli.projectors.factory import refuse_over_memory

        need, what = self.memory_floor(implementation)
        refuse_over_memory(self.proj_dim, need, what)

    def matrix(self, cache_bytes: int) -> Any:
        """The matrix object (:mod:`trakcli.projectors.matrices`) the default :meth:`build` multiplies with."""
        raise NotImplementedError(f"projector kind {self.name!r} defines neither matrix() nor build()")

    def build(self, implementation: str, *, cache_bytes: int, block_size: int, max_chunk_size: int) -> "Projector":
        """The projector: ``implementation`` (resolved, one of :attr:`implementations`) over :meth:`matrix`.

        Args:
            implementation: ``single_block``, ``basic``, ``chunked`` or ``cuda``.
            cache_bytes: byte budget of the block cache (resolved from ``auto``).
            block_size, max_chunk_size: the ``basic`` and ``chunked`` options.
        """
        from trakcli.projectors.chunked import ChunkedProjector
        from trakcli.projectors.dense import BasicProjector, BasicSingleBlockProjector

        if implementation == "single_block":
            return BasicSingleBlockProjector(self.matrix(0))
        if implementation == "chunked":
            return ChunkedProjector(self.matrix(cache_bytes), max_chunk_size)
        if implementation == "cuda":
            from trakcli.projectors.cuda import CudaProjector

            return CudaProjector(self.matrix(0))
        return BasicProjector(self.matrix(cache_bytes), block_size)


_REGISTRY: dict[str, type[ProjectorKind]] = {}


def register_projector_kind(cls: type[ProjectorKind]) -> type[ProjectorKind]:
    """Register a :class:`ProjectorKind` subclass under its ``name`` (usable as a class decorator).

    Returns:
        ``cls``.

    Raises:
        ProjectorError: ``cls`` is no ProjectorKind subclass, has no name, a name another kind has, an implementation
            outside :data:`IMPLEMENTATIONS`, or an option that is a common option or argument.
    """
    if not (isinstance(cls, type) and issubclass(cls, ProjectorKind)):
        raise ProjectorError(f"register_projector_kind takes a ProjectorKind subclass, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name.isidentifier():
        raise ProjectorError(f"projector kind class {cls.__name__} needs a name, a word such as 'mykind', got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ProjectorError(f"projector kind {name!r} is already registered ({_REGISTRY[name].__name__}); "
                             f"choose another name or unregister_projector_kind({name!r}) first")
    bad = [i for i in cls.implementations if i not in IMPLEMENTATIONS or i == "auto"]
    if bad:
        raise ProjectorError(f"projector kind {name!r} lists implementation {bad[0]!r}; "
                             f"choose among {', '.join(IMPLEMENTATIONS[1:])}")
    clash = [k for k in cls.options if (k in COMMON_OPTIONS and cls.built_from_model is None) or k in ARGUMENTS]
    if clash:
        raise ProjectorError(f"projector kind {name!r} declares option {clash[0]!r}, which every kind has; "
                             "remove it from its options")
    _REGISTRY[name] = cls
    _registry_changed()
    return cls


def unregister_projector_kind(name: str) -> None:
    """Remove the kind ``name`` from the registry (a kind added by a plugin or a test).

    Raises:
        ProjectorError: no kind has that name.
    """
    if name not in _REGISTRY:
        raise ProjectorError(f"no projector kind {name!r} is registered; registered: {', '.join(_REGISTRY)}")
    del _REGISTRY[name]
    _registry_changed()


def kind_names() -> tuple[str, ...]:
    """The names of the registered kinds, built-in ones first, in registration order."""
    return tuple(_REGISTRY)


def did_you_mean(value: Any, choices: tuple[str, ...] | list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to ``value``, or ``""``."""
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def projector_kind(name: Any) -> type[ProjectorKind]:
    """The registered kind called ``name``.

    Raises:
        ProjectorError: ``name`` is no registered kind: the message names it, the closest kind and every registered one.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ProjectorError(f"unknown projector kind {name!r}{did_you_mean(name, kind_names())}; "
                             f"choose one of {', '.join(kind_names())}")
    return _REGISTRY[name]


def option_owner(option: str) -> str | None:
    """The first registered kind (built from a gradient dimension) whose own options include ``option``."""
    for cls in _REGISTRY.values():
        if cls.built_from_model is None and option in cls.options:
            return cls.name
    return None


_options: dict[str, str] = {}
#: Options ``make_projector`` accepts beyond kind, implementation, grad_dim, proj_dim, seed: :data:`COMMON_OPTIONS`
#: and every registered kind's own ones (rebuilt on every register / unregister).
OPTIONS: Mapping[str, str] = MappingProxyType(_options)


def _registry_changed() -> None:
    _options.clear()
    _options.update(COMMON_OPTIONS)
    for cls in _REGISTRY.values():
        if cls.built_from_model is None:
            for k, v in cls.options.items():
                _options.setdefault(k, f"{cls.name}: {v}")


class KindNames(Sequence[str]):
    """A live, tuple-like view of the registered kind names that ``select(cls)`` accepts."""

    def __init__(self, select: Callable[[type[ProjectorKind]], bool]):
        self._select = select

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, cls in _REGISTRY.items() if self._select(cls))

    def __getitem__(self, i: Any) -> Any:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, KindNames)) else other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


from trakcli.projectors import kinds as _builtin_kinds  # noqa: E402,F401  (registers the built-in kinds)
