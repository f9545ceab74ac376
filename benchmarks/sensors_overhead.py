"""Overhead of the in-training sensors (docs/sensors.md) on a training step, in one run.

    PYTHONPATH=. python3 benchmarks/sensors_overhead.py [--preset 1b] [--batch 2] [--steps 10] [--rounds 2]
        [--clean-steps 1000] [--time-budget 240] [--device cuda|cpu] [--modes plain,sampled] [--out DIR]

The example's GPT (examples/train_gpt/gpt.py; ``1b``: ~1.2B parameters, sequence 4096) in bf16,
AdamW, one training step = forward, backward, the sensors' step boundary, optimizer step. Modes,
measured interleaved in ``--rounds`` rounds of ``--steps`` steps each (after ``--warmup`` steps of
each mode, excluded), the order of the modes reversed every other round so that a drift of the
GPU's clocks falls on both sides alike, each step timed to a device synchronisation; the first
``--skip`` steps of each window (the model just instrumented or restored) are left out of the
figures; before the first round, plain steps for ``--settle`` seconds (60 on CUDA) bring a
power-capped card to its working temperature and clocks (without them round 0's plain window ran
~60 MHz faster than the rest, and round 0's overhead was the largest in every run of session 16).
A mode's overhead is the mean of its rounds' ratios to the same round's plain window, with
its standard error over the rounds:

  plain      the model as it is: torch's own GEMMs (cuBLAS), no sensors
  unsampled  instrumented, nothing sampled: every Linear through the sensors' autograd function,
             each launch deciding (no) and running torch's GEMM: the instrumentation's own cost
  kernels    instrumented, nothing sampled, every GEMM pinned to aegis' checked kernels (fused
             sums, no reference): what the kernels cost against cuBLAS in this step
  every      every Linear launch compared with the fp64 references (forward and dgrad rows,
             wgrad rows and columns)
  sampled    each launch sampled with p = --sample-prob (0.01): on average every operator once per
             100 steps, and none unchecked for longer (the coverage floor)
  coverage   p = 0: each operator exactly once per 100 steps, the floor alone (its phases spread
             over the steps): the least sampling the issue allows
  drained    sampled, the device drained (synchronised) before the step boundary: what the
             boundary cost when the sensors read their comparisons that way (before session 13)
  attention  instrumented, nothing sampled, SDPA routed through aegis' checked attention kernels
             (SensorConfig.attention): what those kernels cost against torch's SDPA in this step
  coverage_attention
             coverage with the attention sensor on: the SDPA calls one operator among the GEMMs,
             checked once per 100 steps too (each check: the checked attention and its fp64 sides)

Each window also samples the SM clock, the power and power capping through NVML every 10 ms
(``sensors_profile.Clocks``): whether a mode's extra work moves the card's clocks; and records,
step by step beside the step times, the operators each step checked (``checked_ops``): whether a
step's cost follows where its checks fell (a check late in backward makes the boundary wait).

``--profile N``: N steps each of plain and the ``--profile-modes`` (default sampled and drained; also
the pinned ``kernels`` and its experiments ``nosums``, ``nosync``) under torch.profiler, the step's GPU
idle time and extra kernel time attributed (benchmarks/sensors_profile.py).

``--noise-steps`` steps with every launch checked record, per layout and layer, the clean
normalised differences |Δ|/σ and what a bias term in σ would make of them (``noise_study``).
``--attention-noise-steps`` steps with every SDPA call on the checked attention and sensed record
each invariant's normalised difference per call against its τ (``attention_noise_study``): what
the attention sensor's τ would be calibrated from on a trained model.
Then ``--clean-steps`` steps with one instrument() at ``--clean-config``: ``default`` (SensorConfig()
as a job gets it: a 1% sensing budget, every operator at least once per 100 steps) or ``coverage``
(p = 0: each operator exactly once per 100 steps, the least the issue allows), counting suspicions
raised, cleared, confirmed and dropped, stopping early when the whole run reaches
``--time-budget`` seconds (the count run is reported), and a last ``plain`` window to bracket
drift. Overheads are ratios of mean step times to the plain mean of the interleaved windows. Writes DIR/sensors_overhead.json (DIR: --out, else $OUT, else
./sensors_overhead_out) and prints a short table last. Every part records its error and the run
goes on. On a CPU (``--device cpu --preset tiny``) it runs in seconds; the figures then say
nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "train_gpt"))

import sensors_profile  # noqa: E402
from gpt import GPT, PRESETS, markov_batches  # noqa: E402
from sensors_noise import attention_noise_study, noise_study  # noqa: E402

from aegis_cli.sensors import Action, SensorConfig, instrument, uninstrument  # noqa: E402

MODES = ("plain", "unsampled", "kernels", "every", "sampled", "coverage", "drained", "attention", "coverage_attention")


def configs(args) -> dict[str, SensorConfig | None]:
    never = {"sample_prob": 0.0, "overhead_budget": None, "coverage_steps": None, "seed": args.seed}
    return {
        "plain": None,
        "unsampled": SensorConfig(**never),
        "kernels": SensorConfig(**never),  # run pinned (Bench.mode_step)
        "every": SensorConfig(sample_prob=1.0, overhead_budget=None, queue_size=16, seed=args.seed),
        "sampled": sampled_config(args),
        "coverage": coverage_config(args),
        "drained": sampled_config(args),  # drained at the boundary (Bench.mode_step)
        "attention": SensorConfig(**never, attention=True),
        "coverage_attention": dataclasses.replace(coverage_config(args), attention=True),
    }


def sampled_config(args) -> SensorConfig:
    return SensorConfig(sample_prob=args.sample_prob, overhead_budget=None, coverage_steps=100, seed=args.seed)


def coverage_config(args) -> SensorConfig:
    """Each operator exactly once per 100 steps: the coverage floor alone, the least sampling issue 20 allows."""
    return SensorConfig(sample_prob=0.0, overhead_budget=None, coverage_steps=100, seed=args.seed)


def clean_config(args) -> SensorConfig:
    cfg = coverage_config(args) if args.clean_config == "coverage" else SensorConfig(seed=args.seed)
    return dataclasses.replace(cfg, attention=True) if args.clean_attention else cfg


class Bench:
    def __init__(self, args):
        self.args = args
        self.dev = torch.device(args.device)
        self.cfg = PRESETS[args.preset]
        self.dtype = getattr(torch, args.dtype)
        torch.manual_seed(args.seed)
        with self.dev:  # initialised where it trains: a 1.2B model's init on the host takes long
            self.model = GPT(self.cfg)
        self.model.to(self.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.batches = self._data(args.batch)

    def _data(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = markov_batches(self.cfg, batch, self.args.seed)
        return [tuple(t.to(self.dev) for t in next(gen)) for _ in range(4)]

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def step(self, i: int, handle, drain: bool = False, mark=contextlib.nullcontext) -> tuple[float, Action]:
        """One training step, timed from a synchronised start to a synchronised end (``drain``: the
        device synchronised before the sensors' step boundary too; ``mark(name)``: a context around
        the step and each of its phases, step fwd bwd sensors opt: sensors_profile annotates them)."""
        x, y = self.batches[i % len(self.batches)]
        self.sync()
        t0 = time.perf_counter()
        with mark("step"):
            with mark("fwd"):
                self.opt.zero_grad(set_to_none=True)
                _, loss = self.model(x, y)
            with mark("bwd"):
                loss.backward()
            with mark("sensors"):
                if drain:
                    self.sync()
                action = handle.step() if handle is not None else Action.CONTINUE
            with mark("opt"):
                self.opt.step()
            self.sync()
        return time.perf_counter() - t0, action

    def mode_step(self, name: str, i: int, handle, mark=contextlib.nullcontext) -> tuple[float, Action]:
        """One step as mode ``name`` runs it: pinned to the checked kernels (``kernels`` and its
        experiments, sensors_profile.PINNED), drained at the boundary (``drained``), else plain ``step``."""
        with handle.pin() if name in sensors_profile.PINNED else contextlib.nullcontext():
            return self.step(i, handle, name == "drained", mark)

    def window(self, name: str, cfg: SensorConfig | None, steps: int, counter: itertools.count, skip: int = 0) -> dict:
        """``steps`` timed steps of one mode after ``skip`` more (kept apart: the model just instrumented or restored)."""
        handle = instrument(self.model, cfg) if cfg is not None else None
        times, stops, checked = [], 0, []
        try:
            with sensors_profile.Clocks(self) as clocks:  # whether a mode runs the GPU at other clocks (power)
                before = _checks(handle)
                for _ in range(skip + steps):
                    dt, action = self.mode_step(name, next(counter), handle)
                    times.append(dt)
                    stops += action is Action.STOP
                    after = _checks(handle)
                    checked.append(sorted(op for op, n in after.items() if n > before.get(op, 0)))
                    before = after
        finally:
            if handle is not None:
                uninstrument(self.model)
        out = {"mode": name, "times": times[skip:], "skipped": times[:skip], "stops": stops, "clocks": clocks.summary()}
        if handle is not None:
            out["checked_ops"] = checked[skip:]  # which operators each step checked: a step's cost against where its checks fell
            s = handle.stats_dict()
            out["stats"] = {k: s[k] for k in ("launches", "checked", "raised", "cleared", "confirmed", "dropped", "sense_s",
                                              "verify_s", "clean_max_ratio", "skipped_nonfinite")}
            out["stats"]["sense_per_check_s"] = s["sense_s"] / s["checked"] if s["checked"] else None
        return out


def _checks(handle) -> dict[str, int]:
    """Each operator's checks so far (none without a handle)."""
    return {} if handle is None else {op: st.checks_total for op, st in handle.controller.ops.items()}


def gemm_work(model: torch.nn.Module, tokens: int, tile: tuple[int, int] = (64, 128)) -> dict:
    """FLOPs per step of the Linears' GEMMs (bf16) and of the fp64 references that check all of them
    (rows and their scales for forward and dgrad, rows and columns for wgrad, at the CUDA checksum
    tile): the arithmetic floor under the cost of checking every launch."""
    tm, tn = tile
    gemm = ref = 0
    for m in model.modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        i, o = m.in_features, m.out_features
        for mm, n, k, cols in ((tokens, o, i, False), (tokens, i, o, False), (o, i, tokens, True)):  # fwd, dgrad, wgrad
            gemm += 2 * mm * n * k
            ref += 2 * 2 * mm * k * -(-n // tn) + (2 * 2 * -(-mm // tm) * k * n if cols else 0)
    return {"gemm_tflop": gemm / 1e12, "reference_fp64_tflop": ref / 1e12, "reference_share": ref / gemm if gemm else None}


def summarise(times: list[float]) -> dict:
    return {"steps": len(times), "mean_s": statistics.fmean(times) if times else None,
            "median_s": statistics.median(times) if times else None, "min_s": min(times) if times else None}


def paired(ws: list[dict], plain: list[dict]) -> dict:
    """A mode's overhead from its rounds: each round's mean step over the same round's ``plain`` mean,
    their mean and standard error (rounds are paired so that drift between rounds cancels; a mode
    that failed ran its first rounds only)."""
    ratios = [statistics.fmean(w["times"]) / statistics.fmean(p["times"]) - 1
              for w, p in zip(ws, plain, strict=False) if w["times"] and p["times"]]
    if not ratios:
        return {"overhead": None}
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    return {"overhead": statistics.fmean(ratios), "overhead_se": se, "round_overheads": [round(x, 6) for x in ratios]}


def part(result: dict, name: str, fn) -> None:
    """Run one part of the benchmark; an exception is recorded and the run goes on."""
    t0 = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as exc:  # a benchmark reports what failed and carries on with the rest
        result[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        print(f"[{name}] FAILED: {exc}", flush=True)
    result.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)


def run(args) -> dict:
    start = time.perf_counter()
    result: dict = {"args": vars(args), "host": platform.node(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    bench: Bench | None = None
    counter = itertools.count()
    modes = {name: cfg for name, cfg in configs(args).items() if name in args.modes or name == "plain"}

    def setup() -> dict:
        nonlocal bench
        bench = Bench(args)
        batch = args.batch
        while True:  # the batch that fits: halve on out-of-memory at the first plain step
            try:
                bench.step(0, None)
                break
            except torch.OutOfMemoryError:
                if batch == 1:
                    raise
                batch //= 2
                bench.opt.zero_grad(set_to_none=True)
                bench.batches = None
                torch.cuda.empty_cache()
                bench.batches = bench._data(batch)
        cfg = bench.cfg
        params = sum(p.numel() for p in bench.model.parameters())
        print(f"GPT {args.preset}: {params / 1e9:.3f}B parameters, {cfg.layers} layers, dim {cfg.dim}, sequence {cfg.seq}, "
              f"batch {batch} ({batch * cfg.seq} tokens) in {args.dtype} on {args.device}", flush=True)
        return {"params": params, "batch": batch, "tokens": batch * cfg.seq, "seq": cfg.seq, "layers": cfg.layers,
                "dim": cfg.dim, "vocab": cfg.vocab, "work_per_step": gemm_work(bench.model, batch * cfg.seq)}

    failed: dict[str, str] = {}  # a mode that failed once is not run again

    def safe_window(name: str, steps: int, skip: int = 0) -> dict | None:
        if name in failed:
            return None
        try:
            return bench.window(name, modes[name], steps, counter, skip)
        except Exception as exc:  # one broken mode must not cost the others their figures
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} FAILED: {exc}\n{traceback.format_exc()[-3000:]}", flush=True)
            return None

    def warmup() -> dict:
        out = {}
        for name in modes:  # kernel builds, cuBLAS heuristics, the allocator's pools
            w = safe_window(name, args.warmup)
            out[name] = summarise(w["times"]) if w else {"error": failed.get(name)}
            if w:
                print(f"warm-up {name:<8} {args.warmup} steps, last {w['times'][-1]:.4f} s", flush=True)
        return out

    def settle() -> dict:
        t0, steps, clocks = time.perf_counter(), 0, {}
        while (elapsed := time.perf_counter() - t0) < args.settle:
            w = bench.window("plain", None, 10, counter)
            steps, clocks = steps + len(w["times"]), w["clocks"]
        print(f"settled: {steps} plain steps in {elapsed:.0f} s"
              + (f"; last SM {clocks['sm_clock_mhz']:.0f} MHz, {clocks['power_w']:.0f} W" if clocks.get("sm_clock_mhz") else ""),
              flush=True)
        return {"steps": steps, "s": round(elapsed, 1), "clocks": clocks}

    def interleaved() -> dict:
        windows: dict[str, list] = {name: [] for name in modes}
        for r in range(args.rounds):
            for name in (list(modes) if r % 2 == 0 else list(reversed(modes))):
                w = safe_window(name, args.steps, args.skip)
                if w is None:
                    continue
                windows[name].append(w)
                ck = w["clocks"]
                print(f"round {r} {name:<8} mean {statistics.fmean(w['times']):.4f} s over {len(w['times'])} steps"
                      + (f"; checked {w['stats']['checked']} of {w['stats']['launches']}" if "stats" in w else "")
                      + (f"; SM {ck['sm_clock_mhz']:.0f} MHz, {ck['power_w']:.0f} W, power-capped {100 * ck['power_capped']:.0f} %"
                         if ck.get("sm_clock_mhz") and ck.get("power_w") else ""), flush=True)
        out = {}
        for name, ws in windows.items():
            times = [t for w in ws for t in w["times"]]
            out[name] = {**summarise(times), "stops": sum(w["stops"] for w in ws), "times": [round(t, 6) for t in times]}
            if name in failed:
                out[name]["error"] = failed[name]
            if ws and "stats" in ws[0]:
                out[name]["stats"] = [w["stats"] for w in ws]
            if ws and "checked_ops" in ws[0]:
                out[name]["checked_ops"] = [ops for w in ws for ops in w["checked_ops"]]  # beside "times", step by step
            out[name]["clocks"] = [w["clocks"] for w in ws]
        for name in modes:
            out[name].update(paired(windows[name], windows["plain"]))
        for name in ("every", "sampled", "coverage"):  # the sensing alone, beside the instrumentation
            if name in out and "unsampled" in out:
                out[name]["overhead_vs_unsampled"] = paired(windows[name], windows["unsampled"])["overhead"]
        return out

    def clean() -> dict:
        handle = instrument(bench.model, clean_config(args))
        times, stopped_at, t_run = [], [], time.perf_counter()
        try:
            for i in range(args.clean_steps):
                if time.perf_counter() - start > args.time_budget and i >= 1:
                    print(f"clean run: time budget reached after {i} steps", flush=True)
                    break
                dt, action = bench.step(next(counter), handle)
                times.append(dt)
                if action is Action.STOP:
                    stopped_at.append(handle.step_index - 1)
                if (i + 1) % 100 == 0:
                    s = handle.stats
                    print(f"clean step {i + 1}: mean {statistics.fmean(times):.4f} s; checked {s.checked}, raised {s.raised}, "
                          f"cleared {s.cleared}, confirmed {s.confirmed}", flush=True)
        finally:
            uninstrument(bench.model)
        s = handle.stats_dict()
        ops = s["operators"]
        checked = [o["checked"] for o in ops.values()]
        return {**summarise(times), "requested": args.clean_steps, "wall_s": time.perf_counter() - t_run,
                "stop_steps": stopped_at[:20], "launches": s["launches"], "checked": s["checked"], "raised": s["raised"],
                "cleared": s["cleared"], "confirmed": s["confirmed"], "dropped": s["dropped"], "unsaved": s["unsaved"],
                "skipped_nonfinite": s["skipped_nonfinite"], "clean_max_ratio": s["clean_max_ratio"], "sense_s": s["sense_s"],
                "verify_s": s["verify_s"], "latency": s["latency"], "operators": len(ops),
                "operators_never_checked": sum(c == 0 for c in checked), "min_checks_per_operator": min(checked, default=0),
                "attention_launches": s["attention_launches"], "attention_unchecked": s["attention_unchecked"],
                "attention_clean_max": s["attention_clean_max"],
                "thresholds_raised": [e.summary for e in handle.events if e.kind == "threshold"][:20],
                "cleared_events": [e.summary for e in handle.events if e.kind == "cleared"][:20],
                "attention_checked": sum(o["checked"] for k, o in ops.items() if k.startswith("sdpa/")),
                "confirmed_events": [e.to_dict() for e in handle.events if e.kind == "confirmed"][:5],
                "closest_operators": sorted(((k, o["clean_max_ratio"], o["checked"]) for k, o in ops.items()),
                                            key=lambda x: -x[1])[:8]}

    def plain_after() -> dict:
        return summarise(bench.window("plain", None, args.steps, counter)["times"])

    part(result, "setup", setup)
    if bench is not None and "error" not in result["setup"]:
        part(result, "warmup", warmup)
        if args.settle > 0:
            part(result, "settle", settle)
        part(result, "interleaved", interleaved)
        if args.profile > 0:
            profiled = {m: configs(args)[sensors_profile.EXPERIMENTS.get(m, m)] for m in args.profile_modes}
            part(result, "profile", lambda: sensors_profile.run(bench, profiled, args.profile, counter))
        if args.noise_steps > 0:
            part(result, "noise", lambda: noise_study(bench, args.noise_steps, counter))
        if args.attention_noise_steps > 0:
            part(result, "attention_noise", lambda: attention_noise_study(bench, args.attention_noise_steps, counter))
        if args.clean_steps > 0:
            part(result, "clean", clean)
            part(result, "plain_after", plain_after)
    if args.device.startswith("cuda"):
        result["max_memory_gib"] = torch.cuda.max_memory_allocated(torch.device(args.device)) / 2**30
    result["total_s"] = round(time.perf_counter() - start, 1)
    return result


def table(result: dict) -> str:
    lines = []
    setup = result.get("setup") or {}
    if "params" in setup:
        lines.append(f"GPT {setup['params'] / 1e9:.2f}B params, seq {setup['seq']}, batch {setup['batch']}, "
                     f"{result['args']['dtype']}, {result.get('gpu', result['args']['device'])}")
        w = setup["work_per_step"]
        lines.append(f"per step: Linear GEMMs {w['gemm_tflop']:.2f} TFLOP (bf16); fp64 references of every launch "
                     f"{w['reference_fp64_tflop']:.3f} TFLOP ({100 * w['reference_share']:.2f}% of the GEMMs' FLOPs, in fp64)")
    inter = result.get("interleaved") or {}
    plain = (inter.get("plain") or {}).get("mean_s")
    lines.append("mode                      mean step   overhead vs plain (± s.e., rounds)   vs unsampled")
    for name, label in (("plain", "plain (torch GEMMs)"), ("unsampled", "instrumented, unsampled"),
                        ("kernels", "checked kernels, pinned"), ("every", "every Linear checked"),
                        ("sampled", f"sampled p={result['args']['sample_prob']} (window)"),
                        ("coverage", "each once per 100 steps"),
                        ("drained", "sampled, drained boundary"), ("attention", "SDPA on checked attention"),
                        ("coverage_attention", "each once/100, SDPA too")):
        r = inter.get(name) or {}
        if r.get("mean_s") is None:
            lines.append(f"{label:<25} {'-':>9}   {r.get('error', inter.get('error', 'not run'))[:60]}")
            continue
        ov, se = r.get("overhead") or 0.0, r.get("overhead_se")
        vk = r.get("overhead_vs_unsampled")
        spread = f" ± {100 * se:.2f}% ({len(r.get('round_overheads', []))})" if se is not None else ""
        lines.append(f"{label:<25} {r['mean_s']:>8.4f}s   {f'{100 * ov:+.2f}%{spread}':>33}   "
                     + (f"{100 * vk:>+13.2f}%" if vk is not None else f"{'':>14}"))
        (checks, sense_s), steps = (sum(w[x] for w in r.get("stats") or []) for x in ("checked", "sense_s")), len(r["times"]) or 1
        if checks and plain:  # the checks' own GPU time (CUDA events), per check and as a share of the plain step
            lines.append(f"{'':<25} {checks / steps:.2f} checks a step, {1e3 * sense_s / checks:.3f} ms each: "
                         f"{100 * sense_s / steps / plain:.2f}% of the plain step")
        ck = [c for c in r.get("clocks") or [] if c.get("sm_clock_mhz") and c.get("power_w")]
        if ck:  # NVML, sampled every 10 ms through the mode's windows
            lines.append(f"{'':<25} SM clock {statistics.fmean(c['sm_clock_mhz'] for c in ck):.0f} MHz, "
                         f"{statistics.fmean(c['power_w'] for c in ck):.0f} W, power-capped "
                         f"{100 * statistics.fmean(c['power_capped'] for c in ck):.0f} % of the samples")
    c = result.get("clean") or {}
    if "mean_s" in c and c["mean_s"] is not None:
        ov = f"{100 * (c['mean_s'] / plain - 1):+.2f}%" if plain else "?"
        lines.append(f"{'clean run, ' + result['args']['clean_config']:<25} {c['mean_s']:>8.4f}s   {ov:>17}   over {c['steps']} of {c['requested']} steps")
        lines.append(f"clean run: {c['checked']} of {c['launches']} launches checked, operators never checked "
                     f"{c['operators_never_checked']} of {c['operators']}; suspicions raised {c['raised']}, cleared {c['cleared']}, "
                     f"confirmed {c['confirmed']}, dropped {c['dropped']}; largest clean difference {c['clean_max_ratio']:.3g}×τ")
        lines.append("clean run, closest to τ: " + ", ".join(f"{k} {r:.3g}×τ ({n} checks)" for k, r, n in c["closest_operators"][:4]))
        if c.get("attention_launches"):
            lines.append(f"clean run: attention {c['attention_checked']} of {c['attention_launches']} calls checked, "
                         f"unchecked {c['attention_unchecked'] or 'none'}; largest clean ÷ τ per invariant "
                         + ", ".join(f"{n} {r:.3g}" for n, r in c["attention_clean_max"].items()))
        for e in c.get("cleared_events", [])[:6]:
            lines.append(f"clean run, cleared: {e[:160]}")
        for e in c.get("thresholds_raised", [])[:6]:
            lines.append(f"clean run, {e[:160]}")
    elif "error" in c:
        lines.append(f"clean run failed: {c['error'][:100]}")
    pa = result.get("plain_after") or {}
    if pa.get("mean_s") and plain:
        lines.append(f"plain again after the clean run: {pa['mean_s']:.4f}s ({100 * (pa['mean_s'] / plain - 1):+.2f}% drift)")
    for name, g in sorted((result.get("noise") or {}).get("groups", {}).items()):
        lines.append(f"noise {name:<18} checks {g['checks']:>4}  |Δ|/σ max {g['d_max']:7.3g} p99 {g['d_p99']:7.3g}  "
                     f"|Δ|/(K·2⁻²⁴Σ|c|) {g['d_over_xc']:6.3g}  ÷cap {g['d_over_cap']:6.3g}  sensors' σ: max {g['d_sensor']:6.3g}")
    for name, g in ((result.get("attention_noise") or {}).get("invariants") or {}).items():
        lines.append(f"attention noise {name:<10} calls {g['calls']:>5}  max {g['max']:8.3g} σ ({g['max_over_tau']:.3g} τ)  "
                     f"p99 {g['p99']:8.3g}  p50 {g['p50']:8.3g}  over τ {g['over_tau']}")
    for name in ("setup", "warmup", "settle", "interleaved", "profile", "noise", "attention_noise", "clean", "plain_after"):
        if isinstance(result.get(name), dict) and "error" in result[name]:
            lines.append(f"{name} FAILED: {result[name]['error'][:150]}")
    if "profile" in result:
        lines += sensors_profile.table(result["profile"])
    lines.append(f"total {result.get('total_s')} s")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (halved on out-of-memory)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3, help="steps of each mode before measuring (excluded)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per mode and round")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds of plain steps before the first round (default 60 on CUDA, 0 on the CPU: no power cap to settle)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the interleaved modes (the order reversed every other round)")
    p.add_argument("--skip", type=int, default=1, help="first steps of each window left out of the figures (just instrumented)")
    p.add_argument("--sample-prob", type=float, default=0.01, help="the sampled mode's per-launch probability")
    p.add_argument("--modes", type=lambda v: v.split(","), default=[m for m in MODES if m not in ("drained", "attention", "coverage_attention")],
                   help=f"interleaved modes (plain always): {','.join(MODES)} (default: all but drained and the attention ones)")
    p.add_argument("--clean-steps", type=int, default=1000, help="steps of the clean run (0: none)")
    p.add_argument("--clean-attention", action="store_true",
                   help="the clean run also routes SDPA through the checked attention and senses it (SensorConfig.attention)")
    p.add_argument("--clean-config", choices=("default", "coverage"), default="default",
                   help="the clean run's config: SensorConfig() or each operator exactly once per 100 steps")
    p.add_argument("--profile", type=int, default=0, help="steps of plain and each --profile-modes mode under torch.profiler (0: none)")
    p.add_argument("--profile-modes", type=lambda v: v.split(","), default=["sampled", "drained"], help="modes profiled beside plain")
    p.add_argument("--noise-steps", type=int, default=0, help="steps of the clean-noise study, every launch checked (0: none)")
    p.add_argument("--attention-noise-steps", type=int, default=0,
                   help="steps of the attention noise study, every SDPA call sensed (0: none)")
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds for the whole run: the clean run stops there")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "sensors_overhead_out"))
    args = p.parse_args(argv)
    if args.settle is None:
        args.settle = 60.0 if args.device.startswith("cuda") else 0.0
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sensors_overhead.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
