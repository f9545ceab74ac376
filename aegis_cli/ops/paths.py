"""Where the project's files are: ``kernels/`` and ``workloads/`` beside the package in a
checkout, ``aegis_cli/_data/…`` in a wheel."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def checkout_root() -> Path | None:
    """The source checkout the package runs from, or None when installed. Recognised by its
    pyproject.toml: installed, the package's parent is site-packages, where another
    distribution may own a top-level ``kernels/`` or ``workloads/``."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def kernel_dir() -> Path:
    """``kernels/`` beside the package in a checkout, ``aegis_cli/_data/kernels`` in a wheel."""
    here = Path(__file__).resolve().parent.parent
    root = checkout_root()
    if root is not None and (root / "kernels" / "common.cuh").is_file():
        return root / "kernels"
    if (here / "_data" / "kernels").is_dir():
        return here / "_data" / "kernels"
    raise FileNotFoundError("aegis kernels directory not found (broken install?)")


def catalog_dir() -> Path:
    """Where the shipped catalogs live: ``workloads/`` beside the package in a checkout,
    ``aegis_cli/_data/workloads`` in a wheel (copied there at build time)."""
    root = checkout_root()
    if root is not None and (root / "workloads").is_dir():
        return root / "workloads"
    return Path(str(resources.files("aegis_cli"))) / "_data" / "workloads"
