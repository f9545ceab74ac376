"""What ``aegis info`` shows: backends, devices, versions, kernels and cache locations."""

from __future__ import annotations

from aegis_cli import workloads
from aegis_cli.backends import get_backend, loader
from aegis_cli.report import versions


def gather() -> dict:
    backends, devices = [], []
    for name in ("cpu", "cuda"):
        entry = {"name": name, "available": False}
        try:
            b = get_backend(name)
            entry["available"] = b.available()
            if entry["available"]:
                for d in b.devices():
                    devices.append({**d.identity.to_dict(), "details": d.describe()})
            else:
                entry["reason"] = "no device or CuPy not installed" if name == "cuda" else "?"
        except Exception as exc:  # info must still print what it can
            entry["reason"] = str(exc)
        backends.append(entry)
    try:
        kdir = str(loader.kernel_dir())
    except FileNotFoundError as exc:
        kdir = f"missing ({exc})"
    return {
        "versions": versions(),
        "backends": backends,
        "devices": devices,
        "paths": {"kernels": kdir, "workloads": str(workloads.catalog_dir()), "cupy kernel cache": loader.cache_dir()},
        "workloads": workloads.available(),
        "kernel_hashes": loader.kernel_hashes(),
    }
