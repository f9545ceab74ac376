"""Backend registry and device selection. Importing this touches no GPU."""

from __future__ import annotations

from aegis_cli.backends.base import Backend, Device
from aegis_cli.ops.errors import DeviceError

BACKENDS = ("cpu", "cuda")


def get_backend(name: str) -> Backend:
    if name == "cpu":
        from aegis_cli.backends.cpu import CpuBackend

        return CpuBackend()
    if name == "cuda":
        try:
            from aegis_cli.backends.cuda import CudaBackend
        except ImportError as exc:  # pragma: no cover - the CUDA backend ships with the package
            raise DeviceError(f"CUDA backend unavailable: {exc}") from None
        return CudaBackend()
    raise DeviceError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")


def cuda_available() -> bool:
    try:
        return get_backend("cuda").available()
    except DeviceError:
        return False


def resolve_devices(spec: str = "auto") -> list[Device]:
    """Devices named by ``spec``: ``auto`` (every GPU, else the CPU), ``all``, ``cpu``,
    ``cuda``, ``cpu:N``, ``cuda:N``, or a comma-separated list of those."""
    out: list[Device] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part == "auto":
            out += get_backend("cuda").devices() if cuda_available() else [get_backend("cpu").device(0)]
        elif part == "all":
            out += get_backend("cpu").devices() + (get_backend("cuda").devices() if cuda_available() else [])
        elif part in BACKENDS:
            backend = get_backend(part)
            if not backend.available():
                raise DeviceError(f"no {part} devices on this node")
            out += backend.devices()
        else:
            name, sep, idx = part.partition(":")
            if not sep or name not in BACKENDS or not (idx.isascii() and idx.isdigit()):
                raise DeviceError(f"unknown device {part!r} (use auto, all, cpu, cuda, cpu:N, cuda:N or a comma-separated list)")
            backend = get_backend(name)
            if name == "cuda" and not backend.available():
                raise DeviceError(f"unknown device {part!r}: no CUDA devices on this node")
            out.append(backend.device(int(idx)))
    if not out:
        raise DeviceError(f"no devices selected by {spec!r}")
    seen, unique = set(), []
    for d in out:
        if d.identity.id not in seen:
            seen.add(d.identity.id)
            unique.append(d)
    return unique
