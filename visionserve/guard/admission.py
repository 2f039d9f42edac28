"""The admission rule, kept pure so it can be read and tested on its own.

A queued job may start when ``free - floor - promised >= need``:

- ``floor`` = the inference server's budget + a margin: memory that is always kept *free*, so
  the server can (re)start and reserve its budget at any moment, even with a job running;
- ``promised`` = what already-running jobs declared but have not allocated yet (a job that just
  started still shows most of the card free; without this two jobs could be admitted on the
  same free bytes when ``concurrency`` > 1).
"""

from __future__ import annotations

from dataclasses import dataclass


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Decision:
    admit: bool
    #: the job can never fit on this card (need > total - floor): fail it instead of waiting forever
    impossible: bool
    reason: str


def decide(*, need: int, total: int, free: int, floor: int, promised: int = 0) -> Decision:
    if need > total - floor:
        return Decision(False, True,
                        f"needs {fmt_bytes(need)} but this card can give at most "
                        f"{fmt_bytes(total - floor)} (total {fmt_bytes(total)} - inference floor "
                        f"{fmt_bytes(floor)})")
    room = free - floor - promised
    if room >= need:
        return Decision(True, False, f"admitted: free {fmt_bytes(free)} - floor {fmt_bytes(floor)}"
                        f" - promised {fmt_bytes(promised)} >= need {fmt_bytes(need)}")
    return Decision(False, False,
                    f"waiting for GPU memory: free {fmt_bytes(free)} - floor {fmt_bytes(floor)}"
                    f" - promised {fmt_bytes(promised)} = {fmt_bytes(room)}"
                    f" < need {fmt_bytes(need)}")
