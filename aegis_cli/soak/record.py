"""What a burn-in reports (the ``soak`` section of a device report, docs/report-format.md):
launches and GEMMs checked, TFLOP/s per interval, clocks, temperature, power and throttle
reasons (NVML) at start, peak and end, the scales and shapes visited, and failures as
"k of n launches" with the first ones listed by case id, seed and the command that re-runs them.
Bounded whatever the duration: at most MAX_INTERVALS intervals and MAX_LISTED failures.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass, field

from aegis_cli.ops.errors import ConfigError
from aegis_cli.ops.verdict import Evidence

MAX_SECONDS = 7 * 86400
MAX_INTERVALS = 240  # a longer burn-in gets longer intervals
MAX_LISTED = 16  # failing launches listed one by one; the rest are counted
PROGRESS_EVERY = 0.5  # seconds between progress events
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}
_READINGS = ("sm_clock_mhz", "temperature_c", "power_w")


def parse_duration(text: str, what: str = "--soak") -> float:
    """Seconds in ``text``: ``10s``, ``2m``, ``1.5h`` or plain seconds; ConfigError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    seconds = float(m[1]) * _UNITS[m[2]] if m else None
    if seconds is None or not 0 < seconds <= MAX_SECONDS:
        raise ConfigError(f"{what} {text!r}: give a duration like 10s, 2m or 1h (more than 0, at most {MAX_SECONDS // 86400} days)")
    return seconds


def replay_command(seed: int, device: str, case: str, opts) -> str:
    """The scan that re-runs one launch of the burn-in as a case (``opts``: SoakOptions): on
    ``device``, or on the burn-in's devices when a fault of ``--inject`` names another (the scan
    refuses a fault for a device it does not scan, and a fault is seeded by its place in the
    spec), with the environment that makes simulated CPU devices exist."""
    from aegis_cli.backends.cpu import simulated_env  # imports torch: not when a sweep config reads a duration
    from aegis_cli.faults.spec import parse_spec

    q = shlex.quote
    named = [f.params["device"] for f in parse_spec(opts.inject) if "device" in f.params] if opts.inject else []
    where = opts.devices if any(d != device for d in named) else device
    parts = [f"{simulated_env([device, *named])}aegis scan", f"--seed {seed}", f"--device {q(where)}"]
    if opts.workload:
        parts.append(f"--workload {q(str(opts.workload))}")
    defaults = type(opts.thresholds)()
    if opts.thresholds.tau != defaults.tau:
        parts.append(f"--threshold {opts.thresholds.tau!r}")
    if opts.thresholds.confirm_margin != defaults.confirm_margin:
        parts.append(f"--confirm-margin {opts.thresholds.confirm_margin!r}")
    if opts.inject:
        parts.append(f"--inject {q(opts.inject)}")
    return " ".join([*parts, f"--case {q(case)}"])


def shape_key(s) -> str:
    """How the record names a GemmShape (``launches_by_shape``): ``op/layout/MxNxK``."""
    return f"{s.op}/{s.layout.value}/{s.m}x{s.n}x{s.k}"


def _summary(values: list[float]) -> dict | None:
    return {"start": values[0], "min": min(values), "peak": max(values), "end": values[-1]} if values else None


@dataclass
class SoakRecord:
    seconds: float  # asked for
    seed: int
    rule: dict  # how launches map to input sets, cases and seeds (the schedule's parameters)
    launches: int = 0  # screened (read back)
    fingerprinted: int = 0  # of those, the ones whose C was fingerprinted (schedule.fingerprinted)
    flops: int = 0
    sets: int = 0
    failures: int = 0
    listed: list[dict] = field(default_factory=list)
    intervals: list[dict] = field(default_factory=list)
    readings: list[dict] = field(default_factory=list)
    telemetry_reason: str | None = None
    throttle: dict[str, int] = field(default_factory=dict)
    shapes: set = field(default_factory=set)
    by_shape: dict[str, int] = field(default_factory=dict)  # launches read back per op/layout/MxNxK
    dists: set = field(default_factory=set)
    scales: set = field(default_factory=set)
    elapsed: float = 0.0
    host_wait: float = 0.0  # seconds the host waited for the device: near 0 means the host, not the GPU, set the pace
    _t0: float = 0.0
    _last: tuple[float, int, int] = (0.0, 0, 0)  # (time, launches, flops) at the last interval
    _shown: float = 0.0

    _stretch: int = 1  # intervals merged so far (a burn-in that ran long: confirmations, a slow device)

    @property
    def interval(self) -> float:
        return max(1.0, self.seconds / MAX_INTERVALS) * self._stretch

    def _add_interval(self, row: dict) -> None:
        self.intervals.append(row)
        if len(self.intervals) > MAX_INTERVALS:  # merge neighbours: the record stays bounded however long it runs
            merged = []
            for a, b in zip(self.intervals[::2], [*self.intervals[1::2], None], strict=True):
                if b is None:
                    merged.append(a)
                    continue
                span_a, span_b = a["t"] - (merged[-1]["t"] if merged else 0.0), b["t"] - a["t"]
                rate = (a["tflops"] * span_a + b["tflops"] * span_b) / max(span_a + span_b, 1e-9)
                merged.append({**b, "launches": a["launches"] + b["launches"], "tflops": round(rate, 3)})
            self.intervals, self._stretch = merged, self._stretch * 2

    def start(self, telemetry) -> None:
        self._t0 = self._shown = time.monotonic()
        self._last = (self._t0, 0, 0)
        self.telemetry_reason = telemetry.reason
        self._sample(telemetry)

    def visit(self, plan) -> None:
        """An input set begins (SetPlan): what it covers."""
        self.sets += 1
        s = plan.case.shape
        self.shapes.add((s.op, s.layout.value, s.m, s.n, s.k))
        self.dists.add(plan.case.dist)
        self.scales.update(plan.scales)

    def completed(self, shapes: list, flops: int) -> None:
        """Launches read back: their GemmShapes and GEMM work."""
        self.launches += len(shapes)
        self.flops += flops
        for s in shapes:
            key = shape_key(s)
            self.by_shape[key] = self.by_shape.get(key, 0) + 1

    def failure(self, launch: int, case: str, seed: int, flagged: int, mismatch: bool, opts, device: str) -> int:
        """Count one failing launch (listed while few); returns how many have failed so far."""
        self.failures += 1
        if len(self.listed) < MAX_LISTED:
            self.listed.append({"launch": launch, "case_id": case, "seed": seed, "flagged_checksums": flagged,
                                "fingerprint_mismatch": mismatch, "command": replay_command(seed, device, case, opts)})
        return self.failures

    def _sample(self, telemetry) -> dict | None:
        r = telemetry.read()
        if r is not None:
            self.readings.append(r)
            for reason in r.get("throttle") or []:
                self.throttle[reason] = self.throttle.get(reason, 0) + 1
        return r

    def tick(self, telemetry, progress, device: str) -> None:
        """After each read: close an interval when one is due, and tell the progress bar."""
        now = time.monotonic()
        if now - self._last[0] >= self.interval:
            self._close_interval(telemetry, now)
        if now - self._shown >= PROGRESS_EVERY:
            self._shown = now
            progress("soak", device=device, elapsed=now - self._t0, seconds=self.seconds, launches=self.launches,
                     failures=self.failures, tflops=self.flops / max(now - self._t0, 1e-9) / 1e12)

    def _close_interval(self, telemetry, now: float) -> None:
        """One interval row since the last: launches, TFLOP/s, and a telemetry sample."""
        t_last, n_last, f_last = self._last
        r = self._sample(telemetry) or {}
        self._add_interval({"t": round(now - self._t0, 2), "launches": self.launches - n_last,
                            "tflops": round((self.flops - f_last) / max(now - t_last, 1e-9) / 1e12, 3),
                            **{k: r.get(k) for k in _READINGS}, "throttle": r.get("throttle")})
        self._last = (now, self.launches, self.flops)

    def finish(self, telemetry) -> None:
        now = time.monotonic()
        self.elapsed = now - self._t0
        if self.launches > self._last[1]:  # the last, partial interval
            self._close_interval(telemetry, now)
        else:
            self._sample(telemetry)

    def annotate(self, evidence: list[Evidence]) -> list[Evidence]:
        """Each confirmed finding says how often the burn-in saw a failure."""
        for e in evidence:
            e.summary = f"soak: {self.failures} of {self.launches} launches failed; first confirmed: {e.summary}"
        return evidence

    def to_dict(self) -> dict:
        tel: dict = {"available": bool(self.readings), "reason": None if self.readings else self.telemetry_reason,
                     "samples": len(self.readings)}
        for key in _READINGS:
            tel[key] = _summary([r[key] for r in self.readings if r.get(key) is not None])
        limits = [r["power_limit_w"] for r in self.readings if r.get("power_limit_w") is not None]
        tel["power_limit_w"] = limits[-1] if limits else None
        tel["throttle"] = dict(sorted(self.throttle.items()))
        ea, eb, e = [s[0] for s in self.scales], [s[1] for s in self.scales], [a + b for a, b in self.scales]
        return {
            "seconds": self.seconds, "elapsed": round(self.elapsed, 3), "host_wait": round(self.host_wait, 3), "launches": self.launches,
            "gemms_checked": self.launches, "fingerprinted": self.fingerprinted, "flops": self.flops,
            "tflops": round(self.flops / self.elapsed / 1e12, 4) if self.elapsed > 0 else None,
            "input_sets": self.sets, "schedule": {"seed": self.seed, **self.rule},
            "coverage": {"shapes": len(self.shapes), "launches_by_shape": dict(sorted(self.by_shape.items())),
                         "distributions": sorted(self.dists), "scales": len(self.scales),
                         "ea": [min(ea), max(ea)] if ea else None, "eb": [min(eb), max(eb)] if eb else None,
                         "exponent_sum": [min(e), max(e)] if e else None},
            "failures": {"launches": self.failures, "of": self.launches, "first": self.listed},
            "intervals": self.intervals,
            "telemetry": tel,
        }
