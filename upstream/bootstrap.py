"""Import sglang for the upstream tier: choose the tree, stand in for torchvision, check it.

Call :func:`load_sglang` before anything imports ``sglang``. It is the only module of
``upstream/`` that may run before sglang exists; everything else imports sglang freely.

Which sglang is driven, in order:

1. ``--sglang-src DIR`` (``OVERLAP_SPEC_SGLANG_SRC``): a source checkout (``DIR/python/sglang``)
   or a directory holding the package (``DIR/sglang``), put first on ``sys.path``;
2. otherwise whatever ``import sglang`` finds, so a copy placed first on ``PYTHONPATH`` is the
   one driven;
3. otherwise the release installed in the upstream environment (``./dev upstream``).

Every failure is an :class:`UpstreamUnavailable` with one line a user can act on; a
:class:`CannotDrive` (exit 3) when the sglang chosen is there but is not one the tier can
drive (it does not import, it is another release than the one installed for the tier);
the names it must have are checked by :mod:`upstream.compat`.

The version reported is the driven tree's own (:func:`read_tree_version`), never the
installed release's metadata, and a tree inside a git checkout is named by its commit.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_VERSION = "0.5.23"


class UpstreamUnavailable(Exception):
    """sglang cannot be driven here (missing, not a tree): a usage error."""


class CannotDrive(UpstreamUnavailable):
    """The sglang given is there but the tier cannot drive it (it does not import, another
    release is installed, a name the tier relies on is gone): exit 3, not a usage error."""

    def __init__(self, message: str, hook: str = "import sglang") -> None:
        super().__init__(message)
        self.hook = hook


@dataclass(frozen=True)
class SglangSource:
    version: str
    source: str  # "release" (site-packages) or the directory the package came from
    package_dir: str
    commit: str | None = None  # the git commit of a tree inside a checkout (short)
    modified: bool = False  # that checkout has uncommitted changes

    def describe(self) -> str:
        """``sglang 0.5.23`` / ``sglang 0.5.24.dev3 at commit abc1234 (modified), /src``."""
        commit = "" if self.commit is None else f" at commit {self.commit}" + (
            " (modified)" if self.modified else "")
        return f"sglang {self.version}{commit} ({self.source})"

    def to_json(self) -> dict[str, str | bool | None]:
        return {"version": self.version, "source": self.source, "commit": self.commit,
                "modified": self.modified}


def _read_assigned_string(path: Path, name: str) -> str | None:
    """The string literal assigned to ``name`` at the top of ``path`` (not executed)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if (any(isinstance(t, ast.Name) and t.id == name for t in targets)
                and isinstance(value, ast.Constant) and isinstance(value.value, str)):
            return value.value
    return None


def read_git_commit(directory: Path) -> tuple[str | None, bool]:
    """The short commit of the git checkout holding ``directory`` and whether it has
    uncommitted changes; (None, False) outside a checkout, without git, or when the tree
    is not tracked there (a copy lying untracked inside another repository is not that
    repository's commit). A status that cannot be read keeps the commit, unmodified."""
    def git(*args: str, timeout: int = 10) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(directory), *args], capture_output=True,
                              text=True, timeout=timeout, check=False)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0 or not head.stdout.strip():
            return None, False
        if not git("ls-files", "--").stdout.strip():
            return None, False  # nothing here is tracked by the enclosing checkout
    except (OSError, subprocess.SubprocessError):
        return None, False
    try:
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".", timeout=30)
    except (OSError, subprocess.SubprocessError):
        return head.stdout.strip(), False
    return head.stdout.strip(), bool(status.stdout.strip())


def read_tree_version(package_dir: Path) -> str:
    """The version of the sglang package in ``package_dir`` (the ``sglang`` folder) as the
    tree itself says it, without importing it: ``_version.py`` (written when the package
    was built), or a literal ``__version__`` in ``version.py`` or ``__init__.py``; in a
    git checkout that tracks it with neither, ``git describe --tags``; else ``unknown``.
    Never the installed release's metadata, which ``version.py`` falls back to in a
    checkout."""
    for name in ("_version.py", "version.py", "__init__.py"):
        version = _read_assigned_string(package_dir / name, "__version__")
        if version:
            return version
    if read_git_commit(package_dir)[0] is None:
        return "unknown"  # not a checkout, or a copy the enclosing checkout does not track
    try:
        described = subprocess.run(["git", "-C", str(package_dir), "describe", "--tags",
                                    "--always"], capture_output=True, text=True, timeout=10,
                                   check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    text = described.stdout.strip()
    return f"{text.removeprefix('v')} (git describe)" if described.returncode == 0 and text \
        else "unknown"


def describe_package(package_dir: Path, release: bool, installed_version: str
                     ) -> SglangSource:
    """What is driven: the release by its installed version, a tree by its own."""
    if release:
        return SglangSource(installed_version, "release", str(package_dir))
    commit, modified = read_git_commit(package_dir)
    return SglangSource(read_tree_version(package_dir), str(package_dir), str(package_dir),
                        commit, modified)


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
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise UpstreamUnavailable(
            "sglang is not installed in this environment; build the upstream environment with "
            "'./dev upstream' or pass --sglang-src DIR")
    _install_torchvision_stand_in()
    try:
        sglang = importlib.import_module("sglang")
        importlib.import_module("sglang.srt.managers.scheduler")
    except Exception as error:  # noqa: BLE001
        raise CannotDrive(
            f"sglang does not import: {type(error).__name__}: {str(error)[:300]}") from None
    package_dir = Path(sglang.__file__ or "").resolve().parent
    release = "site-packages" in str(package_dir)
    _LOADED = describe_package(package_dir, release,
                               str(getattr(sglang, "__version__", "unknown")))
    if expected_version is not None and src is None and _LOADED.version != expected_version:
        version, _LOADED = _LOADED.version, None
        raise CannotDrive(
            f"sglang {version} is installed; this adapter drives {expected_version} "
            "(rebuild with './dev upstream', or pass --sglang-src for a tree)", "sglang version")
    return _LOADED


def find_sglang_source(src: Path | None) -> SglangSource | None:
    """The sglang that :func:`load_sglang` would drive, described without importing it
    (for a report when it does not import); None when there is none."""
    if src is None and os.environ.get("OVERLAP_SPEC_SGLANG_SRC"):
        src = Path(os.environ["OVERLAP_SPEC_SGLANG_SRC"])
    if src is not None:
        try:
            package = find_package_dir(src.resolve()) / "sglang"
        except UpstreamUnavailable:
            return None
        return describe_package(package, False, "unknown")
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations))).resolve()
    release = "site-packages" in str(package)
    return describe_package(package, release, read_tree_version(package))
