"""Import sglang for the upstream tier: choose the tree, stand in for torchvision, check it.

Call :func:`load_sglang` before anything imports ``sglang``. It is the only module of
``upstream/`` that may run before sglang exists; everything else imports sglang freely.

Which sglang is driven, in order:

1. ``--sglang-src DIR`` (``OVERLAP_SPEC_SGLANG_SRC``): a source checkout (``DIR/python/sglang``)
   or a directory holding the package (``DIR/sglang``), put first on ``sys.path``;
2. otherwise whatever ``import sglang`` finds, so a copy placed first on ``PYTHONPATH`` is the
   one driven;
3. otherwise the release installed in the upstream environment (``./dev upstream``).

Every failure is an :class:`UpstreamUnavailable` with one line a user can act on.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_VERSION = "0.5.23"


class UpstreamUnavailable(Exception):
    """sglang cannot be driven here (missing, wrong version, not a tree, import failure)."""


@dataclass(frozen=True)
class SglangSource:
    version: str
    source: str  # "release" (site-packages) or the directory the package came from
    package_dir: str


def find_package_dir(src: Path) -> Path:
    """The directory that holds the ``sglang`` package inside a checkout or a package root."""
    for candidate in (src / "python", src):
        if (candidate / "sglang" / "srt" / "managers" / "scheduler.py").is_file():
            return candidate
    raise UpstreamUnavailable(
        f"--sglang-src {src}: not an SGLang tree (expected python/sglang/srt/managers/"
        "scheduler.py or sglang/srt/managers/scheduler.py under it)")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an empty ``torchvision``: the registry's builds are CUDA builds that do not load
    on torch 2.13.0+cpu, and sglang imports ``torchvision.transforms`` at module level
    (configs/__init__ -> multimodal/internvl_utils.py). Nothing the scheduler runs uses it."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] != "torchvision":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _StandInModule(types.ModuleType):
    def __getattr__(self, item: str) -> object:
        if item.startswith("__"):
            raise AttributeError(item)
        # Names used as types (isinstance, subclassing) get a class; anything else is an
        # object that fails loudly if the scheduler ever calls it.
        if item[:1].isupper():
            cls = type(item, (), {"__module__": self.__name__})
            setattr(self, item, cls)
            return cls
        return _Uncallable(f"{self.__name__}.{item}")


class _Uncallable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> _Uncallable:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Uncallable(f"{self._name}.{item}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{self._name} is a stand-in (upstream/bootstrap.py) and was called")


def _install_torchvision_stand_in() -> None:
    if any(isinstance(f, _TorchvisionStandIn) for f in sys.meta_path):
        return
    try:
        # transformers caches "is torchvision available" on first ask; ask before the
        # stand-in exists so it answers False and never parses the stand-in's version.
        from transformers.utils import import_utils  # type: ignore[import-not-found]

        import_utils.is_torchvision_available()
    except Exception as error:  # noqa: BLE001 - any failure here means: cannot import sglang
        raise UpstreamUnavailable(f"cannot import transformers for sglang: {error}") from None
    sys.meta_path.insert(0, _TorchvisionStandIn())


_LOADED: SglangSource | None = None


def load_sglang(src: Path | None = None, expected_version: str | None = SUPPORTED_VERSION
                ) -> SglangSource:
    """Import sglang (from ``src`` when given) and check it is a version the adapter drives."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    env_src = os.environ.get("OVERLAP_SPEC_SGLANG_SRC")
    if src is None and env_src:
        src = Path(env_src)
    if src is not None:
        if not src.is_dir():
            raise UpstreamUnavailable(f"--sglang-src {src}: no such directory")
        sys.path.insert(0, str(find_package_dir(src.resolve())))
    os.environ.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
    try:
        import torch  # noqa: F401
    except Exception as error:  # noqa: BLE001
        raise UpstreamUnavailable(f"torch does not import: {error}") from None
    if importlib.util.find_spec("sglang") is None:
        raise UpstreamUnavailable(
            "sglang is not installed in this environment; build the upstream environment with "
            "'./dev upstream' or pass --sglang-src DIR")
    _install_torchvision_stand_in()
    try:
        sglang = importlib.import_module("sglang")
        importlib.import_module("sglang.srt.managers.scheduler")
    except Exception as error:  # noqa: BLE001
        raise UpstreamUnavailable(
            f"sglang does not import: {type(error).__name__}: {str(error)[:300]}") from None
    version = str(getattr(sglang, "__version__", "unknown"))
    package_dir = str(Path(sglang.__file__ or "").resolve().parent)
    if expected_version is not None and src is None and version != expected_version:
        raise UpstreamUnavailable(
            f"sglang {version} is installed; this adapter drives {expected_version} "
            "(rebuild with './dev upstream', or pass --sglang-src for a tree)")
    source = "release" if "site-packages" in package_dir else package_dir
    _LOADED = SglangSource(version, source, package_dir)
    return _LOADED
