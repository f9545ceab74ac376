"""Control: sampling under an overhead budget, coverage, adaptive thresholds, the bounded queue,
the verifier's budget, events and the last clean step."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from aegis_cli.ops.numerics import Thresholds
from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument
from aegis_cli.sensors.control import Controller
from tests.sensors.tiny import inputs, mlp


def controller(**kw) -> Controller:
    args = {"sample_prob": 1.0, "budget": 0.01, "coverage_steps": 5, "headroom": 2.0, "max_raise": 100.0, "decay": 0.5, "seed": 0}
    return Controller(**{**args, **kw})


def test_budget_is_shared_by_water_filling():
    c = controller()
    for op, launches, cost in (("cheap", 1, 1e-4), ("mid", 2, 1e-3), ("dear", 4, 1e-2)):
        # before its cost is measured, one check of an operator a step: it measures the cost, and the
        # operator's other launches would only repeat it (22 attention calls of ~12 ms, on the H200)
        assert [c.want(op) for _ in range(launches)] == [True] + [False] * (launches - 1)
        c.spent(op, cost)
    c.end_step(1.0)  # budget 10 ms: demands 0.1, 2 and 40 ms
    p = {op: st.prob for op, st in c.ops.items()}
    assert p["cheap"] == 1.0 and p["mid"] == 1.0
    # the dear one's share (what is left) pays its coverage floor (one check in 5 steps) first
    assert p["dear"] == pytest.approx((10e-3 - 0.1e-3 - 2e-3 - 1e-2 / 5) / 40e-3)


def test_sensing_keeps_to_the_budget_with_the_coverage_floor():
    """Forced coverage checks are paid from the budget: over many steps the checks cost the budget
    (within the coin's noise), not the budget plus the floor; a budget under the floor buys the
    floor alone, and every operator is still checked once per window."""
    for budget, expect in ((0.01, 0.01), (0.002, None)):
        c = controller(sample_prob=1.0, budget=budget, coverage_steps=20)
        costs = {f"op{i}": 1e-4 * (1 + i % 7) for i in range(60)}
        spent, last, gap = 0.0, dict.fromkeys(costs, 0), 0
        for step in range(1500):
            for op, cost in costs.items():
                if c.want(op):
                    c.spent(op, cost)
                    spent += cost if step >= 100 else 0.0
                    gap, last[op] = max(gap, step - last[op]), step
            c.end_step(0.2)
        rate = spent / 1400 / 0.2
        floor = sum(costs.values()) / 20 / 0.2
        assert gap <= 20
        if expect is None:  # the floor (0.6 %) is above this budget: it is what sensing costs
            assert rate == pytest.approx(floor, rel=0.03)
        else:
            assert floor < expect and rate == pytest.approx(expect, rel=0.06)


def test_every_operator_is_checked_within_the_coverage_window():
    c = controller(sample_prob=0.0, budget=None, coverage_steps=5)
    checked_at = []
    for step in range(20):
        if c.want("op"):
            c.spent("op", 1e-3)
            checked_at.append(step)
        c.end_step(1.0)
    # never sampled, so forced: first within the window (at its phase), then once per 5 steps
    assert checked_at[0] < 5 and all(b - a == 5 for a, b in itertools.pairwise(checked_at))
    assert checked_at[-1] >= 15


def test_no_coverage_floor_never_forces_a_check():
    """``coverage_steps=None``: only the coin decides (p = 0: never), and the budget's share has no floor to pay."""
    c = controller(sample_prob=0.0, budget=None, coverage_steps=None)
    ops = [f"op{i}" for i in range(300)]
    for _ in range(50):
        assert not any(c.want(op) for op in ops)
        c.end_step(1.0)
    budgeted = controller(sample_prob=1.0, budget=0.01, coverage_steps=None)
    for _ in range(3):  # 4 operators at 10 ms a check against a 10 ms budget: a quarter each, nothing kept for a floor
        for op in ops[:4]:
            if budgeted.want(op):
                budgeted.spent(op, 1e-2)
        budgeted.end_step(1.0)
    assert [budgeted.ops[op].prob for op in ops[:4]] == pytest.approx([0.25] * 4)


def test_the_coverage_floor_spreads_over_the_steps():
    """Operators' first forced checks fall at phases of their own (from the seed and the name), so the
    floor checks about operators ÷ coverage a step, not all of them in one step out of 100."""
    ops = [f"layer{i}.{site}" for i in range(90) for site in ("forward", "dgrad", "wgrad")]
    per_step, firsts = [], {}
    c = controller(sample_prob=0.0, budget=None, coverage_steps=100)
    for step in range(300):
        n = 0
        for op in ops:
            if c.want(op):
                c.spent(op, 1e-3)
                firsts.setdefault(op, step)
                n += 1
        per_step.append(n)
        c.end_step(1.0)
    assert sum(per_step) == 3 * len(ops)  # each exactly once per 100 steps
    assert max(per_step) <= 12  # 2.7 a step on average; all 270 at once before the phases
    assert max(firsts.values()) <= 99 and len(set(firsts.values())) > 50
    again = controller(sample_prob=0.0, budget=None, coverage_steps=100)
    backwards = [again._op(op).phase for op in reversed(ops)][::-1]
    fresh = controller(sample_prob=0.0, budget=None, coverage_steps=100)
    assert backwards == [fresh._op(op).phase for op in ops]  # from the seed and the name, not the order
    other = controller(sample_prob=0.0, budget=None, coverage_steps=100, seed=1)
    assert backwards != [other._op(op).phase for op in ops]


def test_a_cleared_spike_raises_tau_which_decays_back_per_check(caplog):
    c = controller()
    with caplog.at_level(logging.INFO, logger="aegis.sensors"):
        assert c.spike("op", 5e-6, 1e-6) == pytest.approx(1e-5)  # headroom 2 × the spike
        assert c.spike("op", 2e-6, 1e-6) is None  # already above it
        assert c.spike("op", 1.0, 1e-6) == pytest.approx(1e-4)  # capped at max_raise × the floor
        for _ in range(20):  # steps without a check of the operator leave its raise where it is
            c.end_step(1.0)
        assert c.tau("op", 1e-6) == pytest.approx(1e-4)
        for _ in range(8):  # each check decays it (0.5 per check here)
            c.spent("op", 1e-3)
            c.end_step(1.0)
    assert c.tau("op", 1e-6) == 1e-6
    assert "raised from 1e-06 to 1e-05" in caplog.text and "back at its floor" in caplog.text
    assert c.to_dict()["op"]["tau_raise"] == 1.0


def test_tight_threshold_flags_are_cleared_and_tau_adapts():
    model = mlp()
    seen = []
    h = instrument(model, SensorConfig(overhead_budget=None, thresholds=Thresholds(tau=0.3), queue_size=64, min_verify=64,
                                       on_event=lambda e: seen.append(e) or Action.CONTINUE))
    x = inputs()
    for _ in range(3):
        model.zero_grad()
        model(x).square().mean().backward()
        assert h.step() is Action.CONTINUE
    uninstrument(model)
    first = [e for e in seen if e.step == 0 and e.kind == "cleared"]
    assert first and all(e.severity == "SUSPECT" and "threshold too tight" in e.summary for e in first)
    assert h.stats.confirmed == 0 and h.stats.cleared == h.stats.raised > 0
    assert any(e.kind == "threshold" for e in seen)
    # raised after the first step's spikes, the thresholds flag less afterwards
    later = [e for e in seen if e.step == 2 and e.kind == "cleared"]
    assert len(later) < len(first)
    assert h.last_clean_step == 2  # cleared suspicions leave every step clean


def test_a_full_queue_drops_and_counts_and_the_verifier_keeps_its_budget():
    model = mlp()
    events = []
    h = instrument(model, SensorConfig(overhead_budget=None, inject="bitflip:bit=hi-mant", queue_size=2, verify_budget=0.0,
                                       min_verify=1, on_event=events.append))
    model(inputs()).square().mean().backward()  # every one of the 8 launches is corrupted and flagged
    assert len(h.queue) == 2 and h.stats.dropped == 6 and h.stats.raised == 8
    assert h.step() is Action.STOP  # one verified (confirmed), one left for the next boundary
    assert h.stats.confirmed == 1 and len(h.queue) == 1
    h.step()
    assert h.stats.confirmed == 2 and h.stats.latency.max_steps == 1
    assert sum(e.kind == "dropped" for e in events) == 6 and h.last_clean_step is None
    stats = h.stats_dict()
    assert stats["queue"]["peak"] == 2 and stats["latency"]["verified"] == 2 and stats["dropped"] == 6
    uninstrument(model)


def test_optimizer_hook_runs_the_step_boundary():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    h = instrument(model, SensorConfig(overhead_budget=None, inject="bitflip:op=fc2/dgrad,bit=exp"), optimizer=opt)
    model(inputs()).square().mean().backward()
    opt.step()
    assert h.stats.steps == 1 and h.pending is Action.STOP and h.stats.confirmed == 1
    uninstrument(model)
    opt.step()  # the hook is gone
    assert h.stats.steps == 1


def test_sampling_under_a_budget_checks_fewer_launches():
    model = mlp()
    h = instrument(model, SensorConfig(overhead_budget=1e-4, coverage_steps=4))
    x = inputs()
    for _ in range(8):
        model(x).square().mean().backward()
        h.step()
    uninstrument(model)
    ops = h.controller.ops
    assert h.stats.checked < h.stats.launches == 64
    assert all(st.checks_total >= 2 for st in ops.values())  # coverage: each operator at least once per 4 steps
    assert all(st.prob < 1.0 for st in ops.values())


def test_a_callback_decides_the_action_and_none_means_no_opinion():
    model = mlp()
    asked = {"confirmed": Action.CHECKPOINT}
    h = instrument(model, SensorConfig(overhead_budget=None, inject="bitflip:op=fc2/fwd,bit=hi-mant",
                                       on_event=lambda e: asked.get(e.kind)))
    model(inputs()).square().mean().backward()
    assert h.step() is Action.CHECKPOINT and h.step() is Action.CONTINUE  # reset after each boundary
    asked.clear()  # no opinion: the default policy stops on confirmed corruption
    model(inputs()).square().mean().backward()
    assert h.step() is Action.STOP
    uninstrument(model)


def test_enqueued_comparisons_are_read_at_the_boundary_and_changed_operands_are_unverified():
    """sense.resolve, as the step boundary runs it on CUDA (comparisons enqueued during the step):
    a flag whose tensors are unchanged becomes a suspicion holding copies; one whose operand was
    changed in place since the check cannot be copied as checked and is counted unverified."""
    from aegis_cli.backends.cpu import CpuDevice
    from aegis_cli.ops.gemm import GemmOperands, Layout
    from aegis_cli.sensors import sense

    model = mlp()
    h = instrument(model, SensorConfig(overhead_budget=None, thresholds=Thresholds(tau=1e-9), min_verify=0, verify_budget=0.0))
    dev = CpuDevice()
    g = torch.Generator().manual_seed(4)
    pend = []
    for i in range(2):
        ops = GemmOperands(torch.randn(8, 32, generator=g).to(torch.bfloat16), torch.randn(16, 32, generator=g).to(torch.bfloat16),
                           Layout.FWD)
        res = dev.checked_gemm(ops)
        parts, summary = sense.enqueue(ops, res, dev.noise_model(32), False)
        pend.append(sense.Pending(f"l{i}", f"train/l{i}/fwd/8x16x32", f"l{i}/fwd", dev, ops, res, 1e-9, 1e-9, parts, summary,
                                  tuple(t._version for t in (ops.a, ops.b, res.c)), sense.CheckTimer(dev), 0))
    h.unread.extend(pend)
    pend[1].ops.a.add_(1.0)  # the loop changed this launch's input in place before the boundary
    sense.resolve(h)
    assert not h.unread and h.stats.checked == 2 and h.stats.raised == 2 and h.stats.unverified == 1 and len(h.queue) == 1
    queued = h.queue.pop()
    assert queued.op == "l0" and queued.context.operands.a is not pend[0].ops.a  # a copy
    assert [e.kind for e in h.events] == ["unverified"] and h.events[0].op == "l1" and h.last_clean_step is None
    uninstrument(model)
