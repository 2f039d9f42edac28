"""The watchdog's rule: from one memory sample, which jobs to pause, resume or stop.

Pure (no signals, no database), so the supervisor applies the actions and the rule can be tested
on its own. Two triggers, either one enough:

- ``over_need``: the job's own processes (its whole session) hold more than it declared;
- ``low_headroom``: the card's free memory is under the inference floor.

A paused job is resumed when free memory is back above ``floor + hysteresis`` and the job is not
over its own declaration. Note that a stopped (SIGSTOP) process keeps its GPU memory: pausing halts
growth, it does not give memory back. A job paused for ``over_need`` therefore stays paused until
it is cancelled; choose ``stop`` for jobs that must not hold memory while waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

from .admission import fmt_bytes


@dataclass(frozen=True)
class JobView:
    job_id: int
    policy: str  # pause | stop
    state: str  # running | paused
    need: int
    used: int


@dataclass(frozen=True)
class Action:
    job_id: int
    kind: str  # pause | resume | stop
    trigger: str  # over_need | low_headroom | headroom_back
    reason: str


def decide(jobs: list[JobView], *, free: int, floor: int, hysteresis: int) -> list[Action]:
    actions = []
    low = free < floor
    for j in jobs:
        over = j.used > j.need
        if j.state == "running":
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
        elif j.state == "paused" and not over and free >= floor + hysteresis:
            actions.append(Action(j.job_id, "resume", "headroom_back",
                                  f"resumed: free {fmt_bytes(free)} >= floor {fmt_bytes(floor)} + "
                                  f"hysteresis {fmt_bytes(hysteresis)}"))
            # one resume per sample: the next sample shows what the resumed job does
            free = -1
    return actions
