"""Checked GEMMs back to back for the burn-in (``aegis scan --soak``), without a host sync per
launch.

``Launcher(device)`` prepares a launch once per operand set (``prepare``) and runs it as often
as the burn-in asks. On a CUDA GPU each run only enqueues the same packed launch (TMA
descriptors, grid, the one loader/launcher of loader.py) writing into outputs of its own, so
the result of a recent launch is still there when the burn-in learns, a little later, that its
checks flagged it: ``run`` allocates them, ``run_into`` writes into one slot of a ``Slab``, the
outputs of many launches allocated together so that the burn-in screens their checksums in
one batch and a launch costs the host little more than the launch itself. Other devices (the
CPU reference path) run ``Device.checked_gemm`` itself, which is synchronous anyway.

Faults (``--inject``) act as in ``CudaDevice.checked_gemm``: accumulator faults in the kernels'
injection build (this launch only, then one sync to record where they landed), operand and
output faults through that method's host copies. A launch no fault touches stays asynchronous,
so an intermittent fault (``prob=…``) costs nothing on the launches it skips.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass, field

import torch

from aegis_cli.backends import loader
from aegis_cli.backends.base import Device
from aegis_cli.backends.cuda import CTA_TILES, OUTS, CudaDevice
from aegis_cli.faults.kernel_params import acc_faults, inject_params
from aegis_cli.faults.spec import FaultPlan, LaunchContext
from aegis_cli.ops.errors import DeviceError
from aegis_cli.ops.gemm import GemmOperands, GemmResult


@dataclass
class Slab:
    """The outputs of up to ``size`` launches of one prepared GEMM: slot i's C is ``c[i]``, its
    row sums ``row_sums[i]``, and so on (tile→SM filled with -1 first, so a tile no launch wrote
    shows; prepare fills it only when poisoning)."""

    c: torch.Tensor  # (size, M, N) bf16
    row_sums: torch.Tensor  # (size, M, nt_n) fp32
    col_sums: torch.Tensor  # (size, nt_m, N) fp32
    tile_sm: torch.Tensor  # (size, nt_m, nt_n) int32
    tile: tuple[int, int]
    bases: tuple[int, ...] = field(init=False)  # data pointers of slot 0, and bytes from one slot to the next
    steps: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        outs = (self.c, self.row_sums, self.col_sums, self.tile_sm)
        self.bases = tuple(t.data_ptr() for t in outs)
        self.steps = tuple(t.stride(0) * t.element_size() for t in outs)

    def pointers(self, slot: int) -> list[ctypes.c_void_p]:
        return [ctypes.c_void_p(b + slot * d) for b, d in zip(self.bases, self.steps, strict=True)]

    def result(self, slot: int, kernel: str, injected: bool) -> GemmResult:
        return GemmResult(c=self.c[slot], row_sums=self.row_sums[slot], col_sums=self.col_sums[slot], tile=self.tile,
                          tile_sm=self.tile_sm[slot], kernel=kernel, injected=injected)

    def store(self, slot: int, res: GemmResult) -> None:
        """A result computed elsewhere (a launch a fault fired on) into ``slot``."""
        for dst, src in ((self.c, res.c), (self.row_sums, res.row_sums), (self.col_sums, res.col_sums), (self.tile_sm, res.tile_sm)):
            dst[slot].copy_(src)


@dataclass
class Prepared:
    """One operand set made ready to run: the packed launch on a GPU (None on other devices)."""

    ops: GemmOperands
    launch: object | None = None  # cuda._Launch


def _pointers(launch) -> list[int]:
    return [a.value or 0 for a in launch.args[OUTS]]


def _fresh(launch):
    """``launch`` on torch's current stream, writing into outputs newly allocated there (of the
    same shapes; tile→SM filled with -1 first, as Slab's), arguments repacked; the launch it
    came from keeps its own."""
    old = launch.keep[OUTS]
    outs = [torch.empty_like(t) for t in old[:3]] + [torch.full_like(old[3], -1)]
    args = list(launch.args)
    args[OUTS] = [ctypes.c_void_p(t.data_ptr()) for t in outs]
    keep = list(launch.keep)
    keep[OUTS] = outs
    return dataclasses.replace(launch, args=args, keep=keep, stream=loader.current_stream(launch.device_id))


class Launcher:
    """Runs checked GEMMs on ``device`` for the burn-in; see the module docstring."""

    def __init__(self, device: Device):
        self.device = device
        self.cuda = isinstance(device, CudaDevice)  # run_into and slab: a GPU's only

    def prepare(self, ops: GemmOperands) -> Prepared:
        if not self.cuda:
            return Prepared(ops)
        dev: CudaDevice = self.device  # type: ignore[assignment]
        with torch.cuda.device(dev.torch_device):
            launch = dev.prepare(ops.a, ops.b, ops.layout)
        # the outputs must sit where prepare packed them: _fresh rewrites exactly those arguments
        if _pointers(launch) != [t.data_ptr() for t in launch.keep[OUTS]]:
            raise DeviceError(f"{dev.identity.id}: the GEMM launch's arguments changed layout; the burn-in cannot repack them")
        return Prepared(ops, launch)

    def slab(self, p: Prepared, size: int) -> Slab:
        """Outputs for ``size`` launches of ``p`` (a GPU's only), on the stream ``p`` was prepared on."""
        c, rows, cols, tile_sm = p.launch.keep[OUTS]
        new = lambda t: torch.empty((size, *t.shape), dtype=t.dtype, device=t.device)
        return Slab(new(c), new(rows), new(cols), torch.full((size, *tile_sm.shape), -1, dtype=tile_sm.dtype, device=tile_sm.device),
                    self.device.tile)

    def run_into(self, p: Prepared, slab: Slab, slot: int, fault: FaultPlan | None = None, *, op: str = "",
                 clean_median: float | None = None) -> tuple[str, bool]:
        """One checked GEMM of ``p``'s operands writing into ``slab``'s ``slot``, enqueued only
        (on the stream ``p`` was prepared on) unless a fault fires on this launch; returns what
        ``slab.result`` needs of it: the kernel that ran and whether a fault plan was on the
        launch (GemmResult.kernel, .injected)."""
        launch = p.launch
        if fault is not None:
            res = self._faulted(p, fault, op, clean_median)
            if res is not None:
                slab.store(slot, res)
                return res.kernel, res.injected
        args = list(launch.args)
        args[OUTS] = slab.pointers(slot)
        launch.run(args)
        return f"gemm_{launch.kernel}", fault is not None

    def _faulted(self, p: Prepared, fault: FaultPlan, op: str, clean_median: float | None) -> GemmResult | None:
        """The result of a launch a fault fires on (computed synchronously), else None; counts the launch."""
        dev = self.device
        ctx = LaunchContext(dev.identity.id, op, dev.tile, None, clean_median)
        if fault.active(ctx, "operands") or fault.active(ctx, "out"):
            return dev.checked_gemm(p.ops, fault, op=op, clean_median=clean_median)  # host copies, synchronous
        acc = acc_faults(fault, ctx, p.ops, CTA_TILES[p.launch.kernel])
        if acc is not None:
            return self._injected(p, fault, ctx, acc)
        fault.launches += 1  # the plan counts launches: an intermittent fault's coin is drawn per launch
        return None

    def run(self, p: Prepared, fault: FaultPlan | None = None, *, op: str = "", clean_median: float | None = None) -> GemmResult:
        """One checked GEMM of ``p``'s operands on torch's current stream; on a GPU enqueued only
        (the caller synchronises), unless a fault fires on this launch."""
        dev = self.device
        if not self.cuda:
            return dev.checked_gemm(p.ops, fault, op=op, clean_median=clean_median)
        if fault is not None:
            res = self._faulted(p, fault, op, clean_median)
            if res is not None:
                return res
        launch = _fresh(p.launch)
        launch.run()
        c, row_sums, col_sums, tile_sm = launch.outputs
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=dev.tile, tile_sm=tile_sm,
                          kernel=f"gemm_{launch.kernel}", injected=fault is not None)

    def _injected(self, p: Prepared, fault: FaultPlan, ctx: LaunchContext, acc) -> GemmResult:
        """A launch an accumulator fault fires on: the injection build, then one sync so the
        plan records the tiles and SMs it hit (as CudaDevice.checked_gemm does)."""
        dev: CudaDevice = self.device  # type: ignore[assignment]
        m, n, _ = p.ops.mnk
        inj, keep = inject_params(acc, m, n, dev.tile, dev.torch_device)
        with torch.cuda.device(dev.torch_device):
            launch = dev.prepare(p.ops.a, p.ops.b, p.ops.layout, variant="inject", inject=inj)
            launch.run()
        dev.synchronize()
        del keep
        c, row_sums, col_sums, tile_sm = launch.outputs
        ctx.tile_sm = tile_sm.cpu().numpy()
        for record in acc.after:
            record(ctx.tile_sm)
        fault.launches += 1
        return GemmResult(c=c, row_sums=row_sums, col_sums=col_sums, tile=dev.tile, tile_sm=tile_sm,
                          kernel=f"gemm_{launch.kernel}+inject", injected=True)
