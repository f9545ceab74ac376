"""Evidence → verdict (docs/design.md §7).

HEALTHY  every check ran and stayed inside calibrated noise
SUSPECT  an unconfirmed signal (a flag that did not reproduce the way corruption would)
FAULTY   confirmed corruption (a flag that reproduced well over threshold, a bitwise
         mismatch between runs of a deterministic kernel, a mismatch against exact
         expectations, a rigorous bound broken)
ERROR    the check could not run; never reported as HEALTHY
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

from aegis_cli.ops.errors import ExitCode


class Verdict(str, enum.Enum):
    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    FAULTY = "FAULTY"
    ERROR = "ERROR"

    @property
    def exit_code(self) -> ExitCode:
        return {Verdict.HEALTHY: ExitCode.HEALTHY, Verdict.SUSPECT: ExitCode.SUSPECT,
                Verdict.FAULTY: ExitCode.FAULTY, Verdict.ERROR: ExitCode.UNKNOWN}[self]

    @property
    def rank(self) -> int:
        # FAULTY outranks ERROR, as in the node exit code: both leave a device untrusted, but
        # confirmed corruption found before a later check failed is the finding to act on
        return {Verdict.HEALTHY: 0, Verdict.SUSPECT: 1, Verdict.ERROR: 2, Verdict.FAULTY: 3}[self]


def worst(verdicts) -> Verdict:
    vs = list(verdicts)
    return max(vs, key=lambda v: v.rank) if vs else Verdict.ERROR


def overall_exit(verdicts) -> ExitCode:
    """Node exit code: FAULTY anywhere → 2; else ERROR anywhere → 3; else SUSPECT → 1."""
    vs = set(verdicts)
    if not vs:
        return ExitCode.UNKNOWN
    if Verdict.FAULTY in vs:
        return ExitCode.FAULTY
    if Verdict.ERROR in vs:
        return ExitCode.UNKNOWN
    return ExitCode.SUSPECT if Verdict.SUSPECT in vs else ExitCode.HEALTHY


@dataclass
class Evidence:
    """One finding, with what a person needs to re-run exactly that case."""

    check: str  # stable id, e.g. gemm.row_checksum
    severity: Verdict
    case_id: str
    summary: str
    op: str = ""
    layout: str = ""
    shape: dict = field(default_factory=dict)  # {m, n, k}
    dist: str = ""
    scale: list[int] = field(default_factory=list)  # [ea, eb]
    seed: int = 0
    threshold: float | None = None
    max_value: float | None = None  # largest normalised difference seen
    margin: float | None = None  # max_value / threshold
    elements: int = 0  # flagged checksums or differing elements
    samples: list[dict] = field(default_factory=list)
    tiles: list[list[int]] = field(default_factory=list)
    sms: list[int] = field(default_factory=list)
    localised: list[list[int]] = field(default_factory=list)  # [row, col] where flagged rows meet flagged columns
    reruns: int = 0
    reproduced: int = 0  # re-runs that showed the same signal
    distinct_outputs: int = 1  # distinct output fingerprints over the original and its re-runs
    kernel: str = ""
    injected: list[dict] = field(default_factory=list)
    # checksum checks: what recomputing the flagged checksums in fp64 found (checks/recompute.py):
    # {"entries", "elements", "beyond_bound", "worst_ratio"}; None where not recomputed
    recompute: dict | None = None

    @property
    def reproduction(self) -> str:
        return f"reproduced in {self.reproduced} of {self.reruns} re-runs" if self.reruns else "not re-run"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["severity"] = self.severity.value
        d["reproduction"] = self.reproduction
        return d
