"""What ``aegis info`` shows: backends, devices, versions, kernels and cache locations."""

from __future__ import annotations

from aegis_cli.backends import get_backend, loader
from aegis_cli.ops import paths, workloads
from aegis_cli.ops.provenance import versions


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
        kdir = str(paths.kernel_dir())
    except FileNotFoundError as exc:
        kdir = f"missing ({exc})"
    return {
        "versions": versions(),
        "backends": backends,
        "devices": devices,
        "paths": {"kernels": kdir, "workloads": str(paths.catalog_dir()), "cupy kernel cache": loader.cache_dir()},
        "workloads": workloads.available(),
        "probes": probes(),
        "kernel_hashes": loader.kernel_hashes(),
    }


def probes() -> list[dict]:
    """Every probe ``aegis scan --probes`` takes: name, whether it runs by default, what it does
    (the first line of its docstring), and its ``--probe-option`` keys."""
    from aegis_cli.probes import DEFAULT_PROBES, NODE_PROBES, PROBE_OPTIONS, PROBES, load_all

    load_all()
    out = []
    for name, fn in sorted({**PROBES, **NODE_PROBES}.items()):
        doc = (fn.__doc__ or "").strip().splitlines()
        out.append({"name": name, "default": name in DEFAULT_PROBES, "node": name in NODE_PROBES,
                    "summary": doc[0] if doc else "", "options": sorted(PROBE_OPTIONS.get(name, {}))})
    return out
