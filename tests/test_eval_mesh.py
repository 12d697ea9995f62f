"""A saved run evaluated on the mesh it trained on (eval/placement.py): a run trained on fsdp x
tensor over the 8 fake devices, read back by `python -m maxtext_rocm.eval` / `MaxTextLM(run=...)`,
has its parameters in the shardings the Trainer gave them (a LoRA run's base and adapters apart,
the adapters applied inside the dots) and every per-request log-likelihood of the one-device
evaluation of the same checkpoint (1e-5, fp32), the greedy generations the same strings; a mesh
given with `--config.mesh.*` too. A mesh that cannot be is one sentence (exit status 2).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from conftest import small_config
from eval_tasks import TASKS, write_tasks

from maxtext_rocm.eval import cli

MESH = {"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2}
LAYOUTS = {
    "fsdp_x_tensor": MESH,
    "lora_fsdp_x_tensor": {**MESH, "lora.rank": 4, "lora.alpha": 8.0, "optimizer.lr": 3e-2},
}


def run_config(folder: Path, layout: dict):
    """A tiny Llama over bytes (ids < 259) that trains 2 steps, in fp32."""
    return small_config(**{"model.vocab_size": 320, "train.seq_len": 64, "train.steps": 2, "log.every": 1,
                           "optimizer.warmup_steps": 0, "output_dir": str(folder / "run"),
                           "checkpoint.async_save": False, **layout})


def specs(tree) -> dict[str, jax.sharding.PartitionSpec]:
    return {jax.tree_util.keystr(path): leaf.sharding.spec
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def train(cfg, devices) -> dict[str, dict]:
    """Trains `cfg` and gives the shardings its state held, by collection as the model applies them."""
    from maxtext_rocm.train import Trainer
    from maxtext_rocm.trainer.step import frozen_base

    trainer = Trainer(cfg, devices=devices, log=lambda *_: None)
    trainer.run()
    base = frozen_base(trainer.state)  # LoRA: the adapters train, the base is frozen
    held = ({"params": specs(base), "adapters": specs(trainer.state.params)} if base
            else {"params": specs(trainer.state.params)})
    trainer.close()
    return held


def one_device_model(run: Path, **args):
    """The same checkpoint's model on one device: read to the host (a LoRA run's base and adapters
    apart, applied by its policy), scored with no mesh."""
    from maxtext_rocm.api import run_config as recorded
    from maxtext_rocm.checkpoint import lora_run, restore_params_to_host
    from maxtext_rocm.eval.model import MaxTextLM
    from maxtext_rocm.finetune import lora, lora_base
    from maxtext_rocm.resolve import resolve_here
    from maxtext_rocm.trainer.launch import run_policy

    cfg = resolve_here(recorded(run))
    if lora_base.is_lora_run(cfg):
        parts = lora_run.load_run(run, cfg)
        variables, policy = lora.model_variables(parts.adapters, parts.base), run_policy(cfg, jax.devices()[0])
    else:
        variables, policy = {"params": restore_params_to_host(run, cfg)}, None
    assert {leaf.sharding.device_set.__len__() for leaf in jax.tree_util.tree_leaves(variables)
            if hasattr(leaf, "sharding")} <= {1}
    return MaxTextLM(run=str(run), params=variables, cfg=cfg, policy=policy, **args)


def evaluate(model, tasks: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=list(TASKS), task_manager=TaskManager(include_path=str(tasks)),
                                   log_samples=True, bootstrap_iters=0)


def responses(samples: list[dict]) -> list:
    return [sample["resps"] for sample in sorted(samples, key=lambda s: s["doc_id"])]


def written(value):
    """A response as lm-eval's samples file writes it (numbers and flags as strings), read back."""
    if isinstance(value, list):
        return [written(v) for v in value]
    return value == "True" if value in ("True", "False") else float(value)


def assert_same_answers(ours: list, reference: list, task: str) -> None:
    assert len(ours) == len(reference) == len(TASKS[task][1])
    for our_doc, their_doc in zip(ours, reference):
        for (one,), (other,) in zip(our_doc, their_doc):
            if task == "tiny_gen":
                assert one == other
            elif task == "tiny_choice":  # (log-likelihood, is_greedy)
                assert one[0] == pytest.approx(other[0], abs=1e-5) and one[1] == other[1]
            else:  # a document's sum of windows (~1,700 nats): 1e-5, or fp32's own resolution there
                assert one == pytest.approx(other, abs=1e-5, rel=1e-7)


@pytest.mark.slow  # a 2-step run on fsdp x tensor, its checkpoint evaluated three ways: 60 s each on 2 cores
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_run_evaluates_on_its_own_mesh_as_on_one_device(layout, tmp_path, devices, capsys):
    pytest.importorskip("lm_eval")
    from maxtext_rocm.eval.model import MaxTextLM

    tasks = write_tasks(tmp_path / "tasks")
    cfg = run_config(tmp_path, LAYOUTS[layout])
    held = train(cfg, devices)
    run = Path(cfg.output_dir)

    lm = MaxTextLM(run=str(run), batch_size=4)
    assert {a: n for a, n in lm.mesh.shape.items() if n > 1} == {"fsdp": 4, "tensor": 2}
    assert {name: specs(tree) for name, tree in lm.params.items()} == held  # the run's own shardings
    assert any(spec != jax.sharding.PartitionSpec() for spec in held["params"].values())
    assert lm.batch_size == 4  # split over fsdp's 4 batch shards
    ours = evaluate(lm, tasks)
    reference = evaluate(one_device_model(run, batch_size=4), tasks)
    for task in TASKS:
        assert_same_answers(responses(ours["samples"][task]), responses(reference["samples"][task]), task)
    assert "note:" not in capsys.readouterr().err  # nothing to say: the run's mesh fits

    # The command, on a mesh given: all fsdp, the rows split 8 ways (its batch 4 rounded up to 8).
    out = tmp_path / "results"
    assert cli.main([str(run), "--tasks", "tiny_choice,tiny_text", "--include_path", str(tasks), "--output_path",
                     str(out), "--log_samples", "--batch_size", "4", "--config.mesh.ici.fsdp=8",
                     "--config.mesh.ici.tensor", "1"]) == 0
    for task in ("tiny_choice", "tiny_text"):
        (samples,) = (out / "run").glob(f"samples_{task}_*.jsonl")
        given = [json.loads(line) for line in samples.read_text().splitlines()]
        assert_same_answers(written(responses(given)), responses(reference["samples"][task]), task)


@pytest.fixture
def recorded_run(tmp_path) -> Path:
    """A run directory as far as a mesh's checks read it: its config.json (fsdp x tensor, 8 devices)."""
    cfg = run_config(tmp_path, MESH)
    run = Path(cfg.output_dir)
    run.mkdir()
    environment = {"device_count": 8, "process_count": 1, "mesh": {"fsdp": 4, "tensor": 2}}
    (run / "config.json").write_text(json.dumps({"config": cfg.to_dict(), "environment": environment}))
    return run


@pytest.mark.parametrize("flags, said", [
    (["--config.mesh.ici.fsdp=3"], "mesh.ici sizes (fsdp=3, tensor=2) multiply to 6 but there are 8 devices per host"),
    (["--config.mesh.ici.fsdp=2", "--config.mesh.ici.tensor=4"],
     "model.n_kv_heads=2 does not divide over the 4 devices of mesh tensor"),
    (["--config.mesh.ici.fsdpp=8"], "unknown config key 'mesh.ici.fsdpp'"),
    (["--config.train.seq_len=128"], "--config.train.seq_len: an evaluation takes only mesh.* keys"),
    (["--config.mesh.ici.fsdp"], "override '--config.mesh.ici.fsdp' has no value"),
    (["--model_args", "mesh.ici.tensor=3"], "mesh.ici sizes (fsdp=4, tensor=3) multiply to 12"),
])
def test_a_mesh_that_cannot_be_is_one_sentence(recorded_run, capsys, flags, said):
    pytest.importorskip("lm_eval")
    assert cli.main([str(recorded_run), "--tasks", "tiny_choice", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1, err


def test_mesh_model_arguments_do_not_move_parameters_given_whole(recorded_run):
    pytest.importorskip("lm_eval")
    from maxtext_rocm.eval.model import MaxTextLM
    from maxtext_rocm.errors import UserError

    with pytest.raises(UserError, match=r"model argument mesh\.ici\.fsdp places a run read from run=RUN"):
        MaxTextLM(params={"params": {}}, cfg=small_config(), **{"mesh.ici.fsdp": 8})


@pytest.mark.parametrize("environment, said", [
    ({"device_count": 4, "process_count": 1, "mesh": {"fsdp": 2, "tensor": 2}},
     "trained on fsdp=2 x tensor=2 over 4 devices (1 process) and this evaluation has 8 devices (1 process)"),
    (None, "records no mesh of its own (an import)"),
])
def test_a_run_whose_mesh_does_not_fit_says_so_in_one_line(recorded_run, environment, said):
    """Where the run's mesh is not these devices' (or it records none), its parameters are placed
    as load_params places them, and one line says so."""
    from maxtext_rocm.api import run_config as recorded
    from maxtext_rocm.eval.placement import own_mesh_config

    record = json.loads((recorded_run / "config.json").read_text())
    record.pop("environment")
    if environment:
        record["environment"] = environment
    (recorded_run / "config.json").write_text(json.dumps(record))
    on_mesh, note = own_mesh_config(recorded_run, recorded(recorded_run))
    assert on_mesh is None and said in note and "\n" not in note


@pytest.mark.slow  # lm-eval's own command line indexes its ~10,000 built-in task files first: ~10 s
def test_lm_evals_command_line_says_a_mesh_that_cannot_be_in_one_sentence(recorded_run, tmp_path, monkeypatch,
                                                                          capsys):
    pytest.importorskip("lm_eval")
    from maxtext_rocm.eval import lm_eval_cli

    tasks = write_tasks(tmp_path / "tasks")
    monkeypatch.setattr("sys.argv", ["lm_eval", "--model", "maxtext_rocm", "--model_args",
                                     f"run={recorded_run},mesh.ici.fsdp=3", "--tasks", "tiny_choice",
                                     "--include_path", str(tasks)])
    assert lm_eval_cli.main() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: mesh.ici sizes (fsdp=3, tensor=2) multiply to 6 but there are 8 devices")
