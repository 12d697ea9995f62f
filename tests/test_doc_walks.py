"""The docs are a test: each page that describes a workflow is walked top to bottom as its reader
walks it, in a fresh directory, every shell command run for real in the page's order with the
page's own arguments and relative paths (tests/doc_walk.py says what the directory holds).

What the test adds, and only this:
- the reader's own inputs, under the page's names: a tiny Llama saved by transformers with a chat
  tokenizer as `Meta-Llama-3.1-8B-Instruct/` (and `Meta-Llama-3.1-8B/`), a tiny Qwen3 with Qwen3's
  tokens and chat template as `Qwen3-8B/`, `chats.jsonl`, `corpus.jsonl`, `preferences.jsonl`;
- doc_walk.TINY_TRAINING appended to every training command (3 steps of 2 x 64 tokens; the page's
  arguments are kept, the appended ones come later and win), so a walk takes seconds per command;
- one CPU device, W&B offline.
Optional parts a page writes `[--flag VALUE]` are run with the command, unless they hold a
placeholder (`KEY=VALUE ...`).
A command is left out only where NOT_WALKED says why (a GPU node's work, or an AOT compile that the
slow test_compile_commands walks); every other command a page shows is walked, so a command added
to a page is walked from then on. The pages that follow the README (lora, dpo, notebooks) start
where the README's walk left its reader: with runs/tiny_llama in the directory. Each walk then
checks what the page promises of its results.

Measured 2026-12-06 on the 2-core machine (load 3-4, -n 0): README 11 s, finetuning 28 s, lora
55 s, dpo 39 s, huggingface 12 s, notebooks 7 s, configs 3 s; 160 s for the file. models (Qwen3,
with its Python block): 54 s, 2026-12-07 at load 4-5. lora and dpo are past the
~30 s that marks a test slow, but issue #43 keeps the walks in CI's default run: a page that fails
its reader must fail CI. Most of a walk is process start-up and compiling a tiny program.
"""
from __future__ import annotations

import fcntl
import json
import re
import shutil
from pathlib import Path

import pytest

from doc_walk import (BOS_ID, CHATS, CORPUS, EOS_IDS, MAX_POSITIONS, PREFERENCES,  # noqa: E402
                      QWEN3_BOS_ID, QWEN3_EOS_ID, Walk, described, fresh_directory, make_hf_llama, make_hf_qwen3,
                      page_commands, page_text, python_blocks, write_jsonl)

# Commands a page shows that the default walk leaves out, with why; each must still be on its page.
# The AOT compiles run on a CPU but take 10 s to minutes each: test_compile_commands (slow) walks them.
COMPILES = {
    "python -m maxtext_rocm.compile configs/llama3_1_405b.py:fp8 --target=mi355x:8x8 --plan --max-compiles=6":
        "ranks Llama 3.1 405B's layouts on 64 GPUs, compiling six: 162 s on a 2-core CPU",
    "python -m maxtext_rocm.compile configs/llama3_1_405b.py:fp8 --target=mi355x:8x8 --comm --config.mesh.dcn.stage=8 "
    "--config.mesh.ici.fsdp=2 --config.mesh.ici.tensor=4 --config.pipeline.schedule=1f1b --config.pipeline.repeats=2 "
    "--config.pipeline.microbatches=32 --config.pipeline.weight_gather=once --config.model.remat=full":
        "compiles Llama 3.1 405B for 64 GPUs: 10-30 s on a 2-core CPU",
    "python -m maxtext_rocm.compile configs/llama3_8b.py --target=mi300x:1": "compiles Llama 3 8B: 10-30 s",
    "python -m maxtext_rocm.compile configs/llama3_8b.py --target=mi300x:1 --config.lora.rank=16":
        "compiles Llama 3 8B under LoRA: 10-40 s",
}
# docs/evaluation.md's public tasks download their data from the Hugging Face Hub, which CI cannot reach.
PUBLIC_TASKS = {
    "python -m maxtext_rocm.eval runs/llama31_8b/ --tasks hellaswag,arc_easy,arc_challenge --batch_size 32 "
    "--output_path results/": "downloads HellaSwag and ARC from the Hugging Face Hub",
    "python -m maxtext_rocm.eval runs/llama31_8b/ --tasks gsm8k --num_fewshot 5 --output_path results/":
        "downloads GSM8K from the Hugging Face Hub",
    # "Sharded like training": Llama 3.1 70B on one 8-GPU node.
    "python -m maxtext_rocm.eval runs/llama31_70b/ --tasks hellaswag --batch_size 32 --output_path results/":
        "downloads HellaSwag; evaluates a 70B run on the 8 GPUs it trained on",
    "python -m maxtext_rocm.eval runs/llama31_70b/ --tasks hellaswag --batch_size 32 --config.mesh.ici.fsdp=4 "
    "--config.mesh.ici.tensor=2": "downloads HellaSwag; evaluates a 70B run on a mesh of 8 GPUs given",
    "python -m maxtext_rocm.eval.lm_eval_cli --model maxtext_rocm --model_args "
    "run=runs/llama31_70b/,mesh.ici.fsdp=4,mesh.ici.tensor=2 --tasks hellaswag":
        "downloads HellaSwag; the same through lm-eval's command line",
}
# docs/evaluation.md's "During training" fine-tunes with lm-eval's harness at every step: its start,
# the harness's programs and three evaluations take 25-50 s on a 2-core CPU. test_evaluation_during_training
# (slow) walks the page with it.
HARNESS_IN_TRAINING = {
    "python -m maxtext_rocm.train llama31_8b/preset.py --config.data.paths=corpus.jsonl --config.data.format=text "
    "--config.eval.harness_tasks=tiny_choice,tiny_gen --config.eval.harness_include_path=tasks/ "
    "--config.eval.harness_every=1 --config.eval.harness_limit=2": "fine-tunes with lm-eval's harness at every step",
}
NOT_WALKED = {
    "python -m maxtext_rocm.train configs/llama3_8b.py --config.mesh.ici.fsdp=8 --config.train.steps=50":
        "trains Llama 3 8B on one 8-GPU node",
    "python -m maxtext_rocm.train configs/llama3_8b.py:fp32 --config.train.steps=100 --config.optimizer.lr=1e-4":
        "trains Llama 3 8B in fp32",
    **COMPILES,
    **PUBLIC_TASKS,
    **HARNESS_IN_TRAINING,
}


def one_line(command: str) -> str:
    """A command as NOT_WALKED names it: a page's continued lines joined with single spaces."""
    return " ".join(command.split())


def walk(page: str, cwd: Path, section: str | None = None, as_written: bool = False) -> Walk:
    """Every command of `page` (of its `section`) in order, in `cwd`, but NOT_WALKED's;
    `as_written`: training commands without TINY_TRAINING (doc_walk.Walk)."""
    lines = page_commands(page, section)
    walked = Walk(page, cwd, as_written=as_written)
    for number, line in enumerate(lines, 1):
        if one_line(line) in NOT_WALKED:
            continue
        step = walked.run(line)
        if step.returncode != 0:
            print(walked.timings())
            pytest.fail(f"{page}, command {number} of {len(lines)}: {described(step)}")
    assert walked.steps, f"{page} shows no command to walk"
    print(walked.timings())
    return walked


def test_not_walked_commands_are_on_their_pages():
    shown = {one_line(line) for page in ("README.md", "docs/lora.md", "docs/configs.md", "docs/evaluation.md")
             for line in page_commands(page)}
    assert set(NOT_WALKED) <= shown, set(NOT_WALKED) - shown


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """The published model the fine-tuning pages start from, made with transformers: the walks
    that need it are skipped where torch or transformers is missing (the README's and the
    notebooks' walks are not)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_hf_llama(tmp_path_factory.mktemp("published") / "model")


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory) -> Path:
    """The published Qwen3 that docs/models.md starts from, made with transformers (skipped as
    hf_model is)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_hf_qwen3(tmp_path_factory.mktemp("published") / "qwen3")


def load_hf(kind: str, folder: Path):
    """transformers' AutoModelForCausalLM or AutoTokenizer on a folder the walk wrote."""
    import transformers

    return getattr(transformers, kind).from_pretrained(folder)


def bring(hf_model: Path, cwd: Path, *names: str) -> None:
    """The reader's published model folders, under the names the page uses."""
    for name in names:
        shutil.copytree(hf_model, cwd / name)


@pytest.fixture(scope="module")
def readme_walk(tmp_path_factory, worker_id) -> Path:
    """The directory of the README's walk, walked once per session: under pytest-xdist the first
    worker to ask walks it into the session's shared temporary folder, the others wait and read it."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # pytest-N/, above each popen-gwK/
    cwd = shared / "readme_walk" / "clone"
    with open(shared / "readme_walk.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (cwd.parent / "walked").exists():
            shutil.rmtree(cwd.parent, ignore_errors=True)  # a walk that failed part way
            walk("README.md", fresh_directory(cwd), section="Train")
            (cwd.parent / "walked").touch()
    return cwd


def after_the_readme(readme_walk: Path, cwd: Path) -> Path:
    """A directory where the README's Train section has been walked: the reader's next page."""
    shutil.copytree(readme_walk, cwd, symlinks=True)
    return cwd


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_readme_train(readme_walk):
    run = readme_walk / "runs" / "tiny_llama"
    for name in ("config.json", "metrics.jsonl", "checkpoints", "tensorboard"):  # the README's table
        assert (run / name).exists(), name
    assert [m["step"] for m in metrics(run) if "loss" in m] == [1, 2, 3]


def test_finetuning(tmp_path, hf_model):
    cwd = fresh_directory(tmp_path / "clone")
    bring(hf_model, cwd, "Meta-Llama-3.1-8B-Instruct")
    write_jsonl(cwd / "chats.jsonl", [{"messages": chat} for chat in CHATS] * 4)
    walked = walk("docs/finetuning.md", cwd)
    chats = [s for s in walked.steps if "--chat" in s.argv]
    assert len(chats) == 2
    # "Back to Hugging Face": transformers loads the export, and its tokenizer with the chat template.
    tokenizer = load_hf("AutoTokenizer", cwd / "llama31_8b_chat_hf")
    assert tokenizer.apply_chat_template(CHATS[0], tokenize=False).endswith("hello world<|eot_id|>")
    load_hf("AutoModelForCausalLM", cwd / "llama31_8b_chat_hf")


def test_lora(tmp_path, hf_model, readme_walk):
    cwd = after_the_readme(readme_walk, tmp_path / "clone")
    bring(hf_model, cwd, "Meta-Llama-3.1-8B-Instruct")
    write_jsonl(cwd / "chats.jsonl", [{"messages": chat} for chat in CHATS] * 4)
    walk("docs/lora.md", cwd)
    assert (cwd / "runs" / "tiny_llama" / "checkpoints").is_dir()  # the README's run, untouched
    assert [m["step"] for m in metrics(cwd / "runs" / "tiny_lora") if "loss" in m] == [1, 2, 3]
    load_hf("AutoModelForCausalLM", cwd / "merged_hf")
    peft = pytest.importorskip("peft")
    base = load_hf("AutoModelForCausalLM", cwd / "Meta-Llama-3.1-8B-Instruct")
    peft.PeftModel.from_pretrained(base, cwd / "adapter_hf")  # as the page says PEFT loads it


def test_dpo(tmp_path, hf_model, readme_walk):
    cwd = after_the_readme(readme_walk, tmp_path / "clone")
    bring(hf_model, cwd, "Meta-Llama-3.1-8B-Instruct")
    write_jsonl(cwd / "preferences.jsonl", PREFERENCES * 4)
    walked = walk("docs/dpo.md", cwd)
    assert "objective dpo" in walked.steps[0].stdout + walked.steps[0].stderr  # "What a DPO run logs"
    first = [m for m in metrics(cwd / "runs" / "llama31_8b_dpo") if "loss" in m][0]
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3) and "dpo_reward_margin" in first
    load_hf("AutoModelForCausalLM", cwd / "llama31_8b_dpo_hf")


def test_huggingface(tmp_path, hf_model):
    cwd = fresh_directory(tmp_path / "clone")
    bring(hf_model, cwd, "Meta-Llama-3.1-8B")
    write_jsonl(cwd / "corpus.jsonl", CORPUS * 4)
    walk("docs/huggingface.md", cwd)
    out = cwd / "llama31_8b_hf"
    load_hf("AutoModelForCausalLM", out)
    load_hf("AutoTokenizer", out)  # "copied along, so AutoTokenizer loads OUT_DIR too"
    # "the original config's other keys (token ids, max positions) are kept"
    config = json.loads((out / "config.json").read_text())
    kept = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
            "max_position_embeddings": config.get("max_position_embeddings")}
    expected = {"bos_token_id": BOS_ID, "eos_token_id": EOS_IDS, "max_position_embeddings": MAX_POSITIONS}
    assert kept == expected
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"  # the page's `[--dtype bfloat16]`
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (BOS_ID, EOS_IDS)


def test_models(tmp_path, hf_qwen3):
    """docs/models.md's Qwen3 walk, then the page's Python in the directory the walk left."""
    from safetensors.numpy import load_file

    section = "Qwen3: from Hugging Face through SFT and back"
    cwd = fresh_directory(tmp_path / "clone")
    bring(hf_qwen3, cwd, "Qwen3-8B")
    write_jsonl(cwd / "chats.jsonl", [{"messages": chat} for chat in CHATS] * 4)
    walked = walk("docs/models.md", cwd, section=section)
    assert len(walked.steps) == len(page_commands("docs/models.md")) == 4  # the section is the page's walk
    assert [m["step"] for m in metrics(cwd / "runs" / "qwen3_8b_chat") if "loss" in m] == [1, 2, 3]
    out = cwd / "qwen3_8b_chat_hf"
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 16)
    assert (config["bos_token_id"], config["eos_token_id"]) == (QWEN3_BOS_ID, QWEN3_EOS_ID)  # the original's
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["top_k"]) == ([QWEN3_EOS_ID, QWEN3_BOS_ID], 20)
    # "the tokenizer files with the chat template": Qwen3's, with its empty <think> block.
    tokenizer = load_hf("AutoTokenizer", out)
    assert tokenizer.apply_chat_template(CHATS[0], tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nhello world<|im_end|>\n")
    # Every tensor of the original, head norms included, under its name; the trained ones moved.
    original, exported = (load_file(str(folder / "model.safetensors")) for folder in (hf_qwen3, out))
    assert sorted(exported) == sorted(original) and any("q_norm" in name for name in exported)
    assert any(not (exported[name] == original[name]).all() for name in original)
    [source] = python_blocks("docs/models.md", section)
    step = walked.run_python(source)
    assert step.returncode == 0, described(step)
    name, error = step.stdout.split()[-2:]
    print(f"{walked.timings()}\nexport -> transformers: {name}, max abs logit error {float(error):.2e}")
    assert name == "Qwen3ForCausalLM" and float(error) <= 1e-4


def test_configs(tmp_path):
    """docs/configs.md's --help commands print what the page says they do: the groups, a group's
    keys (each with its line of documentation), one key."""
    from maxtext_rocm.config import declared

    walked = walk("docs/configs.md", fresh_directory(tmp_path / "clone"))
    groups, pipeline, one_key = (step.stdout for step in walked.steps)
    assert all(f"  {name} " in groups for name, item in declared.SCHEMA.keys.items() if name not in ("name", "output_dir"))
    assert all(f"--config.{key}=" in pipeline and spec.doc in pipeline
               for key, spec in declared.SCHEMA.keys["pipeline"].walk("pipeline."))
    assert one_key.startswith("  --config.train.seq_len=2048") and len(one_key.splitlines()) == 2


def test_notebooks(tmp_path, readme_walk):
    cwd = after_the_readme(readme_walk, tmp_path / "clone")
    walked = walk("docs/notebooks.md", cwd)
    assert walked.steps[-1].stdout.strip()  # the continuation of "def "


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/lora.md"])
def test_compile_commands(tmp_path, page):
    """The AOT compile commands that the default walks leave out, in their page's order."""
    walked = Walk(page, fresh_directory(tmp_path / "clone"))
    for line in page_commands(page):
        if line in COMPILES:
            step = walked.run(line, timeout=900)
            assert step.returncode == 0, described(step)
    assert len(walked.steps) == 2
    print(walked.timings())


def test_a_walk_fails_on_a_command_that_fails_its_reader(tmp_path):
    """The walk can fail: a page whose training command names a file the reader was never told to
    bring stops the walk, naming the step and the run's own sentence."""
    page = tmp_path / "page.md"  # absolute: page_commands reads it where it is
    page.write_text("```bash\npython -m maxtext_rocm.convert to-hf runs/tiny_llama tiny_hf\n```\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)page.md, command 1 of 1: .*exited 2.*runs/tiny_llama"):
        walk(str(page), fresh_directory(tmp_path / "clone"))


def evaluation_directory(tmp_path: Path, hf_model: Path) -> Path:
    """docs/evaluation.md's reader's directory: its task YAML files as the page writes them,
    documents of each kind, and the text "During training" fine-tunes on."""
    pytest.importorskip("lm_eval")
    cwd = fresh_directory(tmp_path / "clone")
    bring(hf_model, cwd, "Meta-Llama-3.1-8B")
    (cwd / "tasks").mkdir()
    for block in re.findall(r"^```yaml\n(.*?)^```", page_text("docs/evaluation.md"), flags=re.S | re.M):
        name = block.splitlines()[0].removeprefix("# ")
        (cwd / name).write_text(block)
    write_jsonl(cwd / "tasks" / "tiny_choice.jsonl", [
        {"question": "Say hello.", "choices": [" hello world", " goodbye"], "answer": 0},
        {"question": "What is 2+2?", "choices": [" four", " five"], "answer": 0}])
    write_jsonl(cwd / "tasks" / "tiny_text.jsonl", CORPUS)
    write_jsonl(cwd / "tasks" / "tiny_gen.jsonl", [{"prompt": "hello", "answer": " world"}])
    write_jsonl(cwd / "corpus.jsonl", CORPUS * 4)  # what "During training" fine-tunes on
    return cwd


def test_evaluation(tmp_path, hf_model):
    """docs/evaluation.md: its commands, in the directory above; lm-eval's results file and
    samples land where the page says."""
    cwd = evaluation_directory(tmp_path, hf_model)
    walked = walk("docs/evaluation.md", cwd)
    assert "tiny_text" in walked.steps[1].stdout and "bits_per_byte" in walked.steps[1].stdout  # the table
    (results,) = (cwd / "results" / "llama31_8b").glob("results_*.json")
    assert set(json.loads(results.read_text())["results"]) == {"tiny_choice", "tiny_text", "tiny_gen"}
    assert len(list((cwd / "results" / "llama31_8b").glob("samples_*.jsonl"))) == 3
    assert "acc" in walked.steps[2].stdout  # lm-eval's own command line, our model registered


@pytest.mark.slow  # the page's walk with its training run, the harness at every step: 60-150 s
def test_evaluation_during_training(tmp_path, hf_model):
    """docs/evaluation.md walked with "During training": the harness's rows at every step."""
    cwd = evaluation_directory(tmp_path, hf_model)
    walked = Walk("docs/evaluation.md", cwd)
    for line in page_commands("docs/evaluation.md"):
        if line not in PUBLIC_TASKS:
            step = walked.run(line)
            assert step.returncode == 0, described(step)
    print(walked.timings())
    assert one_line(walked.steps[-1].line) in HARNESS_IN_TRAINING
    harness = [m for m in metrics(cwd / "runs" / "llama31_8b") if "harness_s" in m]
    assert [m["step"] for m in harness] == [1, 2, 3]
    assert {"harness/tiny_choice/acc", "harness/tiny_choice/acc_norm", "harness/tiny_gen/exact_match"} < set(harness[0])
    assert "step 1: harness tiny_choice/acc" in walked.steps[-1].stdout


def test_grpo(tmp_path):
    """docs/grpo.md's worked example as written (its run is tiny already, and what the page
    promises is what it learns): the reward file and the prompts from the page's Python blocks,
    then its commands; the reward rises from near 0 to at least 0.8 and the model answers with a
    digit."""
    section = "A tiny model learns a reward on the CPU"
    cwd = fresh_directory(tmp_path / "clone")
    reward_file, make_prompts = python_blocks("docs/grpo.md", section)
    name = reward_file.splitlines()[0].removeprefix("# ")
    (cwd / name).write_text(reward_file)
    walked = Walk("docs/grpo.md", cwd, as_written=True)
    step = walked.run_python(make_prompts)
    assert step.returncode == 0, described(step)
    for line in page_commands("docs/grpo.md", section):
        step = walked.run(line)
        assert step.returncode == 0, described(step)
    print(walked.timings())
    rewards = [m["grpo_reward"] for m in metrics(cwd / "runs" / "grpo_digits") if "grpo_reward" in m]
    assert rewards[0] < 0.3 and rewards[-1] >= 0.8, rewards
    answer = walked.steps[-1].stdout.strip().split("A:", 1)[1]
    assert answer[:1].isdigit(), walked.steps[-1].stdout

