"""Training with sensors on: clean training confirms nothing; the example catches, confirms and
saves an injected fault that `aegis replay` reproduces; a Hugging Face causal LM trains."""

from __future__ import annotations

import pytest
import torch

from aegis_cli.sensors import SensorConfig, instrument, uninstrument
from tests.helpers import run_cli
from tests.sensors.tiny import batches, gpt

FAULT = "bitflip:op=blocks.1.mlp.fc/fwd,bit=hi-mant"


def test_clean_training_confirms_nothing():
    """100 steps, every launch checked and every block's recompute fingerprinted."""
    model = gpt(checkpointing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    h = instrument(model, SensorConfig(overhead_budget=None, queue_size=64))
    data, first = batches(), None
    for _ in range(100):
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        h.step()
        opt.step()
        first = first if first is not None else float(loss.detach())
    uninstrument(model)
    s = h.stats_dict()
    assert s["confirmed"] == 0 and s["dropped"] == 0, s
    assert s["cleared"] == s["raised"]  # anything raised was verified and cleared (reported, not hidden)
    assert s["checked"] == s["launches"] == 100 * (27 + 8) and s["fingerprinted"] == 200
    assert s["clean_max_ratio"] < 1 and h.last_clean_step == 99
    per_op = [o["clean_max_ratio"] for o in s["operators"].values()]  # which operator runs closest to its τ
    assert max(per_op) == s["clean_max_ratio"]
    assert all(o["clean_max_ratio"] > 0 for k, o in s["operators"].items() if not k.startswith("ckpt/"))  # regions compare bits
    assert s["last_step"]["step"] == 99 and s["last_step"]["checked"] == 35 and 0 < s["last_step"]["max_ratio"] < 1
    assert float(loss.detach()) < first - 0.5  # and it learned


def test_the_example_catches_confirms_saves_and_replays(tmp_path, capsys):
    import train  # examples/train_gpt/train.py (on the path through tests.sensors.tiny)

    out = train.main(["--steps", "5", "--checkpointing", "--bundle-dir", str(tmp_path), "--inject", FAULT])
    printed = capsys.readouterr().out
    assert out["stopped"] == 0 and "corruption confirmed" in printed and "aegis replay" in printed
    confirmed = [e for e in out["events"] if e.kind == "confirmed"]
    assert confirmed and all(e.op == "blocks.1.mlp.fc" for e in confirmed)
    bundle = confirmed[0].bundle
    assert bundle is not None and bundle.startswith(str(tmp_path))
    code, _, _ = run_cli(capsys, "replay", bundle, "--device", "cpu:0", "--inject", FAULT)
    assert code == 2
    code, _, _ = run_cli(capsys, "replay", bundle, "--device", "cpu:0")
    assert code == 0

    clean = train.main(["--steps", "3"])
    assert clean["stopped"] is None and clean["stats"]["confirmed"] == 0 and "sensors:" in capsys.readouterr().out


def test_a_hugging_face_causal_lm_trains_instrumented():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5; gradient_checkpointing_enable before
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    h = instrument(model, SensorConfig(overhead_budget=None))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        h.step()
        opt.step()
        losses.append(float(loss.detach()))
    uninstrument(model)
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored: no instance forward left
    assert losses[-1] < losses[0] and h.stats.confirmed == 0 and h.stats.raised == 0
    assert h.stats.fingerprinted == 4 * cfg.num_hidden_layers  # each decoder layer's recompute matched its forward
    assert h.stats.launches >= 4 * 3 * linears and {"ckpt/model.layers.0", "ckpt/model.layers.1"} <= set(h.controller.ops)
