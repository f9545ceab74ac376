"""Training-state guard on a tiny CPU model: no event on clean runs, each injected state fault
caught, and recovery by re-execution that rejoins the clean run bit for bit."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.ops.errors import ConfigError, InjectSpecError
from aegis_cli.sensors.guards import TrainingGuard, TrainingStateError

STEPS = 12


def make(opt: str = "adam", seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[opt]
    return model, cls(model.parameters(), lr=1e-2, **kw)


def batches(n: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(32, 8, generator=g) * 3 + 1
        out.append((x, (x[:, :1] * 2 - x[:, 1:2]).sin()))
    return out


def step_fn(model, opt, batch):
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)  # dropout draws from torch's CPU generator
    loss.backward()
    opt.step()
    return loss.item()


def train(inject=None, opt="adam", steps=STEPS, **kw):
    model, optimizer = make(opt, **kw)
    guard = TrainingGuard(model, optimizer, step_fn, inject=inject)
    torch.manual_seed(123)  # dropout's draws: same stream in every run
    losses = [guard.step(b) for b in batches(steps)]
    return losses, model, optimizer, guard


def same_state(m1, o1, m2, o2) -> bool:
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    if any(not torch.equal(sd1[k], sd2[k]) for k in sd1):
        return False
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        s1, s2 = o1.state[p1], o2.state[p2]
        if any(not torch.equal(s1[k], s2[k]) for k in s1):
            return False
    return True


@pytest.mark.parametrize("opt,kw", [("adam", {}), ("adam", {"weight_decay": 0.1}), ("adamw", {"weight_decay": 0.1}),
                                    ("adam", {"amsgrad": True, "betas": (0.5, 0.6)})])
def test_clean_runs_raise_nothing(opt, kw):
    losses, _, _, guard = train(opt=opt, steps=30, **kw)
    assert guard.events == [] and guard.last_clean_step == 30 and guard.stats["checks"] == 30
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.parametrize("spec,check", [
    ("stateflip:target=exp_avg_sq,step=6,bit=30,op=0.weight", "train.adam_exp_avg_sq"),
    ("stateflip:target=exp_avg,step=6,bit=30,op=4.weight", "train.adam_exp_avg"),
    ("stateflip:target=exp_avg_sq,step=6,bit=29,op=4.weight", "train.adam_moment_ratio"),  # v → tiny
    ("stateflip:target=running_var,step=6,bit=28", "train.norm_running_var"),
    ("stateflip:target=running_mean,step=6,bit=30", "train.norm_running_mean"),
])
def test_injected_fault_is_caught_and_run_recovers_bit_exactly(spec, check):
    clean, m0, o0, _ = train()
    losses, m1, o1, guard = train(inject=spec)
    assert len(guard.events) == 1
    ev = guard.events[0]
    assert ev.step == 6 and ev.outcome == "recovered" and ev.restored_to == 4 and ev.replayed == [5, 6]
    assert ev.violations[0].check == check, ev.violations
    assert ev.injected and ev.injected[0]["step"] == 6
    e = ev.evidence()[0]
    assert e.check == check and e.severity.value == ("SUSPECT" if "norm_" in check else "FAULTY") and e.reproduced == 0
    assert losses == clean  # the loss curve after recovery is the clean one, bit for bit
    assert same_state(m0, o0, m1, o1)


def test_fault_at_the_first_step_restores_the_initial_state():
    clean, m0, o0, _ = train(steps=4)
    losses, m1, o1, guard = train(inject="stateflip:target=exp_avg_sq,step=1,bit=30", steps=4)
    assert [(e.step, e.restored_to, e.replayed) for e in guard.events] == [(1, 0, [1])]
    assert losses == clean and same_state(m0, o0, m1, o1)


def test_persistent_fault_reproduces_and_raises():
    seen = []
    model, opt = make()
    guard = TrainingGuard(model, opt, step_fn, inject="stateflip:target=exp_avg_sq,step=3,bit=30,persist=1",
                          retries=2, callback=seen.append)
    with pytest.raises(TrainingStateError, match="reproduced after 2 re-execution"):
        for b in batches():
            guard.step(b)
    assert len(seen) == 1 and seen[0].outcome == "reproduced" and seen[0].attempts == 2 and guard.last_clean_step == 2


def test_guard_attached_mid_run_starts_from_the_state_it_finds():
    model, opt = make(weight_decay=0.05)
    data = batches(20)
    torch.manual_seed(5)
    for b in data[:8]:
        step_fn(model, opt, b)
    guard = TrainingGuard(model, opt, step_fn)
    for b in data[8:]:
        guard.step(b)
    assert guard.events == []


def test_memory_is_two_copies_of_parameters_buffers_and_moments():
    _, model, opt, guard = train(steps=3)
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    mem = guard.memory_bytes()
    assert mem["snapshots"] == 2 * state + 2 * mem["trackers"]


def test_bad_setups_are_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="Adam"):
        TrainingGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn)
    with pytest.raises(ConfigError, match=r"0\.5"):
        TrainingGuard(model, torch.optim.Adam(model.parameters(), betas=(0.1, 0.999)), step_fn)
    with pytest.raises(InjectSpecError, match="only the training guard"):
        from aegis_cli.faults.spec import parse_spec
        parse_spec("stateflip:target=exp_avg")
    with pytest.raises(InjectSpecError, match="persist=1 needs step"):
        TrainingGuard(model, torch.optim.Adam(model.parameters()), step_fn, inject="stateflip:persist=1")


def test_amsgrad_max_is_guarded_too():
    clean, *_ = train(amsgrad=True)
    losses, _, _, guard = train(inject="stateflip:target=max_exp_avg_sq,step=6,bit=30,op=0.weight", amsgrad=True)
    assert [(e.step, e.outcome, e.violations[0].check) for e in guard.events] == [(6, "recovered", "train.adam_amsgrad")]
    assert losses == clean


def test_scan_refuses_training_state_faults(capsys):
    from aegis_cli import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["scan", "--device", "cpu", "--inject", "stateflip:target=exp_avg_sq,step=3", "-q"])
    assert exc.value.code == 3 and "only the training guard applies it" in capsys.readouterr().err


def test_a_state_fault_lands_in_channels_last_moments():
    """Adam keeps a channels_last weight's moments channels_last (dense, not contiguous)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 1))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(4)]
    guard = TrainingGuard(model, opt, step_fn, inject="stateflip:target=exp_avg_sq,step=3,bit=30,op=0.weight")
    for b in data:
        guard.step(b)
    assert not opt.state[model[0].weight]["exp_avg_sq"].is_contiguous()
    assert [(e.step, e.outcome, e.violations[0].check) for e in guard.events] == [(3, "recovered", "train.adam_exp_avg_sq")]
