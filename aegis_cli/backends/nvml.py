"""NVML memory-health counters (ECC, retired pages, remapped rows) and live telemetry
(clocks, temperature, power, throttle reasons), absent gracefully.

``snapshot(identity)`` reads what the driver knows about a GPU's memory health; the memory
probe takes one before and one after it fills and holds the GPU's memory, and ``delta``
says what changed. Without nvidia-ml-py (``pynvml``), without a driver, or for a CPU
device the snapshot is ``{"available": False, "reason": …}``: never an exception. Counters
a GPU does not support are ``None``. ``Telemetry`` keeps one NVML session open and reads the
SM clock, temperature, power and throttle reasons as often as a burn-in (``aegis scan --soak``)
samples them.
"""

from __future__ import annotations

import contextlib

from aegis_cli.backends.base import DeviceIdentity

COUNTERS = ("ecc_volatile_corrected", "ecc_volatile_uncorrected", "ecc_aggregate_corrected", "ecc_aggregate_uncorrected",
            "retired_pages_sbe", "retired_pages_dbe", "remapped_rows_correctable", "remapped_rows_uncorrectable")
FLAGS = ("retired_pages_pending", "remap_pending", "remap_failure")


def handle_by_bus_id(nv, pci: str | None):
    """The NVML handle of the GPU at PCI bus id ``pci``, or None where NVML knows no such card."""
    for lookup in ("nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleByPciBusId"):  # not every pynvml has _v2
        with contextlib.suppress(Exception):
            return getattr(nv, lookup)(pci)
    return None


def _handle(nv, identity: DeviceIdentity):
    if identity.uuid and identity.uuid.startswith(("GPU-", "MIG-")):
        with contextlib.suppress(Exception):
            return nv.nvmlDeviceGetHandleByUUID(identity.uuid)
    h = handle_by_bus_id(nv, identity.pci_bus_id)
    if h is not None:
        return h
    # not by index: NVML counts every GPU in the node, CUDA only the visible ones, so the same
    # index can be another card, whose counters would then be blamed on this one
    raise LookupError("NVML knows neither its UUID nor its PCI bus id")


def snapshot(identity: DeviceIdentity) -> dict:
    """ECC error totals, retired pages and remapped rows of one GPU, as the driver reports them."""
    if identity.backend != "cuda":
        return {"available": False, "reason": f"{identity.backend} device: no NVML counters"}
    try:
        import pynvml as nv
    except ImportError:
        return {"available": False, "reason": "nvidia-ml-py (pynvml) is not installed"}
    try:
        nv.nvmlInit()
    except Exception as exc:
        return {"available": False, "reason": f"NVML init failed: {exc}"}
    try:
        try:
            h = _handle(nv, identity)
        except Exception as exc:
            return {"available": False, "reason": f"NVML has no handle for {identity.id}: {exc}"}

        def get(fn, *args):
            try:
                return fn(*args)
            except Exception:  # NotSupported, NoPermission …: the counter is unknown, not zero
                return None

        out: dict = {"available": True}
        mode = get(nv.nvmlDeviceGetEccMode, h)
        out["ecc_enabled"] = None if mode is None else bool(mode[0])
        for kind, err in (("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED), ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            out[f"ecc_volatile_{kind}"] = get(nv.nvmlDeviceGetTotalEccErrors, h, err, nv.NVML_VOLATILE_ECC)
            out[f"ecc_aggregate_{kind}"] = get(nv.nvmlDeviceGetTotalEccErrors, h, err, nv.NVML_AGGREGATE_ECC)
        sbe = get(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = get(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        out["retired_pages_sbe"] = None if sbe is None else len(sbe)
        out["retired_pages_dbe"] = None if dbe is None else len(dbe)
        pending = get(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        out["retired_pages_pending"] = None if pending is None else bool(pending)
        rows = get(nv.nvmlDeviceGetRemappedRows, h)  # (correctable, uncorrectable, pending, failure)
        if rows is not None:
            out.update(remapped_rows_correctable=int(rows[0]), remapped_rows_uncorrectable=int(rows[1]),
                       remap_pending=bool(rows[2]), remap_failure=bool(rows[3]))
        else:
            out.update(remapped_rows_correctable=None, remapped_rows_uncorrectable=None, remap_pending=None, remap_failure=None)
        return out
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()


def delta(before: dict, after: dict) -> dict:
    """Counters that grew and flags that turned on between two snapshots."""
    if not (before.get("available") and after.get("available")):
        return {}
    out = {}
    for key in COUNTERS:
        b, a = before.get(key), after.get(key)
        if isinstance(b, int) and isinstance(a, int) and a > b:  # a reset counter is no new error
            out[key] = a - b
    for key in FLAGS:
        if after.get(key) and not before.get(key):
            out[key] = True
    return out


# clocks-event (throttle) reason bits of nvmlDeviceGetCurrentClocksEventReasons, as nvml.h names them
THROTTLE_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


def throttle_names(mask: int) -> list[str]:
    """The reasons a clocks-event bit mask names (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


class Telemetry:
    """Live readings of one GPU over one NVML session: ``read()`` gives the SM clock (MHz),
    temperature (°C), power draw (W) and throttle reasons, or None where NVML cannot say
    (``reason`` tells why); a reading NVML refuses is None. ``close()`` ends the session."""

    def __init__(self, identity: DeviceIdentity):
        self.reason: str | None = None
        self._nv = self._h = None
        if identity.backend != "cuda":
            self.reason = f"{identity.backend} device: no NVML telemetry"
            return
        try:
            import pynvml as nv
        except ImportError:
            self.reason = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            nv.nvmlInit()
        except Exception as exc:
            self.reason = f"NVML init failed: {exc}"
            return
        try:
            self._h = _handle(nv, identity)
        except Exception as exc:
            self.reason = f"NVML has no handle for {identity.id}: {exc}"
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()
            return
        self._nv = nv

    @property
    def available(self) -> bool:
        return self._nv is not None

    def _get(self, name: str, *args):
        fn = getattr(self._nv, name, None)
        if fn is None:
            return None
        try:
            return fn(self._h, *args)
        except Exception:  # NotSupported, NoPermission …: unknown, not zero
            return None

    def read(self) -> dict | None:
        if self._nv is None:
            return None
        nv = self._nv
        power = self._get("nvmlDeviceGetPowerUsage")  # mW
        limit = self._get("nvmlDeviceGetEnforcedPowerLimit")
        # renamed "clocks event reasons" in newer drivers; older pynvml has only the throttle name
        mask = self._get("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is None:
            mask = self._get("nvmlDeviceGetCurrentClocksThrottleReasons")
        return {"sm_clock_mhz": self._get("nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM),
                "temperature_c": self._get("nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU),
                "power_w": None if power is None else round(power / 1000, 1),
                "power_limit_w": None if limit is None else round(limit / 1000, 1),
                "throttle": None if mask is None else throttle_names(int(mask))}

    def close(self) -> None:
        if self._nv is not None:
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()
            self._nv = None
