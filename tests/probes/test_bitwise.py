"""The bitwise probes on the CPU backend: clean runs stay quiet, injected faults are
detected and localised (determinism, pow2, memory, cross-device; docs/probes.md)."""

from __future__ import annotations

import pytest

from aegis_cli.backends.cpu import CpuDevice
from aegis_cli.faults.spec import FaultPlan, parse_spec
from aegis_cli.ops.errors import ConfigError, InjectSpecError
from aegis_cli.probes import ProbeConfig, ProbeContext
from aegis_cli.probes.computations import COMPUTATIONS, CPU_SIZES, NONDETERMINISTIC
from aegis_cli.probes.crossdevice import case_ids
from aegis_cli.scan import ScanOptions, run_scan


def ctx(spec: str | None = None, **options) -> ProbeContext:
    return ProbeContext(config=ProbeConfig(probe_options={k.replace("__", "."): str(v) for k, v in options.items()}),
                        fault=FaultPlan.parse(spec) if spec else None, progress=lambda *a, **k: None)


def test_determinism_clean_cpu_is_deterministic_everywhere():
    from aegis_cli.probes.determinism import determinism_probe

    c = ctx()
    assert determinism_probe(CpuDevice(0), c) == []
    comps = c.stats["determinism"]["computations"]
    assert {"checked_gemm", "matmul", "sdpa_fwd", "sdpa_bwd", "rmsnorm", "gelu", "silu"} <= set(comps)
    assert all(s["deterministic"] and s["distinct"] == 1 for s in comps.values())


def test_determinism_keeps_the_reference_through_many_corrupted_results():
    """Run 0 clean, runs 1–8 corrupted in pairs four different ways, run 9 clean: five results
    twice each. The clean one (the majority by majority()'s tie rule) was dropped from the held
    results and never taken back, and the probe died with a KeyError (device ERROR, the
    corruption's evidence lost)."""
    from aegis_cli.probes.determinism import determinism_probe

    spec = ";".join(f"memflip:op=gelu/run{r},index={idx},bit=3" for r, idx in ((1, 10), (2, 10), (3, 20), (4, 20), (5, 30),
                                                                              (6, 30), (7, 40), (8, 40)))
    c = ctx(spec, determinism__only="gelu", determinism__runs=10)
    (ev,) = determinism_probe(CpuDevice(0), c)
    assert ev.severity.value == "FAULTY" and ev.distinct_outputs == 5
    assert {s["run"] for s in ev.samples} <= set(range(1, 9)) and {s["reference_run"] for s in ev.samples} <= {0, 9}


@pytest.mark.parametrize("step", [57, 112])
def test_pow2_step_that_checks_nothing_is_refused(step):
    """step=112 left the grid {−112, 0, 112}, where no pair is inside the exact range: the probe
    tested nothing, even with a fault injected, and said HEALTHY."""
    from aegis_cli.probes.pow2 import pow2_probe

    with pytest.raises(ConfigError, match=f"pow2.step='{step}' must lie in 1…56"):
        pow2_probe(CpuDevice(0), ctx("memflip:op=pow2/matmul", pow2__step=step))
    c = ctx("memflip:op=pow2/matmul", pow2__step=56)
    (ev,) = pow2_probe(CpuDevice(0), c)
    assert ev.check == "pow2.inexact" and c.stats["pow2"]["implementations"]["matmul"]["tested"] > 0


def test_determinism_localises_a_flip_in_one_of_n_gemm_outputs():
    from aegis_cli.probes.determinism import determinism_probe

    c = ctx("memflip:op=checked_gemm/run1,bit=exp,seed=4", determinism__only="checked_gemm")
    (ev,) = determinism_probe(CpuDevice(0), c)
    assert ev.check == "determinism.mismatch" and ev.severity.value == "FAULTY"
    inj = c.fault.injected[0]
    assert ev.elements == 1 and ev.distinct_outputs == 2
    s = ev.samples[0]
    out = inj["op"].rsplit(":", 1)[1]
    assert s["run"] == 1 and s["output"] == out and s["index"] == inj["positions"][0]
    assert int(s["xor"], 16) == int(inj["masks"][0], 16)
    assert int(s["expected"], 16) ^ int(s["actual"], 16) == int(s["xor"], 16)


def test_determinism_sees_an_intermittent_accumulator_fault_inside_the_gemm():
    from aegis_cli.probes.determinism import determinism_probe

    c = ctx("bitflip:target=acc,bit=exp,prob=0.5,seed=3,op=determinism/checked_gemm", determinism__only="checked_gemm",
            determinism__runs=8)
    (ev,) = determinism_probe(CpuDevice(0), c)
    assert ev.severity.value == "FAULTY" and 0 < len(c.stats["determinism"]["computations"]["checked_gemm"]["differing_runs"]) < 8
    assert ev.tiles and all(len(t) == 2 for t in ev.tiles)


def test_determinism_localises_an_element_swap():
    from aegis_cli.probes.determinism import determinism_probe

    c = ctx("swap:op=matmul/run2,index=1000", determinism__only="matmul")
    (ev,) = determinism_probe(CpuDevice(0), c)
    pair = c.fault.injected[0]["pairs"][0]
    assert ev.elements == 2 and sorted(s["index"] for s in ev.samples) == pair
    assert ev.samples[0]["expected"] == ev.samples[1]["actual"]


def test_pow2_clean_and_injected_regime():
    from aegis_cli.probes.pow2 import pow2_probe

    c = ctx()
    assert pow2_probe(CpuDevice(0), c) == []
    st = c.stats["pow2"]["implementations"]["checked_gemm"]
    assert st["tested"] > 5 and st["skipped_unsafe"] > 0
    # a fault that fires only when A is scaled by 2^56: the regime is exactly a = 56
    c = ctx("bitflip:target=acc,bit=mant,op=pow2/checked_gemm/64x96x128/a+56")
    evs = pow2_probe(CpuDevice(0), c)
    assert [e.check for e in evs] == ["pow2.inexact"] and evs[0].op == "checked_gemm"
    reg = c.stats["pow2"]["implementations"]["checked_gemm"]["deviating_regime"]
    assert reg["a"] == [56, 56] and evs[0].reproduced == 1
    assert all(s["a"] == 56 for s in evs[0].samples)


def test_memory_clean_then_flip_and_swap_with_address_and_mask():
    from aegis_cli.probes.memory import memory_probe

    c = ctx(memory__mb=8)
    assert memory_probe(CpuDevice(0), c) == []
    st = c.stats["memory"]
    assert st["bytes_covered"] == 8 << 20 and st["coverage_of_free"] == 1.0 and not st["nvml"]["before"]["available"]
    c = ctx("memflip:bit=6,index=777777", memory__mb=8)
    (ev,) = memory_probe(CpuDevice(0), c)
    inj = c.fault.injected[0]
    chunk = int(inj["op"].rsplit("chunk", 1)[1])
    s = ev.samples[0]
    assert ev.check == "memory.bitflip" and ev.severity.value == "FAULTY" and ev.reproduced == 1
    assert s["chunk"] == chunk and s["offset"] == 777777 // 8 * 8 and s["flipped_bits"] == 1
    assert int(s["xor"], 16) == (1 << 6) << (8 * (777777 % 8))
    c = ctx("swap:index=4096", memory__mb=8)
    (ev,) = memory_probe(CpuDevice(0), c)
    assert ev.elements >= 1 and all(int(x["xor"], 16) for x in ev.samples if "xor" in x)


@pytest.mark.parametrize("bit", [12, 63])
def test_memflip_bit_beyond_the_element_counts_on_in_memory(bit):
    """bit=N on a byte buffer is bit N of the memory from the chosen byte on (bit 12 is bit 4 of
    the next byte), as in the 64-bit word the probe reports; it was taken mod 8 (bit 4 of the same
    byte), so the flip landed somewhere other than asked."""
    from aegis_cli.probes.memory import memory_probe

    c = ctx(f"memflip:bit={bit},index=777776", memory__mb=8)  # 777776: the first byte of a 64-bit word
    (ev,) = memory_probe(CpuDevice(0), c)
    s = ev.samples[0]
    assert c.fault.injected[0]["positions"] == [777776 + bit // 8]
    assert s["offset"] == 777776 and int(s["xor"], 16) == 1 << bit and s["flipped_bits"] == 1


def test_memory_flips_in_several_chunks_reproduce_once_per_reread():
    """The third read is one re-run: it counted the chunks still changed ("3 of 1 re-runs")."""
    from aegis_cli.probes.memory import memory_probe

    c = ctx("memflip:seed=1;memflip:seed=2;memflip:seed=3", memory__mb=16)
    (ev,) = memory_probe(CpuDevice(0), c)
    assert len({t[0] for t in ev.tiles}) >= 2  # several chunks changed
    assert (ev.reproduced, ev.reruns) == (1, 1) and ev.to_dict()["reproduction"] == "reproduced in 1 of 1 re-runs"


def test_memory_finds_a_bit_stuck_from_the_write(monkeypatch):
    """A cell that never holds what is written (stuck at 1) reads the same wrong bits when the
    patterns are fingerprinted and after the hold: only the pattern itself shows it. The
    probe compared fingerprint with fingerprint and said HEALTHY."""
    from aegis_cli.probes import memory

    stuck, chunks = 777777, []  # a byte of chunk 0 (walking ones: 0x00 there), bit 4 stuck at 1
    allocate, fill = memory._Region.allocate, memory.fill

    def allocate_and_note(self, target):
        allocate(self, target)
        chunks[:] = self.chunks

    def fill_with_a_stuck_cell(piece, pattern, seed, gen):
        fill(piece, pattern, seed, gen)
        off = stuck - (piece.data_ptr() - chunks[0].data_ptr())
        if piece.untyped_storage().data_ptr() == chunks[0].untyped_storage().data_ptr() and 0 <= off < piece.numel():
            piece[off] |= 0x10

    monkeypatch.setattr(memory._Region, "allocate", allocate_and_note)
    monkeypatch.setattr(memory, "fill", fill_with_a_stuck_cell)
    c = ctx(memory__mb=8)
    (ev,) = memory.memory_probe(CpuDevice(0), c)
    (s,) = ev.samples
    assert ev.severity.value == "FAULTY" and ev.reproduced == 1 and "right after the write" in ev.summary
    assert (s["chunk"], s["offset"], s["wrong_since"]) == (0, stuck // 8 * 8, "write")
    assert int(s["xor"], 16) == 0x10 << (8 * (stuck % 8)) and s["pattern"] == "walking_ones"


def test_memory_probe_that_could_allocate_nothing_is_an_error(monkeypatch):
    """When no memory can be allocated (another process fills the GPU) the probe checked
    nothing: it said HEALTHY with 0 bytes covered."""
    from aegis_cli.probes import memory

    monkeypatch.setattr(memory._Region, "allocate", lambda self, target: None)  # every allocation failed
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("memory",)))
    d = rep.devices[0]
    assert d.verdict.value == "ERROR" and "no memory could be allocated" in d.error


def test_memory_summary_counts_every_changed_block():
    from aegis_cli.probes.memory import BLOCK, memory_probe

    # 1000 flips in one 4 MiB chunk land in (almost surely) all 64 of its 64 KiB blocks: the summary
    # counted at most 16 per chunk
    c = ctx("memflip:count=1000", memory__mb=8)
    (ev,) = memory_probe(CpuDevice(0), c)
    n = int(ev.summary.split("memory.bitflip: ")[1].split(" block(s)")[0])
    assert 16 < n <= (4 << 20) // BLOCK and len(ev.tiles) == 16


def test_crossdevice_three_cpus_majority_flags_the_odd_one(monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "3")
    rep = run_scan(ScanOptions(devices="cpu", probes=("crossdevice",), inject="memflip:device=cpu:1,op=crossdevice/matmul"))
    v = {d.identity.id: d.verdict.value for d in rep.devices}
    assert v == {"cpu:0": "HEALTHY", "cpu:1": "FAULTY", "cpu:2": "HEALTHY"}
    (ev,) = rep.devices[1].evidence
    assert ev.check == "crossdevice.mismatch" and "majority" in ev.summary and ev.samples[0]["reference_device"] == "cpu:0"
    assert rep.devices[0].probe_stats["crossdevice"]["groups"][0]["compared"]


def test_crossdevice_two_cpus_fp64_reference_decides(monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    rep = run_scan(ScanOptions(devices="cpu", probes=("crossdevice",),
                               inject="memflip:device=cpu:0,op=crossdevice/checked_gemm,bit=exp"))
    v = {d.identity.id: d.verdict.value for d in rep.devices}
    assert v == {"cpu:0": "FAULTY", "cpu:1": "HEALTHY"}
    assert "fp64 reference decides" in rep.devices[0].evidence[0].summary


def test_crossdevice_clean_and_single_device():
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("determinism", "crossdevice"),
                               probe_options={"determinism.only": "gelu"}))
    assert rep.devices[0].verdict.value == "HEALTHY"
    assert rep.devices[0].probe_stats["crossdevice"]["groups"][0]["compared"] is False
    # alone, on one device, it would check nothing and still say HEALTHY
    with pytest.raises(ConfigError, match="with one device it checks nothing"):
        run_scan(ScanOptions(devices="cpu:0", probes=("crossdevice",)))


@pytest.mark.parametrize("case", ["crossdevice/matmul/zzz", "crossdevice/matmul", "crossdevice/matmul/c/extra",
                                  "crossdevice/matmul/row_sums", "crossdevice/matmul/input:q", "crossdevice/nope/c"])
def test_crossdevice_case_that_the_probe_never_gives_is_refused(monkeypatch, case):
    """A wrong output part used to run that computation's comparison and say HEALTHY."""
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    with pytest.raises(ConfigError, match="crossdevice probe has no"):
        run_scan(ScanOptions(devices="cpu", case=case))


def test_crossdevice_case_reruns_the_flagged_output(monkeypatch):
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "3")
    spec = "memflip:device=cpu:1,op=crossdevice/checked_gemm"
    first = run_scan(ScanOptions(devices="cpu", probes=("crossdevice",), inject=spec))
    (ev,) = first.devices[1].evidence
    assert ev.case_id in case_ids("checked_gemm")
    again = run_scan(ScanOptions(devices="cpu", inject=spec, case=ev.case_id))
    assert [e.case_id for e in again.devices[1].evidence] == [ev.case_id]
    assert again.devices[0].probe_stats["crossdevice"]["groups"][0]["computations"] == ["checked_gemm"]
    assert run_scan(ScanOptions(devices="cpu", case="crossdevice/matmul/input:b")).devices[0].verdict.value == "HEALTHY"


@pytest.mark.parametrize("name", sorted(COMPUTATIONS))
def test_computation_names_are_what_it_produces(name):
    """The case ids the crossdevice probe accepts come from these declared names."""
    dev, comp = CpuDevice(), COMPUTATIONS[name]
    x = comp.inputs(dev, CPU_SIZES, 0)
    assert (tuple(x), tuple(comp.run(dev, x, None, name))) == comp.names


def test_crossdevice_refuses_a_selection_it_would_skip_entirely(monkeypatch):
    """Computations that differ run to run on the backend are skipped; with nothing else
    selected the probe compared nothing and said HEALTHY."""
    monkeypatch.setenv("AEGIS_CPU_DEVICES", "2")
    monkeypatch.setitem(NONDETERMINISTIC, "cpu", {"sdpa_bwd"})
    for opts in (ScanOptions(devices="cpu", probes=("gemm", "crossdevice"), probe_options={"crossdevice.only": "sdpa_bwd"}),
                 ScanOptions(devices="cpu", case="crossdevice/sdpa_bwd/dq")):
        with pytest.raises(ConfigError, match="would compare nothing"):
            run_scan(opts, lambda event, **info: pytest.fail("refused only after work began") if event == "start" else None)
    rep = run_scan(ScanOptions(devices="cpu", probes=("crossdevice",), probe_options={"crossdevice.only": "sdpa_bwd,gelu"}))
    assert rep.devices[0].probe_stats["crossdevice"]["groups"][0]["computations"] == ["gelu"]


def test_crossdevice_alone_over_devices_of_different_models_is_refused():
    """Two devices, no two of one model: the probe compared nothing and said HEALTHY."""
    import dataclasses

    from aegis_cli.probes.crossdevice import selection

    d0, d1 = CpuDevice(0), CpuDevice(1)
    d1.identity = dataclasses.replace(d1.identity, name="another model")
    with pytest.raises(ConfigError, match="no two of the scanned devices are of one model"):
        selection([d0, d1], ProbeContext(config=ProbeConfig(probes=("crossdevice",)), fault=None, progress=lambda *a, **k: None))
    assert selection([d0, d1], ProbeContext(config=ProbeConfig(probes=("gemm", "crossdevice")), fault=None,
                                            progress=lambda *a, **k: None))  # others run: it may compare nothing


def test_inject_grammar_for_stored_faults():
    assert parse_spec("memflip")[0].target == "mem" and parse_spec("swap:count=2")[0].target == "mem"
    assert parse_spec("memflip:bit=63,index=5")[0].get("bit") == "63"
    for bad in ("memflip:target=acc", "swap:bit=3", "memflip:bit=64", "swap:index=-1"):
        with pytest.raises(InjectSpecError):
            parse_spec(bad)


def test_probe_options_are_validated():
    with pytest.raises(ConfigError, match="unknown probe option"):
        run_scan(ScanOptions(devices="cpu:0", probes=("memory",), probe_options={"memory.nope": "1"}))
    with pytest.raises(ConfigError, match="not a valid"):
        run_scan(ScanOptions(devices="cpu:0", probes=("memory",), probe_options={"memory.mode": "slow"}))


def test_default_scan_includes_the_bitwise_probes_and_stays_healthy():
    from aegis_cli.probes import DEFAULT_PROBES

    assert {"determinism", "pow2", "memory", "crossdevice"} <= set(DEFAULT_PROBES)
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("determinism", "pow2", "memory", "crossdevice")))
    d = rep.devices[0]
    assert d.verdict.value == "HEALTHY", [e.summary for e in d.evidence]
    assert {"determinism", "pow2", "memory", "crossdevice"} <= set(d.probe_stats)


def test_case_rerun_runs_only_the_owning_probe_and_computation():
    spec = "memflip:op=determinism/matmul/run1"
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("gemm", "determinism", "pow2"), inject=spec,
                               case="determinism/matmul/128x192x256"))
    d = rep.devices[0]
    assert set(d.probe_stats) == {"determinism"} and set(d.probe_stats["determinism"]["computations"]) == {"matmul"}
    assert [e.case_id for e in d.evidence] == ["determinism/matmul/128x192x256"]


def test_progress_counts_only_gemm_cases():
    """The scan's progress total counts GEMM cases; the other probes report steps that must not
    push the bar past it (they used to send counted "case" events)."""
    events: list[tuple[str, dict]] = []
    run_scan(ScanOptions(devices="cpu:0", probes=("gemm", "determinism", "pow2", "memory", "crossdevice")),
             lambda event, **info: events.append((event, info)))
    total = next(info["total"] for event, info in events if event == "start")
    assert total > 0
    assert sum(event == "case" for event, _ in events) == total
    assert any(event == "step" for event, _ in events)


@pytest.mark.gpu
def test_crossdevice_two_gpus_fp64_reference_decides_on_checksums():
    # the referee judges the fused sums on the kernels' own 64×128 tiles and each GPU's τ for this
    # K (a fixed 128×128 tile left every checksum disagreement undecided on CUDA)
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    seen = {}
    for seed in range(24):
        rep = run_scan(ScanOptions(devices="cuda:0,cuda:1", probes=("crossdevice",),
                                   probe_options={"crossdevice.only": "checked_gemm"},
                                   inject=f"memflip:device=cuda:0,op=crossdevice/checked_gemm,bit=exp,seed={seed}"))
        v = {d.identity.id: d.verdict.value for d in rep.devices}
        (ev,) = rep.devices[0].evidence
        out = ev.samples[0]["output"]
        assert v == {"cuda:0": "FAULTY", "cuda:1": "HEALTHY"}, (seed, out, ev.summary)
        assert "fp64 reference decides" in ev.summary, (seed, out, ev.summary)
        seen[out] = seed
        if {"row_sums", "col_sums"} <= set(seen):
            break
    assert {"row_sums", "col_sums"} <= set(seen), seen


def test_determinism_majority_found_after_four_corrupted_runs():
    # the first four runs are corrupted differently and the clean result comes later: only
    # MAX_HELD results are kept, and the majority's must be one of them (was a KeyError → ERROR)
    spec = ";".join(f"memflip:op=gelu/run{r}" for r in range(4))
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("determinism",), inject=spec,
                               probe_options={"determinism.only": "gelu", "determinism.runs": "9"}))
    d = rep.devices[0]
    assert d.verdict.value == "FAULTY" and not d.error
    (ev,) = d.evidence
    assert "4 of 9 runs differ from the majority" in ev.summary and ev.samples[0]["reference_run"] >= 4  # a clean run


def test_determinism_without_majority_says_so():
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("determinism",), inject="memflip:op=gelu/run0",
                               probe_options={"determinism.only": "gelu", "determinism.runs": "2"}))
    (ev,) = rep.devices[0].evidence
    assert ev.severity.value == "FAULTY" and "no majority" in ev.summary and ev.samples[0]["no_majority"] is True


@pytest.mark.parametrize("name", ["silu", "sdpa_fwd"])
def test_stored_fault_positions_differ_per_run_for_every_computation(name):
    # a fault's position is derived from its op without the GEMM scale suffix "/s±a±b"; cutting at
    # the first "/s" made every run of silu or sdpa_* identical (all flipped alike, nothing seen)
    rep = run_scan(ScanOptions(devices="cpu:0", probes=("determinism",), inject=f"memflip:op={name}",
                               probe_options={"determinism.only": name}))
    assert rep.devices[0].verdict.value == "FAULTY"
