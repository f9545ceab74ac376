"""What a vTask of kind ``attention`` may say (normative spec: docs/bundle-format.md §3.5, §3.6):
its ``attention`` object, tensor roles, check and threshold, and the rule on its inputs.
Called by manifest.check_vtask once the kind is known; every problem is a BundleError naming
the file on one line.
"""

from __future__ import annotations

import torch

from aegis_cli.checks.attention import ATTENTION_CHECKS
from aegis_cli.ops.attention import MAX_SEQ
from aegis_cli.vtask.model import ATTENTION_INPUTS, ATTENTION_ROLES

INPUT_LIMIT = 2.0**24  # |Q|, |K|, |V|, |dO|: keeps every fp32 product and sum of attention finite (spec §3.6)
TAU_MAX = 1e6  # a τ in units of the rounding spread


def check_attention(ck, w: str, v: dict) -> dict:
    """Validate the attention-specific fields of entry ``v`` (``w`` names it); returns role → tensor name."""
    ck.str_(v["check"], f"{w}: check", choices=ATTENTION_CHECKS)
    a = ck.obj(v["attention"], f"{w}: attention", {"batch", "q_heads", "kv_heads", "seq", "head_dim", "causal", "scale"}, set())
    for key in ("batch", "q_heads", "kv_heads", "seq", "head_dim"):
        ck.int_(a[key], f"{w}: attention.{key}", 1, MAX_SEQ)
    if a["q_heads"] % a["kv_heads"]:
        raise ck.fail(f"{w}: attention.q_heads {a['q_heads']} is not a multiple of kv_heads {a['kv_heads']}")
    if not isinstance(a["causal"], bool):
        raise ck.fail(f"{w}: attention.causal must be true or false")
    ck.num(a["scale"], f"{w}: attention.scale", 2.0**-20, 2.0**20)
    rows = a["batch"] * a["q_heads"] * a["seq"]
    if rows * a["head_dim"] > 1 << 31:
        raise ck.fail(f"{w}: attention of {rows}×{a['head_dim']} query values is over the limit of 2³¹")
    ck.exponents(v["scale"], f"{w}: scale", "the exponents of V and dO")
    ck.threshold(v["threshold"], f"{w}: threshold", (1e-300, TAU_MAX), ("rounding-spread",))
    names = ck.tensor_names(v["tensors"], f"{w}: tensors", set(ATTENTION_INPUTS), set(ATTENTION_ROLES) - set(ATTENTION_INPUTS))
    return names


def input_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """Why an attention vTask's inputs could not be checked (NaN/Inf, or a magnitude whose
    products and sums could overflow fp32 and read as a fault), or None."""
    for role in ATTENTION_INPUTS:
        t = tensors[role]
        if not bool(torch.isfinite(t).all()):
            return f"input {role} contains NaN or Inf"
        top = float(t.float().abs().max()) if t.numel() else 0.0
        if top > INPUT_LIMIT:
            return f"input {role} holds |x| = {top:.3g}, over the limit of 2^24 (its products could overflow fp32)"
    return None
