"""Who a CUDA device is: name, UUID, serial, PCI bus id and driver, from torch's device
properties and NVML (matched by bus id, else UUID; never by index). A MIG slice is keyed by its
own UUID and name. Importing this module touches neither NVML nor CUDA.
"""

from __future__ import annotations

import contextlib

import torch

from aegis_cli.backends import nvml
from aegis_cli.backends.base import DeviceIdentity, node_name


def nvml_identity(pci: str, uuid: str) -> dict:
    """Name, UUID, serial, bus id and driver from NVML, matched by PCI bus id, else by CUDA's UUID;
    {} if NVML is unusable or knows neither. Never by index: NVML counts every GPU in the node,
    CUDA only the visible ones (fastest first), so the same index can be another card."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict = {}
    try:
        h = nvml.handle_by_bus_id(pynvml, pci)
        if h is None:
            with contextlib.suppress(Exception):
                h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        if h is None:
            return {}

        def get(fn, *args):
            try:
                v = fn(*args)
                return v.decode() if isinstance(v, bytes) else v
            except Exception:
                return None

        out = {"name": get(pynvml.nvmlDeviceGetName, h), "uuid": get(pynvml.nvmlDeviceGetUUID, h),
               "serial": get(pynvml.nvmlDeviceGetSerial, h), "driver": get(pynvml.nvmlSystemGetDriverVersion)}
        mig = get(pynvml.nvmlDeviceGetMigMode, h)  # (current, pending); the bus id names the whole GPU
        out["mig"] = bool(mig and mig[0] == 1)
        info = get(pynvml.nvmlDeviceGetPciInfo, h)
        if info is not None:
            bus = info.busId
            out["pci_bus_id"] = bus.decode() if isinstance(bus, bytes) else bus
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return {k: v for k, v in out.items() if v}


def device_identity(index: int) -> DeviceIdentity:
    props = torch.cuda.get_device_properties(index)
    pci = (f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
           if hasattr(props, "pci_domain_id") else "")  # older torch: NVML finds the card by UUID
    nv = nvml_identity(pci, f"GPU-{props.uuid}")
    extra = {"cc": f"{props.major}.{props.minor}", "sms": str(props.multi_processor_count),
             "memory_gib": f"{props.total_memory / 2**30:.1f}", "identity_source": "nvml" if nv else "torch"}
    uuid, name = nv.get("uuid") or f"GPU-{props.uuid}", nv.get("name") or props.name
    if nv.get("mig"):
        # a MIG slice: NVML's handle by bus id is the parent GPU, whose UUID every slice would share
        # (one history for all of them) and whose name keys golden records and fingerprint classes of
        # the whole GPU (more SMs: torch's RNG and cuBLAS give other bits). The slice's own keep it apart
        uuid, name = f"MIG-{props.uuid}", props.name if "MIG" in props.name else f"{props.name} MIG {props.multi_processor_count} SMs"
        extra["parent_uuid"] = nv.get("uuid") or ""
    return DeviceIdentity(backend="cuda", index=index, name=name, uuid=uuid, host=node_name(), serial=nv.get("serial"),
                          pci_bus_id=nv.get("pci_bus_id") or pci or None, driver=nv.get("driver"), extra=extra)
