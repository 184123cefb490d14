"""What the GPU's clocks did while a window was timed (NVML, through nvidia-ml-py).

    with ClockWatch(device) as w:
        samples = time_steps(...)
    w.summary()   # {"sm_mhz": 1980.0, "sm_mhz_min": 1965.0, "power_w": 512.0, "capped_pct": 0.0}; {} off NVIDIA

Why: an H200 held at its 700 W limit lowers the SM clock, after ~0.6-0.8 s of this kernel at
6-16 tokens, from 1980 MHz to as low as 960 (NVML reason: software power cap), and a launch then
takes 5-25% longer (graph replays timed back to back for 10 s, H200, 2026-12-04).
A window timed across that edge has a p90 far over its p50, and two runs of one kernel differ by
where their windows fell. The bench therefore idles before each timed burst (ffnq.timing) and
records, per window, the SM clock and the share of polls during which a cap held the clocks down.
"""
from __future__ import annotations

import functools
import statistics
import threading
import time

import torch

# NVML clock-event reasons that lower the clocks under load (nvmlClocksEventReason*): software
# power cap, hardware slowdown, software and hardware thermal slowdown, the power brake. Idle
# (0x1), application clocks (0x2), sync boost (0x10) and display (0x100) are not caps.
CAP_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


@functools.cache
def nvml_handle(device: torch.device | str):
    """(pynvml, handle, the reasons query) of ``device`` or None: off NVIDIA GPUs, or where
    nvidia-ml-py or the driver's NVML is missing (the bench then reports no clock columns)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        # by UUID: NVML counts every GPU of the host, CUDA only the visible ones
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        return pynvml, h, reasons_query(pynvml)
    except Exception:  # noqa: BLE001 (no NVML: the timing stands, without its clock columns)
        return None


def reasons_query(m):
    """NVML's clock-event reasons call (drivers before the rename know it as throttle reasons)."""
    return getattr(m, "nvmlDeviceGetCurrentClocksEventReasons", None) or m.nvmlDeviceGetCurrentClocksThrottleReasons


class ClockWatch:
    """Polls the SM clock, power and clock-event reasons every ``period_s`` on a thread while
    the ``with`` block runs. ``nvml`` = (module, handle) replaces the lookup (tests)."""

    def __init__(self, device: torch.device | str, period_s: float = 0.005, nvml=None):
        self.nvml = (*nvml, reasons_query(nvml[0])) if nvml is not None else nvml_handle(device)
        self.period_s = period_s
        self.polls: list[tuple[float, float, int]] = []  # (sm MHz, W, reasons)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        m, h, reasons = self.nvml
        self.polls.append((float(m.nvmlDeviceGetClockInfo(h, m.NVML_CLOCK_SM)),
                           m.nvmlDeviceGetPowerUsage(h) / 1e3, int(reasons(h))))

    def _run(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # noqa: BLE001 (a query this GPU does not answer: fewer polls, no crash)
                return
            if self._stop.wait(self.period_s):
                return

    def __enter__(self) -> ClockWatch:  # again for each burst: the polls add up
        if self.nvml is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            try:
                self.poll()  # the state at the window's end, also for windows shorter than a period
            except Exception:  # noqa: BLE001
                pass

    def summary(self) -> dict:
        if not self.polls:
            return {}
        sm = [p[0] for p in self.polls]
        return {"sm_mhz": statistics.median(sm), "sm_mhz_min": min(sm),
                "power_w": statistics.median(p[1] for p in self.polls),
                "capped_pct": 100.0 * sum(bool(p[2] & CAP_REASONS) for p in self.polls) / len(self.polls)}


def idle(seconds: float, device: torch.device | str) -> None:
    """Let the GPU sit idle for ``seconds`` (after its queued work), so that a power average the
    last window raised falls back before the next one starts."""
    if seconds > 0 and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        time.sleep(seconds)
