"""Every command that README.md and docs/*.md show in a ```bash block, checked against the code,
so the documentation cannot drift from it. Commands are discovered, not listed: a page or a
command added later is checked the same way.

What "checked" means, per command (the whole set runs in seconds, so it is in CI's default run):
- the program is one this project ships or one of a few known tools (pip, tensorboard, ...); an
  unknown one fails until this file learns it;
- every repository path it names (configs/, scripts/, notebooks/) exists;
- its preset and every --config.GROUP.KEY=VALUE override load, and the result passes the same
  validation the trainer runs, on the device and process count its mesh names;
- a `python -m maxtext_rocm.X` command goes through X's own command-line parsing with the work
  itself replaced by a recorder; a script's argparse parser accepts its arguments;
- optional parts written `[--flag VALUE]` are checked both left out and put in (unless they hold
  a placeholder such as `KEY=VALUE ...` or `OUT`).
The slow test then runs every tiny-preset training command for real, with tiny overrides.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.trainer.preflight import check_run

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Tools that are not ours: their commands are shown for the reader to run and are not checked here.
EXTERNAL = {"pip", "tensorboard", "jupyter", "wandb", "pytest", ".", "source"}
PLACEHOLDER = re.compile(r"\.\.\.|\b[A-Z][A-Z_]+\b")  # `[--config.KEY=VALUE ...]`, `[--json OUT]`
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# Paths a reader supplies (their data, an earlier run): stood in for by files of the right kind.
USER_INPUT_KEYS = ("data.paths", "data.eval_paths", "checkpoint.load_params_from")
# A stand-in for the reader's data file holds one record of the command's data.format.
STAND_IN_RECORDS = {
    "text": {"text": "a document " * 50},
    "chat": {"messages": [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer"}]},
    "prompt_completion": {"prompt": "a question", "completion": "an answer"},
    "preference": {"prompt": "a question", "chosen": "a good answer", "rejected": "a bad one"},
    "prompt": {"prompt": "a question", "answer": "42"},
}


def bash_blocks(path: Path) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def command_lines(block: str) -> list[str]:
    lines = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            lines.extend(part.strip() for part in line.split("&&"))
    return lines


def forms(line: str) -> list[list[str]]:
    """The command without its optional `[...]` parts, and with every one that holds no placeholder."""
    optional = re.compile(r"(?<!\S)\[([^\[\]]*)\]")  # at a word's start: `'.[test]'` is no option
    bare = shlex.split(optional.sub("", line), comments=True)
    full = shlex.split(optional.sub(lambda m: "" if PLACEHOLDER.search(m.group(1)) else m.group(1), line),
                       comments=True)
    return [bare] if full == bare else [bare, full]


def all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in bash_blocks(page):
            for line in command_lines(block):
                for argv in forms(line):
                    found.append((f"{page.relative_to(REPO)}: {' '.join(argv)}", argv))
    return found


COMMANDS = all_commands()


# ----------------------------------------------------------------------------------------------
# Config checks shared by every command that names a preset or overrides


def _is_preset(token: str) -> bool:
    if token.startswith("-") or "=" in token:
        return False
    if token.split(":", 1)[0].endswith(".py") and (REPO / token.split(":", 1)[0]).is_file():
        return True
    try:
        config_lib._resolve_preset(token.split(":", 1)[0])
    except config_lib.UserError:
        return False
    return True


def _mesh_counts(cfg) -> tuple[int, int]:
    """(devices, processes) that the config's mesh names; -1 on ici fills 8 devices per process."""
    dcn = [cfg.mesh.dcn[a] for a in cfg.mesh.dcn]
    ici = [cfg.mesh.ici[a] for a in cfg.mesh.ici]
    processes = math.prod(s for s in dcn if s > 0)
    per_process = 8 if any(s < 0 for s in ici) else math.prod(ici)
    return per_process * processes, processes


def check_config(spec: str | None, overrides: list[str], tmp_path: Path, shape: tuple[int, int] | None = None):
    """The preset and overrides load, and pass validation on the mesh's devices and processes.
    A preset written by an earlier command (convert's OUT_DIR/preset.py) stands as tiny_llama."""
    if spec and (REPO / spec.split(":", 1)[0]).exists():  # a repository path, whatever the cwd
        spec = str(REPO / spec)
    cfg = config_lib.load_preset(spec if spec and _is_preset(spec) else "tiny_llama")
    if spec and not _is_preset(spec):
        cfg.data.source = "files"  # as the preset that from-hf writes
    config_lib.apply_cli_overrides(cfg, overrides)
    stand_in = tmp_path / "stand_in"
    stand_in.mkdir(exist_ok=True)
    (stand_in / "docs.jsonl").write_text(json.dumps(STAND_IN_RECORDS[cfg.data.format]) + "\n")
    for key in USER_INPUT_KEYS:
        group, name = key.split(".")
        value = cfg[group][name]
        if value and not all(Path(REPO, p).exists() for p in str(value).split(",")):
            cfg[group][name] = str(stand_in if key.startswith("checkpoint") else stand_in / "docs.jsonl")
    # GRPO's own reward functions (module:function) are the reader's files too: stand-ins of the names.
    for name in (cfg.grpo.rewards if cfg.train.objective == "grpo" else ()):
        if ":" in name:
            module, function = name.split(":")
            (stand_in / f"{module}.py").write_text(f"def {function}(record, completion):\n    return 0.0\n")
    devices, processes = shape or _mesh_counts(cfg)
    sys.path.insert(0, str(stand_in))
    try:
        check_run(cfg, devices, processes)
    finally:
        sys.path.remove(str(stand_in))
    return cfg


def check_repo_paths(argv: list[str]) -> None:
    for token in argv:
        path = token.split("=", 1)[-1].split(":", 1)[0]
        if path.startswith(("configs/", "scripts/", "notebooks/")):
            assert (REPO / path).exists(), f"{path} does not exist"


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    spec = next((a for a in args if _is_preset(a)), None)
    return spec, [a for a in args if a.startswith("--config.")]


# ----------------------------------------------------------------------------------------------
# Per-program checks


def run_main_with_recorder(monkeypatch, module: str, args: list[str], tmp_path: Path, shape=None) -> int | None:
    """X's own main() on `args`, with what it would do (train, compile, convert, export) replaced
    by a recorder, so only its argument handling and config loading run (config loading as in
    check_config, with stand-ins for the reader's own files). None: X has no recorder here."""
    monkeypatch.setattr(config_lib, "load", lambda spec, overrides=(): check_config(spec, list(overrides), tmp_path, shape))
    monkeypatch.chdir(tmp_path)  # what a main still writes (compile's --json) lands there
    done = []
    if module == "train":
        from maxtext_rocm.runtime import distributed
        from maxtext_rocm import train

        class Recorder:
            def __init__(self, cfg, **_):  # hooks=: the harness, built before it
                done.append(cfg)
                raise SystemExit(0)

        monkeypatch.setattr(train, "Trainer", Recorder)
        monkeypatch.setattr(train, "harness_hooks", lambda cfg: [])  # its task checks: test_eval_in_training
        real_help = train.config_help.help_text
        monkeypatch.setattr(train.config_help, "help_text", lambda topics: done.append(topics) or real_help(topics))
        monkeypatch.setattr(distributed, "initialize", lambda *_: None)
        main = train.main
    elif module == "compile":
        from types import SimpleNamespace

        from maxtext_rocm.planner import report as compile_lib

        monkeypatch.setattr(compile_lib, "force_host_devices", lambda n, **_: done.append(n))
        fitting = SimpleNamespace(fits=True, comm=None, search=None, to_json=dict)  # a FitReport's reads
        monkeypatch.setattr(compile_lib, "analyse", lambda cfg, *a, **_: done.append(cfg) or fitting)
        monkeypatch.setattr(compile_lib, "search", lambda *a, **_: {})
        monkeypatch.setattr(compile_lib, "format_report", lambda report: "")
        empty_plan = compile_lib.plan_lib.Plan(config="", target="", enumerated=0, fitting=0, ranked=[])
        monkeypatch.setattr(compile_lib.plan_lib, "make_plan", lambda cfg, *a, **_: done.append(cfg) or empty_plan)
        main = compile_lib.main
    elif module == "convert":
        import maxtext_rocm.convert as convert
        from maxtext_rocm.convert.__main__ import main

        def from_hf(source, out, overrides):
            config_lib.apply_cli_overrides(config_lib.defaults(), list(overrides))
            done.append(source)
            return out

        monkeypatch.setattr(convert, "hf_to_export", from_hf)
        monkeypatch.setattr(convert, "import_note", lambda source: None)  # of the import just replaced
        monkeypatch.setattr(convert, "export_note", lambda source, dtype=None: None)  # of the export just replaced
        monkeypatch.setattr(convert, "checkpoint_to_hf", lambda source, out, **options: done.append(options) or out)
    elif module == "checkpoint":
        from maxtext_rocm.checkpoint import cli

        monkeypatch.setattr(cli, "export_params", lambda run, out, step: done.append(step) or out)
        monkeypatch.setattr(cli, "verify_params", lambda path: done.append(path) or "")
        main = cli.main
    else:
        return None  # argparse dry run instead
    try:
        status = main(list(args))
    except SystemExit as exit:
        status = exit.code
    assert done, f"maxtext_rocm.{module} returned {status} before doing anything"
    return status


ARGPARSE_DRY_RUN = textwrap.dedent("""
    import argparse, json, os, runpy, sys
    class Parsed(BaseException):
        pass
    original = argparse.ArgumentParser.parse_known_args
    def parse_known_args(self, *a, **k):
        _, rest = original(self, *a, **k)
        # What a script leaves unparsed must be the project's --config.KEY=VALUE overrides.
        stray = [arg for arg in rest if not arg.startswith("--config.")]
        if stray:
            self.error("unrecognized arguments: " + " ".join(stray))
        raise Parsed
    def parse_args(self, *a, **k):
        _, rest = original(self, *a, **k)
        if rest:
            self.error("unrecognized arguments: " + " ".join(rest))
        raise Parsed
    argparse.ArgumentParser.parse_known_args = parse_known_args
    argparse.ArgumentParser.parse_args = parse_args
    results = []
    for kind, target, args in json.loads(sys.argv[1]):
        sys.argv = [target, *args]
        path = list(sys.path)
        try:
            if kind == "module":
                runpy.run_module(target, run_name="__main__")
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python SCRIPT` does
                runpy.run_path(target, run_name="__main__")
            results.append("finished without parsing its arguments: give it a check in tests/test_docs.py")
        except Parsed:
            results.append(0)
        except SystemExit as exit:
            results.append(exit.code)
        except Exception as error:
            results.append(f"{type(error).__name__}: {error}")
        finally:
            sys.path[:] = path
    print(json.dumps(results))
""")


def argparse_dry_runs(jobs: list[tuple[str, str, list[str]]]) -> list:
    """Each (kind, target, args) through its own argparse parser, in one child process (a script's
    imports are paid once); parsing stops the script, so nothing else of it runs."""
    if not jobs:
        return []
    out = subprocess.run([sys.executable, "-c", ARGPARSE_DRY_RUN, json.dumps(jobs)], cwd=REPO,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def classify(argv: list[str]):
    """(kind, target, args): kind is "module", "script", "shell", "external"."""
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    program, args = argv[0], argv[1:]
    if program in ("python", "python3"):
        if args[:1] == ["-m"]:
            module = args[1]
            if module.startswith("maxtext_rocm."):
                return "module", module, args[2:]
            return "external", module, args[2:]  # python3 -m venv
        return "script", args[0], args[1:]
    if program == "mpirun":
        start = args.index("python")
        return classify(args[start:])
    if program == "sbatch":  # sbatch [options] scripts/slurm.sbatch CONFIG [overrides]: the job runs train
        start = next(i for i, a in enumerate(args) if a.endswith(".sbatch"))
        return "shell", args[start], args[start + 1:]
    if program == "bash":
        return "shell", args[0], args[1:]
    if program.endswith(".sh"):
        return "shell", program, args
    if program == "kubectl":
        return "shell", args[args.index("-f") + 1], []
    if program in EXTERNAL:
        return "external", program, args
    raise AssertionError(f"unknown program {program!r}: teach tests/test_docs.py how to check it")


def test_docs_show_commands():
    assert len(COMMANDS) >= 40, len(COMMANDS)  # the discovery works (README + docs held 70+ in 2026-12)
    modules = {classify(argv)[1] for _, argv in COMMANDS if classify(argv)[0] == "module"}
    assert {"maxtext_rocm.train", "maxtext_rocm.compile", "maxtext_rocm.convert", "maxtext_rocm.generate",
            "maxtext_rocm.checkpoint"} <= modules


def launch_shape(argv: list[str]) -> tuple[int, int] | None:
    """(devices, processes) a launcher starts: `sbatch --nodes=N` and `mpirun -np N` on nodes of
    8 GPUs, `scripts/launch_local.sh N` with its 8 fake CPU devices in all; None: the mesh decides."""
    text = " ".join(argv)
    if match := re.search(r"\bsbatch\b.*?(?:--nodes[= ]|-N ?)(\d+)", text):
        return 8 * int(match.group(1)), int(match.group(1))
    if match := re.search(r"\bmpirun\b.*?(?:-np|-n) (\d+)", text):
        return 8 * int(match.group(1)), int(match.group(1))
    if match := re.search(r"launch_local\.sh (\d+)", text):
        return 8, int(match.group(1))
    return None


# Programs whose argument parser is an optional extra's (lm-eval's own command line): without the
# extra they say in one sentence what to install (tests/test_eval_harness.py), and parse nothing.
OPTIONAL_PARSERS = {"maxtext_rocm.eval.lm_eval_cli": "lm_eval"}


def _lacks_its_optional_extra(module: str) -> bool:
    import importlib.util

    return module in OPTIONAL_PARSERS and importlib.util.find_spec(OPTIONAL_PARSERS[module]) is None


def check_command(argv: list[str], monkeypatch, tmp_path: Path):
    """Raises on what is wrong with one command; returns the argparse dry run it still needs, if any."""
    shape = launch_shape(argv)
    kind, target, args = classify(argv)
    check_repo_paths([target, *args])
    if kind == "external":
        return None
    spec, overrides = split_config_args(args)
    status, dry_run = None, None
    if kind == "module":
        with monkeypatch.context() as patch:
            status = run_main_with_recorder(patch, target.split(".", 1)[1], args, tmp_path, shape)
        assert status in (0, None), f"exit status {status}"
        if status is None and not _lacks_its_optional_extra(target):
            dry_run = ("module", target, args)
    elif kind == "script" and target.endswith(".py"):
        dry_run = ("script", target, args)
    else:
        assert (REPO / target).exists(), f"{target} does not exist"
    if status is None and (overrides or spec):
        check_config(spec, overrides, tmp_path, shape)
    return dry_run


def problems(commands, monkeypatch, tmp_path) -> list[str]:
    failures, dry_runs = [], []
    for where, argv in commands:
        try:
            job = check_command(argv, monkeypatch, tmp_path)
            if job:
                dry_runs.append((where, job))
        except (AssertionError, config_lib.UserError, ValueError) as error:
            failures.append(f"{where}\n    {type(error).__name__}: {error}")
    for (where, _), result in zip(dry_runs, argparse_dry_runs([job for _, job in dry_runs])):
        if result != 0:
            failures.append(f"{where}\n    its argument parser said: {result}")
    return failures


def test_every_documented_command_is_accepted(monkeypatch, tmp_path):
    failures = problems(COMMANDS, monkeypatch, tmp_path)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("line", [
    "python -m maxtext_rocm.train configs/tiny_llama.py --config.train.stpes=10",  # unknown key
    "python -m maxtext_rocm.train configs/tiny_llama.py:fp16",  # unknown variant
    "python -m maxtext_rocm.train configs/tiny_llama.py --config.mesh.ici.tensor=3",  # does not divide
    "python -m maxtext_rocm.compile llama3_8b --target=mi999x:8",  # unknown target
    "python -m maxtext_rocm.compile llama3_8b --target=mi355x:8 --serach",  # unknown flag
    "python -m maxtext_rocm.convert from-hf A B --config.model.d_modle=8",
    "python -m maxtext_rocm.convert to-hf A B --dtype=bfloat16 --shards 2",
    "python -m maxtext_rocm.checkpoint export A B --stpe 3",
    "python -m maxtext_rocm.generate runs/x --promt hello",
    "python scripts/benchmark.py configs/tiny_llama.py --stpes 30",
    "python scripts/benchmark.py configs/tiny_llama.py --config.model.remat=some",
    "python scripts/no_such_script.py",
    "scripts/launch_local.sh 2 configs/tiny_llama.py --config.mesh.dcn.data=3 --config.mesh.ici.fsdp=4",
    "sbatch scripts/slurm.sbatch configs/llama3_70b.py --config.mesh.ici.fsdp=9",
    "kubectl apply -f scripts/no-such.yaml",
    "torchrun train.py",  # a program the project does not know
])
def test_a_drifted_command_is_caught(line, monkeypatch, tmp_path):
    """Each of these is how a documented command goes stale; the check must name it."""
    commands = [(line, argv) for argv in forms(line)]
    try:
        failures = problems(commands, monkeypatch, tmp_path)
    except AssertionError as error:  # classify() refuses an unknown program outright
        failures = [str(error)]
    assert failures, line


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run runs exactly the command README.md's "Run the tests" gives."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    ci_lines = [l for l in (REPO / ".ci/run").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert command_lines(block) == [ci_lines[-1].strip()] == ["pytest"]
    assert len(readme.splitlines()) <= 200, "README.md stays short: put the detail in docs/"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_pages_resolves():
    failures = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                failures.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", linked.read_text(), flags=re.S | re.M),
                                      flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    failures.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not failures, "\n".join(failures)


def test_every_source_path_the_docs_name_exists():
    """`maxtext_rocm/trainer/step.py`, `maxtext_rocm/parallel/`: a page naming a file the package
    no longer has (a module moved or renamed) is caught here, not by a reader."""
    missing = [f"{page.relative_to(REPO)}: {path}" for page in PAGES
               for path in sorted(set(re.findall(r"maxtext_rocm/[\w/]+(?:\.py|/)", page.read_text())))
               if not (REPO / path).exists()]
    assert not missing, "\n".join(missing)


TINY = ["--config.train.steps=2", "--config.log.every=1", "--config.train.seq_len=64",
        "--config.train.per_device_batch_size=1", "--config.train.eval_steps=1"]


@pytest.mark.slow
def test_tiny_training_commands_run(tmp_path):
    """Every documented training command on a tiny preset, run for real (2 steps, short rows),
    each in its own output directory (W&B offline: CI has no network); those that read the
    reader's own files (data.paths, load_params_from) are left to the config check."""
    runs = []
    for where, argv in COMMANDS:
        kind, target, args = classify(argv)
        spec, overrides = split_config_args(args)
        if target == "maxtext_rocm.train" and spec and spec.startswith(("configs/tiny_", "tiny_")):
            if all(not o.startswith(tuple(f"--config.{k}=" for k in USER_INPUT_KEYS)) for o in overrides):
                runs.append((where, args))
    assert runs
    for i, (where, args) in enumerate(runs):
        out = subprocess.run([sys.executable, "-m", "maxtext_rocm.train", *args, *TINY,
                              f"--config.output_dir={tmp_path / str(i)}"], cwd=REPO, capture_output=True,
                             text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
        assert out.returncode == 0, f"{where}\n{out.stderr[-2000:]}"
