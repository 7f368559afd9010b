"""Stand-ins for packages an RL trainer's module imports but whose code the measured path never runs on CPU (issue 44).

A trainer's packing and log-prob code often sits in a module whose top imports a CUDA-only or heavy package for
something else (OpenRLHF's ``ring_attn_utils`` imports ``flash_attn.bert_padding``, pure torch, through the
``flash_attn`` package whose ``__init__`` loads the CUDA kernels; its ``models/utils.py`` imports ``deepspeed`` for
ZeRO-3 only). Each stand-in here is the smallest honest one, and the cell names it (:func:`flash_attn_stand_in`,
:func:`stub_module` return the sentence):

- ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed``: the two files of flash-attn's source at tag
  v2.8.3, verbatim (``vendor/flash_attn_2.8.3_*.py.txt``, BSD-3-Clause, ``vendor/flash_attn_LICENSE.txt``), checked
  against their sha256 on load; the package's ``__init__`` (the CUDA extension) is not run;
- a stub module (:func:`stub_module`) with only the names the import reads, every other attribute raising
  ModuleNotFoundError naming the package, so a path that does use it fails loudly, never silently.

Stand-ins live in ``sys.modules`` only while the caller's import runs; a package that is installed is used as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: flash-attn's release whose source files stand in (git tag v2.8.3 of Dao-AILab/flash-attention).
FLASH_ATTN_SOURCE = "2.8.3"
#: The vendored files: module name -> (file under vendor/, sha256 of the file as tag v2.8.3 has it).
FLASH_ATTN_FILES = {
    "flash_attn.bert_padding": ("flash_attn_2.8.3_bert_padding.py.txt",
                                "805d449ac749f87a50f3a3114385710f0f926ff45521275000b74d9e80721e5c"),
    "flash_attn.utils.distributed": ("flash_attn_2.8.3_utils_distributed.py.txt",
                                     "aa17326d15edb25b2cb95f4b61a432dfb85a3da3ed925338614303c7d52f9e74"),
}
VENDOR = Path(__file__).with_name("vendor")


def _load_source(name: str, file: str, digest: str) -> types.ModuleType:
    """The module ``name`` executed from ``vendor/<file>``; ValueError when the file is not the one recorded."""
    data = (VENDOR / file).read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise ValueError(f"{VENDOR / file}: sha256 {got}, not flash-attn v{FLASH_ATTN_SOURCE}'s {digest}: restore the file "
                         "from the tag (git show v2.8.3:flash_attn/...)")
    module = types.ModuleType(name)
    module.__file__ = str(VENDOR / file)
    exec(compile(data, str(VENDOR / file), "exec"), module.__dict__)  # noqa: S102 - flash-attn's own source, hash-checked
    return module


@contextlib.contextmanager
def flash_attn_stand_in() -> Iterator[str]:
    """While the block runs, ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` import as flash-attn
    v2.8.3's own files (needs ``einops``, which bert_padding imports) under a bare ``flash_attn`` package; yields the
    sentence naming the stand-in, or "" when flash_attn is installed (nothing is replaced).

    Raises:
        ModuleNotFoundError: ``einops`` is not installed (named).
    """
    if importlib.util.find_spec("flash_attn") is not None:
        yield ""
        return
    names = ("flash_attn", "flash_attn.utils", *FLASH_ATTN_FILES)
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for package in ("flash_attn", "flash_attn.utils"):
            bare = types.ModuleType(package)
            bare.__path__ = []
            sys.modules[package] = bare
        for name, (file, digest) in FLASH_ATTN_FILES.items():
            sys.modules[name] = _load_source(name, file, digest)
        sys.modules["flash_attn.utils"].distributed = sys.modules["flash_attn.utils.distributed"]
        sys.modules["flash_attn"].bert_padding = sys.modules["flash_attn.bert_padding"]
        yield (f"flash_attn.bert_padding and flash_attn.utils.distributed from flash_attn {FLASH_ATTN_SOURCE}'s source "
               "(pure torch; its CUDA __init__ not run)")
    finally:
        _restore_modules(saved)


def _restore_modules(saved: dict[str, Any]) -> None:
    """Put back the ``sys.modules`` entries a stand-in replaced (``None``: the name was not imported; removed)."""
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def _missing_attr(root: str, module: str) -> Any:
    """A stub module's ``__getattr__``: any use of an attribute it does not hold raises ModuleNotFoundError naming
    ``root``, the package to install; dunder lookups (introspection: ``__file__``, ``__version__``) stay
    AttributeError."""
    def missing(attr: str) -> Any:
        if attr.startswith("__"):  # introspection (__file__, __version__): an absent attribute, not a use
            raise AttributeError(attr)
        raise ModuleNotFoundError(f"{root} is stubbed by packcheck ({module}.{attr} used): install {root}", name=root)
    return missing


@contextlib.contextmanager
def stub_module(name: str, why: str, **attrs: Any) -> Iterator[str]:
    """While the block runs, ``import <name>`` gives a stub holding ``attrs`` only (any other attribute raises
    ModuleNotFoundError naming ``name``); yields "<name> stubbed: <why>", or "" when ``name`` is installed."""
    if importlib.util.find_spec(name) is not None:
        yield ""
        return
    stub = types.ModuleType(name)
    stub.__dict__.update(attrs)
    stub.__getattr__ = _missing_attr(name, name)  # type: ignore[method-assign]
    saved = {name: sys.modules.get(name)}
    sys.modules[name] = stub
    try:
        yield f"{name} stubbed: {why}"
    finally:
        _restore_modules(saved)


@contextlib.contextmanager
def stub_tree(root: str, why: str, attrs: dict[str, dict[str, Any]]) -> Iterator[str]:
    """:func:`stub_module` for a package and its submodules: ``attrs`` maps each module name (``root`` or
    ``root.x.y``) to the names it must hold; every module on the way is created, every other attribute raises
    ModuleNotFoundError naming ``root``. Yields "<root> stubbed: <why>", or "" when ``root`` is installed."""
    if importlib.util.find_spec(root) is not None:
        yield ""
        return
    names = sorted({".".join(m.split(".")[:i]) for m in [root, *attrs] for i in range(1, len(m.split(".")) + 1)})
    saved = {n: sys.modules.get(n) for n in names}

    try:
        for name in names:
            stub = types.ModuleType(name)
            stub.__path__ = []
            # a spec, so that find_spec (TRL's _is_package_available) finds the stub, not a ValueError
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            stub.__dict__.update(attrs.get(name, {}))
            stub.__getattr__ = _missing_attr(root, name)  # type: ignore[method-assign]
            sys.modules[name] = stub
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, stub)
        yield f"{root} stubbed: {why}"
    finally:
        _restore_modules(saved)


def never_called(name: str, package: str) -> Any:
    """A stand-in callable for ``name`` that raises ModuleNotFoundError naming ``package`` when called."""
    def stand_in(*_args: Any, **_kwargs: Any) -> Any:
        raise ModuleNotFoundError(f"{name} is a packcheck stand-in (never called on the measured path): install {package}",
                                  name=package)
    stand_in.__name__ = name.rpartition(".")[2]
    return stand_in
