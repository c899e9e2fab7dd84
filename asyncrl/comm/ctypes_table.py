"""The shape every ctypes binding of a collective library (libnccl, libhccl) declares itself in.

A binding lists its C functions once, as `Function` records in a module-level table, and
`CLibrary` resolves that table against the loaded library: each function becomes an attribute with
its prototype set, so a call with a wrong-width value fails in ctypes, not in C. A required
function that the library lacks fails the load with a `CommLibraryError` naming the symbol; an
optional one is None, and the binding checks `CLibrary.has` before relying on it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from asyncrl.comm.errors import CommLibraryError


@dataclass(frozen=True)
class Function:
    """One exported C function: its name, its ctypes return type and argument types, and whether the
    binding can work without it (``required=False``: a symbol only some library versions export)."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    required: bool = True


def bind_functions(cdll: ctypes.CDLL, path: str, table: Sequence[Function], hint: str) -> dict[str, Any]:
    """Every function of ``table`` looked up in ``cdll`` with its prototype set, by name (None for a
    missing optional one). A missing required one raises CommLibraryError naming it and ``path``,
    followed by ``hint`` (what the library was expected to be)."""
    bound: dict[str, Any] = {}
    for function in table:
        # cdll[name] makes a fresh function object (unlike getattr, which caches one on the CDLL),
        # so the prototypes set here cannot clash with another binding of the same library.
        try:
            fn = cdll[function.name]
        except AttributeError:
            if function.required:
                raise CommLibraryError(f"{path} lacks the required symbol {function.name}: {hint}") from None
            bound[function.name] = None
            continue
        fn.restype = function.restype
        fn.argtypes = list(function.argtypes)
        bound[function.name] = fn
    return bound


class CLibrary:
    """A loaded library with the functions of ``functions`` as attributes (see `bind_functions`).

    Subclasses set ``functions`` (their table) and ``missing_hint`` (appended to the error for a
    missing required symbol)."""

    functions: ClassVar[Sequence[Function]] = ()
    missing_hint: ClassVar[str] = "not the expected library, or a version too old for this binding"

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self.path = path
        self._cdll = cdll
        for name, fn in bind_functions(cdll, path, self.functions, self.missing_hint).items():
            setattr(self, name, fn)

    if TYPE_CHECKING:
        # The bound functions are set by name from the table at load, so a type checker cannot list
        # them; each is a ctypes function (or None for a missing optional one): Any is their edge.
        def __getattr__(self, name: str) -> Any: ...

    def has(self, name: str) -> bool:
        """True when the library exports ``name`` (an optional function may be absent)."""
        return getattr(self, name, None) is not None
