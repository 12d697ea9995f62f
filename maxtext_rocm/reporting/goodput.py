"""Goodput: the fraction of a run's wall time that trained the model, and where the rest went.

Reads the timelines the processes appended (timeline.py) and accounts each launch's wall time,
from its process's start to the next launch's start (the last launch: to its last record):

- productive: steps trained for the first time;
- recomputed: steps trained again after a restart, up to the step an earlier launch had reached
  (the work the restart lost), at the time they took again;
- startup (the interpreter, imports, config, the Trainer's build), distributed_init, compile (the
  launch less its restore, and the first step's warm-up beyond one step time), restore,
  checkpoint_persistent and checkpoint_local (stalls of the loop), eval;
- between_launches: from a launch's last record to the next launch's start (a killed launch's
  steps since its last record, the scheduler's restart);
- other: what no span covers (row formatting, summaries, the exit).

The first step's own share is the median step time of the run (its launch's first-step span
also holds compilation or warm-up). A multi-process run's figures are the processes' means.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

CAUSES = ("startup", "distributed_init", "compile", "restore", "checkpoint_persistent", "checkpoint_local", "eval",
          "recomputed", "between_launches", "other")


@dataclasses.dataclass
class LaunchAccount:
    """One launch: its wall time (to the next launch's start), productive seconds and badput by cause."""
    launch: int
    wall_s: float
    productive_s: float
    badput: dict[str, float]
    steps: tuple[int, int]  # (the step it began after, the last step it recorded)
    recomputed_steps: int


@dataclasses.dataclass
class Account:
    """A run's goodput: `wall_s` = `productive_s` + the badput's seconds."""
    wall_s: float
    productive_s: float
    badput: dict[str, float]
    launches: list[LaunchAccount]
    recomputed_steps: int
    step_time_s: float | None
    processes: int = 1

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def restarts(self) -> int:
        return max(0, len(self.launches) - 1)

    def to_json(self) -> dict:
        return {"goodput": self.goodput, "wall_s": self.wall_s, "productive_s": self.productive_s,
                "badput": self.badput, "restarts": self.restarts, "recomputed_steps": self.recomputed_steps,
                "step_time_s": self.step_time_s, "processes": self.processes,
                "launches": [dataclasses.asdict(launch) for launch in self.launches]}


def read_spans(path: Path) -> list[dict]:
    """The spans of one process's timeline; a line torn by a kill mid-write is left out."""
    spans = []
    if not Path(path).is_file():
        return spans
    for line in Path(path).read_text().splitlines():
        try:
            span = json.loads(line)
        except ValueError:
            continue
        if isinstance(span, dict) and {"launch", "event", "t0", "t1"} <= span.keys():
            spans.append(span)
    return spans


def _median_step_time(spans: list[dict]) -> float | None:
    per_step = [(s["t1"] - s["t0"]) / (s["last"] - s["first"]) for s in spans
                if s["event"] == "steps" and s["last"] > s["first"]]
    return statistics.median(per_step) if per_step else None


def account(spans: list[dict]) -> Account:
    """The goodput of one process's timeline."""
    step_time = _median_step_time(spans)
    by_launch: dict[int, list[dict]] = {}
    for span in spans:
        by_launch.setdefault(span["launch"], []).append(span)
    order = sorted(by_launch)
    starts = [min(s["t0"] for s in by_launch[k]) for k in order]
    launches, reached = [], 0
    for i, k in enumerate(order):
        ends_at = starts[i + 1] if i + 1 < len(order) else max(s["t1"] for s in by_launch[k])
        launch = _account_launch(k, by_launch[k], starts[i], ends_at, reached, step_time)
        launches.append(launch)
        reached = max(reached, launch.steps[1])
    badput = {cause: sum(launch.badput[cause] for launch in launches) for cause in CAUSES}
    return Account(wall_s=sum(launch.wall_s for launch in launches),
                   productive_s=sum(launch.productive_s for launch in launches), badput=badput,
                   launches=launches, recomputed_steps=sum(launch.recomputed_steps for launch in launches),
                   step_time_s=step_time)


def _account_launch(k: int, spans: list[dict], start: float, ends_at: float, reached: int,
                    step_time: float | None) -> LaunchAccount:
    badput = dict.fromkeys(CAUSES, 0.0)
    productive, recomputed_steps = 0.0, 0
    began_after, last = None, 0

    def steps(first: int, last_step: int, seconds: float) -> None:
        nonlocal productive, recomputed_steps
        again = max(0, min(last_step, reached) - first)  # steps first+1..last_step already trained before
        badput["recomputed"] += seconds * again / (last_step - first)
        productive += seconds * (1 - again / (last_step - first))
        recomputed_steps += again

    for span in spans:
        seconds, event = span["t1"] - span["t0"], span["event"]
        if event in ("startup", "build"):
            badput["startup"] += seconds
        elif event == "distributed_init":  # inside the startup span
            badput["distributed_init"] += seconds
            badput["startup"] -= seconds
        elif event == "launch":
            restore = min(seconds, span.get("restore_s", 0.0))
            badput["restore"] += restore
            badput["compile"] += seconds - restore
        elif event == "first_step":
            one = min(seconds, step_time) if step_time is not None else 0.0
            badput["compile"] += seconds - one
            if one:
                steps(span["first"], span["last"], one)
            began_after, last = span["first"], max(last, span["last"])
        elif event == "steps":
            steps(span["first"], span["last"], seconds)
            last = max(last, span["last"])
        elif event == "checkpoint":
            badput[f"checkpoint_{span.get('tier', 'persistent')}"] += seconds
        elif event == "eval":
            badput["eval"] += seconds
    end = max(s["t1"] for s in spans)
    badput["between_launches"] = max(0.0, ends_at - end)
    wall = ends_at - start
    badput["other"] = max(0.0, wall - productive - sum(v for c, v in badput.items() if c != "other"))
    return LaunchAccount(k, wall, productive, badput, (began_after if began_after is not None else last, last),
                         recomputed_steps)


def timeline_path(output_dir: str, process: int) -> Path:
    """Where process `process` of the run in `output_dir` appends its timeline (reporting/timeline.py)."""
    return Path(output_dir) / "goodput" / f"process-{process}.jsonl"


def account_run(run_dir) -> Account | None:
    """The goodput of run directory `run_dir`: every process's timeline, averaged; None without one."""
    folder = timeline_path(str(run_dir), 0).parent
    accounts = [account(read_spans(path)) for path in sorted(folder.glob("process-*.jsonl"))] \
        if folder.is_dir() else []
    accounts = [a for a in accounts if a.launches]
    if not accounts:
        return None
    if len(accounts) == 1:
        return accounts[0]
    n = len(accounts)
    mean = accounts[0]
    same_launches = all(len(a.launches) == len(mean.launches) for a in accounts)
    launches = [LaunchAccount(launch.launch, sum(a.launches[i].wall_s for a in accounts) / n,
                              sum(a.launches[i].productive_s for a in accounts) / n,
                              {c: sum(a.launches[i].badput[c] for a in accounts) / n for c in CAUSES},
                              launch.steps, launch.recomputed_steps)
                for i, launch in enumerate(mean.launches)] if same_launches else mean.launches
    return Account(wall_s=sum(a.wall_s for a in accounts) / n, productive_s=sum(a.productive_s for a in accounts) / n,
                   badput={c: sum(a.badput[c] for a in accounts) / n for c in CAUSES}, launches=launches,
                   recomputed_steps=mean.recomputed_steps, step_time_s=mean.step_time_s, processes=n)


def format_account(run_dir, acct: Account) -> str:
    """The report: goodput, then a table of seconds by cause for the whole run and each launch."""
    lines = [f"{run_dir}: goodput {100 * acct.goodput:.1f}% of {acct.wall_s:.1f} s wall time "
             f"({len(acct.launches)} launch{'es' * (len(acct.launches) != 1)}, {acct.restarts} restart"
             f"{'s' * (acct.restarts != 1)}; {acct.recomputed_steps} step{'s' * (acct.recomputed_steps != 1)} "
             f"recomputed{f'; {acct.processes} processes, their mean' if acct.processes > 1 else ''})"]
    heads = ["whole run", "%"] + [f"launch {launch.launch + 1}" for launch in acct.launches]
    rows = [("wall", acct.wall_s, [launch.wall_s for launch in acct.launches]),
            ("productive", acct.productive_s, [launch.productive_s for launch in acct.launches])]
    rows += [(cause, acct.badput[cause], [launch.badput[cause] for launch in acct.launches]) for cause in CAUSES]
    width = max(len(h) for h in heads) + 2
    lines.append(f"{'seconds':<22}" + "".join(f"{h:>{width}}" for h in heads))
    for name, whole, per_launch in rows:
        share = f"{100 * whole / acct.wall_s:.1f}" if acct.wall_s > 0 else "-"
        lines.append(f"{name:<22}{whole:>{width}.2f}{share:>{width}}" + "".join(f"{v:>{width}.2f}" for v in per_launch))
    return "\n".join(lines)
