"""Stop a 2-process training run at random moments, restart it each time, and check it ends bit-exact.

    python scripts/kill_trials_multihost.py [--trials 20] [--steps 120] [--seed 0] [--workdir DIR]
                                            [--every 3] [--local-every N]

The multi-host sibling of scripts/kill_trials.py. Two trainer processes on 127.0.0.1 (2 fake CPU
devices each, mesh dcn.data=2 x ici.fsdp=2) train a tiny Llama on a generated JSON Lines corpus
(documents of varied lengths, so each process's data position is its own), checkpointing every 3
steps. A reference pair trains --steps steps uninterrupted. A second pair, in its own directory,
is stopped --trials times, each time in a fresh launch: a random one of the two processes gets
SIGKILL or SIGTERM (chosen at random), at a random moment: during start-up, between or inside
steps, or while a checkpoint is being written. After each stop the pair is started again; after
the last it runs to the end.

Checked for each trial:
- both processes end within a bound (never a hang); after SIGTERM both exit 0 with a committed
  checkpoint at the same step (one decision for all processes), after SIGKILL the survivor exits
  non-zero, naming the lost process;
- every loss any launch logged equals the reference's for that step, bit for bit (steps redone
  after a resume are logged again), so each resume continued the data of every process exactly;
- at the end, the final checkpoint's parameters and the checksums of every array are identical
  to the reference's.

With --local-every N each process also saves to a node-local tier (checkpoint.local_dir in the
work directory, every N steps; persistent saves every --every steps): after half the SIGKILLs
(at random) the killed process's local tier is removed too, as if its node had been replaced, so
the relaunch must fall back to the persistent tier on both processes; each launch's line says
which tier it resumed from.

One line per trial, then a summary; exit status 0 if and only if every trial resumed bit-exact.
About 25-40 s a launch on 2 CPU cores (the launches share one compilation cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kill_trials import REPO, TINY, rows, same_final_checkpoints, saves_begun, time_reference, trial_moments  # noqa: E402

SAVE_EVERY = 3
PROCESSES = 2
EXIT_BOUND_S = 90  # a process must be gone this long after the signal, or the trial counts as a hang


def write_corpus(path: Path, seed: int = 0, documents: int = 400) -> Path:
    """JSON Lines of documents from 5 to 400 characters: rows pack different numbers of documents,
    so the two processes' data positions differ (what a checkpoint must keep per process)."""
    rng = random.Random(seed)
    words = "the a of to in model train data token step loss layer head mesh device shard".split()
    with open(path, "w") as out:
        for _ in range(documents):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 80)))[: rng.randint(5, 400)]
            out.write(json.dumps({"text": text}) + "\n")
    return path


VOCAB = ["--config.model.vocab_size=320"]  # the byte tokenizer's 259 ids


def final_state(run_dir: Path, steps: int):
    """(params as NumPy arrays, the saved checksums of every array) of checkpoint `steps`."""
    import jax
    import numpy as np

    from maxtext_rocm import config as config_lib
    from maxtext_rocm.checkpoint import restore_params_to_host

    cfg = config_lib.load("configs/tiny_llama.py", TINY + VOCAB)
    params = restore_params_to_host(run_dir / "checkpoints" / str(steps), cfg)
    meta = json.loads((run_dir / "checkpoints" / str(steps) / "meta" / "metadata").read_text())
    return jax.tree_util.tree_map(np.asarray, params), meta["checksums"]


def committed_steps(run_dir: Path) -> set[str]:
    folder = run_dir / "checkpoints"
    return {p.name for p in folder.iterdir() if p.name.isdigit()} if folder.is_dir() else set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, steps: int, cache: Path, corpus: Path, logs: list[Path], extra=()) -> list[subprocess.Popen]:
    port = free_port()
    args = [sys.executable, "-m", "maxtext_rocm.train", "configs/tiny_llama.py", *TINY,
            "--config.data.source=files", f"--config.data.paths={corpus}", "--config.data.tokenizer=byte",
            *VOCAB,
            "--config.mesh.dcn.data=2", "--config.mesh.ici.fsdp=2",
            f"--config.train.steps={steps}", f"--config.output_dir={run_dir}",
            f"--config.checkpoint.every={SAVE_EVERY}", f"--config.train.compilation_cache={cache}",
            "--config.distributed.init_timeout_s=60", "--config.distributed.heartbeat_timeout_s=20", *extra]
    processes = []
    for i, log in enumerate(logs):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
                   PYTHONUNBUFFERED="1", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES=str(PROCESSES), JAX_PROCESS_ID=str(i),
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        with open(log, "w") as out:
            processes.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
    return processes


def wait_all(processes: list[subprocess.Popen], bound_s: float) -> list[int | None]:
    """Exit statuses, None for a process still running after `bound_s` (then killed)."""
    deadline = time.monotonic() + bound_s
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    statuses = [p.poll() for p in processes]
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
    return statuses


def stop_at_random(processes, run_dir: Path, moment: str, how: signal.Signals, victim: int,
                   rng: random.Random, start_up_s: float, step_s: float) -> tuple[str, float | None]:
    """Sends `how` to process `victim` at a moment of the kind asked for; (what happened, seconds
    from launch to this launch's first logged step when it waited for one)."""
    started, rows_before, first_row_s = time.perf_counter(), len(rows(run_dir)), None
    seen_at_launch = saves_begun(run_dir)
    alive = lambda: all(p.poll() is None for p in processes)  # noqa: E731
    if moment == "save":  # a save in flight, or (when a quick one began and ended between two looks) just done
        seen, committed = saves_begun(run_dir), committed_steps(run_dir)
        while alive() and not saves_begun(run_dir) - seen and committed_steps(run_dir) == committed:
            time.sleep(0.002)
    elif moment == "start-up":
        delay = rng.uniform(0.2, 0.95) * start_up_s
        while alive() and time.perf_counter() - started < delay:
            time.sleep(0.01)
    else:
        while alive() and len(rows(run_dir)) == rows_before:
            time.sleep(0.01)
        first_row_s = time.perf_counter() - started
        time.sleep(rng.uniform(0.0, 2 * SAVE_EVERY + 1) * step_s)
    if not alive():
        return f"NOT stopped: the launch ended first (exits {[p.poll() for p in processes]})", first_row_s
    in_save = bool(saves_begun(run_dir) - seen_at_launch)
    processes[victim].send_signal(how)
    landed = ("while a checkpoint was being written" if in_save else
              "during start-up" if len(rows(run_dir)) == rows_before else "between or inside steps")
    return f"{how.name} to process {victim} {landed}, {time.perf_counter() - started:.2f} s after launch", first_row_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=120, help="long enough that no stopped launch runs to the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--every", type=int, default=3, help="steps between persistent saves")
    parser.add_argument("--local-every", type=int, default=0, help="steps between local saves; 0: no local tier")
    args = parser.parse_args()
    global SAVE_EVERY
    SAVE_EVERY = args.every
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kill_trials_multihost_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cache, reference, run = workdir / "xla_cache", workdir / "reference", workdir / "stopped"
    corpus = write_corpus(workdir / "corpus.jsonl", args.seed)
    rng = random.Random(args.seed)
    local = workdir / "local"  # kill_trials.saves_begun looks for local writes in flight there
    tiers = ([f"--config.checkpoint.local_dir={local}", f"--config.checkpoint.local_every={args.local_every}",
              "--config.checkpoint.local_keep=2"] if args.local_every else [])

    started = time.perf_counter()
    logs = [workdir / f"reference_{i}.log" for i in range(PROCESSES)]
    reference_run = time_reference(launch(reference, args.steps, cache, corpus, logs), reference, args.steps, logs)
    if reference_run is None:
        return 1
    want, first_step_s, step_s = reference_run
    moments = trial_moments(args.trials, rng)
    exact, clean, seen_rows, start_up_s, kinds = 0, 0, 0, first_step_s, []
    for trial in range(args.trials + 1):
        logs = [workdir / f"launch_{trial}_process_{i}.log" for i in range(PROCESSES)]
        processes = launch(run, args.steps, cache, corpus, logs, tiers)
        if trial < args.trials:
            how, victim = rng.choice([signal.SIGKILL, signal.SIGTERM]), rng.randrange(PROCESSES)
            when, first_row_s = stop_at_random(processes, run, moments[trial], how, victim, rng, start_up_s, step_s)
            start_up_s = first_row_s or start_up_s
            if when.startswith("NOT"):
                wait_all(processes, 0)
                print(f"trial {trial + 1}: {when}; see {logs}")
                return 1
            statuses = wait_all(processes, EXIT_BOUND_S)
            text = [log.read_text(errors="replace") for log in logs]
            if how == signal.SIGTERM and "start-up" not in when:
                ended_well = statuses == [0, 0] and "checkpoint committed" in text[0]
            elif how == signal.SIGTERM:  # before the loop: one line, nothing to save; the peer follows
                ended_well = None not in statuses
            else:
                ended_well = None not in statuses and all(s != 0 for s in statuses)
            kinds.append(f"{how.name} {when.split(' ', 4)[4].split(',')[0]}")
            if tiers and how == signal.SIGKILL and rng.random() < 0.5:  # its node replaced: its local tier is gone
                for folder in local.glob(f"*/process-{victim}-of-{PROCESSES}"):
                    shutil.rmtree(folder)
                when += f"; process {victim}'s local tier removed"
        else:
            statuses = wait_all(processes, 600)
            when, ended_well = f"ran to the end (exits {statuses})", statuses == [0, 0]
        logged = rows(run)
        new, seen_rows = logged[seen_rows:], len(logged)
        matched = sum(1 for row in new if row is not None and row["loss"] == want.get(row["step"]))
        torn = sum(1 for row in new if row is None)
        ok = matched == len(new) - torn
        if trial > 0:  # this launch's rows check the resume that the previous trial's stop forced
            exact += ok
        clean += bool(ended_well) if trial < args.trials else 0
        text0 = logs[0].read_text(errors="replace")
        resumed = next((line for line in text0.splitlines() if line.startswith(("resuming from the ", "resumed from "))),
                       "started afresh" if "first step done" in text0 else "stopped before it had restored or started")
        print(f"launch {trial}: {resumed}, {matched}/{len(new) - torn} logged losses equal the reference's"
              f"{f' ({torn} line cut short)' if torn else ''}; "
              + (f"trial {trial + 1}: {when}; exits {statuses}{'' if ended_well else ' (NOT as expected)'}"
                 if trial < args.trials else when), flush=True)
        if trial == args.trials and not ended_well:
            print(f"the final launch failed; see {logs}")
            return 1

    exact = exact if same_final_checkpoints(run, reference, args.steps, final_state) else 0
    summary = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
    print(f"{exact} of {args.trials} trials resumed bit-exact, {clean} of {args.trials} ended as expected "
          f"({summary}); {time.perf_counter() - started:.0f} s in all; output in {workdir}")
    return 0 if exact == args.trials and clean == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
