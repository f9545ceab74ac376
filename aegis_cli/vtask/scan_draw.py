"""Were a vTask's inputs a scan's own draw? τ is calibrated for the scan's input distributions
(docs/calibration.md); ``dist`` in a bundle is only a label any producer can write, so it counts
when the inputs regenerate bit for bit from (dist, seed, case id) as the scan drew them
(GemmCase.operands), on the replaying device's backend or the CPU's."""

from __future__ import annotations

import functools

from aegis_cli.backends.base import Device
from aegis_cli.checks.observed import same_bits
from aegis_cli.ops import numerics
from aegis_cli.ops.case import split_scale
from aegis_cli.probes.gemm import draw_operands, scaled
from aegis_cli.vtask import model as vtask

REGENERATE_BYTES = 2 << 30  # memory for regenerating a vTask's inputs where the device's free memory is unknown


def is_scan_draw(dev: Device, vt: vtask.VTask) -> tuple[bool, str]:
    """(whether ``vt``'s inputs are the scan's draw from its ``dist``, a clause saying why not)."""
    g = vt.gemm
    if vt.dist not in numerics.DISTRIBUTIONS:
        return False, ""
    claim = f"; dist {vt.dist!r} is claimed, but "
    group, scale = split_scale(vt.case_id or "")
    if vt.seed is None or scale is None:
        return False, claim + "without the scan's seed and case id its inputs cannot be checked against it"
    # generating fills fp32 (plus three more for heavy tails), then rounds to bf16
    need = 18 * (g.m * g.k + g.k * g.n)
    backends = [(dev.generate, dev.memory_free())]
    if dev.identity.backend != "cpu":
        backends.append((functools.partial(numerics.generate_bf16, device="cpu"), None))
    stored = (vt.tensors["a"], vt.tensors["b"])
    tried = False
    for generate, free in backends:
        if need > (free if free is not None else REGENERATE_BYTES):
            continue
        tried = True
        drawn = scaled(draw_operands(generate, g.layout, g.m, g.n, g.k, vt.dist, vt.seed, group), *vt.scale)
        a, b = g.sub_operands(drawn.a, drawn.b)
        if all(same_bits(x.to("cpu"), y) for x, y in zip((a, b), stored, strict=True)):
            return True, ""
    if not tried:
        return False, claim + f"its {g.m}x{g.n}x{g.k} inputs are too large to regenerate here and check against it"
    return False, claim + "its inputs are not the scan's draw from it (seed and case id)"
