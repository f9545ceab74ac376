"""What the probes checked on one device, and how much of it the report keeps in full
(docs/design.md §7.2).

A device that corrupts every launch must be diagnosed as fast as a healthy one is cleared,
with a report that does not grow with every case. So once a probe has confirmed FAULTY
evidence, its later cases are still run and checked, but confirmed cheaply (the probe says
how) and kept as counts: "failed k of n runs" for every flagged case, full evidence for the
first ``in_full`` of them. With ``fail_fast`` the device stops at its first confirmed FAULTY
and the report names what was skipped.

Every probe counts its launches (runs of a checked computation) and its failed launches
(those with any signal), so the report and the Prometheus export say "k of n launches" per
device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aegis_cli.ops.verdict import Verdict, worst

DEFAULT_IN_FULL = 4  # flagged cases per probe given as full evidence (aegis scan --evidence-in-full)


@dataclass
class ProbeTally:
    """One probe's counts on one device."""

    launches: int = 0  # runs of a checked computation
    failed: int = 0  # of those, runs with any signal
    in_full: int = 0  # flagged cases given as full evidence
    worst: Verdict = Verdict.HEALTHY  # the worst severity given in full
    cases: list[dict] = field(default_factory=list)  # every flagged case: {case_id, check, runs, failed}
    skipped: list[str] = field(default_factory=list)  # fail-fast: cases not run
    shown: set[str] = field(default_factory=set)  # cases given in full (through Tally.keep)

    @property
    def confirmed(self) -> bool:
        """A FAULTY finding confirmed: later cases are confirmed cheaply."""
        return self.worst is Verdict.FAULTY

    def flagged(self, case_id: str, check: str, runs: int, failed: int, shown: bool = False) -> None:
        """A flagged case: ``failed`` of its ``runs`` runs failed; ``shown``: given as full evidence
        by a probe that shows every case it flags (the gemm probe counts those in ``Tally.keep``)."""
        self.cases.append({"case_id": case_id, "check": check, "runs": runs, "failed": failed})
        self.in_full += shown

    def to_dict(self) -> dict:
        return {"launches": self.launches, "failed_launches": self.failed, "flagged_cases": len({c["case_id"] for c in self.cases}),
                "evidence_in_full": self.in_full, "cases": self.cases, "skipped_cases": self.skipped}


@dataclass
class Tally:
    """The counts of every probe on one device, and whether fail-fast stopped it."""

    in_full: int | None = DEFAULT_IN_FULL  # None: every case confirmed and kept in full (no bound)
    fail_fast: bool = False
    probes: dict[str, ProbeTally] = field(default_factory=dict)
    stopped_at: str | None = None  # fail-fast: the case whose confirmed FAULTY stopped the device
    skipped_probes: list[str] = field(default_factory=list)

    def probe(self, name: str) -> ProbeTally:
        return self.probes.setdefault(name, ProbeTally())

    def cheap(self, name: str) -> bool:
        """Whether ``name`` confirms its flagged cases cheaply now (bounded, and FAULTY confirmed)."""
        return self.in_full is not None and self.probe(name).confirmed

    def room(self, name: str) -> bool:
        """Whether ``name``'s next flagged case may still be given in full."""
        return self.in_full is None or self.probe(name).in_full < self.in_full

    def may_keep(self, name: str) -> bool:
        """Whether evidence of ``name``'s next case could be given in full (what to keep for it)."""
        return not self.cheap(name) or self.room(name)

    def keep(self, name: str, case_id: str, severity: Verdict) -> bool:
        """Whether a finding on ``name``'s case ``case_id``, judged ``severity``, is given in full:
        those of the first ``in_full`` cases, and any that makes the probe's worst severity worse
        (the verdict always rests on evidence in full); counts the case when so."""
        t = self.probe(name)
        if case_id not in t.shown:
            if not self.room(name) and severity.rank <= t.worst.rank:
                return False
            t.shown.add(case_id)
            t.in_full += 1
        t.worst = worst([t.worst, severity])
        return True

    def stop(self, case_id: str) -> bool:
        """With fail-fast, note that the device stops at ``case_id``'s confirmed FAULTY; whether it stops."""
        if self.fail_fast and self.stopped_at is None:
            self.stopped_at = case_id
        return self.fail_fast

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def to_dict(self) -> dict:
        return {"launches": sum(t.launches for t in self.probes.values()),
                "failed_launches": sum(t.failed for t in self.probes.values()),
                "evidence_in_full": self.in_full,
                "fail_fast": {"stopped_at": self.stopped_at, "skipped_probes": self.skipped_probes} if self.fail_fast else None,
                "probes": {name: t.to_dict() for name, t in self.probes.items()}}
