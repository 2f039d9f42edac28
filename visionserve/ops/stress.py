"""GPU health check: sustained matmul throughput, a device-memory pattern test, and the
temperature / SM clock trend while loaded.

  visionserve stress [--seconds N] [--device SPEC] [--memory-fraction F] [--json PATH]

Run it when a card is new, monthly, and whenever a line's inference got slower for no reason:
a card that overheats, sits on a degraded link or has failing memory shows it here.
Exit code: 0 healthy, 1 warnings, 2 failures (including "no CUDA device").

Throughput is judged against a table of dense fp16/bf16 tensor-core peaks; a large matmul
reaches roughly 60-80 % of the peak on a healthy card, so below 50 % is a warning and below
25 % a failure. Unknown cards are reported without a verdict.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..gpu.device import PinningError, ResolvedDevice, describe, pin_environment, resolve
from ..gpu.nvml import Nvml, real_nvml

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

# (substring of the NVML name, dense fp16/bf16 tensor TFLOP/s with fp32 accumulate).
# First match wins, so the more specific names come first. Data-sheet figures without sparsity.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("B200", 2250.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A30", 165.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("T4", 65.0),
    ("V100", 125.0),
    ("RTX 6000 Ada", 364.0),
    ("RTX A6000", 155.0),
    ("RTX A5000", 111.0),
    ("RTX A4000", 77.0),
    ("RTX 5090", 210.0),
    ("RTX 4090", 165.0),
    ("RTX 4080", 97.0),
    ("RTX 3090", 71.0),
)
WARN_RATIO, FAIL_RATIO = 0.5, 0.25


def expected_peak(name: str) -> float | None:
    for key, peak in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return peak
    return None


@dataclass
class Finding:
    status: str  # ok | warn | fail | info
    what: str


@dataclass
class Report:
    device: str
    gpu: dict[str, Any] | None = None
    torch: str | None = None
    seconds: float = 0.0
    matmul: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    exit_code: int = 0

    def finish(self) -> Report:
        st = {f.status for f in self.findings}
        self.exit_code = 2 if "fail" in st else 1 if "warn" in st else 0
        return self


# -- the measurements (device-agnostic, so the logic is testable on the CPU) -------------------

def matmul_throughput(torch: Any, device: Any, dtype: Any, seconds: float, n: int = 8192,
                      window_s: float = 0.5) -> dict[str, Any]:
    """Run n x n matmuls for ``seconds``; TFLOP/s per window of about ``window_s``."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    torch.matmul(a, b, out=c)  # warm-up: cuBLAS picks its kernel, clocks ramp
    sync()
    flops = 2.0 * n ** 3
    samples: list[float] = []
    iters = 1
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=c)
        sync()
        dt = time.perf_counter() - t0
        samples.append(flops * iters / dt / 1e12)
        # grow the batch of launches until one window takes about window_s
        if dt < window_s:
            iters = max(1, min(iters * 2, int(iters * window_s / max(dt, 1e-6))))
    finite = bool(torch.isfinite(c.float()).all().item()) if n <= 16384 else True
    del a, b, c
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "windows": len(samples),
            "tflops_median": statistics.median(samples) if samples else 0.0,
            "tflops_min": min(samples) if samples else 0.0,
            "tflops_max": max(samples) if samples else 0.0,
            "tflops_samples": [round(s, 2) for s in samples], "finite": finite}


PATTERNS = (("zeros", 0x00000000), ("ones", -1), ("0xAAAAAAAA", -0x55555556),
            ("0x55555555", 0x55555555), ("address", None), ("address_inverted", None))


def memory_pattern_test(torch: Any, device: Any, nbytes: int,
                        chunk_bytes: int = 64 * 2**20) -> dict[str, Any]:
    """Write patterns over ``nbytes`` of device memory, then read them back and count the int32
    words that differ. All chunks are written before any is read, so a cell has to keep its
    value while the rest of the region is being written."""
    words_per_chunk = max(1, chunk_bytes // 4)
    chunks: list[Any] = []
    allocated = 0
    try:
        while allocated + 4 <= nbytes:
            w = min(words_per_chunk, (nbytes - allocated) // 4)
            chunks.append(torch.empty(w, dtype=torch.int32, device=device))
            allocated += w * 4
    except RuntimeError as exc:  # OutOfMemoryError is a RuntimeError: test what we got
        log.warning("memory test: allocated %d of %d bytes (%s)", allocated, nbytes, exc)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    starts = [0]
    for ch in chunks:
        starts.append(starts[-1] + ch.numel())

    def expected(i: int, chunk: Any, invert: bool) -> Any:
        start = starts[i]
        idx = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=device)
        idx = (idx * 2654435761) & 0x7FFFFFFF  # scramble so neighbours differ in many bits
        v = idx.to(torch.int32)
        return ~v if invert else v

    results = {}
    total_mismatch = 0
    for name, value in PATTERNS:
        invert = name.endswith("inverted")
        for i, ch in enumerate(chunks):
            if value is not None:
                ch.fill_(value)
            else:
                ch.copy_(expected(i, ch, invert))
        sync()
        bad = 0
        for i, ch in enumerate(chunks):
            if value is not None:
                bad += int((ch != value).sum().item())
            else:
                bad += int((ch != expected(i, ch, invert)).sum().item())
        results[name] = bad
        total_mismatch += bad
    del chunks
    return {"bytes_tested": allocated, "bytes_requested": nbytes, "patterns": results,
            "mismatches": total_mismatch}


class TelemetrySampler:
    """Samples temperature, SM clock, power and throttle reasons through NVML in a thread."""

    def __init__(self, nvml: Nvml, index: int, period_s: float = 0.5) -> None:
        self.nvml, self.index, self.period_s = nvml, index, period_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-telemetry", daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            try:
                g = next(d for d in self.nvml.devices() if d.index == self.index)
                clock = getattr(self.nvml, "sm_clock_mhz", lambda i: None)(self.index)
                self.samples.append({"t": round(time.monotonic() - t0, 2),
                                     "temperature_c": g.temperature_c, "sm_clock_mhz": clock,
                                     "power_w": g.power_w,
                                     "throttle_reasons": list(g.throttle_reasons)})
            except Exception as exc:  # noqa: BLE001 - telemetry is best effort
                log.debug("telemetry sample failed: %s", exc)
            self._stop.wait(self.period_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def summary(self) -> dict[str, Any]:
        temps = [s["temperature_c"] for s in self.samples if s["temperature_c"] is not None]
        clocks = [s["sm_clock_mhz"] for s in self.samples if s["sm_clock_mhz"]]
        reasons = sorted({r for s in self.samples for r in s["throttle_reasons"]})
        return {
            "samples": len(self.samples),
            "temperature_start_c": temps[0] if temps else None,
            "temperature_end_c": temps[-1] if temps else None,
            "temperature_max_c": max(temps) if temps else None,
            "sm_clock_first_mhz": clocks[0] if clocks else None,
            "sm_clock_min_mhz": min(clocks) if clocks else None,
            "sm_clock_median_mhz": statistics.median(clocks) if clocks else None,
            "throttle_reasons_seen": reasons,
            "trend": self.samples,
        }


# -- verdicts ----------------------------------------------------------------------------------

def judge(report: Report, gpu_name: str) -> None:
    peak = expected_peak(gpu_name)
    for dt, m in report.matmul.items():
        if m.get("skipped"):
            report.findings.append(Finding("info", f"{dt}: {m['skipped']}"))
            continue
        got = m["tflops_median"]
        if not m.get("finite", True):
            report.findings.append(Finding("fail", f"{dt} matmul produced NaN/Inf from finite "
                                                   "inputs: the card computes wrong results"))
        if peak is None:
            m["expected_peak_tflops"] = None
            report.findings.append(Finding("info", f"{dt}: {got:.1f} TFLOP/s; no reference "
                                                   f"figure for {gpu_name!r}, no verdict"))
            continue
        ratio = got / peak
        m["expected_peak_tflops"], m["ratio_to_peak"] = peak, round(ratio, 3)
        status = "fail" if ratio < FAIL_RATIO else "warn" if ratio < WARN_RATIO else "ok"
        report.findings.append(Finding(status, f"{dt}: {got:.1f} TFLOP/s median = {ratio:.0%} of "
                                               f"the {peak:.0f} TFLOP/s dense peak"))
    mem = report.memory
    if mem:
        if mem.get("mismatches"):
            report.findings.append(Finding("fail", f"memory test: {mem['mismatches']} word(s) "
                                                   "read back wrong: faulty device memory"))
        else:
            report.findings.append(Finding("ok", f"memory test: {mem['bytes_tested'] / 2**30:.1f} "
                                                 f"GiB x {len(mem['patterns'])} patterns, no "
                                                 "mismatch"))
    tel = report.telemetry
    if tel.get("temperature_max_c") is not None and tel["temperature_max_c"] >= 90:
        report.findings.append(Finding("warn", f"temperature reached {tel['temperature_max_c']} "
                                               "C under load: check cooling"))
    seen = set(tel.get("throttle_reasons_seen") or [])
    if seen & {"hw_slowdown", "hw_power_brake_slowdown", "hw_thermal_slowdown"}:
        report.findings.append(Finding("fail", "hardware slowdown under load: "
                                               + ", ".join(sorted(seen))))
    elif "sw_thermal_slowdown" in seen:
        report.findings.append(Finding("warn", "thermal slowdown under load"))


# -- command -----------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="matmul duration, split between fp16 and bf16 (default 10)")
    parser.add_argument("--device", default="auto", help="GPU to test (default: first visible)")
    parser.add_argument("--memory-fraction", type=float, default=0.5,
                        help="fraction of the free device memory to pattern-test (default 0.5; "
                             "0 skips the test)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report here")


def _no_cuda(report: Report, args: argparse.Namespace, why: str) -> int:
    report.findings.append(Finding("fail", f"no CUDA device: {why}"))
    report.finish()
    print(f"visionserve stress: no CUDA device: {why}")
    _write(report, args.json)
    return report.exit_code


def _write(report: Report, path: str | None) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(report), f, indent=2, default=str)


def _torch_device_for(torch: Any, resolved: ResolvedDevice, pinned: bool) -> Any:
    if pinned:
        return torch.device("cuda:0")
    # CUDA was loaded before we could pin: find the card by UUID among what torch sees.
    want = resolved.gpu.uuid.lower().removeprefix("gpu-") if resolved.gpu else ""
    for i in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", "")).lower()
        if uuid and uuid.removeprefix("gpu-") == want:
            return torch.device(f"cuda:{i}")
    return torch.device("cuda:0")


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or not 0 <= args.memory_fraction <= 0.95:
        print("visionserve stress: --seconds must be > 0 and --memory-fraction in [0, 0.95]")
        return 2
    report = Report(device=args.device, seconds=args.seconds)
    nvml = real_nvml()
    try:
        resolved = resolve(args.device, nvml)
    except ConfigError as exc:
        return _no_cuda(report, args, exc.message)
    if resolved.kind != "cuda":
        return _no_cuda(report, args, resolved.note or "the device resolves to the CPU")
    pinned = True
    try:
        pin_environment(resolved)
    except PinningError as exc:
        pinned = False
        log.warning("%s", exc)
    try:
        import torch
    except ImportError as exc:
        return _no_cuda(report, args, f"torch is not installed ({exc})")
    if not torch.cuda.is_available():
        return _no_cuda(report, args, f"torch {torch.__version__} cannot use CUDA "
                                      f"(CUDA runtime {torch.version.cuda or 'none: CPU build'})")
    assert resolved.gpu is not None
    report.gpu = resolved.gpu.to_dict()
    report.torch = torch.__version__
    device = _torch_device_for(torch, resolved, pinned)
    print(f"stress: {describe(resolved)}")
    dtypes = [("fp16", torch.float16), ("bf16", torch.bfloat16)]
    with TelemetrySampler(nvml, resolved.gpu.index) as sampler:
        for label, dt in dtypes:
            if dt is torch.bfloat16 and not torch.cuda.is_bf16_supported():
                report.matmul[label] = {"skipped": "bf16 not supported by this card"}
                continue
            try:
                report.matmul[label] = matmul_throughput(torch, device, dt, args.seconds / 2)
            except RuntimeError as exc:
                report.matmul[label] = {"skipped": f"failed: {exc}"}
                report.findings.append(Finding("fail", f"{label} matmul failed: {exc}"))
            print(f"stress: {label} {report.matmul[label]}"[:200])
        torch.cuda.empty_cache()
        if args.memory_fraction > 0:
            free, _total = torch.cuda.mem_get_info(device)
            report.memory = memory_pattern_test(torch, device, int(free * args.memory_fraction))
    report.telemetry = sampler.summary()
    judge(report, resolved.gpu.name)
    report.finish()
    for f in report.findings:
        print(f"[{f.status:>4}] {f.what}")
    print(f"stress: exit {report.exit_code}")
    _write(report, args.json)
    return report.exit_code
