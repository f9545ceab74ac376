"""CPU reference backend (torch on the host).

The "device" is the host CPU. The checked GEMM multiplies the bf16 operands exactly in
fp32 (bf16·bf16 products are exact in fp32) with fp32 accumulation, takes row/column
checksums from that accumulator in fp64 (exact sums of the fp32 values up to a final
rounding), then rounds C to bf16 — the same contract as the GPU kernels.

Several simulated devices (``cpu:0``, ``cpu:1`` …) can be asked for, to exercise
node-level logic (sweeps, cross-device comparison) on one machine; each has its own id.
Tiles are assigned to ``SIM_SMS`` simulated multiprocessors round-robin so SM-pinned
fault models have something to pin to.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from functools import cache

import numpy as np
import torch

from aegis_cli.backends.base import Backend, Device, DeviceIdentity, node_name
from aegis_cli.faults import tensor as corrupt
from aegis_cli.faults.attention import pass_fault
from aegis_cli.faults.spec import FaultPlan, LaunchContext
from aegis_cli.ops import attention, fingerprint, numerics
from aegis_cli.ops.errors import DeviceError
from aegis_cli.ops.gemm import GemmOperands, GemmResult

CPU_TILE = (128, 128)
SIM_SMS = 16


# torch's fp32 GEMM rounds to nearest in short blocked chains: measured, its clean noise follows ρ
# with no growth in K to speak of (power 0; docs/calibration.md)
CPU_NOISE = numerics.NoiseModel(unit=1e-6, power=0.0, cap=numerics.S_FLOOR,
                                source="largest clean |Δ|/ρ of 1,257 launches (cpu-quick, llama3-1b) on an x86 CPU, 8.4e-7, 2026-12-01")


@cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


@cache
def _machine_id(paths: tuple[str, ...] = ("/etc/machine-id", "/var/lib/dbus/machine-id")) -> str:
    """This host's part of a CPU device UUID: the OS machine-id with the hostname mixed in.
    Cloned VM images often share one machine-id, and two hosts with one UUID would share one
    fleet history; the hostname alone stands in where there is no machine-id."""
    mid = ""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as fh:
                mid = fh.read().strip()
        except OSError:
            continue
        if mid:
            break
    return hashlib.sha256(f"{mid}\0{socket.gethostname()}".encode()).hexdigest()[:32]


def meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), in bytes;
    None where there is no such file or line (not Linux, or a kernel before 3.14)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    value, *unit = rest.split()
                    return int(value) * (1024 if unit == ["kB"] else 1)
    except (OSError, ValueError):
        return None
    return None


def _accumulate(a_mk: torch.Tensor, b_kn: torch.Tensor) -> torch.Tensor:
    """(M, N) fp32 accumulator of the CPU path's GEMM."""
    return a_mk.float() @ b_kn.float()


class CpuDevice(Device):
    shape_independent_sums = False  # BLAS picks its summation order by the GEMM's shape

    def __init__(self, index: int = 0):
        self.tile = CPU_TILE
        self.identity = DeviceIdentity(
            backend="cpu",
            index=index,
            name=_cpu_name(),
            uuid=f"CPU-{_machine_id()[:24]}-{index}",
            host=node_name(),
            extra={"threads": str(torch.get_num_threads()), "simulated": "yes" if index else "no"},
        )

    def generate(self, shape: tuple[int, ...], dist: str, seed: int) -> torch.Tensor:
        return numerics.generate_bf16(shape, dist, seed, "cpu")

    def memory_bytes(self) -> int | None:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
            return None

    def memory_free(self) -> int | None:
        return meminfo_available()

    def plain_gemm(self, ops: GemmOperands) -> torch.Tensor:
        """The product checked_gemm forms, rounded as it rounds C: an unsampled launch gives the
        bits a checked one would (on the CPU path the bits do not depend on sampling)."""
        return _accumulate(ops.a_mk, ops.b_kn).to(torch.bfloat16)

    def checked_gemm(self, ops: GemmOperands, fault: FaultPlan | None = None, op: str = "",
                     clean_median: float | None = None) -> GemmResult:
        m, n, _ = ops.mnk
        tm, tn = self.tile
        a_mk, b_kn = ops.a_mk, ops.b_kn
        ctx = None
        tile_sm = _tile_sm(m, n, self.tile)
        if fault is not None:
            ctx = LaunchContext(self.identity.id, op, self.tile, tile_sm, clean_median)
            a_mk, b_kn = corrupt.apply_operands(fault, ctx, a_mk, b_kn)
        acc = _accumulate(a_mk, b_kn)
        if fault is not None:
            corrupt.apply_acc(fault, ctx, acc, a_mk, b_kn)
        acc64 = acc.double()
        row_sums = numerics.sum_col_tiles(acc64, tn).float()
        col_sums = numerics.sum_row_tiles(acc64, tm).float()
        c = acc.to(torch.bfloat16)
        if fault is not None:
            corrupt.apply_out(fault, ctx, c)
            fault.launches += 1
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=self.tile,
                          tile_sm=torch.from_numpy(tile_sm), kernel="cpu-fp32acc",
                          injected=fault is not None)

    def attention_forward(self, q, k, v, *, causal: bool, scale: float, fault: FaultPlan | None = None,
                          op: str = "") -> attention.AttentionForward:
        af = pass_fault(fault, self.identity.id, op, attention.AttentionShape.of(q, k, causal), attention.FORWARD_STAGES)
        return attention.flash_forward(q, k, v, causal=causal, scale=scale, fault=af)

    def attention_backward(self, q, k, v, o, lse, do, *, causal: bool, scale: float, fault: FaultPlan | None = None,
                           op: str = "") -> attention.AttentionBackward:
        af = pass_fault(fault, self.identity.id, op, attention.AttentionShape.of(q, k, causal), attention.BACKWARD_STAGES)
        return attention.flash_backward(q, k, v, o, lse, do, causal=causal, scale=scale, fault=af)

    def noise_model(self, k: int) -> numerics.NoiseModel:
        return CPU_NOISE.capped_at(self.accumulation_bound(k))

    def fingerprint(self, t: torch.Tensor) -> int:
        return fingerprint.fingerprint(t)

    def describe(self) -> dict:
        return {"torch": torch.__version__, "threads": torch.get_num_threads(), "simulated_sms": SIM_SMS}


def _tile_sm(m: int, n: int, tile: tuple[int, int]) -> np.ndarray:
    tm_n, tn_n = -(-m // tile[0]), -(-n // tile[1])
    return (np.arange(tm_n * tn_n, dtype=np.int32) % SIM_SMS).reshape(tm_n, tn_n)


def simulated_env(ids: list[str]) -> str:
    """The prefix a printed command needs to see the simulated CPU devices among ``ids``
    (``AEGIS_CPU_DEVICES=N ``), empty when cpu:0 is enough."""
    sims = [int(i[4:]) for i in ids if i.startswith("cpu:") and i[4:].isdigit()]
    return f"AEGIS_CPU_DEVICES={max(sims) + 1} " if sims and max(sims) > 0 else ""


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, n_devices: int | None = None):
        if n_devices is not None:
            self.n_devices = n_devices
            return
        env = os.environ.get("AEGIS_CPU_DEVICES", "1")
        try:
            self.n_devices = int(env)
        except ValueError:
            self.n_devices = 0
        if self.n_devices < 1:  # 0 or -3 meant 1 while "abc" was refused: refuse them alike
            raise DeviceError(f"AEGIS_CPU_DEVICES={env!r} is not a positive integer")

    def available(self) -> bool:
        return True

    def devices(self) -> list[Device]:
        return [CpuDevice(i) for i in range(self.n_devices)]

    def device(self, index: int) -> Device:
        if not 0 <= index < self.n_devices:
            raise DeviceError(f"no device cpu:{index} (this node has cpu:0…cpu:{self.n_devices - 1}; set AEGIS_CPU_DEVICES to simulate more)")
        return CpuDevice(index)
