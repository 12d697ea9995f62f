"""scripts/compare_trl.py (this trainer against Hugging Face TRL): its refusals, how its worker
counts TRL's real tokens, and its --quick path on this trainer's side (TRL itself is an optional
install that CI does not have), checked against transformers on the same conversations."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, says", [
    (["--modes", "sft_packed,sft_fast"], "--modes names sft_fast; give some of sft_packed, sft_unpacked"),
    (["--trl-python", "/no/such/venv/bin/python"], "--trl-python /no/such/venv/bin/python is not an executable"),
    (["--steps", "3", "--warmup", "3"], "--steps 3 leaves no step after --warmup 3 to time"),
])
def test_bad_arguments_are_one_sentence_and_exit_2(argv, says, capsys, tmp_path):
    assert load("compare_trl").main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # refused before anything was made


def test_trl_real_tokens_are_counted_as_ours_count_them():
    """A sequence of n tokens counts n - 1 (its next-token pairs); padding counts nothing, in
    padded batches and in TRL's padding-free packed rows alike."""
    worker = load("compare_trl_worker")  # it reads torch tensors; NumPy arrays have the same methods
    padded = {"attention_mask": np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])}
    assert worker.real_tokens(padded) == 3 + 1 + 5
    packed = {"position_ids": np.array([[0, 1, 2, 3, 0, 1, 2, 0, 1]])}  # sequences of 4, 3 and 2
    assert worker.real_tokens(packed) == 3 + 2 + 1


@pytest.mark.slow
def test_quick_run_of_our_side_trains_each_mode_and_starts_at_transformers_loss(tmp_path, capsys):
    """All four modes run on the tiny setup without TRL; the table shows our numbers and no TRL
    ones. One conversation per row, the first step's loss is transformers' on the first four
    conversations in the order the script hands TRL (so TRL trains on the same batches), and
    DPO's first loss is ln 2."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert load("compare_trl").main(["--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "compare_trl.md").read_text()
    assert table in capsys.readouterr().out
    report = json.loads((tmp_path / "compare_trl.json").read_text())
    results = report["results"]
    assert set(results) == {"sft_packed", "sft_unpacked", "dpo_lora", "dpo_full"}
    for mode, (run,) in results.items():
        ours = run["ours"]
        assert "error" not in ours, (mode, ours)
        assert ours["tokens_per_s"] > 0 and ours["peak_rss_mib"] > 0 and len(ours["losses"]) == 4
        assert "trl" not in run
    for mode in ("dpo_lora", "dpo_full"):
        assert results[mode][0]["ours"]["losses"][0] == pytest.approx(math.log(2), abs=1e-6)

    prep = tmp_path / "prep_quick" / "seed0"
    order = json.loads((prep / "order_sft.json").read_text())
    chats = [json.loads(line)["messages"] for line in (prep / "chats.jsonl").read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(prep / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(prep / "hf", dtype=torch.float32)
    total, count = 0.0, 0
    for index in order[:4]:
        encoded = tokenizer.apply_chat_template(chats[index], return_assistant_tokens_mask=True, return_dict=True)
        ids = torch.tensor([encoded["input_ids"]])
        trained = torch.tensor(encoded["assistant_masks"][1:], dtype=torch.bool)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        nll = -logp.gather(-1, ids[0, 1:, None])[:, 0]
        total, count = total + float(nll[trained].sum()), count + int(trained.sum())
    assert results["sft_unpacked"][0]["ours"]["losses"][0] == pytest.approx(total / count, abs=2e-4)
    assert "| SFT one conversation per row" in table and "| n/a |" in table
