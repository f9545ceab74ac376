"""Sampling in lockstep across data-parallel ranks (sensors/lockstep.py): 3 gloo ranks train the
instrumented micro GPT under DDP on their own batches under a budget (tests/sensors/gloo_ranks.py
runs them); and the agreement's rules in one process."""

from __future__ import annotations

import pytest

from aegis_cli.sensors.control import Controller
from aegis_cli.sensors.lockstep import Lockstep
from tests.sensors.gloo_ranks import LOCK_EVERY, LOCK_STEPS


def test_ranks_in_lockstep_check_the_same_operators_in_every_step(gloo_ranks):
    runs = [g["lockstep"]["lockstep"] for g in gloo_ranks]
    assert all(r["joined"] for r in runs)
    assert [len(r["checked"]) for r in runs] == [LOCK_STEPS] * 3
    assert runs[1]["checked"] == runs[0]["checked"] == runs[2]["checked"]
    assert any(runs[0]["checked"]) and not all(len(c) == len(runs[0]["checked"][0]) for c in runs[0]["checked"])  # sampling, not all or nothing
    assert runs[1]["probs"] == runs[0]["probs"] == runs[2]["probs"]  # bit for bit, from the agreed figures
    # instrumented under DDP: the gradients were averaged (the weights alike on every rank), nothing confirmed
    assert len({r["weights"] for r in runs}) == 1 and all(r["confirmed"] == 0 for r in runs)


def test_ranks_on_their_own_figures_share_the_budget_differently(gloo_ranks):
    """Without lockstep each rank's probabilities follow its own measured times: they differ, and so do
    the launches the ranks check (in test runs, 1 of 10 steps alike on all three, against 10 of 10)."""
    probs = [g["lockstep"]["own"]["probs"] for g in gloo_ranks]
    assert not any(g["lockstep"]["own"]["joined"] for g in gloo_ranks)
    assert probs[0].keys() == probs[1].keys() and (probs[0] != probs[1] or probs[0] != probs[2])
    checked = [g["lockstep"]["own"]["checked"] for g in gloo_ranks]  # so some step checks other launches on some rank
    assert any(not (a == b == c) for a, b, c in zip(*checked, strict=True))


def test_the_example_trains_data_parallel_in_lockstep_and_stops_every_rank_on_one_ranks_fault(gloo_ranks):
    """examples/train_gpt/train.py under DDP on 3 ranks: the same checks on every rank, its own
    batches each; a fault confirmed on rank 1 stops all three at the same step."""
    ex = [g["example"] for g in gloo_ranks]
    assert all(e["stopped"] is None and e["confirmed"] == 0 for e in ex)
    assert ex[0]["checked"] == ex[1]["checked"] == ex[2]["checked"] and ex[0]["probs"] == ex[1]["probs"] == ex[2]["probs"]
    assert ex[0]["losses"] != ex[1]["losses"]  # each rank's own batches
    assert [e["faulty_confirmed"] > 0 for e in ex] == [False, True, False]
    assert [e["faulty_stopped"] for e in ex] == [0, 0, 0]


def test_no_process_group_no_lockstep():
    assert Lockstep.join() is None


def test_between_agreements_the_probabilities_stay_and_agreed_figures_replace_its_own():
    def measured(costs: dict[str, float]) -> Controller:
        c = Controller(1.0, 0.01, 10, headroom=2.0, max_raise=100.0, decay=0.5, seed=0)
        for op, cost in costs.items():
            assert c.want(op)
            c.spent(op, cost)
        return c

    c = measured({"a": 0.01, "b": 0.01})
    c.end_step(1.0, share=False)
    assert c.ops["a"].prob == c.ops["b"].prob == 1.0 and not c.ops["a"].shared  # still one check a step
    c.end_step(1.0, {"a": (1, 0.01), "b": (1, 0.03)})  # the ranks' agreed figures (b dearer elsewhere)
    own = measured({"a": 0.01, "b": 0.03})
    own.end_step(1.0)
    assert c.ops["a"].shared and {op: st.prob for op, st in c.ops.items()} == {op: st.prob for op, st in own.ops.items()}
    assert c.ops["b"].prob < c.ops["a"].prob < 1.0


@pytest.mark.parametrize("step,asked", [(0, True), (1, False), (LOCK_EVERY, True)])
def test_agreements_fall_every_few_steps(monkeypatch, step, asked):
    lock, calls = Lockstep(every=LOCK_EVERY), []
    monkeypatch.setattr(lock, "_max", lambda v: calls.append(v) or list(v))
    got = lock.agree(step, 0.5, {"b": (2, 0.1), "a": (1, 0.2)})
    assert bool(calls) is asked
    if asked:
        assert got == (0.5, {"a": (1, 0.2), "b": (2, 0.1)}) and calls[1] == [-0.5, 1, 0.2, 2, 0.1]
    else:
        assert got is None


def test_ranks_whose_operators_differ_leave_lockstep(monkeypatch, caplog):
    lock = Lockstep(every=1)
    monkeypatch.setattr(lock, "_max", lambda v: [v[0] + 1, *v[1:]])  # another rank's checksum is larger
    assert lock.agree(0, 0.5, {"a": (1, 0.2)}) == (0.5, {"a": (1, 0.2)})
    assert not lock.active and "operators differ" in caplog.text
    assert lock.agree(1, 0.7, {"a": (3, 0.1)}) == (0.7, {"a": (3, 0.1)})  # its own figures every step from then on
