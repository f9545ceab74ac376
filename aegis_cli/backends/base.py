"""The backend interface: what a device must do for the probes.

Every backend (CPU reference, CUDA) hands out ``Device`` objects that speak torch
tensors living on that device. The probes never look inside a backend; they call
``generate``, ``checked_gemm``, ``reference_checksums`` and ``fingerprint`` and compare.

GEMM convention: C[M, N] = A[M, K] · B[K, N], bf16 in, fp32 accumulate, bf16 out.
Operands are *stored* as training stores them (see ``Layout``); ``GemmOperands``
gives the logical M×K / K×N views.
"""

from __future__ import annotations

import abc
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aegis_cli.ops.gemm import GemmOperands, GemmResult, ReferenceChecksums

if TYPE_CHECKING:  # torch is heavy; import lazily at run time
    import torch

    from aegis_cli.faults.spec import FaultPlan
    from aegis_cli.ops.attention import AttentionBackward, AttentionForward, AttentionOperands, AttentionReference
    from aegis_cli.ops.numerics import NoiseModel


def node_name() -> str:
    """The node a device is on, as reports, quarantine lists, metrics and actions name it:
    ``AEGIS_HOST`` if set (in a Kubernetes pod, set it to spec.nodeName: the pod's own hostname
    is the pod name), else the hostname."""
    return os.environ.get("AEGIS_HOST", "").strip() or socket.gethostname()

@dataclass(frozen=True)
class DeviceIdentity:
    """Who a device is. ``uuid`` identifies the physical device across reboots."""

    backend: str  # "cpu" | "cuda"
    index: int
    name: str
    uuid: str
    host: str
    serial: str | None = None
    pci_bus_id: str | None = None
    driver: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.backend}:{self.index}"

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "backend": self.backend,
            "index": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "serial": self.serial,
            "pci_bus_id": self.pci_bus_id,
            "driver": self.driver,
            "host": self.host,
            **({"extra": dict(self.extra)} if self.extra else {}),
        }


class Device(abc.ABC):
    """One device a scan can run on."""

    identity: DeviceIdentity
    tile: tuple[int, int]  # checksum tile (tm, tn) of this device's checked GEMM
    torch_device: torch.device | str = "cpu"  # where its tensors live, as torch names it (CUDA: its own)
    # whether each output and checksum is summed in an order that does not depend on the GEMM's
    # M and N (our CUDA kernels: per tile, k in order), so a sub-GEMM repeats the full one's bits
    shape_independent_sums: bool = True

    @abc.abstractmethod
    def generate(self, shape: tuple[int, ...], dist: str, seed: int) -> torch.Tensor:
        """Seeded bf16 tensor of ``shape`` drawn from ``dist`` (see numerics.DISTRIBUTIONS),
        generated on this device. Same (shape, dist, seed) → same bits on this backend."""

    @abc.abstractmethod
    def checked_gemm(self, ops: GemmOperands, fault: FaultPlan | None = None, *, op: str = "",
                     clean_median: float | None = None) -> GemmResult:
        """Run C = A·B with fused fp32-accumulator checksums; apply ``fault`` where
        the hardware fault it models would act (``op`` names the case for the fault's
        filters, ``clean_median`` scales perturbation faults). Synchronises and checks
        errors; raises DeviceError when the device fails."""

    @abc.abstractmethod
    def attention_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                          fault: FaultPlan | None = None, op: str = "") -> AttentionForward:
        """Checked flash-attention forward (ops/attention.py: shapes, GQA, what each output
        holds): O, the log-sum-exp and the row sums of the fp32 O accumulator. ``fault``'s
        ``target=attn.*`` faults of the forward stages act inside the pass (faults/attention.py).
        Synchronises; raises DeviceError when the device fails."""

    @abc.abstractmethod
    def attention_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           lse: torch.Tensor, do: torch.Tensor, *, causal: bool, scale: float,
                           fault: FaultPlan | None = None, op: str = "") -> AttentionBackward:
        """Checked, deterministic flash-attention backward from the forward's O and LSE: dQ,
        dK, dV and the fused sums of their fp32 accumulators; backward-stage faults as above."""

    def attention_reference(self, ops: AttentionOperands, scale: float) -> AttentionReference:
        """The fp64 sides the attention checks compare with (ops/attention.reference); a backend
        may compute them in a kernel of its own, tested against that reference."""
        from aegis_cli.ops.attention import reference

        return reference(ops, scale)

    def reference_checksums(self, ops: GemmOperands, tile: tuple[int, int]) -> ReferenceChecksums:
        """fp64 reference checksums read from the stored operands (not from the tiles that fed
        the matrix unit), with this device's noise scale σ at the operands' K."""
        from aegis_cli.ops import numerics  # torch: only when a device computes

        return numerics.reference_checksums(ops, tile, self.noise_model(ops.mnk[2]))

    def plain_gemm(self, ops: GemmOperands) -> torch.Tensor:
        """C (bf16) of a GEMM nobody checks (the sensors' unsampled launches): torch's product of
        the bf16 operands (cuBLAS on CUDA, fp32 accumulation)."""
        return ops.a_mk @ ops.b_kn

    def lean_side(self, left: torch.Tensor, right: torch.Tensor, t: int,
                  rho: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The sensors' reference of one side (lean.lean_side): row checksums of left (R, K) ·
        right (K, N) over tiles of ``t`` columns, (sums, s, ρ) fp64, ρ None unless ``rho``. torch's
        here, the reference every backend's own implementation is tested against (CUDA:
        kernels/sensor_reference.cu)."""
        from aegis_cli.ops import lean  # torch: only when a device computes

        return lean.lean_side(left, right, t, rho)

    def tile_abs_sums(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """Σ|x| over each tile of ``t`` columns of x (M, N): (M, ceil(N/t)) fp64 (the sensors' Σ|c|).
        torch's here (the reference); a kernel on CUDA."""
        from aegis_cli.ops import numerics  # torch: only when a device computes

        return numerics.abs_col_tiles(x, t)

    @abc.abstractmethod
    def fingerprint(self, t: torch.Tensor) -> int:
        """64-bit fingerprint of the tensor's raw bits (aegis_cli.ops.fingerprint)."""

    def accumulation_bound(self, k: int) -> float:
        """Normalised bound (÷ s) on how far this device's fp32 accumulation of a K-deep dot
        product may drift from round-to-nearest summation. 0 for a path that rounds to
        nearest after every add (its error does not grow with K relative to s); matrix units
        that truncate per MMA step override it; it caps the noise scale (NoiseModel.capped_at)."""
        return 0.0

    def noise_model(self, k: int) -> NoiseModel:
        """This device's clean checksum noise at depth K (numerics.NoiseModel): what
        ``reference_checksums`` divides differences by. Each backend declares its calibrated one."""
        raise NotImplementedError

    def synchronize(self) -> None:  # noqa: B027 - CPU needs nothing
        """Wait for queued work; raise DeviceError on an asynchronous failure."""

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu")

    def describe(self) -> dict:
        """Backend-specific facts for ``aegis info`` and reports (versions, caches)."""
        return {}

    def memory_bytes(self) -> int | None:
        """Total memory the device's tensors live in (None: unknown). Preflight only: a scan
        refuses work that could never fit instead of dying to the OOM killer half-way."""
        return None

    def memory_free(self) -> int | None:
        """Memory this process could allocate on the device now (None: unknown): total less what
        other processes hold. Preflight only, like ``memory_bytes``."""
        return None


def memory_shortfall(device: Device, need: int) -> tuple[str, str] | None:
    """Why ``need`` bytes cannot be held on ``device`` now, for preflights: ("small", "which has
    X GiB") when the device itself is too small, ("busy", "which has only …") when other
    processes hold the memory; None when it fits or the device cannot tell."""
    have, free = device.memory_bytes(), device.memory_free()
    if have and need > have:
        return "small", f"which has {have / 2**30:.1f} GiB"
    if free is not None and need > free:
        total = f" of its {have / 2**30:.1f} GiB" if have else ""
        return "busy", f"which has only {free / 2**30:.1f} GiB{total} free now (other processes hold the rest)"
    return None


class Backend(abc.ABC):
    """A family of devices (all CPUs, all CUDA GPUs)."""

    name: str

    @abc.abstractmethod
    def available(self) -> bool:
        """True when at least one device of this backend can run (no side effects
        beyond probing the driver)."""

    @abc.abstractmethod
    def devices(self) -> list[Device]:
        """Every device of this backend on the node."""

    @abc.abstractmethod
    def device(self, index: int) -> Device:
        """One device by index; DeviceError when there is no such device."""
