"""Workload catalogs: shipped presets load, shapes follow the model config, bad YAML is named."""

from __future__ import annotations

import pytest

from aegis_cli.ops import workloads
from aegis_cli.ops.errors import ConfigError


def test_every_shipped_catalog_loads():
    names = workloads.available()
    assert {"cpu-quick", "llama3-1b", "llama3-70b"} <= set(names)
    for name in names:
        wl = workloads.load(name)
        assert wl.gemms(), name


def test_llama3_70b_tp8_per_gpu_shapes():
    wl = workloads.load("llama3-70b")
    shapes = {(g.op, g.layout.value): (g.m, g.n, g.k) for g in wl.gemms()}
    # 64 heads of 128, 8 KV heads, TP=8: 8 q heads + 2·1 kv heads per GPU
    assert shapes[("qkv", "fwd")] == (8192, 1280, 8192)
    assert shapes[("attn_out", "fwd")] == (8192, 8192, 1024)
    assert shapes[("mlp_gate_up", "fwd")] == (8192, 7168, 8192)
    assert shapes[("mlp_down", "fwd")] == (8192, 8192, 3584)
    assert shapes[("mlp_down", "dgrad")] == (8192, 3584, 8192)
    assert shapes[("mlp_down", "wgrad")] == (8192, 3584, 8192)
    assert shapes[("qkv", "wgrad")] == (1280, 8192, 8192)


def _write(tmp_path, text):
    p = tmp_path / "w.yaml"
    p.write_text(text)
    return str(p)


BASE = "name: t\nmodel:\n  hidden: 256\n  ffn: 512\n  heads: 4\n  kv_heads: 2\n  seq_len: 64\n"


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (BASE + "  hiden: 3\n", ["unknown key 'hiden'", "line 8"]),
        (BASE + "scan:\n  opz: [qkv]\n", ["unknown key 'opz'", "line 9"]),
        (BASE + "scan:\n  ops: [qkvv]\n", ["unknown op 'qkvv'"]),
        (BASE + "scan:\n  distributions: [cauchy]\n", ["unknown distribution 'cauchy'"]),
        (BASE + "scan:\n  scales: [[0, 99]]\n", ["scales"]),
        (BASE.replace("hidden: 256", "hidden: 250"), ["not a multiple of heads"]),
        (BASE.replace("hidden: 256", "hidden: big"), ["hidden must be int", "line 3"]),
        (BASE.replace("seq_len: 64", "seq_len: -1"), ["seq_len = -1"]),
        ("name: t\nmodel: {hidden: 256}\n", ["missing key"]),
        ("name: t\nmodel: [1, 2\n", ["malformed YAML"]),
        ("", ["empty file"]),
        ("- just\n- a list\n", ["expected a mapping"]),
        (BASE + "name: again\n", ["duplicate key 'name'"]),
        ("name: !!python/object/apply:os.system ['true']\n", ["malformed YAML"]),
    ],
)
def test_bad_catalogs_name_file_and_problem(tmp_path, text, needles):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        workloads.load(path)
    msg = str(exc.value)
    assert path in msg
    for n in needles:
        assert n in msg, msg


def test_unknown_name_lists_shipped():
    with pytest.raises(ConfigError, match=r"shipped: .*cpu-quick"):
        workloads.load("gpt-17")


def test_max_tokens_shrinks_token_dimension(tmp_path):
    wl = workloads.load(_write(tmp_path, BASE + "scan:\n  max_tokens: 32\n  ops: [qkv]\n"))
    assert {(g.layout.value, g.m if g.layout.value != "wgrad" else g.k) for g in wl.gemms()} == {("fwd", 32), ("dgrad", 32), ("wgrad", 32)}
