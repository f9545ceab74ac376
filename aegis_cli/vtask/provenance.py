"""The provenance of captured vTasks (docs/bundle-format.md): where the computation ran, what ran
it, when and why. One builder for every producer, a scan (vtask/from_scan.py) or a training job
(sensors/save.py). Kept apart from vtask/capture.py, which imports no backend."""

from __future__ import annotations

from aegis_cli.backends.base import DeviceIdentity
from aegis_cli.backends.loader import kernel_hashes
from aegis_cli.ops.provenance import versions
from aegis_cli.vtask.model import MAX_STRING


def device_provenance(ident: DeviceIdentity, *, rank: int | None, job: str | None, captured: str, command_line: list,
                      injected: bool, step: int | None = None) -> dict:
    """Provenance of vTasks captured on the device ``ident``; None values (and an empty job) left out."""
    vers = versions()
    prov = {"host": ident.host, "device_id": ident.id, "gpu_name": ident.name, "gpu_uuid": ident.uuid,
            "gpu_serial": ident.serial, "pci_bus_id": ident.pci_bus_id, "rank": rank, "step": step, "job": job or None,
            "captured": captured, "command_line": [str(x)[:MAX_STRING] for x in command_line][:256],
            "versions": {k: v for k, v in {**vers, "driver": ident.driver, "cuda": vers.get("torch_cuda")}.items() if v},
            "kernel_hashes": kernel_hashes(), "injected": injected}
    return {k: v for k, v in prov.items() if v is not None}
