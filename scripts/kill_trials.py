"""SIGKILL a training run at random moments, restart it each time, and check it ends bit-exact.

    python scripts/kill_trials.py [--trials 20] [--steps 100] [--seed 0] [--workdir DIR]
                                  [--every 3] [--local-every N]

A reference run trains --steps steps of a tiny Llama (configs/tiny_llama.py made smaller, 2 fake
CPU devices, a checkpoint every 3 steps) uninterrupted. A second run, in its own directory, is
killed --trials times, each kill in a fresh launch: a third of them while a checkpoint is being
written (the moment orbax's temporary `*.orbax-checkpoint-tmp*` directory appears), the others
at a random moment from start-up to a few steps in. After each kill it is started again; after
the last it runs to the end. Checked: every loss any launch logged equals the reference's for
that step, bit for bit (steps redone after a resume are logged again), and the final
checkpoints' parameters and the checksums of every array are identical.

With --local-every N the killed run also saves to a node-local tier (checkpoint.local_dir in the
work directory, every N steps; persistent saves every --every steps, e.g. --every 10
--local-every 2): "while a checkpoint is being written" then also counts a local write in flight,
and each resume says which tier it read.

One line per trial, then a summary; exit status 0 if and only if every trial resumed bit-exact.
About 10-15 s a launch on 2 CPU cores (the launches share one compilation cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["--config.model.vocab_size=128", "--config.model.d_model=64", "--config.model.n_layers=2",
        "--config.model.n_heads=4", "--config.model.n_kv_heads=2", "--config.model.head_dim=16",
        "--config.model.mlp_dim=128", "--config.model.scan_layers=true", "--config.data.source=synthetic",
        "--config.train.seq_len=32", "--config.train.per_device_batch_size=2", "--config.log.every=1",
        "--config.log.tensorboard=false", "--config.checkpoint.keep=2"]
SAVE_EVERY = 3


def launch(run_dir: Path, steps: int, cache: Path, log: Path, extra=()) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *TINY,
             f"--config.train.steps={steps}", f"--config.output_dir={run_dir}",
             f"--config.checkpoint.every={SAVE_EVERY}", f"--config.train.compilation_cache={cache}", *extra],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; a line that a kill cut short is left out (and counted by the caller)."""
    path = run_dir / "metrics.jsonl"
    parsed = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            parsed.append(None)
    return parsed


def saves_begun(run_dir: Path) -> set[str]:
    """Orbax's temporary step directories there now (one per save in flight, or left by a kill)."""
    folder = run_dir / "checkpoints"
    persistent = {p.name for p in folder.iterdir() if ".orbax-checkpoint-tmp" in p.name} if folder.is_dir() else set()
    local = run_dir.parent / "local"  # the local tier's writes in flight (--local-every)
    return persistent | ({str(p) for p in local.glob("*/process-*/*.orbax-checkpoint-tmp*")} if local.is_dir() else set())


def kill_at_random(process: subprocess.Popen, run_dir: Path, moment: str, rng: random.Random,
                   start_up_s: float, step_s: float) -> tuple[str, float | None]:
    """SIGKILLs `process` at a moment of the kind asked for. Returns what happened, and for kills
    within steps how long the launch took to its first step (start-up with a warm cache)."""
    started, rows_before, first_row_s = time.perf_counter(), len(rows(run_dir)), None
    seen_at_launch = saves_begun(run_dir)
    if moment == "save":  # orbax's temporary directory is there from the save's start to its commit
        seen = saves_begun(run_dir)  # a killed save's directory stays until the next launch cleans up
        for _ in range(rng.randint(1, 2)):  # the launch's first save, or its second
            while process.poll() is None and not saves_begun(run_dir) - seen:
                time.sleep(0.002)
            seen |= saves_begun(run_dir)
        what = "while a checkpoint was being written"
    elif moment == "start-up":  # imports, building the trainer, restoring, compiling
        delay = rng.uniform(0.2, 0.95) * start_up_s
        while process.poll() is None and time.perf_counter() - started < delay:
            time.sleep(0.01)
        what = "during start-up (before its first step)"
    else:  # within the first few steps of this launch, wherever a step happens to be
        while process.poll() is None and len(rows(run_dir)) == rows_before:
            time.sleep(0.01)
        first_row_s = time.perf_counter() - started
        time.sleep(rng.uniform(0.0, 2 * SAVE_EVERY + 1) * step_s)  # usually past a save: the run moves on
        what = "between or inside steps"
    if process.poll() is not None:
        return f"NOT killed: the launch ended first (exit {process.returncode})", first_row_s
    in_save = bool(saves_begun(run_dir) - seen_at_launch)
    process.send_signal(signal.SIGKILL)
    process.wait()
    # What the moment turned out to be (a start-up kill timed from another launch may land later).
    landed = ("while a checkpoint was being written" if in_save else
              "during start-up (before its first step)" if len(rows(run_dir)) == rows_before else
              "between or inside steps")
    aimed = "" if landed == what else f" (aimed {what})"
    return f"{landed}{aimed}, {time.perf_counter() - started:.2f} s after launch", first_row_s


def resumed_from(log: Path) -> str:
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("resumed from the local tier's step "):
            return f"resumed from local step {int(line.rsplit(' ', 1)[1])}"
        if line.startswith("resumed from "):
            return f"resumed from step {int(line.rsplit('/', 1)[1])}"
    return "started afresh" if "first step done" in text else "killed before it had restored or started"


def final_state(run_dir: Path, steps: int):
    """(params as NumPy arrays, the saved checksums of every array) of checkpoint `steps`."""
    import jax
    import numpy as np

    from maxtext_rocm import config as config_lib
    from maxtext_rocm.checkpoint import restore_params_to_host

    cfg = config_lib.load("configs/tiny_llama.py", TINY)
    params = restore_params_to_host(run_dir / "checkpoints" / str(steps), cfg)
    meta = json.loads((run_dir / "checkpoints" / str(steps) / "meta" / "metadata").read_text())
    return jax.tree_util.tree_map(np.asarray, params), meta["checksums"]


def time_reference(processes: list[subprocess.Popen], run_dir: Path, steps: int, logs) -> tuple | None:
    """Waits for the reference launch; (its losses by step, seconds to its first step, seconds a
    step after that), or None (said in one line) if it failed."""
    started, first_step_s = time.perf_counter(), None
    while any(p.poll() is None for p in processes):
        if first_step_s is None and rows(run_dir):
            first_step_s = time.perf_counter() - started
        time.sleep(0.01)
    if any(p.returncode != 0 for p in processes) or first_step_s is None:
        print(f"the reference run failed (exits {[p.returncode for p in processes]}); see {logs}")
        return None
    step_s = (time.perf_counter() - started - first_step_s) / max(steps - 1, 1)
    print(f"reference: {steps} steps in {time.perf_counter() - started:.1f} s (first step at "
          f"{first_step_s:.1f} s, then {step_s:.2f} s a step)")
    return {row["step"]: row["loss"] for row in rows(run_dir)}, first_step_s, step_s


def trial_moments(trials: int, rng: random.Random) -> list[str]:
    """When each trial's stop lands: while a checkpoint is written, in start-up, or within steps,
    a third each in random order. The first lands within steps: it times a start-up from a warm
    compilation cache, which the start-up stops then fall inside (the reference compiled everything)."""
    moments = (["save", "start-up", "steps"] * trials)[:trials - 1]
    rng.shuffle(moments)
    return ["steps", *moments]


def same_final_checkpoints(run: Path, reference: Path, steps: int, read=final_state) -> bool:
    """Whether checkpoint `steps` of `run` holds exactly the reference's parameters and checksums
    (`read(run_dir, steps)` -> (params, checksums)); says so in one line."""
    import jax
    import numpy as np

    got_params, got_sums = read(run, steps)
    want_params, want_sums = read(reference, steps)
    same_params = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(got_params),
                                                           jax.tree_util.tree_leaves(want_params)))
    print(f"final checkpoint {steps}: parameters {'identical' if same_params else 'DIFFER'}, checksums of "
          f"every array {'identical' if got_sums == want_sums else 'DIFFER'}")
    return same_params and got_sums == want_sums


def main() -> int:
    global SAVE_EVERY
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--every", type=int, default=3, help="steps between persistent saves")
    parser.add_argument("--local-every", type=int, default=0, help="steps between local saves; 0: no local tier")
    args = parser.parse_args()
    SAVE_EVERY = args.every
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kill_trials_"))
    cache, reference, run = workdir / "xla_cache", workdir / "reference", workdir / "killed"
    tiers = ([f"--config.checkpoint.local_dir={workdir / 'local'}", f"--config.checkpoint.local_every={args.local_every}",
              "--config.checkpoint.local_keep=2"] if args.local_every else [])
    rng = random.Random(args.seed)

    started = time.perf_counter()
    reference_run = time_reference([launch(reference, args.steps, cache, workdir / "reference.log")], reference,
                                   args.steps, workdir / "reference.log")
    if reference_run is None:
        return 1
    want, first_step_s, step_s = reference_run
    moments = trial_moments(args.trials, rng)
    exact, seen_rows, start_up_s, landed = 0, 0, first_step_s, []
    for trial in range(args.trials + 1):
        log = workdir / f"launch_{trial}.log"
        process = launch(run, args.steps, cache, log, tiers)
        if trial < args.trials:
            when, first_row_s = kill_at_random(process, run, moments[trial], rng, start_up_s, step_s)
            start_up_s = first_row_s or start_up_s  # later launches start from a warm compilation cache
            if when.startswith("NOT"):
                print(f"trial {trial + 1}: {when}; see {log}")
                return 1
        else:
            process.wait()
            when = f"ran to the end (exit {process.returncode})"
        logged = rows(run)
        new, seen_rows = logged[seen_rows:], len(logged)
        matched = sum(1 for row in new if row is not None and row["loss"] == want.get(row["step"]))
        torn = sum(1 for row in new if row is None)
        ok = matched == len(new) - torn
        if trial > 0:  # this launch's rows check the resume that trial `trial - 1`'s kill forced
            exact += ok
        landed.append(when.split(",")[0].split(" (aimed")[0])
        print(f"launch {trial}: {resumed_from(log)}, {matched}/{len(new) - torn} logged losses "
              f"equal the reference's{f' ({torn} line cut short by the kill)' if torn else ''}; "
              + (f"trial {trial + 1}: killed {when}" if trial < args.trials else when))
        if trial == args.trials and process.returncode != 0:
            print(f"the final launch failed; see {log}")
            return 1

    exact = exact if same_final_checkpoints(run, reference, args.steps, final_state) else 0
    kinds = ", ".join(f"{landed[:args.trials].count(kind)} {kind}" for kind in sorted(set(landed[:args.trials])))
    print(f"{exact} of {args.trials} trials resumed bit-exact (killed: {kinds}); "
          f"{time.perf_counter() - started:.0f} s in all; launches' output in {workdir}")
    return 0 if exact == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
