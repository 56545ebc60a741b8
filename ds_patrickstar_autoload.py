"""Registers stage "patrickstar" when DeepSpeed is imported, without ``import ds_patrickstar``.

[Note: autoload]
Installed with the package as ``ds_patrickstar_autoload.pth`` in site-packages, whose one line
runs :func:`install` at interpreter start-up. :func:`install` only puts a finder at the front of
``sys.meta_path`` (standard library only: nothing is imported, no torch, no DeepSpeed). The finder
ignores every import but the top-level ``deepspeed``; for that one it lets the other finders find
it and wraps its loader, so that right after DeepSpeed's ``__init__`` has run, ``ds_patrickstar``
is imported, which wraps ``deepspeed.initialize`` (see [Note: registration] in
ds_patrickstar/integration/registration.py). The finder removes itself when DeepSpeed is
executed, not when it is found (a ``find_spec`` probe imports nothing), and the module gets its
own loader back. A process that never imports DeepSpeed never imports ds_patrickstar. This module
is the bottom of the import graph: standard library only, the package loaded by name (so the
package may use :func:`after_import`, the project's one import hook, without an import circle).

``DS_PATRICKSTAR_AUTOLOAD=0`` in the environment turns it off (the stage then needs
``import ds_patrickstar`` or ``python -m ds_patrickstar``). If ds_patrickstar cannot be
imported, DeepSpeed's import goes on and a warning says why.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

ENV = "DS_PATRICKSTAR_AUTOLOAD"
PACKAGE = "ds_patrickstar"  # loaded by name, as an entry point is: this module imports nothing of it


def _register(_deepspeed: ModuleType | None = None) -> None:
    try:
        importlib.import_module(PACKAGE)  # wraps deepspeed.initialize
    except Exception as err:  # DeepSpeed must still import
        warnings.warn(
            f"ds_patrickstar could not register stage 'patrickstar' when DeepSpeed was imported: {err!r} "
            f"(set {ENV}=0 to skip this)",
            stacklevel=2,
        )


class _Loader:
    """The module's own loader, then the callback; the module gets its own loader back."""

    def __init__(self, inner, callback: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.callback = callback

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self.inner.exec_module(module)
        finally:
            module.__loader__ = self.inner
            if module.__spec__ is not None:
                module.__spec__.loader = self.inner
        self.callback(module)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Finder:
    """A ``sys.meta_path`` finder for one module name (duck-typed: importing importlib.abc would
    cost start-up time). It lets the other finders find that module and wraps its loader; it
    leaves ``sys.meta_path`` only when the module is executed, so that a probe
    (``importlib.util.find_spec``, as Hugging Face's ``is_deepspeed_available()`` does) finds a
    spec without disarming it."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, self._executed)  # type: ignore[assignment]  # duck-typed Loader
        return spec

    def _executed(self, module: ModuleType) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        self.callback(module)


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` right after module ``name`` is first imported, or now if it already
    was; once per callback (a second call with the same pair while waiting does nothing). The one
    import hook of the project: DeepSpeed's registration here and Hugging Face's evaluation guard
    (ds_patrickstar/integration/hf_eval.py) both use it."""
    if name in sys.modules:
        callback(sys.modules[name])
    elif not any(isinstance(f, _Finder) and f.name == name and f.callback == callback for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, callback))


def install() -> None:
    """Register on DeepSpeed's import, unless ``DS_PATRICKSTAR_AUTOLOAD=0``; see [Note: autoload]."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    after_import("deepspeed", _register)
