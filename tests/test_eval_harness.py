"""maxtext_rocm.eval against lm-evaluation-harness's own `hf` backend on the same tiny model: a
Llama made by transformers, imported with `convert from-hf`, scored by both on local tasks (YAML +
JSON Lines written here, nothing downloaded) of each request type. Every per-request
log-likelihood agrees to 1e-4 in fp32, the metrics agree, greedy generations are the same strings.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from chat_helpers import make_chat_tokenizer  # noqa: E402
from eval_tasks import STOP, TASKS, write_tasks  # noqa: E402

from maxtext_rocm.convert.__main__ import main as convert_main  # noqa: E402
from maxtext_rocm.eval import cli  # noqa: E402

WINDOW = 64  # both backends' max_length: the rolling task's documents need several windows


def make_llama(folder: Path) -> Path:
    """A tiny Llama with a BPE tokenizer; weights drawn wide (std 0.15) so that logits differ by
    far more than float noise and greedy choices are not near-ties."""
    make_chat_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=[1, 4])
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.15)
    model.eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    make_llama(root / "hf")
    assert convert_main(["from-hf", str(root / "hf"), str(root / "export")]) == 0
    write_tasks(root / "tasks")
    return root


def evaluate(model: str, model_args: dict, root: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import maxtext_rocm.eval.model  # noqa: F401  registers "maxtext_rocm"

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), batch_size=4,
                                   task_manager=TaskManager(include_path=str(root / "tasks")), log_samples=True)


@pytest.fixture(scope="module")
def both(workspace):
    ours = evaluate("maxtext_rocm", {"run": str(workspace / "export"), "precision": "fp32", "max_length": WINDOW},
                    workspace)
    theirs = evaluate("hf", {"pretrained": str(workspace / "hf"), "dtype": "float32", "max_length": WINDOW,
                             "device": "cpu"}, workspace)
    return ours, theirs


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def assert_loglikelihoods_match(ours: dict, theirs: dict, task: str) -> None:
    ours, theirs = responses(ours, task), responses(theirs, task)
    assert len(ours) == len(theirs) == len(TASKS[task][1])
    for our_doc, their_doc in zip(ours, theirs):
        assert len(our_doc) == len(their_doc)
        for (ours_one,), (theirs_one,) in zip(our_doc, their_doc):
            if task == "tiny_choice":  # (log-likelihood, is_greedy)
                assert ours_one[0] == pytest.approx(theirs_one[0], abs=1e-4) and ours_one[1] == theirs_one[1]
            else:
                assert ours_one == pytest.approx(theirs_one, abs=1e-4)


def assert_metrics_match(ours: dict, theirs: dict) -> None:
    for task in TASKS:
        our_metrics = {k: v for k, v in ours["results"][task].items() if "," in k and not isinstance(v, str)}
        their_metrics = {k: v for k, v in theirs["results"][task].items() if "," in k and not isinstance(v, str)}
        assert our_metrics.keys() == their_metrics.keys() and our_metrics
        for key, value in our_metrics.items():
            assert value == pytest.approx(their_metrics[key], rel=1e-5), (task, key)


@pytest.mark.parametrize("task", ["tiny_choice", "tiny_text"])
def test_every_loglikelihood_matches_hf(both, task):
    assert_loglikelihoods_match(*both, task)


def test_metrics_match_hf(both):
    assert_metrics_match(*both)


def test_greedy_generations_are_hf_strings(both, workspace):
    ours, theirs = both
    assert responses(ours, "tiny_gen") == responses(theirs, "tiny_gen")
    # The stop string was met: some unstopped greedy continuation holds it (so it cut that one).
    tokenizer = transformers.AutoTokenizer.from_pretrained(workspace / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(workspace / "hf", dtype=torch.float32)
    cut = 0
    for doc, ((ours_text,),) in zip(TASKS["tiny_gen"][1], responses(ours, "tiny_gen")):
        ids = tokenizer(doc["prompt"], return_tensors="pt").input_ids
        whole = tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:],
                                 skip_special_tokens=True)
        assert whole.split(STOP)[0] == ours_text
        cut += STOP in whole
    assert cut >= 1


def test_a_task_compiles_a_few_programs(workspace):
    """Requests of many lengths run in a few padded shapes (eval/scoring.py's buckets)."""
    from lm_eval.api.instance import Instance

    from maxtext_rocm.eval.model import MaxTextLM
    from maxtext_rocm.eval.scoring import bucket_lengths

    lm = MaxTextLM(run=str(workspace / "export"), precision="fp32", max_length=WINDOW, batch_size=4)
    requests = [Instance("loglikelihood", {}, ("the quick brown fox " * n, " jumps"), 0) for n in range(1, 13)]
    scores = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(scores) == 12 and lm.scorer.shapes_run <= {(4, b) for b in bucket_lengths(WINDOW)}
    assert len(lm.scorer.shapes_run) <= 3


def test_command_writes_lm_evals_results_file(workspace, tmp_path, capsys):
    out = tmp_path / "results"
    code = cli.main([str(workspace / "export"), "--tasks", "tiny_choice", "--include_path", str(workspace / "tasks"),
                     "--limit", "2", "--output_path", str(out), "--log_samples", "--model_args", "precision=fp32"])
    assert code == 0
    assert "tiny_choice" in capsys.readouterr().out  # lm-eval's results table
    (results,) = (out / "export").glob("results_*.json")
    record = json.loads(results.read_text())
    assert record["results"]["tiny_choice"]["sample_len"] == 2 and "configs" in record and "versions" in record
    (samples,) = (out / "export").glob("samples_tiny_choice_*.jsonl")
    assert len(samples.read_text().splitlines()) == 2


@pytest.mark.parametrize("argv, said", [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    (["--tasks", "tiny_choice", "--include_path", "EMPTY"], "holds no task YAML file"),
])
def test_bad_input_is_one_sentence(workspace, tmp_path, capsys, argv, said):
    (tmp_path / "empty").mkdir()
    argv = [str(tmp_path / "empty") if a == "EMPTY" else a for a in argv]
    if "--include_path" not in argv:
        argv += ["--include_path", str(workspace / "tasks")]
    assert cli.main([str(workspace / "export"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1


def test_without_lm_eval_the_command_names_the_extra(monkeypatch, capsys, tmp_path):
    from maxtext_rocm.eval import lm_eval_cli

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    for command in (lambda: cli.main([str(tmp_path), "--tasks", "hellaswag"]), lm_eval_cli.main):
        assert command() == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "pip install -e '.[eval]'" in err


# A run's live model, as the in-training harness evaluates it (eval/in_training.py), against the
# `hf` backend on the run's `to-hf` export: a full fine-tune on fsdp x tensor, and a LoRA run, whose
# adapters apply inside the dots here and are merged into the export's weights there.
RUNS = {
    "fsdp_x_tensor": {"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2},
    "lora": {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": ("q", "v", "o", "up", "down")},
}


@pytest.mark.slow  # a 2-step run, its to-hf export and both backends on the three tasks: ~40 s each
@pytest.mark.parametrize("layout", list(RUNS))
def test_a_training_runs_live_model_scores_as_hf_on_its_export(layout, workspace, both, tmp_path, devices):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from maxtext_rocm import config as config_lib
    from maxtext_rocm.eval.model import MaxTextLM
    from maxtext_rocm.trainer.hooks import live_model
    from maxtext_rocm.train import Trainer

    cfg = config_lib.load(str(workspace / "export" / "preset.py"), overrides={
        "precision.policy": "fp32", "data.source": "synthetic", "data.format": "text", "train.seq_len": WINDOW,
        "train.per_device_batch_size": 1, "train.steps": 2, "optimizer.lr": 1e-2, "optimizer.warmup_steps": 0,
        "log.tensorboard": False, "checkpoint.async_save": False, "output_dir": str(tmp_path / "run"),
        **RUNS[layout]})
    trainer = Trainer(cfg, devices=devices, log=lambda *_: None)
    trainer.run()
    live = live_model(trainer)
    if layout == "lora":
        assert set(live.variables) == {"params", "adapters"}  # applied inside the dots, not merged
    else:
        assert {a: n for a, n in live.mesh.shape.items() if n > 1} == {"fsdp": 4, "tensor": 2}
    with live.rules():
        ours = lm_eval.simple_evaluate(
            model=MaxTextLM(params=live.variables, cfg=live.cfg, policy=live.policy, mesh=live.mesh, batch_size=4),
            tasks=list(TASKS), task_manager=TaskManager(include_path=str(workspace / "tasks")), log_samples=True)
    trainer.close()

    assert convert_main(["to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0  # a LoRA run's merged
    theirs = evaluate("hf", {"pretrained": str(tmp_path / "hf"), "tokenizer": str(workspace / "hf"),
                             "dtype": "float32", "max_length": WINDOW, "device": "cpu"}, workspace)
    for task in ("tiny_choice", "tiny_text"):
        assert_loglikelihoods_match(ours, theirs, task)
    assert_metrics_match(ours, theirs)
    assert responses(ours, "tiny_gen") == responses(theirs, "tiny_gen")
    flat = [doc[0][0] for doc in responses(theirs, "tiny_text")]
    original = [doc[0][0] for doc in responses(both[1], "tiny_text")]
    assert min(abs(a - b) for a, b in zip(flat, original)) > 1e-2, "training moved the model"
