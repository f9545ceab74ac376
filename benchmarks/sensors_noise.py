"""The clean-noise studies of ``benchmarks/sensors_overhead.py``. ``--noise-steps N``: steps with
every launch checked, each check's clean normalised differences per layout and layer, under the
sensors' σ and under candidate bias terms (how BIAS and WGRAD_BOUND of aegis_cli/sensors/sense.py
were chosen). ``--attention-noise-steps N``: steps with every SDPA call sensed, each invariant's
normalised difference against its τ (what the attention sensor's τ would be set from)."""

from __future__ import annotations

import itertools
import statistics

import torch

from aegis_cli.checks import attention as attention_checks
from aegis_cli.ops import attention_sums, lean, numerics
from aegis_cli.sensors import SensorConfig, sense

BETAS = (0.0, 1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8)  # candidate bias terms: σ + β·K·2⁻²⁴·Σ|C| over the tile


def _study_one(ops, res, noise) -> list[dict]:
    """Clean normalised differences of one launch's checksums (rows; wgrad also columns) under the
    sensors' σ and under σ + β·K·2⁻²⁴·Σ|c| (the truncating accumulator's bias follows the partial
    sums, which for same-sign products grow with |c| rather than with ρ)."""
    k = ops.mnk[2]
    sig = sense.Sigma.of(noise, k)
    tm, tn = res.tile
    c = res.c.float().abs_()
    sides = [(res.row_sums, lean.lean_side(ops.a_mk, ops.b_kn, tn), numerics.sum_col_tiles(c, tn), "row")]
    if ops.layout.value == "wgrad":
        col = tuple(x.t() for x in lean.lean_side(ops.b_kn.t(), ops.a_mk.t(), tm))
        sides.append((res.col_sums, col, numerics.sum_row_tiles(c, tm), "col"))
    out = []
    for obs, (ref, s, rho), csum, side in sides:
        delta = ((obs.double() - ref).abs() - numerics.subnormal_slack(k, max(tm, tn))).clamp_(min=0)
        cap, base = s * sig.p, rho * sig.u
        xc = csum.double() * (k * 2.0**-24)
        sensor = sense.sigma_of(s, None, None, sig) if ops.layout.value == "wgrad" else sense.sigma_of(s, rho, csum.double(), sig)
        vals = [(delta / torch.minimum(base, cap).clamp(min=1e-300)).amax(), (delta / xc.clamp(min=1e-300)).amax(),
                (delta / cap.clamp(min=1e-300)).amax(), (s / rho.clamp(min=1e-300)).median(),
                (delta / sensor.clamp(min=1e-300)).amax()]
        vals += [(delta / torch.minimum(base + b * xc, cap).clamp(min=1e-300)).amax() for b in BETAS]
        got = torch.stack(vals).tolist()
        out.append({"side": side, "d": got[0], "d_over_xc": got[1], "d_over_cap": got[2], "s_over_rho": got[3],
                    "d_sensor": got[4], "beta": dict(zip(BETAS, got[5:], strict=True))})
    return out


def spread(d: list[float]) -> tuple[float, float, float]:
    """(max, median, 99th percentile) of sorted values, by rank."""
    return d[-1], d[len(d) // 2], d[min(len(d) - 1, int(0.99 * len(d)))]


def noise_study(bench, steps: int, counter: itertools.count) -> dict:
    """``steps`` steps with every launch checked, each check also measured by ``_study_one``;
    summarised per layout and layer kind (the last two parts of the layer's name)."""
    real, seen = sense.sense, []

    def spy(h, device, layer, ops, res, site, key):
        for r in _study_one(ops, res, device.noise_model(ops.mnk[2])):
            seen.append({"group": f"{ops.layout.value}:{'.'.join(layer.split('.')[-2:])}", **r})
        return real(h, device, layer, ops, res, site, key)

    sense.sense = spy
    try:
        w = bench.window("every", SensorConfig(sample_prob=1.0, overhead_budget=None, queue_size=16,
                                               min_verify=0, verify_budget=0.0), steps, counter)
    finally:
        sense.sense = real
    groups: dict[str, dict] = {}
    for r in seen:
        g = groups.setdefault(r["group"], {"checks": 0, "d": [], "d_over_xc": 0.0, "d_over_cap": 0.0, "s_over_rho": [], "d_sensor": 0.0,
                                          "beta_max": dict.fromkeys(BETAS, 0.0), "beta_over_tau": dict.fromkeys(BETAS, 0)})
        g["checks"] += 1
        g["d"].append(r["d"])
        g["s_over_rho"].append(r["s_over_rho"])
        g["d_over_xc"], g["d_over_cap"] = max(g["d_over_xc"], r["d_over_xc"]), max(g["d_over_cap"], r["d_over_cap"])
        g["d_sensor"] = max(g["d_sensor"], r["d_sensor"])
        for b, v in r["beta"].items():
            g["beta_max"][b] = max(g["beta_max"][b], v)
            g["beta_over_tau"][b] += v > 3.5
    for g in groups.values():
        d = sorted(g.pop("d"))
        g["d_max"], g["d_p50"], g["d_p99"] = spread(d)
        g["s_over_rho_median"] = statistics.median(g.pop("s_over_rho"))
    return {"steps": steps, "checks": len(seen), "stats": w.get("stats"), "groups": groups}


def attention_noise_study(bench, steps: int, counter: itertools.count) -> dict:
    """``steps`` steps with every SDPA call on the checked attention and sensed: per invariant, each
    call's largest normalised difference (units of its σ, flagged or not) against its τ floor
    (ops/attention_sums.DEFAULT_TAU). No suspicion is queued (``queue_bytes`` 1: each is dropped
    before anything is copied), so nothing is verified and each call is counted once."""
    real, seen = attention_checks.check_attention, []

    def spy(*args, **kw):
        c = real(*args, **kw)
        worst = dict(c.clean_max)
        for sig in c.signals:
            if sig.tensor in worst:
                worst[sig.tensor] = max(worst[sig.tensor], sig.max_value)
        seen.append(worst)
        return c

    attention_checks.check_attention = spy
    try:
        w = bench.window("attention-noise", SensorConfig(sample_prob=1.0, overhead_budget=None, attention=True, queue_bytes=1,
                                                         min_verify=0, verify_budget=0.0), steps, counter)
    finally:
        attention_checks.check_attention = real
    out = {}
    for name, tau in attention_sums.DEFAULT_TAU.items():
        d = sorted(v[name] for v in seen if name in v)
        if d:
            top, p50, p99 = spread(d)
            out[name] = {"calls": len(d), "tau": tau, "max": top, "p99": p99, "p50": p50, "over_tau": sum(x > tau for x in d),
                         "max_over_tau": top / tau}
    return {"steps": steps, "calls": len(seen), "stats": w.get("stats"), "invariants": out}
