"""The watchdog's rule: from one memory sample, which jobs to pause, resume or stop.

Pure (no signals, no database), so the supervisor applies the actions and the rule can be tested
on its own. Memory triggers, either one enough, act by the job's policy (pause or stop):

- ``over_need``: the job's own processes (its whole session) hold more than it declared;
- ``low_headroom``: the card's free memory is under the inference floor.

And, when the server hosts the guard with a latency budget, ``latency``: the served p99 of the
last second is over the budget. That one always pauses (the job is not at fault, it only
shares the card); the job resumes once the p99 is back under ``RESUME_FRACTION`` of the budget.
A *cooperative* job (its hook yields while the server runs a batch, see :mod:`.yieldhook`) is not
paused for latency: the budget drives its duty cycle instead (the supervisor's).

A paused job is resumed when free memory is back above ``floor + hysteresis`` and the job is not
over its own declaration. Note that a stopped (SIGSTOP) process keeps its GPU memory: pausing halts
growth, it does not give memory back. A job paused for ``over_need`` therefore stays paused until
it is cancelled; choose ``stop`` for jobs that must not hold memory while waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

from .admission import fmt_bytes

#: a job paused for latency resumes when the p99 is under this fraction of the budget
RESUME_FRACTION = 0.8


@dataclass(frozen=True)
class Latency:
    p99_ms: float | None  # None: too few frames to tell
    budget_ms: float

    @property
    def over(self) -> bool:
        return self.p99_ms is not None and self.p99_ms > self.budget_ms

    @property
    def back(self) -> bool:
        return self.p99_ms is None or self.p99_ms <= RESUME_FRACTION * self.budget_ms


@dataclass(frozen=True)
class JobView:
    job_id: int
    policy: str  # pause | stop
    state: str  # running | paused
    need: int
    used: int
    #: its hook yields the GPU at module boundaries: the latency rule leaves it to the hook
    cooperative: bool = False


@dataclass(frozen=True)
class Action:
    job_id: int
    kind: str  # pause | resume | stop
    trigger: str  # over_need | low_headroom | latency | headroom_back
    reason: str


def decide(jobs: list[JobView], *, free: int | None, floor: int, hysteresis: int,
           latency: Latency | None = None) -> list[Action]:
    """``free`` None: no memory sample (no GPU, or NVML failed): memory rules are skipped."""
    actions = []
    low = free is not None and free < floor
    slow = latency is not None and latency.over
    for j in jobs:
        over = free is not None and j.used > j.need
        if j.state == "running":
            if not over and not low and latency is not None and slow and not j.cooperative:
                actions.append(Action(j.job_id, "pause", "latency",
                                      f"paused: served p99 {latency.p99_ms:.1f} ms is over the "
                                      f"latency budget {latency.budget_ms:g} ms"))
                continue
            if over:
                trigger = "over_need"
                reason = (f"job uses {fmt_bytes(j.used)} of GPU memory, over its declared "
                          f"{fmt_bytes(j.need)}")
            elif low:
                trigger = "low_headroom"
                reason = (f"card free memory {fmt_bytes(free)} fell under the inference floor "
                          f"{fmt_bytes(floor)}")
            else:
                continue
            kind = "pause" if j.policy == "pause" else "stop"
            actions.append(Action(j.job_id, kind, trigger, f"{kind}d: {reason}"
                                  if kind == "pause" else f"stopped: {reason}"))
        elif j.state == "paused" and not over and (free is None or free >= floor + hysteresis) \
                and (latency is None or latency.back):
            memory = "" if free is None else (f"free {fmt_bytes(free)} >= floor {fmt_bytes(floor)}"
                                              f" + hysteresis {fmt_bytes(hysteresis)}")
            lat = ""
            if latency is not None:
                seen = f"served p99 {latency.p99_ms:.1f} ms" if latency.p99_ms is not None \
                    else "served p99 n/a"
                lat = f"{seen} <= {RESUME_FRACTION:g} x budget {latency.budget_ms:g} ms"
            actions.append(Action(j.job_id, "resume", "headroom_back",
                                  "resumed: " + "; ".join(x for x in (memory, lat) if x)))
            # one resume per sample: the next sample shows what the resumed job does
            free = -1
    return actions
