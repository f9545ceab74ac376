"""What a result depends on: this tool's version and its dependencies'."""

from __future__ import annotations

import platform
import sys
from importlib import metadata


def tool_version() -> str:
    try:
        return metadata.version("aegis-sdc")
    except metadata.PackageNotFoundError:
        return "0.1.0.dev0+checkout"


def versions() -> dict[str, str]:
    """Versions of what a result depends on; looked up without importing CUDA libraries."""
    out = {"aegis": tool_version(), "python": platform.python_version()}
    for dist in ("torch", "numpy", "cupy-cuda13x", "cupy-cuda12x", "cupy", "safetensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    if "torch" in sys.modules:
        cuda = getattr(sys.modules["torch"].version, "cuda", None)
        if cuda:
            out["torch_cuda"] = cuda
    return out
