"""SDPA through the checked attention (SensorConfig.attention): a model trains like its plain self
within bf16 tolerance and repeats bit for bit; an injected attention fault is caught, confirmed,
saved as a vTask of the call's real tensors at its softmax scale, and `aegis replay` reproduces it
with the same injection and not without; unsupported calls fall through to torch and are counted;
uninstrument restores SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aegis_cli.ops import attention_sums as sums
from aegis_cli.ops.errors import ConfigError
from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument
from aegis_cli.sensors.attention import AttentionRouter
from aegis_cli.sensors.handoff import Cause, HandoffExit, classify_bundles
from aegis_cli.vtask.bundle import read_bundle
from tests.helpers import run_cli
from tests.sensors.test_instrument import loss_and_grads, rel
from tests.sensors.tiny import batches, gpt, mlp

ATTN = SensorConfig(overhead_budget=None, attention=True)


def test_gpt_matches_the_plain_model_and_repeats_bit_for_bit():
    model = gpt()
    x, y = next(batches())
    loss0, g0 = loss_and_grads(model, x, y)
    runs = []
    for _ in range(2):
        h = instrument(model, ATTN)
        runs.append(loss_and_grads(model, x, y))
        assert h.step() is Action.CONTINUE
        uninstrument(model)
        # two blocks: two SDPA calls, each checked after its backward; nothing flagged
        assert h.stats.attention_launches == 2 and h.stats.attention_unchecked == {}
        assert h.stats.checked == 27 + 2 and h.stats.raised == 0
    (loss1, g1), (loss2, g2) = runs
    assert abs(float(loss1 - loss0)) <= 1e-2 * abs(float(loss0))
    for name, g in g0.items():
        assert rel(g1[name], g) < 5e-2, name
    assert torch.equal(loss1.view(torch.int32), loss2.view(torch.int32))
    assert all(torch.equal(g1[n].view(torch.int32), g2[n].view(torch.int32)) for n in g1)


def test_attention_checks_on_the_cpu_are_charged_their_wall_time_at_once():
    """On the CPU an attention check's cost is its wall time, charged to its operator as it returns
    (on CUDA its events are read at the step boundary: test_attention_sensor_gpu.py)."""
    model = gpt()
    x, y = next(batches())
    h = instrument(model, ATTN)
    loss_and_grads(model, x, y)
    costs = [st.cost_s for key, st in h.controller.ops.items() if key.startswith("sdpa/")]
    assert costs and all(c > 0 for c in costs) and h.timed == []
    uninstrument(model)


@pytest.mark.parametrize("spec, check", [("perturb:target=attn.dv,r=1000,op=sdpa#1", "attention.dv_colsum"),
                                         ("perturb:target=attn.pv,r=100,op=sdpa#0", "attention.o_rowsum")])
def test_injected_attention_fault_is_caught_confirmed_saved_and_replayed(spec, check, tmp_path, capsys):
    model = gpt()
    x, y = next(batches())
    h = instrument(model, SensorConfig(overhead_budget=None, attention=True, inject=spec, bundle_dir=str(tmp_path),
                                       job="t", rank=2))
    loss_and_grads(model, x, y)
    assert h.step() is Action.STOP
    uninstrument(model)
    confirmed = [e for e in h.events if e.kind == "confirmed"]
    assert len(confirmed) == 1 and h.stats.raised == 1 and h.stats.confirmed == 1 and h.stats.saved == 1
    ev = confirmed[0]
    want_op = spec.split("op=")[1]
    assert ev.check == check and ev.severity == "FAULTY" and ev.op == want_op and ev.site.startswith(f"train/{want_op}/")
    assert ev.evidence[0].reproduced == 2 and ev.evidence[0].distinct_outputs == 1 and ev.evidence[0].injected
    assert h.stats_dict()["never_fired"] == []
    _replayed(ev, spec, check, capsys, step=0, rank=2)


def _replayed(ev, spec: str, check: str, capsys, **provenance) -> None:
    """``ev``'s bundle holds the call's real bf16 tensors, and `aegis replay` reproduces its check with
    the same injection and not without."""
    vt = read_bundle(ev.bundle).vtasks[0]
    assert vt.kind == "attention" and vt.check == check and vt.case_id == ev.site and vt.scale == (0, 0)
    assert vt.observed["source"] == "training" and vt.observed["severity"] == "FAULTY" and vt.provenance["injected"]
    assert all(vt.provenance[k] == v for k, v in provenance.items())
    assert vt.seed is None and vt.dist is None and {"q", "k", "v", "do", "o", "dv"} <= set(vt.tensors)
    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", "cpu:0", "--inject", spec, "--format", "json")
    assert code == 2 and '"outcome": "reproduced"' in out and '"captured_check_fired": true' in out
    assert '"matches_capture": true' in out  # the same bits as the training step's, fault and all
    code, out, _ = run_cli(capsys, "replay", ev.bundle, "--device", "cpu:0", "--format", "json")
    assert code == 0 and '"outcome": "not_reproduced"' in out


class _Attend(torch.nn.Module):
    """One projection into SDPA at a softmax scale of its own (not 1/√D)."""

    def __init__(self, d=16, heads=2, scale=0.37):
        super().__init__()
        self.proj, self.heads, self.scale = torch.nn.Linear(d, 3 * d), heads, scale

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.proj(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)


def test_a_call_at_its_own_softmax_scale_is_saved_and_replayed_at_that_scale(tmp_path, capsys):
    """The bundle carries the call's scale, and a replay runs at it: a clean replay at 1/√D would
    differ from the reference at the captured scale and read as a reproduced fault."""
    torch.manual_seed(5)
    model, spec = _Attend(), "perturb:target=attn.dv,r=1000,op=sdpa#0"
    x = torch.randn(2, 32, 16)
    h = instrument(model, SensorConfig(overhead_budget=None, attention=True, inject=spec, bundle_dir=str(tmp_path)))
    model(x).square().sum().backward()
    h.step()
    uninstrument(model)
    ev = next(e for e in h.events if e.kind == "confirmed")
    assert read_bundle(ev.bundle).vtasks[0].attention.scale == pytest.approx(0.37)
    _replayed(ev, spec, "attention.dv_colsum", capsys, step=0, rank=0)


def test_a_saved_attention_event_is_classified_by_replay_on_another_device(tmp_path, monkeypatch):
    """The hand-off replays an attention vTask as it does a GEMM's: a fault of this device only is hardware."""
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    spec = "perturb:target=attn.pv,r=100,op=sdpa#0,device=cpu:0"
    model = gpt()
    x, y = next(batches())
    h = instrument(model, SensorConfig(overhead_budget=None, attention=True, inject=spec, bundle_dir=str(tmp_path)))
    loss_and_grads(model, x, y)
    h.step()
    uninstrument(model)
    ev = next(e for e in h.events if e.kind == "confirmed")
    c = classify_bundles([ev.bundle], "cpu:0", "cpu:1", inject=spec)
    assert (c.cause, c.here, c.there, c.exit_code) == (Cause.HARDWARE, "reproduced", "not_reproduced", HandoffExit.HARDWARE)


def test_a_cleared_attention_spike_raises_its_operators_tau(monkeypatch):
    """Adaptive thresholds (docs/sensors.md §4) for attention as for GEMMs: a flag within the
    invariant's rounding bound is cleared, raises the operator's τ above it, and is not raised again."""
    monkeypatch.setitem(sums.DEFAULT_TAU, "o_rowsum", 1e-3)  # far under the clean rounding noise
    model = gpt()
    data = batches()
    h = instrument(model, ATTN)
    x, y = next(data)
    loss_and_grads(model, x, y)
    assert h.step() is Action.CONTINUE
    op = next(k for k in h.controller.ops if k.startswith("sdpa/"))
    cleared, raised = [e for e in h.events if e.kind == "cleared"], h.stats.raised
    assert raised >= len(cleared) >= 1 and h.stats.confirmed == 0  # (min_verify: one a boundary)
    assert "could be rounding" in cleared[0].summary and cleared[0].check == "attention.o_rowsum"
    assert any(e.kind == "threshold" and op in e.summary for e in h.events)
    assert h.stats_dict()["operators"][op]["tau_raise"] > 1
    x, y = next(data)
    loss_and_grads(model, x, y)
    h.step()
    uninstrument(model)  # verifies what is still queued
    assert h.stats.raised == raised == h.stats.cleared and h.stats.confirmed == 0  # nothing new at the raised τ
    assert set(h.stats.attention_clean_max) == set(sums.INVARIANTS)


def test_a_confirmed_attention_call_over_max_vtask_bytes_is_reported_unsaved(tmp_path):
    model = gpt()
    x, y = next(batches())
    h = instrument(model, SensorConfig(overhead_budget=None, attention=True, inject="perturb:target=attn.dv,r=1000,op=sdpa#1",
                                       bundle_dir=str(tmp_path), max_vtask_bytes=1024))
    loss_and_grads(model, x, y)
    h.step()
    uninstrument(model)
    assert h.stats.confirmed == 1 and h.stats.saved == 0 and h.stats.unsaved == 1 and list(tmp_path.iterdir()) == []
    unsaved = [e for e in h.events if e.kind == "unsaved"]
    assert len(unsaved) == 1 and "over max_vtask_bytes" in unsaved[0].summary


def test_an_unsampled_call_drawn_at_its_forward_runs_torchs_sdpa(monkeypatch):
    """The fast path (``draws_at_forward``: bf16 on a GPU the sensors run on, forced here on the CPU):
    with nothing sampled every call is torch's SDPA, bit for bit the plain model's, and counted."""
    from aegis_cli.sensors import attention, linear

    for module in (attention, linear):  # the Linears' fast path too: the whole model is then torch's
        monkeypatch.setattr(module, "draws_at_forward", lambda h, x, *tensors: True)
    model = gpt().to(torch.bfloat16)
    x, y = next(batches())
    loss0, g0 = loss_and_grads(model, x, y)
    h = instrument(model, SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=None, attention=True))
    loss1, g1 = loss_and_grads(model, x, y)
    h.step()
    uninstrument(model)
    assert torch.equal(loss1, loss0) and all(torch.equal(g1[n], g0[n]) for n in g0)  # finite: equal is bitwise
    assert h.stats.attention_launches == 2 and h.stats.checked == 0


def _qkv(heads=4, kv=4, seq=16, d=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(2, h, seq, d, generator=g, requires_grad=True)
    return mk(heads), mk(kv), mk(kv)


def test_gqa_is_checked_and_unsupported_calls_fall_through_counted():
    model = mlp()
    original = F.scaled_dot_product_attention
    h = instrument(model, ATTN)
    assert isinstance(F.scaled_dot_product_attention, AttentionRouter)
    with pytest.raises(ConfigError):  # one global function: one routing handle at a time
        instrument(mlp(), ATTN)
    q, k, v = _qkv(kv=2)
    got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got.square().sum().backward()
    want = original(q, k, v, is_causal=True, enable_gqa=True)
    assert rel(got.detach(), want.detach()) < 2e-2 and k.grad.shape == k.shape
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                       original(q, k, v, attn_mask=mask, enable_gqa=True))
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True)
    with pytest.raises(RuntimeError):  # torch's own refusal of unequal heads without enable_gqa, unchanged
        F.scaled_dot_product_attention(q, k, v)
    h.step()
    uninstrument(model)
    assert F.scaled_dot_product_attention is original
    assert h.stats.attention_launches == 1 and h.stats.checked == 1 and h.stats.raised == 0
    assert h.stats_dict()["attention_unchecked"] == {"attn_mask": 1, "dropout": 1, "kv heads": 1}


def test_attention_off_by_default_leaves_sdpa_alone():
    original = F.scaled_dot_product_attention
    model = gpt()
    h = instrument(model, SensorConfig(overhead_budget=None))
    assert F.scaled_dot_product_attention is original
    x, y = next(batches())
    loss_and_grads(model, x, y)
    uninstrument(model)
    assert h.stats.attention_launches == 0
