"""Control (docs/sensors.md §4): which launches are checked, under an overhead budget, and the
threshold each operator is checked at.

Sampling. Each operator (a layer's forward, dgrad or wgrad; a checkpointed region) has its own
probability p. At each step boundary the budget B = overhead_budget × (the step's time without
sensors and verifier) is shared by water-filling: operators sorted by their demand d = launches
per step × measured seconds per check, each takes min(d, what is left ÷ operators left), so cheap
operators are checked every time and the expensive ones share the rest. Whatever the budget, an
operator unchecked for ``coverage_steps - 1`` steps is checked at its next launch (``None``: no
floor, for measurements that must never force a check); those forced
checks are paid from the operator's share first (``_share``), so sensing keeps to the budget
unless the coverage floor alone exceeds it. Until its cost is measured and shared, an operator
under a budget is checked at most once a step: one check measures it, and an operator launched
many times a step (the 22 attention calls of the 1.18B GPT, ~12 ms a check on the H200) would
otherwise pay the full price in its first step. Each operator's first forced check comes after a phase
of its own (drawn from the seed and its name), so the floor's checks spread evenly over the steps
instead of all falling due together at step ``coverage_steps - 1`` (with p = 0, all 267 operators
of the 1.18B GPT in one step: a step ~60 % longer).
The coin is a private generator seeded by the config, drawn once a launch whatever decides it: the
model's own random stream is untouched, and data-parallel ranks that share the budget from the same
figures (``end_step(figures=…)``, sensors/lockstep.py) check the same launches.

Thresholds. An operator's τ is its floor (Thresholds.tau, in units of the device's noise scale σ)
times a raise factor ≥ 1. A cleared spike (a flag that the
verifier found within rounding) raises the factor to headroom × spike ÷ floor, at most max_raise;
each later check of that operator decays it geometrically back toward 1 (per check, not per step:
an operator sampled once per 100 steps would otherwise be back at its floor before its next
check, and raise the same cleared spike again). Each change is logged.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

log = logging.getLogger("aegis.sensors")


@dataclass
class OpState:
    prob: float
    raise_: float = 1.0  # τ = floor × raise_
    cost_s: float | None = None  # seconds per check (exponential average)
    launches: int = 0  # this step
    checks: int = 0  # this step
    idle_steps: int = 0  # steps since the last check
    phase: int = 0  # until its first check: steps the coverage floor counts as already idle (spreads the floor)
    launches_total: int = 0
    checks_total: int = 0
    shared: bool = False  # its probability set from its measured cost (``_share``)
    clean_max: float = 0.0  # the largest normalised difference ÷ τ of its unflagged checks

    def to_dict(self) -> dict:
        return {"prob": round(self.prob, 6), "tau_raise": self.raise_, "cost_s": self.cost_s, "launches": self.launches_total,
                "checked": self.checks_total, "idle_steps": self.idle_steps, "clean_max_ratio": self.clean_max}


class Controller:
    def __init__(self, sample_prob: float, budget: float | None, coverage_steps: int | None, *, headroom: float, max_raise: float,
                 decay: float, seed: int):
        self.sample_prob, self.budget = sample_prob, budget
        # None (no floor) is a window that never closes: nothing falls due, the floor's share is 0, and
        # the budget's expected checks a step are the coin's alone, by the same formulas as a finite one
        self.coverage = math.inf if coverage_steps is None else coverage_steps
        self.headroom, self.max_raise, self.decay = headroom, max_raise, decay
        self.seed = seed
        self.coin = random.Random(seed)
        self.ops: dict[str, OpState] = {}

    def _op(self, op: str) -> OpState:
        st = self.ops.get(op)
        if st is None:
            # its own generator: the phase depends on the seed and the name, not on the order operators appear in
            phase = random.Random(f"{self.seed}:{op}").randrange(self.coverage) if self.coverage < math.inf else 0
            st = self.ops[op] = OpState(prob=self.sample_prob, phase=phase)
        return st

    # -- per launch --------------------------------------------------------------------------
    def want(self, op: str) -> bool:
        """Whether this launch of ``op`` is checked."""
        st = self._op(op)
        st.launches += 1
        u = self.coin.random()  # one draw a launch whatever decides it: ranks with equal probabilities stay in step
        due = st.checks == 0 and st.idle_steps + st.phase >= self.coverage - 1
        if self.budget is not None and not st.shared and st.checks:
            return False  # one check measures its cost: more in its first step would repeat it at full price
        if due or st.prob >= 1.0 or u < st.prob:
            st.checks += 1  # counted now: its cost may be known only at the step boundary (spent)
            return True
        return False

    def spent(self, op: str, seconds: float) -> None:
        """A check of ``op`` (``want`` said yes) done in ``seconds``: its cost, and one step of its τ's decay."""
        st = self._op(op)
        st.cost_s = seconds if st.cost_s is None else 0.8 * st.cost_s + 0.2 * seconds
        if st.raise_ > 1.0:  # per check of this operator, not per step: sampled once per 100 steps, a
            st.raise_ = max(1.0, st.raise_ * self.decay)  # raise decaying per step would be gone before its next check
            if st.raise_ == 1.0:
                log.info("aegis sensors: τ of %s back at its floor", op)

    def clean(self, op: str, ratio: float) -> None:
        """An unflagged check of ``op`` whose largest normalised difference was ``ratio`` × τ."""
        st = self._op(op)
        st.clean_max = max(st.clean_max, ratio)

    def tau(self, op: str, floor: float) -> float:
        return floor * self._op(op).raise_

    def spike(self, op: str, value: float, floor: float) -> float | None:
        """A cleared flag of normalised size ``value`` on ``op``: raise its τ to cover it. Returns
        the new τ when it rose."""
        st = self._op(op)
        want = min(self.max_raise, max(st.raise_, self.headroom * value / floor))
        if want <= st.raise_:
            return None
        log.info("aegis sensors: τ of %s raised from %.3g to %.3g after a cleared spike of %.3g", op, floor * st.raise_,
                 floor * want, value)
        st.raise_ = want
        return floor * want

    # -- per step ---------------------------------------------------------------------------
    def figures(self) -> dict[str, tuple[int, float]]:
        """This step's launches and each operator's measured seconds a check (0: not measured), by
        operator: what the budget is shared from (``end_step``), and what ranks agree on (lockstep.py)."""
        return {op: (st.launches, st.cost_s or 0.0) for op, st in self.ops.items()}

    def end_step(self, base_s: float, figures: dict[str, tuple[int, float]] | None = None, share: bool = True) -> None:
        """Close a step whose time without sensors and verifier was ``base_s``: new probabilities
        under the budget, from ``figures`` (``figures()``; the ranks' agreed ones in lockstep) or this
        controller's own, unless ``share`` is False (they stay); per-step counts reset."""
        figures = self.figures() if figures is None else figures
        for st in self.ops.values():
            if st.checks:  # the phase only delays the first check
                st.idle_steps = st.phase = 0
            else:
                st.idle_steps += 1
            st.launches_total += st.launches
            st.checks_total += st.checks
        if self.budget is not None and base_s > 0 and share:
            self._share(self.budget * base_s, figures)
        for st in self.ops.values():
            st.launches = st.checks = 0

    def _share(self, budget_s: float, figures: dict[str, tuple[int, float]]) -> None:
        """Water-fill ``budget_s`` over the operators, the coverage floor included: an operator's
        coin checks cost p·d a step and its forced checks (none in ``coverage - 1`` steps) at most
        f = cost ÷ coverage, so its share pays f first and the coin gets the rest; an operator whose
        share is below f is checked only when due (coverage wins over the budget). Each is charged its
        expected cost, forced checks included (a cycle ends at a coin check or at the forced one), and
        what it leaves of its share goes to the dearer ones."""
        demand = sorted(((n * c, op, n, c) for op, (n, c) in figures.items() if n and c), key=lambda x: x[:2])
        left = budget_s
        for i, (d, op, n, cost) in enumerate(demand):
            st = self._op(op)
            share = left / (len(demand) - i)
            floor = cost / self.coverage
            st.prob, st.shared = min(1.0, max(0.0, share - floor) / d), True
            q = (1.0 - st.prob) ** n  # P(a step without a coin check)
            per_step = (1.0 - q) / (1.0 - q**self.coverage) if q < 1.0 else 1.0 / self.coverage  # steps with a check
            left -= cost * (per_step + st.prob * n - (1.0 - q))  # + launches beyond the first in a step

    def to_dict(self) -> dict:
        return {op: st.to_dict() for op, st in sorted(self.ops.items())}
