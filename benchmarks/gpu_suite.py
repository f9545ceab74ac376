"""One GPU session's worth of checks and figures, in one command:

    PYTHONPATH=. python3 benchmarks/gpu_suite.py [--out DIR] [--only NAME ...] [--skip NAME ...]

Sections: env selfcheck sass gemm pytest scan sustained soak sensors thresholds (all by default).

Each section runs in its own subprocess under its own time limit (a hung kernel costs that
section, not the session), writes ``DIR/<name>.log`` and returns a small summary dict;
``DIR/suite.json`` collects the summaries and a short table is printed last.
DIR defaults to $OUT (the device tool's output folder) or ./gpu_suite_out.

Adding a section: write ``def section_<name>(out: Path) -> dict`` and append
``Section("<name>", section_<name>, seconds)`` to SECTIONS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Section:
    name: str
    fn: Callable[[Path], dict]
    timeout_s: int


# ---------------------------------------------------------------------------- sections
def section_env(out: Path) -> dict:
    import torch

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu",
                          "--format=csv,noheader"], capture_output=True, text=True, check=False)
    print(smi.stdout)
    from aegis_cli.backends.cuda import CudaDevice

    dev = CudaDevice(0)
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "identity": dev.identity.to_dict(),
            "nvidia_smi": smi.stdout.strip()}
    print(json.dumps(info, indent=1))
    return {"gpu": info["gpu"], "driver": dev.identity.driver, "kernel": dev.kernel}


def section_selfcheck(out: Path) -> dict:
    """Each kernel x layout on a ragged shape: error against fp64 and the worst checksum difference."""
    import torch

    from aegis_cli.backends import cuda
    from aegis_cli.ops import numerics
    from aegis_cli.ops.gemm import GemmOperands, Layout

    kernels = ["mma", "wgmma"] if torch.cuda.get_device_capability(0) == (9, 0) else ["mma"]
    summary = {}
    for kernel in kernels:
        dev = cuda.CudaDevice(0, kernel=kernel)
        for layout in Layout:
            for m, n, k in ((640, 768, 520), (300, 1000, 136)):
                a = dev.generate(layout.a_stored_shape(m, k), "normal", 1)
                b = dev.generate(layout.b_stored_shape(k, n), "normal", 2)
                ops = GemmOperands(a, b, layout)
                t0 = time.perf_counter()
                res = dev.checked_gemm(ops)
                ref = ops.a_mk.double() @ ops.b_kn.double()
                rel = float((res.c.double() - ref).norm() / ref.norm())
                rc = dev.reference_checksums(ops, res.tile)
                worst = max(float(d.max()) for d in numerics.checksum_diffs(res, rc))
                key = f"{kernel}/{layout.value}/{m}x{n}x{k}"
                summary[key] = {"rel_err": rel, "worst_checksum": worst, "ran": res.kernel,
                                "ok": rel < 4e-3 and worst <= numerics.Thresholds().tau}
                print(f"{key:<28} ran {res.kernel:<12} rel {rel:.2e} checksum {worst:.2e} "
                      f"{'OK' if summary[key]['ok'] else 'FAIL'} ({time.perf_counter() - t0:.1f}s)", flush=True)
    return {"all_ok": all(v["ok"] for v in summary.values()), "cases": summary}


def section_sass(out: Path) -> dict:
    """nvcc resource report and SASS instruction census of the kernels, as built for sm_90a."""
    res = {}
    nvcc, cuobjdump = shutil.which("nvcc"), shutil.which("cuobjdump")
    if not nvcc or not cuobjdump:
        return {"skipped": "nvcc/cuobjdump missing"}
    with tempfile.TemporaryDirectory() as tmp:
        for src in ("gemm_wgmma.cu", "gemm_mma.cu"):
            cubin = Path(tmp) / (src + ".cubin")
            p = subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-cubin", "-Xptxas", "-v",
                                f"-I{ROOT / 'kernels'}", "-o", str(cubin), str(ROOT / "kernels" / src)],
                               capture_output=True, text=True, check=False)
            print(p.stdout + p.stderr)
            sass = subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
            counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "HMMA", "UTMALDG", "LDL", "STL", "LDSM")}
            regs = sorted(set(re.findall(r"Used (\d+) registers", p.stderr)))
            spills = sorted(set(re.findall(r"(\d+) bytes spill stores", p.stderr)))
            res[src] = {"sass_counts": counts, "registers": regs, "spill_store_bytes": spills}
            print(src, res[src], flush=True)
    return res


def section_pytest(out: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE", "-s",
                        "--continue-on-collection-errors", "tests"],
                       cwd=ROOT, capture_output=True, text=True, check=False)
    print(p.stdout[-200_000:])
    print(p.stderr[-20_000:])
    tail = [ln for ln in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[-1] if tail else "")}
    worst = re.findall(r"(\w+): (\d+) clean GEMMs, worst normalised checksum difference ([\d.e+-]+).*? at (.*)", p.stdout)
    return {"returncode": p.returncode, "counts": counts, "summary": tail[-1] if tail else "no summary",
            "false_positive_runs": [{"kernel": k, "gemms": int(n), "worst": float(w), "at": at} for k, n, w, at in worst]}


def section_gemm(out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gemm

    reps = int(os.environ.get("AEGIS_BENCH_REPS", "12"))
    rows = gemm.run(reps=reps)
    import torch

    # the same square shapes again: the spread between the two is the noise floor of these figures
    rows += [dict(r, name=r["name"] + "(repeat)") for r in gemm.run(reps=reps, only_square=True)]
    split = []
    if torch.cuda.get_device_capability(0) == (9, 0):  # the portable path, for comparison
        rows += [dict(r, name=r["name"] + "(mma)") for r in gemm.run(reps=reps, kernel="mma", only_square=True)]
        split = gemm.epilogue_split(reps)
    return {"rows": rows, "epilogue_split": split}


def section_sustained(out: Path) -> dict:
    """Three shapes under sustained load (gemm.sustained): the checksum cost a long scan pays at
    the power cap, which the interleaved bursts of section gemm do not charge in full."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gemm

    only = (("square-8192", "fwd"), ("square-8192", "dgrad"), ("llama3-70b/mlp_down", "fwd"))
    return {"rows": gemm.sustained(rounds=2, only=only)}


def section_scan(out: Path) -> dict:
    """The default scan (llama3-70b catalog, every default probe) three times in a row: each must be HEALTHY."""
    runs = []
    for i in range(int(os.environ.get("AEGIS_SCAN_RUNS", "3"))):
        target = out / f"scan{i}.json"
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "aegis_cli", "scan", "-q", "--format", "json", "--output", str(target)],
                           cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        print(p.stderr[-5000:])
        doc = json.loads(target.read_text()) if target.exists() else {}
        devs = doc.get("devices", [])
        # wall_s includes interpreter start, imports and kernel compiles; report_s is the scan itself
        runs.append({"exit": p.returncode, "wall_s": round(wall, 1), "report_s": doc.get("duration_seconds"),
                     "verdicts": [d["verdict"] for d in devs],
                     "margins": [(d.get("noise") or {}).get("margin") for d in devs],
                     "gemms": [(d.get("stats") or {}).get("gemms") for d in devs],
                     "evidence": [e["summary"] for d in devs for e in d["evidence"]][:5]})
        print(json.dumps(runs[-1]), flush=True)
    return {"runs": runs}


def section_soak(out: Path) -> dict:
    """The checked burn-in for two minutes against cuBLAS on the same shapes, then 6 s with an
    intermittent injected fault (benchmarks/soak.py; issue 18): its JSON beside this section's log."""
    target = out / "soak.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--seconds", os.environ.get("AEGIS_SOAK_SECONDS", "120"),
                        "--cublas-seconds", "8", "--inject-seconds", "6", "--json", str(target)],
                       cwd=ROOT, capture_output=True, text=True, check=False)
    print(p.stdout[-20_000:])
    print(p.stderr[-5_000:])
    doc = json.loads(target.read_text()) if target.exists() else {}
    soak, inj = doc.get("soak") or {}, doc.get("injected") or {}
    return {"returncode": p.returncode, "verdict": soak.get("verdict"), "tflops": soak.get("tflops"),
            "vs_cublas_sustained": doc.get("ratio_vs_cublas_sustained"), "vs_cublas_same_mix": doc.get("ratio_vs_cublas_same_mix"),
            "injected": f"{inj.get('verdict')}, failed {inj.get('failed')} of {inj.get('of')}" if inj else None}


def section_sensors(out: Path) -> dict:
    """The in-training sensors' overhead on the example's ~1.2B GPT at sequence 4096 (plain vs
    instrumented unsampled vs checked kernels vs every Linear checked vs sampled, then 1,000 clean
    steps at the default config): benchmarks/sensors_overhead.py with its defaults, its JSON
    beside this section's log."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sensors_overhead

    res = sensors_overhead.main(["--out", str(out)])
    inter = res.get("interleaved") or {}
    modes = {name: {k: r.get(k) for k in ("mean_s", "overhead", "overhead_se", "overhead_vs_unsampled", "error")}
             for name, r in inter.items() if isinstance(r, dict)}
    clean = {k: v for k, v in (res.get("clean") or {}).items() if k not in ("confirmed_events", "latency", "traceback")}
    errors = {k: v["error"] for k, v in res.items() if isinstance(v, dict) and "error" in v}
    return {"setup": res.get("setup"), "modes": modes, "clean": clean, "errors": errors, "total_s": res.get("total_s")}


def section_thresholds(out: Path) -> dict:
    """Issue 17's figures at the production thresholds (τ on each device's noise scale): a scan at
    --threshold 1e-10 (SUSPECT, exit 1), the default scan's margin, ≥ 10⁴ clean GEMMs for false
    positives, the sensitivity study (writes sensitivity-<gpu>.md/.json), the noise profile and the
    bias experiment. Each step under its own limit; AEGIS_FP_SECONDS bounds the false-positive run."""
    py, tmp, dev = sys.executable, Path(tempfile.mkdtemp()), os.environ.get("AEGIS_SUITE_DEVICE", "cuda:0")
    out = Path(os.environ.get("OUT") or out)  # the files come back from the device tool's $OUT
    steps = [
        ("tiny_threshold", ["-m", "aegis_cli", "scan", "-q", "--device", dev, "--workload", "cpu-quick", "--probes", "gemm",
                            "--threshold", "1e-10", "--format", "json", "--output", str(tmp / "tiny.json")], 40),
        ("default_scan", ["-m", "aegis_cli", "scan", "-q", "--device", dev, "--format", "json", "--output", str(tmp / "scan.json")], 40),
        ("false_positives", ["benchmarks/false_positives.py", "--device", dev, "--max-seconds",
                             os.environ.get("AEGIS_FP_SECONDS", "180"), "--out", str(out / "false_positives.json")], 240),
        ("sensitivity", ["benchmarks/sensitivity.py", "--device", dev, "--out-dir", str(out)], 100),
        ("noise_profile", ["benchmarks/noise_profile.py", "--device", dev, "--workloads", "llama3-8b", "llama3-70b",
                           "--seeds", "2", "--out", str(out / "noise_profile.json")], 40),
        ("noise_bias", ["benchmarks/noise_bias.py", "--device", dev, "--out", str(out / "noise_bias.json")], 30),
    ]
    summary = {}
    for name, argv, limit in steps:
        t0 = time.perf_counter()
        try:
            p = subprocess.run([py, *argv], cwd=ROOT, capture_output=True, text=True, timeout=limit, check=False)
            rc, text = p.returncode, p.stdout[-4000:] + p.stderr[-2000:]
        except subprocess.TimeoutExpired as exc:
            rc, text = "timeout", str(exc.stdout or "")[-4000:]
        print(f"== {name}: rc {rc} in {time.perf_counter() - t0:.0f} s\n{text}", flush=True)
        summary[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1)}
    for name, file in (("tiny_threshold", "tiny.json"), ("default_scan", "scan.json")):
        if (tmp / file).exists():
            devs = json.loads((tmp / file).read_text())["devices"]
            summary[name].update(verdicts=[d["verdict"] for d in devs], margins=[(d.get("noise") or {}).get("margin") for d in devs],
                                 severities=sorted({e["severity"] for d in devs for e in d["evidence"]}),
                                 numerics=all("numerics" in e["summary"] for d in devs for e in d["evidence"]),
                                 scan_s=[d["timings"]["seconds"] for d in devs])
    if (out / "false_positives.json").exists():
        fp = json.loads((out / "false_positives.json").read_text())
        worst = max((c["clean_max"] for c in fp["cases"]), default=0.0)
        summary["false_positives"].update(gemms=fp["gemms"], flagged=fp["false_positives"], clean_max=worst,
                                          margin=fp["tau"] / worst if worst else None)
    return summary


SECTIONS = [
    Section("env", section_env, 40),
    Section("selfcheck", section_selfcheck, 100),
    Section("sass", section_sass, 60),
    Section("gemm", section_gemm, 150),
    Section("pytest", section_pytest, 270),
    Section("scan", section_scan, 240),
    Section("sustained", section_sustained, 150),
    Section("soak", section_soak, 240),
    Section("sensors", section_sensors, 320),
    Section("thresholds", section_thresholds, 500),
]


# ---------------------------------------------------------------------------- driver
def _run_child(name: str, result_path: Path) -> int:
    sec = {s.name: s for s in SECTIONS}[name]
    res = sec.fn(result_path.parent)
    result_path.write_text(json.dumps(res, default=str), encoding="utf-8")
    return 0


def _table(results: dict) -> str:
    lines = ["section     status   seconds  summary"]
    for name, r in results.items():
        s = r.get("result") or {}
        if name == "gemm" and "rows" in s:
            summ = "; ".join(f"{x['name'].split('/')[-1]}/{x['layout']}: {x['checked_tflops']:.0f} TF "
                             f"({x['checked_vs_cublas']:.2f}x cuBLAS, sums {100 * x['checksum_overhead']:+.1f}%)" for x in s["rows"])
        elif name == "sustained":
            summ = "; ".join(f"{x['name'].split('/')[-1]}/{x['layout']}: {x['checked_vs_cublas']:.2f}x cuBLAS, "
                             f"sums {100 * x['checksum_overhead']:+.1f}%" for x in s["rows"])
        elif name == "pytest":
            summ = s.get("summary", "")
        elif name == "scan":
            summ = "; ".join(f"exit {x['exit']} {x['verdicts']} scan {x.get('report_s')}s (process {x['wall_s']}s) margin {x['margins']}"
                             for x in s.get("runs", []))
        elif name == "sensors":
            summ = "; ".join(f"{k} {100 * v['overhead']:+.2f}%" for k, v in (s.get("modes") or {}).items()
                             if v.get("overhead") is not None)
            c = s.get("clean") or {}
            if c.get("steps"):
                summ += (f"; clean {c['steps']} steps: raised {c.get('raised')}, cleared {c.get('cleared')}, "
                         f"confirmed {c.get('confirmed')}")
            if s.get("errors"):
                summ += f"; errors in {sorted(s['errors'])}"
        elif name == "selfcheck":
            summ = f"all_ok={s.get('all_ok')}"
        elif name == "sass":
            summ = ", ".join(f"{k}: {v.get('sass_counts')}" for k, v in s.items() if isinstance(v, dict))
        else:
            summ = json.dumps(s)[:200]
        lines.append(f"{name:<11} {r['status']:<8} {r['seconds']:>7.1f}  {summ}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="aegis GPU suite")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "gpu_suite_out"))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _run_child(args.child, Path(args.result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}
    results: dict = {}
    for sec in SECTIONS:
        if (args.only and sec.name not in args.only) or sec.name in args.skip:
            continue
        result_path = Path(tempfile.mkdtemp()) / "result.json"
        t0 = time.perf_counter()
        with open(out / f"{sec.name}.log", "w", encoding="utf-8") as log:
            try:
                p = subprocess.run([sys.executable, __file__, "--child", sec.name, "--result", str(result_path)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, timeout=sec.timeout_s, check=False)
                status = "ok" if p.returncode == 0 else f"rc={p.returncode}"
            except subprocess.TimeoutExpired:
                status = "timeout"
        res = json.loads(result_path.read_text()) if result_path.exists() else None
        results[sec.name] = {"status": status, "seconds": time.perf_counter() - t0, "result": res}
        (out / "suite.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
        print(f"[{sec.name}] {status} in {results[sec.name]['seconds']:.1f}s", flush=True)
        if status != "ok":
            print("".join((out / f"{sec.name}.log").read_text(errors="replace").splitlines(True)[-30:]), flush=True)
    print(_table(results))
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
