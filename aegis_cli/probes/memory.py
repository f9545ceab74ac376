"""The memory probe: fill most of a device's free memory with patterns, fingerprint it,
hold it while compute runs, re-read and compare (docs/design.md §1: HBM flips without ECC reports).

Chunks (1 GiB on GPUs) are allocated until ``fraction`` of the free memory is covered and
filled, in pieces of a few MiB each seeded apart, with a pattern per chunk (rotated each
pass): walking ones and walking zeros (64-bit words), random bytes, and training-like bf16
and fp32 normal values. Each piece is read back against its pattern regenerated in a scratch
buffer (cells wrong from the start: stuck bits, failed writes). Each chunk's block fingerprints
(64 KiB blocks, on the device) are taken after the write; matmuls run for ``hold`` seconds; the
fingerprints are taken again.

  memory.bitflip   a block read back wrong right after the write, or its fingerprint changed
                   between write and re-read. The block's
                   piece is regenerated from its seed and compared word by word: device
                   address, offset, expected/actual 64-bit words, XOR mask, flipped bits.
                   FAULTY. A third read says whether the flip stays in storage.
  memory.ecc       NVML reports new uncorrectable ECC errors, pending page retirement or a
                   row-remap failure during the probe. SUSPECT (the driver saw it; no silent
                   corruption was proven).

ECC counters, retired pages and remapped rows before and after are in the stats (nvml.py).
On the CPU backend the probe checks a host buffer of ``mb`` MiB the same way.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from aegis_cli.backends import fingerprints, nvml
from aegis_cli.backends.base import Device
from aegis_cli.faults.spec import recent_injections
from aegis_cli.faults.stored import stored_faults
from aegis_cli.ops.case import CaseId, case_seed
from aegis_cli.ops.errors import ConfigError, DeviceError
from aegis_cli.ops.verdict import Evidence, Verdict
from aegis_cli.probes import ProbeContext, bounded, quick_or_full, register
from aegis_cli.probes.computations import MAX_SAMPLES

PATTERNS = ("walking_ones", "walking_zeros", "random", "bf16_normal", "fp32_normal")
BLOCK = 1 << 16  # bytes per block fingerprint
GPU_CHUNK, GPU_PIECE = 1 << 30, 1 << 26
CPU_CHUNK, CPU_PIECE = 1 << 22, 1 << 20
MAX_BLOCKS_EXAMINED = 16

OPTIONS = {
    "mode": (quick_or_full, "quick", "quick: 90% of free GPU memory held 3 s, one pass; full: 95%, 30 s, two passes"),
    "fraction": (bounded(float, 0.01, 0.99, auto=0.0), 0.0, "fraction of free GPU memory to cover, 0.01…0.99 (0: by mode)"),
    "hold": (bounded(float, -1, 3600), -1.0, "seconds to hold the patterns while matmuls run (-1: by mode)"),
    "passes": (bounded(int, 0, 1000), 0, "passes, each with the patterns rotated across chunks (0: by mode)"),
    "mb": (bounded(int, 0, 1 << 20), 0, "CPU backend: host buffer size in MiB (0: by mode, 32 quick / 512 full)"),
}

_TEMPLATES: dict[torch.device, torch.Tensor] = {}


def _walking(dev: torch.device) -> torch.Tensor:
    if dev not in _TEMPLATES:
        _TEMPLATES[dev] = torch.ones(64, dtype=torch.int64, device=dev) << torch.arange(64, device=dev)
    return _TEMPLATES[dev]


def fill(piece: torch.Tensor, pattern: str, seed: int, gen: torch.Generator) -> None:
    """Write ``pattern`` into a uint8 piece (length a multiple of 512 bytes), reproducibly."""
    if pattern in ("walking_ones", "walking_zeros"):
        t = _walking(piece.device)
        words = piece.view(torch.int64).view(-1, 64)
        words.copy_((t if pattern == "walking_ones" else ~t).expand_as(words))
        return
    gen.manual_seed(seed)
    if pattern == "random":
        piece.random_(0, 256, generator=gen)
    elif pattern == "bf16_normal":
        piece.view(torch.bfloat16).normal_(generator=gen)
    else:
        piece.view(torch.float32).normal_(generator=gen)


def block_prints(t: torch.Tensor) -> torch.Tensor:
    """int64 block fingerprints (BLOCK bytes each) of a uint8 buffer, on its device."""
    return fingerprints.device_block_tensor(t, BLOCK)


class _Region:
    """The chunks under test, with their patterns and per-piece seeds."""

    def __init__(self, dev: torch.device, chunk: int, piece: int, seed: int, pass_no: int):
        self.dev, self.chunk, self.piece, self.seed, self.pass_no = dev, chunk, piece, seed, pass_no
        self.chunks: list[torch.Tensor] = []
        self.gen = torch.Generator(device=dev)
        self.wrong: dict[int, list[int]] = {}  # chunk → blocks that read back wrong right after the write

    def pattern(self, i: int) -> str:
        return PATTERNS[(i + self.pass_no) % len(PATTERNS)]

    def piece_seed(self, i: int, p: int) -> int:
        return case_seed(self.seed, "memory", self.pass_no, i, p)

    def allocate(self, target: int) -> None:
        while sum(c.numel() for c in self.chunks) < target:
            size = min(self.chunk, target - sum(c.numel() for c in self.chunks))
            size -= size % 512
            if size <= 0:
                break
            try:
                self.chunks.append(torch.empty(size, dtype=torch.uint8, device=self.dev))
            except torch.cuda.OutOfMemoryError:
                if size <= self.piece:
                    break
                self.chunk = max(self.piece, self.chunk // 2)  # fragmented: try smaller chunks

    def write(self) -> None:
        """Fill every piece and read it back against the pattern regenerated in a scratch
        buffer: a cell that holds wrong bits from the start (stuck, or a failed write) is
        fingerprinted wrong before the hold too, so only this read finds it."""
        scratch = torch.empty(self.piece, dtype=torch.uint8, device=self.dev)
        wpb = BLOCK // 8  # 64-bit words per block
        for i, c in enumerate(self.chunks):
            for p, start in enumerate(range(0, c.numel(), self.piece)):
                piece = c[start : start + self.piece]
                want = scratch[: piece.numel()]
                fill(piece, self.pattern(i), self.piece_seed(i, p), self.gen)
                fill(want, self.pattern(i), self.piece_seed(i, p), self.gen)
                if torch.equal(piece, want):
                    continue
                ne = piece.view(torch.int64) != want.view(torch.int64)  # pieces are whole 512-byte multiples
                nb = -(-ne.numel() // wpb)
                ne = torch.nn.functional.pad(ne, (0, nb * wpb - ne.numel())).view(nb, wpb).any(1)
                self.wrong.setdefault(i, []).extend(start // BLOCK + b for b in ne.nonzero().flatten().tolist())

    def expected_block(self, i: int, block: int) -> torch.Tensor:
        """The bytes block ``block`` of chunk ``i`` should hold, regenerated from its seed."""
        c = self.chunks[i]
        start = block * BLOCK
        p = start // self.piece
        p0 = p * self.piece
        buf = torch.empty(min(self.piece, c.numel() - p0), dtype=torch.uint8, device=self.dev)
        fill(buf, self.pattern(i), self.piece_seed(i, p), self.gen)
        return buf[start - p0 : min(start - p0 + BLOCK, buf.numel())]


def _hold(dev: torch.device, seconds: float, backend: str) -> dict:
    """Matmuls for ``seconds`` (power, heat and traffic while the patterns sit in memory)."""
    n = 4096 if backend != "cpu" else 256
    g = torch.Generator(device=dev)
    g.manual_seed(12345)
    a = torch.randn((n, n), generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
    b = torch.randn((n, n), generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
    c = torch.empty((n, n), dtype=torch.bfloat16, device=dev)
    t0, count = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(8 if backend != "cpu" else 1):
            torch.matmul(a, b, out=c)
            count += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    return {"matmuls": count, "size": n, "seconds": round(time.perf_counter() - t0, 3)}


def _compare(region: _Region, before: list[torch.Tensor], ctx_device: str) -> tuple[int, list[dict], dict, int]:
    """Blocks whose fingerprints changed or that were wrong right after the write → (differing
    words, samples, per-chunk blocks, examined blocks wrong since the write that still are)."""
    words_bad, samples, where = 0, [], {}
    examined = stuck = 0
    for i, c in enumerate(region.chunks):
        after = block_prints(c)
        bad = sorted({*(after != before[i]).nonzero().flatten().tolist(), *region.wrong.get(i, [])})
        if not bad:
            continue
        where[i] = bad  # all of them: the summary counts them; evidence lists the first 16
        for blk in bad:
            if examined >= MAX_BLOCKS_EXAMINED:
                break
            examined += 1
            want = region.expected_block(i, blk).view(torch.int64).cpu().numpy().view(np.uint64)
            got = c[blk * BLOCK : blk * BLOCK + want.size * 8].view(torch.int64).cpu().numpy().view(np.uint64)
            diff = np.flatnonzero(want != got)
            words_bad += int(diff.size)
            since = "write" if blk in region.wrong.get(i, ()) else "hold"
            stuck += since == "write" and diff.size > 0
            if not diff.size and len(samples) < MAX_SAMPLES:
                samples.append({"chunk": i, "block": blk, "pattern": region.pattern(i),
                                "note": "fingerprint changed but the data now matches the pattern (transient read error)"})
            for w in diff[: max(0, MAX_SAMPLES - len(samples))]:
                off = blk * BLOCK + int(w) * 8
                x = int(want[w] ^ got[w])
                samples.append({"chunk": i, "block": blk, "pattern": region.pattern(i), "wrong_since": since, "offset": off,
                                "address": f"0x{c.data_ptr() + off:x}", "expected": f"0x{int(want[w]):016x}",
                                "actual": f"0x{int(got[w]):016x}", "xor": f"0x{x:016x}", "flipped_bits": bin(x).count("1")})
    return words_bad, samples, where, stuck


def cpu_buffer_bytes(ctx: ProbeContext) -> int:
    """Bytes of the host buffer the probe checks on the CPU backend (``mb``, else by mode)."""
    return (ctx.option("memory", "mb") or (512 if ctx.option("memory", "mode") == "full" else 32)) << 20


def check_fits(device: Device, ctx: ProbeContext) -> None:
    """Refuse a CPU buffer larger than the memory available now (MemAvailable): allocating it
    fails, or the OOM killer ends the scan, and either was blamed on the device. On GPUs the
    probe covers a fraction of the free memory, which fits by construction."""
    if device.identity.backend != "cpu":
        return
    need, free = cpu_buffer_bytes(ctx), device.memory_free()
    if free is not None and need > free:
        raise ConfigError(f"memory probe: a {need >> 20} MiB buffer (memory.mb) does not fit in the {free >> 20} MiB "
                          f"available on {device.identity.id}; lower memory.mb")


def preflight(devices: list[Device], ctx: ProbeContext) -> None:
    """Before any probe runs: the CPU buffer fits on every device (check_fits)."""
    for d in devices:
        check_fits(d, ctx)


def check_case(case: str | None, passes: int) -> None:
    """``--case memory/passN`` (N below ``passes``) or ``memory/nvml``, either of which re-runs
    the whole probe; anything else ran it and reported HEALTHY for a case that does not exist."""
    cid = CaseId.parse(case) if case is not None else None
    if cid is None or cid.prefix != "memory" or cid == CaseId("memory"):
        return
    part = cid.part("memory") if len(cid.parts) == 1 and cid.scale is None else ""
    if not (part == "nvml" or (part.startswith("pass") and part[4:].isascii() and part[4:].isdecimal())):
        raise ConfigError(f"case {case!r}: the memory probe has no such case (its cases: memory/passN, one per pass, "
                          "and memory/nvml)")
    if part != "nvml" and int(part[4:]) >= passes:
        last = f"…memory/pass{passes - 1}" if passes > 1 else ""
        raise ConfigError(f"case {case!r}: the memory probe makes {passes} pass(es) here (memory/pass0{last}); "
                          "give memory.passes to re-run a later one")


@register("memory", OPTIONS, preflight=preflight)
def memory_probe(device: Device, ctx: ProbeContext) -> list[Evidence]:
    """Patterns in most of free memory, fingerprinted, held under load, re-read."""
    mode = ctx.option("memory", "mode")
    full = mode == "full"
    fraction = ctx.option("memory", "fraction") or (0.95 if full else 0.90)
    hold = ctx.option("memory", "hold")
    passes = ctx.option("memory", "passes") or (2 if full else 1)
    check_case(ctx.config.case, passes)
    check_fits(device, ctx)
    backend = device.identity.backend
    if hold < 0:
        hold = (30.0 if full else 3.0) if backend != "cpu" else (2.0 if full else 0.2)
    dev = device.generate((1,), "normal", 0).device
    t0 = time.perf_counter()
    nv_before = nvml.snapshot(device.identity)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        chunk, piece = GPU_CHUNK, GPU_PIECE
    else:
        free = cpu_buffer_bytes(ctx)
        total, fraction, chunk, piece = None, 1.0, CPU_CHUNK, CPU_PIECE
    evidence: list[Evidence] = []
    passes_stats = []
    covered = 0
    tally = ctx.tally.probe("memory")  # a pass (write, hold, re-read) counts as one launch
    for pass_no in range(passes):
        region = _Region(dev, chunk, piece, ctx.config.seed, pass_no)
        try:
            if dev.type == "cuda":  # the hold's workspace comes out of the free memory first
                workspace = _hold(dev, 0.0, backend)
                del workspace
            region.allocate(int(free * fraction))
            covered = sum(c.numel() for c in region.chunks)
            if not covered:  # e.g. another process holds the GPU's memory: HEALTHY would mean nothing was checked
                raise DeviceError(f"memory probe: no memory could be allocated to test on {device.identity.id} "
                                  f"({free >> 20} MiB free at the start)")
            tw = time.perf_counter()
            region.write()
            before = [block_prints(c) for c in region.chunks]
            device.synchronize()
            tw = time.perf_counter() - tw
            op = f"memory/pass{pass_no}"
            stored_faults(ctx.fault, device.identity.id, op, {f"chunk{i:04d}": c for i, c in enumerate(region.chunks)})
            held = _hold(dev, hold, backend)
            tr = time.perf_counter()
            words_bad, samples, where, stuck = _compare(region, before, device.identity.id)
            tr = time.perf_counter() - tr
            if where:
                # one third read: reproduced 1 of 1 if a changed block still differs or a block wrong
                # since the write still is (a count of chunks here read "reproduced in 3 of 1 re-runs")
                again = int(bool(stuck) or any(bool((block_prints(region.chunks[i]) != before[i]).any()) for i in where))
                n_blocks = sum(len(v) for v in where.values())
                n_write = sum(len(v) for v in region.wrong.values())
                when = (f"wrong right after the write ({n_write} of them: stuck bits or failed writes) or changed "
                        "between write and re-read" if n_write else "changed between write and re-read")
                ev = Evidence(
                    check="memory.bitflip", severity=Verdict.FAULTY, case_id=f"memory/pass{pass_no}",
                    summary=(f"memory.bitflip: {n_blocks} block(s) of {BLOCK >> 10} KiB {when} "
                             f"({words_bad} differing 64-bit word(s) in the blocks examined) after {held['seconds']:.1f} s "
                             f"held; chunks {sorted(where)[:8]}"),
                    op="memory", shape={"bytes": covered}, dist=",".join(PATTERNS), seed=ctx.config.seed, max_value=1.0,
                    elements=words_bad, samples=samples, tiles=[[i, b] for i, bl in where.items() for b in bl[:16]][:16],
                    localised=[[s["chunk"], s["offset"]] for s in samples if "offset" in s], reruns=1,
                    reproduced=again, kernel="fingerprint.cu" if dev.type == "cuda" else "cpu",
                    injected=recent_injections(ctx.fault))
                evidence.append(ev)
                tally.failed += 1
                tally.flagged(ev.case_id, ev.check, 1, 1, shown=True)
            tally.launches += 1
            passes_stats.append({"pass": pass_no, "chunks": len(region.chunks), "bytes": covered,
                                 "patterns": sorted({region.pattern(i) for i in range(len(region.chunks))}),
                                 "write_and_fingerprint_s": round(tw, 3), "reread_s": round(tr, 3), "hold": held,
                                 "reread_gb_per_s": round(covered / tr / 1e9, 1) if tr > 0 else None})
        finally:
            region.chunks.clear()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        ctx.progress("step", device=device.identity.id, case=f"memory/pass{pass_no}")
    nv_after = nvml.snapshot(device.identity)
    nv_delta = nvml.delta(nv_before, nv_after)
    bad = {k: v for k, v in nv_delta.items() if k in ("ecc_volatile_uncorrected", "ecc_aggregate_uncorrected",
                                                      "retired_pages_pending", "remap_pending", "remap_failure",
                                                      "remapped_rows_uncorrectable", "retired_pages_dbe")}
    if bad:
        evidence.append(Evidence(check="memory.ecc", severity=Verdict.SUSPECT, case_id="memory/nvml",
                                 summary=f"memory.ecc: NVML memory-health counters changed during the probe: {bad}",
                                 op="memory", seed=ctx.config.seed, elements=len(bad), samples=[{"before": nv_before, "after": nv_after}]))
    ctx.stats["memory"] = {
        "mode": mode, "bytes_covered": covered, "free_bytes_at_start": free, "total_bytes": total,
        "coverage_of_free": round(covered / free, 4) if free else None, "passes": passes_stats,
        "block_bytes": BLOCK, "seconds": round(time.perf_counter() - t0, 3),
        "nvml": {"before": nv_before, "after": nv_after, "delta": nv_delta},
    }
    return evidence
