"""lm-evaluation-harness during training (`eval.harness_*`, eval/in_training.py): its scores land in
metrics.jsonl at the steps it is due, equal (to float noise) the scores of the same checkpoint
evaluated afterwards with `maxtext_rocm.eval`, and the training losses are those of the run without
it, bit for bit; on a fsdp x tensor mesh and for a LoRA run. What it refuses, it refuses before any
step, in one sentence. Tasks are tests/eval_tasks.py's local ones; the model is a tiny byte-level
Llama. The tests that run lm-eval are skipped without it (the `eval` extra); the refusals are not."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import small_config
from eval_tasks import write_tasks

from maxtext_rocm.config import UserError
from maxtext_rocm.eval.in_training import harness_hooks, scores
from maxtext_rocm.train import Trainer, main as train_main

TASKS = ("tiny_choice", "tiny_text", "tiny_gen")
LAYOUTS = {
    "fsdp_x_tensor": {"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2},
    "lora": {"lora.rank": 4, "lora.alpha": 8.0, "optimizer.lr": 3e-2, "optimizer.warmup_steps": 0},
}


def config(folder: Path, layout: dict, harness: bool, **more):
    """A tiny Llama over bytes (ids < 259) that trains 4 steps and logs each; with `harness`, the
    three local tasks (2 documents each) every 2 steps."""
    overrides = {"model.vocab_size": 320, "train.seq_len": 64, "log.every": 1, "output_dir": str(folder / "run"),
                 "checkpoint.async_save": False, **layout, **more}
    if harness:
        overrides.update({"eval.harness_tasks": TASKS, "eval.harness_every": 2, "eval.harness_limit": 2,
                          "eval.harness_include_path": str(folder.parent / "tasks")})
    return small_config(**overrides)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train(cfg, devices, hooks=()) -> list[dict]:
    trainer = Trainer(cfg, devices=devices, log=lambda *_: None, hooks=hooks)
    trainer.run()
    trainer.close()
    return rows(Path(cfg.output_dir))


@pytest.mark.slow  # two 4-step runs, three tasks' programs and a checkpoint's evaluation: ~40 s each
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_harness_scores_its_steps_and_leaves_training_as_it_was(layout, tmp_path, devices):
    lm_eval = pytest.importorskip("lm_eval")
    write_tasks(tmp_path / "tasks")
    plain = config(tmp_path / "plain", LAYOUTS[layout], harness=False)
    with_harness = config(tmp_path / "harness", LAYOUTS[layout], harness=True)
    without = train(plain, devices)
    logged = train(with_harness, devices, harness_hooks(with_harness))

    losses = [(r["step"], r["loss"], r["grad_norm"]) for r in without if "loss" in r]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in logged if "loss" in r] == losses  # bit for bit
    harness = {r["step"]: r for r in logged if "harness_s" in r}
    assert sorted(harness) == [2, 4]
    expected = {f"harness/{t}/{m}" for t, ms in (("tiny_choice", ("acc", "acc_norm")), ("tiny_gen", ("exact_match",)),
                                                ("tiny_text", ("word_perplexity", "byte_perplexity", "bits_per_byte")))
                for m in ms}
    assert set(harness[4]) == expected | {"step", "harness_s"}
    assert harness[2]["harness/tiny_text/bits_per_byte"] != harness[4]["harness/tiny_text/bits_per_byte"]

    # The checkpoint of step 4, read back and evaluated as `python -m maxtext_rocm.eval` does (a
    # LoRA run's merged model): the scores the live parameters had at step 4.
    import maxtext_rocm.eval.model  # noqa: F401  registers "maxtext_rocm"
    from lm_eval.tasks import TaskManager

    saved = lm_eval.simple_evaluate(
        model="maxtext_rocm", model_args={"run": with_harness.output_dir}, tasks=list(TASKS), limit=2,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")), bootstrap_iters=0)
    for name, value in scores(saved).items():
        assert harness[4][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.slow  # lm-eval indexes its ~10,000 built-in task files to know a name is none of them: ~7 s
def test_unknown_task_is_refused_before_any_step(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    write_tasks(tmp_path / "tasks")
    code = train_main(["configs/tiny_llama.py", f"--config.output_dir={tmp_path / 'run'}",
                       "--config.eval.harness_tasks=tiny_choice,no_such_task", "--config.eval.harness_every=5",
                       f"--config.eval.harness_include_path={tmp_path / 'tasks'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: unknown task 'no_such_task' in eval.harness_tasks")
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


@pytest.mark.parametrize("bad, said", [
    ("missing", "eval.harness_include_path {} is not a folder"),
    ("empty", "eval.harness_include_path {} holds no task YAML file"),
])
def test_a_bad_include_path_is_one_sentence(tmp_path, bad, said):
    pytest.importorskip("lm_eval")
    (tmp_path / "empty").mkdir()
    cfg = small_config(**{"eval.harness_tasks": ("tiny_choice",), "eval.harness_every": 1,
                          "eval.harness_include_path": str(tmp_path / bad)})
    with pytest.raises(UserError, match=said.format(tmp_path / bad).replace(".", r"\.")):
        harness_hooks(cfg)


def test_without_lm_eval_a_harness_config_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    code = train_main(["configs/tiny_llama.py", f"--config.output_dir={tmp_path / 'run'}",
                       "--config.eval.harness_tasks=hellaswag", "--config.eval.harness_every=5"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "eval.harness_tasks='hellaswag' needs lm-evaluation-harness" in err and "pip install -e '.[eval]'" in err


@pytest.mark.parametrize("overrides, said", [
    (["--config.eval.harness_tasks=tiny_choice"],
     "eval.harness_tasks='tiny_choice' with eval.harness_every=0: set both"),
    (["--config.eval.harness_every=10"], "eval.harness_tasks='' with eval.harness_every=10: set both"),
    (["--config.eval.harness_tasks=a", "--config.eval.harness_every=1", "--config.eval.harness_limit=2.5"],
     "eval.harness_limit=2.5 must be a whole number of documents"),
])
def test_the_harness_keys_are_checked_together(tmp_path, capsys, overrides, said):
    assert train_main(["configs/tiny_llama.py", f"--config.output_dir={tmp_path / 'run'}", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


def test_a_trainer_without_the_hook_refuses_the_key():
    """From Python, a config that asks for the harness needs the hook handed in; said, not skipped."""
    cfg = small_config(**{"eval.harness_tasks": ("tiny_choice",), "eval.harness_every": 1})
    with pytest.raises(UserError, match=r"needs the harness hook.*hooks=maxtext_rocm\.eval\.in_training"):
        Trainer(cfg)
