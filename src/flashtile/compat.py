"""Drop-in shim: make ``import flash_attn`` (and its submodules) resolve to flashtile, and FlashAttention-3's
``import flash_attn_interface`` to ``flashtile.hopper.flash_attn_interface``. Opt in.

::

    import flashtile.compat
    flashtile.compat.install()
    from flash_attn import flash_attn_func                    # flashtile's
    from flash_attn.bert_padding import unpad_input, pad_input
    from flash_attn.modules.mha import MHA
    from flash_attn_interface import flash_attn_func as fa3_func  # FlashAttention-3's API

``install()`` puts a finder at the front of ``sys.meta_path``. It maps FlashAttention 2.8.3's
module names (``MODULES``) onto flashtile's, and imports a flashtile module only when its
flash_attn name is imported, so nothing heavy (layers, modules) loads until asked for. Names that
are in flash_attn but not in flashtile (``flash_attn.ops.*``, ``flash_attn_2_cuda``...) fail with
an ImportError that says so, rather than falling through to a real flash_attn installed beside
it: mixing the two would mix two dropout RNGs, two lse layouts and two compile stories.

``flash_attn`` itself is a small facade package: attributes come from ``flashtile``, except
``__version__``, which reports the FlashAttention API version flashtile implements ("2.8.3") so
version gates in third-party code take the right branches; ``flashtile_version`` has ours.

``uninstall()`` removes the finder and every ``flash_attn`` entry it created in ``sys.modules``,
and restores a real flash_attn's modules if ``install()`` had displaced them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

import flashtile

FLASH_ATTN_API_VERSION = "2.8.3"

# flash_attn module name -> flashtile module name (the top-level "flash_attn" is the facade)
MODULES = {
    "flash_attn.flash_attn_interface": "flashtile.flash_attn_interface",
    "flash_attn.bert_padding": "flashtile.bert_padding",
    "flash_attn.layers": "flashtile.layers",
    "flash_attn.layers.rotary": "flashtile.layers.rotary",
    "flash_attn.modules": "flashtile.modules",
    "flash_attn.modules.mha": "flashtile.modules.mha",
    "flash_attn.modules.mlp": "flashtile.modules.mlp",
    "flash_attn.modules.block": "flashtile.modules.block",
    # FlashAttention-3's top-level module (its hopper/ package installs it under this name)
    "flash_attn_interface": "flashtile.hopper.flash_attn_interface",
}
_ROOT = "flash_attn"
_FA3 = "flash_attn_interface"


def _ours(name: str) -> bool:
    return name in (_ROOT, _FA3) or name.startswith(_ROOT + ".")


class _AliasLoader(importlib.abc.Loader):
    """Loads a flash_attn name by handing back flashtile's module (or building the facade)."""

    def create_module(self, spec):
        return None  # a fresh placeholder; exec_module swaps the real module into sys.modules

    def exec_module(self, module):
        name = module.__name__
        if name == _ROOT:
            _fill_facade(module)
            return
        # The import system returns whatever sys.modules holds once exec_module is done, so the
        # flashtile module itself (with its own __spec__ and __name__ untouched) becomes the answer.
        sys.modules[name] = importlib.import_module(MODULES[name])


def _fill_facade(module: types.ModuleType):
    def __getattr__(attr):
        try:
            return getattr(flashtile, attr)
        except AttributeError:
            raise AttributeError(f"module 'flash_attn' (flashtile's shim) has no attribute {attr!r}") from None

    module.__getattr__ = __getattr__
    module.__version__ = FLASH_ATTN_API_VERSION
    module.flashtile_version = flashtile.__version__
    module.__all__ = list(flashtile.__all__)
    module.__doc__ = "flashtile's stand-in for flash_attn (installed by flashtile.compat.install())."


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not _ours(fullname):
            return None
        if fullname == _ROOT:
            return importlib.machinery.ModuleSpec(_ROOT, _LOADER, is_package=True)
        if fullname not in MODULES:
            raise ModuleNotFoundError(f"flashtile's flash_attn shim has no {fullname!r} (it provides "
                                      f"{', '.join(sorted(MODULES))})", name=fullname)
        is_pkg = fullname in ("flash_attn.layers", "flash_attn.modules")
        return importlib.machinery.ModuleSpec(fullname, _LOADER, is_package=is_pkg)


_LOADER = _AliasLoader()
_FINDER = _Finder()
_displaced: dict[str, types.ModuleType] = {}


def installed() -> bool:
    return _FINDER in sys.meta_path


def install() -> None:
    """Make ``flash_attn`` and its submodules import as flashtile. Idempotent.

    If a real flash_attn is already imported, warns and takes its modules out of ``sys.modules``
    (kept for :func:`uninstall`); references already bound to them keep pointing at the real one.
    """
    if installed():
        return
    real = {name: mod for name, mod in sys.modules.items() if _ours(name) and not _is_shim(mod)}
    if real:
        warnings.warn("flashtile.compat.install(): a real flash_attn is already imported; later imports of "
                      "flash_attn will get flashtile, but objects already imported from it stay the real ones. "
                      "Call install() before anything imports flash_attn.", RuntimeWarning, stacklevel=2)
        for name in real:
            _displaced[name] = sys.modules.pop(name)
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Undo :func:`install`: drop the finder and the shim's ``sys.modules`` entries, restore a real flash_attn."""
    if installed():
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if _ours(n)]:
        del sys.modules[name]
    sys.modules.update(_displaced)
    _displaced.clear()


def _is_shim(mod) -> bool:
    spec = getattr(mod, "__spec__", None)
    return (spec is not None and spec.loader is _LOADER) or getattr(mod, "__name__", "").startswith("flashtile")
