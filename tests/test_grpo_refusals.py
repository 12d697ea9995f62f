"""GRPO's bad input: one sentence naming what is wrong and what would be valid, exit status 2,
before any device work where the config or the files can tell (a reward that fails at a step stops
the run there, naming the function and the record)."""

import json
from pathlib import Path

import pytest

from maxtext_rocm.train import main

REPO = Path(__file__).resolve().parent.parent


def argv(tmp_path, *overrides, prompts=None):
    path = tmp_path / "prompts.jsonl"
    path.write_text(prompts or "".join(json.dumps({"prompt": f"Q{i}: ", "answer": "1"}) + "\n" for i in range(8)))
    return [str(REPO / "configs/tiny_llama.py"), "--config.train.objective=grpo", "--config.data.source=files",
            "--config.data.format=prompt", f"--config.data.paths={path}", "--config.train.seq_len=32",
            "--config.grpo.max_new_tokens=4", "--config.grpo.group_size=4", "--config.train.per_device_batch_size=4",
            "--config.mesh.ici.fsdp=1", "--config.mesh.ici.data=-1", "--config.train.steps=2",
            "--config.model.d_model=64", "--config.model.n_layers=1", "--config.model.mlp_dim=64",
            "--config.model.head_dim=16", "--config.checkpoint.enabled=false", "--config.log.tensorboard=false",
            f"--config.output_dir={tmp_path / 'run'}", *overrides]


def refused(capsys, args) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("overrides,says", [
    (["--config.grpo.rewards=no_such_module:reward"], "module 'no_such_module' cannot be imported"),
    (["--config.grpo.rewards=answer,rewards_here:missing"], "has no function 'missing'"),
    (["--config.grpo.rewards=answr"], "neither a built-in reward (answer, format, length) nor module:function"),
    (["--config.grpo.reward_weights=1,2"], "must be 1 finite numbers, one per reward"),
    (["--config.grpo.group_size=1"], "grpo.group_size"),
    (["--config.grpo.group_size=3"], "make it a multiple of 3"),
    (["--config.data.format=text"], "set both, or neither"),
    (["--config.train.eval_every=5", "--config.data.eval_paths=x.jsonl"], "train.eval_every=5 has no held-out loss"),
    (["--config.grpo.max_new_tokens=32"], "leaves no room for a prompt"),
    (["--config.grpo.format_pattern=(["], "is not a regular expression"),
    (["--config.data.epochs=2"], "data.epochs=2 does not apply to train.objective='grpo'"),
])
def test_bad_settings_are_one_sentence_before_any_device_work(tmp_path, capsys, monkeypatch, overrides, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards_here.py").write_text("def reward(record, completion):\n    return 1.0\n")
    assert says in refused(capsys, argv(tmp_path, *overrides))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_record_without_the_answer_the_built_in_reward_reads_is_named(tmp_path, capsys):
    prompts = json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n"
    err = refused(capsys, argv(tmp_path, "--config.grpo.rewards=answer", prompts=prompts))
    assert "prompts.jsonl line 2 has no 'answer' field, which the built-in reward 'answer' compares" in err


def test_a_prompt_that_leaves_no_room_for_its_completion_is_named(tmp_path, capsys):
    prompts = json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "x" * 40}) + "\n"
    err = refused(capsys, argv(tmp_path, prompts=prompts))
    assert "prompts.jsonl line 2: the prompt is 41 tokens, more than the 28 that train.seq_len" in err


@pytest.mark.parametrize("module,body,says", [
    ("raising", "    raise ValueError('no answer here')",
     "reward 'raising:reward' raised ValueError: no answer here on the prompt of"),
    ("not_finite", "    return float('nan')", "reward 'not_finite:reward' returned nan for the prompt of"),
])
def test_a_failing_reward_stops_the_run_naming_the_function_and_the_record(tmp_path, capsys, monkeypatch, module,
                                                                          body, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{module}.py").write_text(f"def reward(record, completion):\n{body}\n")
    err = refused(capsys, argv(tmp_path, f"--config.grpo.rewards={module}:reward"))
    assert says in err and "prompts.jsonl line" in err
