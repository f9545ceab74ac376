"""The AEGIS sensitivity study, built so that it can fail (docs/sensitivity.md, issue 17).

For one GEMM shape (M, N, K) and one input distribution:

1. **Calibration, held out.** Clean checked GEMMs on the calibration seeds. Four checks are
   measured on them: the fp32-accumulator row and column checksums (the fused sums of the
   checked GEMM against their fp64 references) and the bf16-output row and column checksums
   (Σ of the rounded output over the same tiles against the same fp64 references), each
   normalised, the fp32 ones by the device's noise scale σ (Device.noise_model), the bf16 ones
   by s = Σ|A||B|. Each check's threshold is ``margin`` × its largest clean
   value: zero false positives on the calibration set, the same margin for every check.
2. **Trials**, on other seeds (disjoint from the calibration ones). Each trial perturbs each
   fp32 accumulator element with probability ``rate`` by ±r × the median absolute clean
   row-checksum difference of that input (the ``perturb`` fault of aegis_cli.faults, in the
   kernel on CUDA), and records which detectors flag any row or column tile:

   - ``fp32_tau``: the fp32-accumulator checks at the production τ (Thresholds.tau, on the
     noise scale σ: what ``aegis scan`` uses);
   - ``fp32_heldout``: the fp32-accumulator checks at their held-out thresholds;
   - ``bf16_heldout``: the bf16-output checks at their held-out thresholds.

   The trial inputs' own clean runs are the held-out false-positive check: a threshold that
   flags one of them is reported, not hidden.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from aegis_cli.backends.base import Device
from aegis_cli.faults.spec import FaultPlan
from aegis_cli.ops import numerics
from aegis_cli.ops.gemm import GemmOperands, GemmResult, Layout, ReferenceChecksums

CHECKS = ("fp32_row", "fp32_col", "bf16_row", "bf16_col")
DETECTORS = ("fp32_tau", "fp32_heldout", "bf16_heldout")


def half_decades(lo: float, hi: float) -> list[float]:
    """10^(e/2) for every half-decade exponent from lo to hi (both powers of √10)."""
    e0, e1 = round(2 * math.log10(lo)), round(2 * math.log10(hi))
    return [10 ** (e / 2) for e in range(e0, e1 + 1)]


def r_at(rs: list[float], rates: list[float], target: float) -> float:
    """Smallest r on the grid from which detection stays ≥ target (inf if it never does)."""
    for i, r in enumerate(rs):
        if all(x >= target for x in rates[i:]):
            return r
    return math.inf


@dataclass
class Setup:
    """What one study runs: the shape, the inputs, the perturbation model and the margin."""

    m: int
    n: int
    k: int
    dist: str = "normal"
    trials: int = 40  # perturbed launches per r, cycling through the trial inputs
    rate: float = 2e-4  # probability that one accumulator element is perturbed
    margin: float = 3.0  # held-out threshold = margin × the calibration set's clean maximum
    cal_inputs: int = 8
    trial_inputs: int = 8
    seed: int = 0

    def seeds(self) -> tuple[list[int], list[int]]:
        """Calibration and trial input seeds: disjoint by construction (one range, split)."""
        base = self.seed * 100_000 + 1_000 * numerics.DISTRIBUTIONS.index(self.dist)
        both = [base + i for i in range(self.cal_inputs + self.trial_inputs)]
        return both[:self.cal_inputs], both[self.cal_inputs:]

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.m, self.n, self.k


@dataclass
class SensitivityResult:
    setup: Setup
    rs: list[float]
    tau: float  # the production τ for this K on this device
    clean_max: dict[str, float]  # per check, on the calibration inputs (fp32: ·σ, bf16: ·s)
    thresholds: dict[str, float]  # per check: margin × clean_max
    heldout_max: dict[str, float]  # per check, on the trial inputs' clean runs
    false_positives: dict[str, int]  # per detector: trial inputs whose clean run it flags
    detection: dict[str, list[float]] = field(default_factory=dict)  # per detector, per r
    medians: list[float] = field(default_factory=list)  # per trial input: the unit of r
    median_norm: float = 0.0  # the same median, normalised (·σ), median over the trial inputs

    def r50(self, detector: str) -> float:
        return r_at(self.rs, self.detection[detector], 0.5)

    def r99(self, detector: str) -> float:
        return r_at(self.rs, self.detection[detector], 0.99)

    @property
    def fp32_clean_max(self) -> float:
        return max(self.clean_max["fp32_row"], self.clean_max["fp32_col"])

    @property
    def tau_over_clean(self) -> float:
        """How far the production τ sits above the largest clean fp32 difference."""
        return self.tau / self.fp32_clean_max if self.fp32_clean_max > 0 else math.inf

    def to_dict(self) -> dict:
        cal, trial = self.setup.seeds()
        out = {"setup": asdict(self.setup), "calibration_seeds": cal, "trial_seeds": trial}
        out.update({k: v for k, v in asdict(self).items() if k != "setup"})
        out["tau_over_clean"] = self.tau_over_clean
        out["r50"] = {d: self.r50(d) for d in DETECTORS}
        out["r99"] = {d: self.r99(d) for d in DETECTORS}
        return out


def check_diffs(res: GemmResult, ref: ReferenceChecksums, tile: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The four normalised checksum differences of one run (see CHECKS), where it ran."""
    tm, tn = tile
    d_row, d_col = numerics.checksum_diffs(res, ref)
    c = res.c.to(torch.float64)
    return {"fp32_row": d_row, "fp32_col": d_col,
            "bf16_row": numerics.normalised_diff(numerics.sum_col_tiles(c, tn), ref.row, ref.row_scale, ref.floor),
            "bf16_col": numerics.normalised_diff(numerics.sum_row_tiles(c, tm), ref.col, ref.col_scale, ref.floor)}


def _maxima(d: dict[str, torch.Tensor]) -> dict[str, float]:
    return dict(zip(CHECKS, torch.stack([d[c].max() for c in CHECKS]).tolist(), strict=True))


def _flags(d: dict[str, torch.Tensor], tau: float, th: dict[str, float]) -> list[bool]:
    """Which DETECTORS flag one run: any row or column tile over its threshold (one sync)."""
    flags = torch.stack([(d["fp32_row"] > tau).any() | (d["fp32_col"] > tau).any(),
                         (d["fp32_row"] > th["fp32_row"]).any() | (d["fp32_col"] > th["fp32_col"]).any(),
                         (d["bf16_row"] > th["bf16_row"]).any() | (d["bf16_col"] > th["bf16_col"]).any()])
    return [bool(x) for x in flags.tolist()]


def _inputs(device: Device, setup: Setup, seeds: list[int]) -> list[tuple[GemmOperands, ReferenceChecksums, GemmResult]]:
    """Seeded operands (A stored M×K, B stored K×N), their references and one clean run each."""
    out = []
    for s in seeds:
        ops = GemmOperands(device.generate((setup.m, setup.k), setup.dist, 2 * s),
                           device.generate((setup.k, setup.n), setup.dist, 2 * s + 1), Layout.DGRAD)
        out.append((ops, device.reference_checksums(ops, device.tile), device.checked_gemm(ops)))
    return out


def sensitivity(device: Device, setup: Setup, rs: list[float], th: numerics.Thresholds | None = None,
                progress=None) -> SensitivityResult:
    """Run the study of the module docstring for one shape and distribution. ``progress``, if
    given, is called with (r, {detector: rate}) after each r."""
    th = th or numerics.Thresholds()
    tau = th.tau
    cal_seeds, trial_seeds = setup.seeds()
    clean_max = dict.fromkeys(CHECKS, 0.0)
    for _ops, ref, res in _inputs(device, setup, cal_seeds):  # calibration: thresholds only
        clean_max = {c: max(clean_max[c], v) for c, v in _maxima(check_diffs(res, ref, device.tile)).items()}
    thresholds = {c: setup.margin * v for c, v in clean_max.items()}

    trial = _inputs(device, setup, trial_seeds)
    heldout_max = dict.fromkeys(CHECKS, 0.0)
    false_pos = dict.fromkeys(DETECTORS, 0)
    medians, medians_norm = [], []
    for _ops, ref, res in trial:  # the held-out clean runs: the unit of r, and false positives
        d = check_diffs(res, ref, device.tile)
        heldout_max = {c: max(heldout_max[c], v) for c, v in _maxima(d).items()}
        for det, hit in zip(DETECTORS, _flags(d, tau, thresholds), strict=True):
            false_pos[det] += hit
        medians.append(numerics.median_row_diff(res, ref))
        medians_norm.append(float(d["fp32_row"].median()))

    out = SensitivityResult(setup, list(rs), tau, clean_max, thresholds, heldout_max, false_pos,
                            {det: [] for det in DETECTORS}, medians, sorted(medians_norm)[len(medians_norm) // 2])
    for r in rs:
        hits = dict.fromkeys(DETECTORS, 0)
        plan = FaultPlan.parse(f"perturb:r={r!r},rate={setup.rate!r},seed={setup.seed}")
        for t in range(setup.trials):
            i = t % len(trial)
            ops, ref, _ = trial[i]
            res = device.checked_gemm(ops, plan, op=f"sensitivity/{setup.dist}/{t}", clean_median=medians[i])
            for det, hit in zip(DETECTORS, _flags(check_diffs(res, ref, device.tile), tau, thresholds), strict=True):
                hits[det] += hit
        for det in DETECTORS:
            out.detection[det].append(hits[det] / setup.trials)
        if progress is not None:
            progress(r, {det: out.detection[det][-1] for det in DETECTORS})
    return out
