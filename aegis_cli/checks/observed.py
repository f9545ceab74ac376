"""A replayed GEMM against what was observed when its vTask was captured: the output bits,
and the fused checksums — bit for bit when the tiles match, else per-row (per-column) totals
across tiles."""

from __future__ import annotations

import torch

from aegis_cli.ops.gemm import GemmResult


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two bf16 or fp32 tensors hold the same shape and the same bits."""
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def result_bits_equal(r1: GemmResult, r2: GemmResult) -> bool:
    return same_bits(r1.c, r2.c) and same_bits(r1.row_sums, r2.row_sums) and same_bits(r1.col_sums, r2.col_sums)


def compare_with_capture(res: GemmResult, captured: dict[str, torch.Tensor], captured_tile, exact: bool) -> dict:
    """{"matches": True/False/None (nothing to compare), "detail": what was compared and how}.
    ``captured``: the vTask's observed "c", "row_sums", "col_sums" (any may be missing);
    ``exact``: whether this run's bits can be expected to equal the capture's at all."""
    parts, matches = [], []
    cap_c = captured.get("c")
    if cap_c is not None and not exact:
        parts.append("output not compared bit for bit (a subset, on a device whose sums depend on the shape)")
    elif cap_c is not None:
        c = res.c.to("cpu")
        if same_bits(c, cap_c):
            parts.append("output bit-identical to the capture")
            matches.append(True)
        else:
            diff = (c.view(torch.int16) != cap_c.view(torch.int16))
            parts.append(f"{int(diff.sum())} of {diff.numel()} output elements differ from the capture")
            matches.append(False)
    for role, obs, axis in (("row_sums", res.row_sums, 1), ("col_sums", res.col_sums, 0)):
        cap = captured.get(role)
        if cap is None:
            continue
        obs = obs.to("cpu")
        if exact and tuple(res.tile) == tuple(captured_tile) and obs.shape == cap.shape:
            same = same_bits(obs, cap)
            parts.append(f"{role} {'bit-identical to' if same else 'differ from'} the capture")
        else:  # other tile: compare per-row (per-column) totals across tiles
            a, b = obs.double().sum(axis), cap.double().sum(axis)
            tol = (obs.double().abs().sum(axis) + cap.double().abs().sum(axis)) * 2.0**-20 + 1e-300
            same = bool(((a - b).abs() <= tol).all())
            how = f"tiles {list(res.tile)} vs {list(captured_tile)}" if tuple(res.tile) != tuple(captured_tile) else "a subset"
            parts.append(f"{role} totals {'agree with' if same else 'differ from'} the capture ({how})")
        matches.append(same)
    if not matches:
        return {"matches": None, "detail": "nothing observed at capture to compare with"}
    return {"matches": all(matches), "detail": "; ".join(parts)}
