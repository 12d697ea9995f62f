"""Walking a documentation page as its reader does: its shell commands, in the page's order, each run
for real in a fresh directory with the page's own relative paths (tests/test_doc_walks.py).

A walk directory holds what a fresh clone gives the reader (configs/, scripts/, notebooks/,
copied from the checkout under test: a `git clone` would walk the last commit, not the pages being
edited) and the inputs the page asks the reader to bring, made by the test under the page's own
names. The package is this checkout's (PYTHONPATH), as after `pip install -e .`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from test_docs import REPO, command_lines, forms

# What the test appends to each training command (never replacing the page's own arguments; a
# later --config override wins): a walk proves the commands run, not that a model converges, so
# 3 steps of 2 rows of 64 tokens keep each run to seconds on a 2-core CPU. 2 rows, not 1: a DPO
# batch must hold whole pairs. log.every=1 so every step's loss reaches metrics.jsonl.
TINY_TRAINING = ["--config.train.steps=3", "--config.train.seq_len=64", "--config.train.per_device_batch_size=2",
                 "--config.log.every=1"]
CLONED = ("configs", "scripts", "notebooks")


def page_text(page: str, section: str | None = None) -> str:
    """The page, or only what stands under its `## section` heading."""
    text = (REPO / page).read_text()
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return text


def page_commands(page: str, section: str | None = None) -> list[str]:
    """The page's shell commands in order, as one line each (continuations joined); `section`: only
    those under that `## ` heading."""
    return [line for block in bash_blocks_of(page_text(page, section)) for line in command_lines(block)]


def python_blocks(page: str, section: str | None = None) -> list[str]:
    """The page's ```python blocks in order (of its `section`), each a program as written."""
    return re.findall(r"^```python\n(.*?)^```", page_text(page, section), flags=re.S | re.M)


def bash_blocks_of(text: str) -> list[str]:
    """test_docs.bash_blocks' pattern, on a page's text (or one section of it)."""
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


@dataclass
class Step:
    line: str
    argv: list[str]
    returncode: int
    seconds: float
    stdout: str
    stderr: str


@dataclass
class Walk:
    """One page's walk: its directory and what each command did, in order."""
    page: str
    cwd: Path
    steps: list[Step] = field(default_factory=list)
    # Training commands as the page writes them, without TINY_TRAINING: for a page whose run is
    # tiny already and whose promise is its result (docs/grpo.md: the reward it learns).
    as_written: bool = False

    def run(self, line: str, timeout: float = 300) -> Step:
        argv = forms(line)[-1]  # with its optional `[...]` parts, unless they hold a placeholder
        if argv[:2] not in (["python", "-m"], ["python3", "-m"]):
            raise AssertionError(f"{self.page}: {line!r} is not a `python -m` command; teach doc_walk.py to run it")
        argv = [sys.executable, *argv[1:]]
        if argv[2] == "maxtext_rocm.train" and not self.as_written and not {"-h", "--help"} & set(argv):  # a run
            argv = [*argv, *TINY_TRAINING]
        start = time.perf_counter()
        out = subprocess.run(argv, cwd=self.cwd, env=walk_env(), capture_output=True, text=True, timeout=timeout)
        step = Step(line, argv, out.returncode, time.perf_counter() - start, out.stdout, out.stderr)
        self.steps.append(step)
        return step

    def run_python(self, source: str, timeout: float = 300) -> Step:
        """A ```python block of the page, run as a program where the walk stands."""
        argv = [sys.executable, "-c", source]
        start = time.perf_counter()
        out = subprocess.run(argv, cwd=self.cwd, env=walk_env(), capture_output=True, text=True, timeout=timeout)
        line = f"python: the page's block {source.splitlines()[0]!r} ..."
        step = Step(line, argv, out.returncode, time.perf_counter() - start, out.stdout, out.stderr)
        self.steps.append(step)
        return step

    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def timings(self) -> str:
        return "\n".join([f"walk of {self.page}: {self.seconds():.1f} s"]
                         + [f"  {s.seconds:6.1f} s  {' '.join(s.line.split())}" for s in self.steps])


def walk_env() -> dict[str, str]:
    """The reader's environment: one CPU device (the test session's 8 fake devices removed), W&B
    offline (CI has no network), this checkout's package. The session's compilation cache
    (tests/conftest.py) is kept: a program that two walks compile is compiled once."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


def fresh_directory(path: Path) -> Path:
    """What a clone of the repository shows the reader: its configs/, scripts/ and notebooks/."""
    path.mkdir(parents=True)
    for name in CLONED:
        shutil.copytree(REPO / name, path / name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    return path


def described(step: Step) -> str:
    return (f"`{step.line}` exited {step.returncode}\n(run as: {' '.join(step.argv)})\n"
            f"stdout:\n{step.stdout[-3000:]}\nstderr:\n{step.stderr[-3000:]}")


# ----------------------------------------------------------------------------------------------
# The reader's inputs


CHATS = [
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello world"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "the answer is four."}],
]
PREFERENCES = [
    {"prompt": "Say hello.", "chosen": "hello world", "rejected": "the lazy dog"},
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "chosen": "the answer is four.", "rejected": "two"},
]
CORPUS = [{"text": "the quick brown fox jumps over the lazy dog. " * 8}, {"text": "hello world, hello tokenizer. " * 8}]
# The tiny model's special token ids (tests/chat_helpers.py's SPECIALS, in its vocabulary's order):
# <|begin_of_text|> 0, <|end_of_text|> 1, <|eot_id|> 4; Meta-Llama-3.1-8B-Instruct's config
# names both ends of a turn as EOS, as here.
BOS_ID, EOS_IDS, MAX_POSITIONS = 0, [1, 4], 128


def make_hf_llama(folder: Path) -> Path:
    """A tiny random Llama saved by transformers as a published model folder is: config.json,
    generation_config.json, model.safetensors, a tokenizer with Llama 3's chat template."""
    import torch
    import transformers
    from chat_helpers import make_chat_tokenizer

    make_chat_tokenizer(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                                      bos_token_id=BOS_ID, eos_token_id=EOS_IDS)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_IDS,
                                                            do_sample=True, temperature=0.6, top_p=0.9)
    model.save_pretrained(folder)
    return folder


# Qwen3-8B's token ids, in the tiny vocabulary (tests/chat_helpers.py's QWEN3_SPECIALS): config.json
# names <|endoftext|> 0 as BOS and <|im_end|> 2 as EOS (the tokenizer has no BOS of its own), its
# generation config both as EOS. Its embedding is padded past the tokenizer's ids, as Qwen's is.
QWEN3_BOS_ID, QWEN3_EOS_ID, QWEN3_VOCAB = 0, 2, 384


def make_hf_qwen3(folder: Path) -> Path:
    """A tiny random Qwen3 saved by transformers as Qwen/Qwen3-8B's folder is: config.json,
    generation_config.json, model.safetensors, a tokenizer with Qwen3's tokens and its published
    chat template. head_dim is not d_model / heads, as in the Qwen3 models up to 4B."""
    import torch
    import transformers
    from chat_helpers import QWEN3, QWEN3_ADDED, QWEN3_NAMES, QWEN3_SPECIALS, make_chat_tokenizer

    make_chat_tokenizer(folder, template=QWEN3, specials=QWEN3_SPECIALS, names=QWEN3_NAMES, added=QWEN3_ADDED)
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                                      rope_theta=1e6, bos_token_id=QWEN3_BOS_ID, eos_token_id=QWEN3_EOS_ID)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=QWEN3_BOS_ID, eos_token_id=[QWEN3_EOS_ID, QWEN3_BOS_ID], pad_token_id=QWEN3_BOS_ID,
        do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    model.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
