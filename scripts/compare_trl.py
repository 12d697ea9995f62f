#!/usr/bin/env python
"""maxtext_rocm against Hugging Face TRL (SFTTrainer, DPOTrainer) on the same fine-tuning work on
this machine, run in alternation so both see the same load (issue #51's setup).

    python scripts/compare_trl.py --trl-python /path/to/venv/bin/python [--rounds 3] [--dtype fp32|bf16]
                                  [--modes sft_packed,sft_unpacked,dpo_lora,dpo_full] [--out runs/compare_trl]
    python scripts/compare_trl.py --quick [--trl-python ...]      # tiny sizes, a few steps: about a minute

TRL is never a dependency of this package: it runs in its own virtual environment (`--trl-python`,
e.g. one made by `python3 -m venv V && V/bin/pip install trl peft transformers datasets accelerate
torch`), through scripts/compare_trl_worker.py. Without `--trl-python` only this trainer's side runs.

The work: one Llama of 40M parameters (8 layers x 512, 8 heads / 4 kv heads, mlp 2048, vocab 8192,
untied head) made by transformers from a seed and read here through `convert from-hf`; 3,000
seeded multi-turn chats of 34 to 512 tokens (median about 221), trained on the assistant's tokens;
2,000 seeded preference pairs (median about 177 tokens). Both trainers read the records in this
trainer's order (its first epoch's permutation), so with one conversation per row they train on
the same batches; the same AdamW (betas 0.9 / 0.95, eps 1e-8, weight decay 0.1 off the norms,
clipping at 1.0), the same warmup + cosine schedule to 0.1 x lr, full recomputation in the
backward pass (TRL's default gradient_checkpointing, our model.remat=full), fp32 by default.

| mode | this trainer | TRL |
|---|---|---|
| sft_packed | data.packing=best_fit, 4 rows of 512 a step | SFTTrainer packing=True (best-fit decreasing, padding-free), batch 4 |
| sft_unpacked | data.packing=none, 4 rows of 512 a step | SFTTrainer packing=False, batch 4 (padded to the batch's longest) |
| dpo_lora | train.objective=dpo, lora.rank=16 (alpha 16, all seven projections), 2 pairs a step | DPOTrainer with PEFT LoRA r=16, the same targets, batch 2 |
| dpo_full | train.objective=dpo, every parameter, 2 pairs a step | DPOTrainer, reference model copied, batch 2 |

Per mode and round: real tokens/s (positions holding a token, padding left out, a sequence of n
tokens counting n - 1, its next-token pairs, on both sides; over the steps after --warmup),
and peak resident memory of each process (its maxrss, from wait4). The table gives the median over
rounds with the range, the ratios taken per round; then each side's first steps' losses. Writes
OUT/compare_trl.json and OUT/compare_trl.md (rewritten after every run, so a long comparison's
finished runs survive an interruption) and each run's console output under OUT/logs/. The model
and data are made once, in OUT/prep/ (OUT/prep_quick/ for --quick), and reused.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "scripts" / "compare_trl_worker.py"
MODES = {
    "sft_packed": ("SFT packed (ours best_fit, TRL packing=True)",
                   ["--config.data.format=chat", "--config.data.packing=best_fit"]),
    "sft_unpacked": ("SFT one conversation per row (ours packing=none, TRL packing=False)",
                     ["--config.data.format=chat", "--config.data.packing=none"]),
    "dpo_lora": ("DPO with LoRA r=16 on all seven projections",
                 ["--config.data.format=preference", "--config.train.objective=dpo", "--config.lora.rank=16",
                  "--config.lora.alpha=16"]),
    "dpo_full": ("DPO, every parameter", ["--config.data.format=preference", "--config.train.objective=dpo"]),
}


class Refusal(Exception):
    """Bad input: one sentence for the user, exit 2."""


def child_env() -> dict:
    """This environment for the trainers' processes, less a forced host device count (one CPU
    device, as a user's run has)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def run(cmd: list, log: Path | None = None) -> tuple[int, str, float]:
    """(exit status, combined output, peak RSS in MiB: the child's own maxrss, from wait4)."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env=child_env())
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if log is not None:
        log.write_text(output)
    return proc.returncode, output, usage.ru_maxrss / 1024


def last_line(output: str, rc: int) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else f"exit {rc}"


def prepare(prep: Path, quick: bool, seed: int, python: str) -> dict:
    """The model, tokenizer and data (made once per folder), and this trainer's export of the model."""
    done = prep / "prepare.json"
    if done.exists():
        summary = json.loads(done.read_text())
        if summary["size"] == ("quick" if quick else "full") and summary["seed"] == seed and (prep / "ours").exists():
            return summary
    prep.mkdir(parents=True, exist_ok=True)
    rc, output, _ = run([python, WORKER, "prepare", prep, "--seed", seed, *(["--quick"] if quick else [])])
    if rc:
        raise Refusal(f"making the model and data with {python} failed ({last_line(output, rc)}); it needs torch, "
                      "transformers and tokenizers: give a Python that has them with --trl-python")
    rc, output, _ = run([sys.executable, "-m", "maxtext_rocm.convert", "from-hf", prep / "hf", prep / "ours"])
    if rc:
        raise Refusal(f"convert from-hf failed on {prep / 'hf'}: {last_line(output, rc)}")
    return json.loads(done.read_text())


def our_order(count: int, seed: int) -> list[int]:
    """The records in the order this trainer reads them in its first epoch."""
    from maxtext_rocm.data.packing import DocumentStream

    return [int(i) for i in DocumentStream(range(count), seed, 0, 1).order(0)]


def speed(steps: list[dict], warmup: int) -> float | None:
    """Real tokens per second over the steps after `warmup`."""
    timed = [s for s in steps if s["step"] > warmup and s.get("time_s")]
    return sum(s["tokens"] for s in timed) / sum(s["time_s"] for s in timed) if timed else None


def run_ours(mode: str, prep: Path, summary: dict, args, work: Path) -> dict:
    data = prep / ("chats.jsonl" if mode.startswith("sft") else "pairs.jsonl")
    sft = mode.startswith("sft")
    out = work / f"ours_{mode}"
    cmd = [sys.executable, "-m", "maxtext_rocm.train", prep / "ours" / "preset.py", f"--config.data.paths={data}",
           *MODES[mode][1], f"--config.train.seq_len={summary['seq_len']}",
           f"--config.train.per_device_batch_size=4", f"--config.train.steps={args.steps}",
           f"--config.optimizer.lr={args.lr if sft else args.dpo_lr}",
           f"--config.optimizer.warmup_steps={args.warmup_steps}", "--config.optimizer.schedule=cosine",
           "--config.optimizer.min_lr_ratio=0.1", "--config.optimizer.b1=0.9", "--config.optimizer.b2=0.95",
           "--config.optimizer.eps=1e-8", "--config.optimizer.weight_decay=0.1", "--config.optimizer.clip_norm=1.0",
           f"--config.precision.policy={args.dtype}", "--config.model.remat=full", "--config.log.every=1",
           "--config.log.tensorboard=false", "--config.checkpoint.enabled=false",
           "--config.train.compilation_cache=off", f"--config.data.seed={args.seed}", f"--config.train.seed={args.seed}",
           f"--config.output_dir={out}"]
    start = time.time()
    rc, output, rss = run(cmd, work / f"ours_{mode}.log")
    metrics = out / "metrics.jsonl"
    if rc or not metrics.exists():
        return {"error": last_line(output, rc)}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [{"step": r["step"], "loss": r["loss"], "time_s": r.get("step_time_s"),
              "tokens": (r.get("real_tokens_per_s_per_device") or 0) * (r.get("step_time_s") or 0)}
             for r in rows if "loss" in r and "eval_loss" not in r]
    return {"tokens_per_s": speed(steps, args.warmup), "peak_rss_mib": rss, "wall_s": time.time() - start,
            "losses": [s["loss"] for s in steps]}


def run_trl(mode: str, prep: Path, summary: dict, args, work: Path) -> dict:
    result = work / f"trl_{mode}.json"
    cmd = [args.trl_python, WORKER, "train", prep, mode, "--order", prep / f"order_{mode[:3]}.json",
           "--result", result, "--workdir", work / f"trl_{mode}", "--steps", args.steps, "--seq-len",
           summary["seq_len"], "--warmup-steps", args.warmup_steps, "--lr", args.lr if mode.startswith("sft")
           else args.dpo_lr, "--dtype", args.dtype, "--seed", args.seed]
    start = time.time()
    rc, output, rss = run(cmd, work / f"trl_{mode}.log")
    if rc or not result.exists():
        return {"error": last_line(output, rc)}
    steps = json.loads(result.read_text())["steps"]
    return {"tokens_per_s": speed(steps, args.warmup), "peak_rss_mib": rss, "wall_s": time.time() - start,
            "losses": [s.get("loss") for s in steps]}


def spread(values: list[float], fmt: str) -> str:
    """The median, and the range where the rounds differ."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    median = fmt.format(statistics.median(values))
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return median if lo == hi else f"{median} ({lo}-{hi})"


def table(results: dict, args, summary: dict, trl: bool) -> str:
    lines = [f"{summary['parameters'] / 1e6:.1f}M-parameter Llama, {args.dtype}, runs of {args.steps} steps timed "
             f"after step {args.warmup}, up to {args.rounds} rounds; median (range) over rounds, ratios per round.", "",
             "| mode | rounds | ours real tokens/s | TRL real tokens/s | ours / TRL | ours peak RSS MiB | TRL peak RSS MiB "
             "| ours / TRL |", "|---|---|---|---|---|---|---|---|"]
    for mode, rounds in results.items():
        ours = [r["ours"] for r in rounds]
        theirs = [r.get("trl", {"error": "not run (no --trl-python)"}) for r in rounds]
        cells = []
        for key, fmt in (("tokens_per_s", "{:,.0f}"), ("peak_rss_mib", "{:,.0f}")):
            both = [(o, t) for o, t in zip(ours, theirs) if "error" not in o and "error" not in t]
            cells.append((spread([o.get(key) for o in ours if "error" not in o], fmt),
                          spread([t.get(key) for t in theirs if "error" not in t], fmt),
                          spread([o[key] / t[key] for o, t in both if o.get(key) and t.get(key)], "{:.2f}x")))
        (speed_o, speed_t, speed_r), (rss_o, rss_t, rss_r) = cells
        failed = [f"ours: {o['error']}" for o in ours[:1] if "error" in o] + \
                 [f"TRL: {t['error']}" for t in theirs[:1] if "error" in t and trl]
        lines.append(f"| {MODES[mode][0]} | {len(rounds)} | {speed_o} | {speed_t} | **{speed_r}** | {rss_o} | {rss_t} | {rss_r} |"
                     + (f" {'; '.join(failed)}" if failed else ""))
    lines += ["", f"First steps' losses (round 1; the first update's learning rate is 0 under warmup, so "
              "step 2 repeats step 1's model):", "",
              "| mode | " + " | ".join(f"step {i + 1} ours / TRL" for i in range(args.loss_steps))
              + " | max abs difference, all steps |", "|---" * (args.loss_steps + 2) + "|"]
    for mode, rounds in results.items():
        ours, theirs = rounds[0]["ours"].get("losses") or [], (rounds[0].get("trl") or {}).get("losses") or []
        pairs = [(o, t) for o, t in zip(ours, theirs) if o is not None and t is not None]
        cells = [f"{ours[i]:.4f} / {theirs[i]:.4f}" if i < len(ours) and i < len(theirs) and theirs[i] is not None
                 else (f"{ours[i]:.4f} / -" if i < len(ours) else "-") for i in range(args.loss_steps)]
        worst = f"{max(abs(o - t) for o, t in pairs):.4f}" if pairs else "n/a"
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {worst} |")
    return "\n".join(lines) + "\n"


def write(out: Path, args, summary: dict, results: dict) -> str:
    """OUT/compare_trl.json and OUT/compare_trl.md from the rounds so far; returns the table."""
    done = {mode: rounds for mode, rounds in results.items() if rounds}
    text = table(done, args, summary, bool(args.trl_python))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_trl.json").write_text(json.dumps({"args": vars(args), "prepared": summary, "results": results},
                                                     indent=1))
    (out / "compare_trl.md").write_text(text)
    return text


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", help="the Python of a virtual environment with trl, peft, transformers, "
                        "datasets, accelerate and torch; without it only this trainer runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    parser.add_argument("--warmup-steps", type=int, default=2, help="the schedule's warmup steps")
    parser.add_argument("--lr", type=float, default=3e-4, help="SFT's peak learning rate")
    parser.add_argument("--dpo-lr", type=float, default=1e-5, help="DPO's peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss-steps", type=int, default=5, help="first steps whose losses the table shows")
    parser.add_argument("--out", default="runs/compare_trl")
    parser.add_argument("--quick", action="store_true", help="tiny model and data, 4 steps, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.loss_steps = 4, 1, 1, 4
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise Refusal(f"--modes names {', '.join(unknown) or 'nothing'}; give some of {', '.join(MODES)}")
    args.modes = modes
    if args.trl_python and not os.access(args.trl_python, os.X_OK):
        raise Refusal(f"--trl-python {args.trl_python} is not an executable file; give the python of a virtual "
                      "environment with trl installed (e.g. /path/to/venv/bin/python)")
    if args.steps <= args.warmup:
        raise Refusal(f"--steps {args.steps} leaves no step after --warmup {args.warmup} to time; give more steps")
    if args.rounds < 1 or args.loss_steps < 1:
        raise Refusal("--rounds and --loss-steps must be at least 1")
    return args


def main(argv=None) -> int:
    try:
        args = parse(argv)
        out = (REPO / args.out) if not os.path.isabs(args.out) else Path(args.out)
        prep = out / ("prep_quick" if args.quick else "prep") / f"seed{args.seed}"
        summary = prepare(prep, args.quick, args.seed, args.trl_python or sys.executable)
    except Refusal as refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    print(f"prepared {prep}: {summary['parameters'] / 1e6:.1f}M parameters; chats {summary['chat_tokens']}; "
          f"pairs {summary['pair_tokens']['chosen']}", flush=True)
    for kind, file in (("sft", "chats.jsonl"), ("dpo", "pairs.jsonl")):
        count = sum(1 for line in (prep / file).read_text().splitlines() if line.strip())
        (prep / f"order_{kind}.json").write_text(json.dumps(our_order(count, args.seed)))

    shutil.rmtree(out / "logs", ignore_errors=True)
    results: dict[str, list] = {mode: [] for mode in args.modes}
    for i in range(args.rounds):
        for mode in args.modes:
            work = out / "logs" / f"round{i + 1}"  # each run's console output and metrics, kept
            work.mkdir(parents=True, exist_ok=True)
            sides = [("ours", run_ours)] + ([("trl", run_trl)] if args.trl_python else [])
            if i % 2:  # alternate which side goes first
                sides.reverse()
            result = {side: fn(mode, prep, summary, args, work) for side, fn in sides}
            results[mode].append(result)
            shown = {side: {k: v for k, v in r.items() if k != "losses"} for side, r in result.items()}
            print(f"round {i + 1} {mode}: {json.dumps(shown)}", flush=True)
            text = write(out, args, summary, results)  # after every run: a long comparison's finished runs survive
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
