"""Generation: the KV-cache decode against the full forward, EOS, sampling, the CLI, plots, profiles."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import maxtext_rocm as mr
from maxtext_rocm.generate import main as generate_main
from maxtext_rocm.generate import sample

from conftest import small_config

REPO = Path(__file__).resolve().parent.parent
# Different lengths, so left padding and per-row positions matter.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23]]
NEW = 6


def full_forward_greedy(cfg, params, prompts, new):
    """The reference: the whole sequence through `forward` at every step, no cache. Rows are
    right-padded into one fixed buffer (causal attention: padding after a token cannot change it)."""
    buf = np.zeros((len(prompts), max(map(len, prompts)) + new), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for row, p in enumerate(prompts):
        buf[row, :len(p)] = p
    for _ in range(new):
        logits = np.asarray(mr.forward(cfg, params, buf))
        nxt = logits[np.arange(len(prompts)), lengths - 1].argmax(-1)
        buf[np.arange(len(prompts)), lengths] = nxt
        lengths += 1
    return [buf[row, len(p):len(p) + new] for row, p in enumerate(prompts)]


def mixtral_config(**overrides):
    return small_config(**{"model.family": "mixtral", "model.n_experts": 4, "model.experts_per_token": 2,
                           "model.mlp_dim": 64, **overrides})


@pytest.fixture(scope="module")
def llama():
    # A sliding window shorter than the sequences, so decode must respect it too.
    cfg = small_config(**{"model.sliding_window": 5})
    return cfg, mr.init_params(cfg, seed=1)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_cached_decode_matches_full_forward(family, llama):
    if family == "llama":
        cfg, params = llama
        reference_cfg = cfg
    else:
        # "capacity" may drop tokens; generate switches to an exact implementation by itself,
        # the reference asks for "dense".
        cfg = mixtral_config(**{"model.moe_impl": "capacity"})
        params = mr.init_params(cfg, seed=2)
        reference_cfg = mixtral_config(**{"model.moe_impl": "dense"})
    assert params["layers"]["attention"]["k"]["kernel"].shape[2] == cfg.model.n_kv_heads  # GQA: 2 kv, 4 q
    got = mr.generate(cfg, params, PROMPTS, max_new_tokens=NEW)
    want = full_forward_greedy(reference_cfg, params, PROMPTS, NEW)
    for row, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"{family} prompt {row}")
    # One prompt alone continues exactly as it does inside the batch.
    np.testing.assert_array_equal(mr.generate(cfg, params, PROMPTS[1], max_new_tokens=NEW), got[1])


def test_eos_stops_each_row(llama):
    cfg, params = llama
    free = mr.generate(cfg, params, PROMPTS, max_new_tokens=NEW)
    eos = int(free[0][2])
    stopped = mr.generate(cfg, params, PROMPTS, max_new_tokens=NEW, eos_id=eos)
    for f, s in zip(free, stopped):
        hits = np.flatnonzero(f == eos)
        expected = f[:hits[0] + 1] if len(hits) else f
        np.testing.assert_array_equal(s, expected)
    assert len(stopped[0]) == 3 and stopped[0][-1] == eos


def test_sampling_is_deterministic_by_seed(llama):
    cfg, params = llama
    draw = lambda seed: mr.generate(cfg, params, PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=seed)
    a, b, c = draw(0), draw(0), draw(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_top_k_and_top_p_restrict_the_choices():
    logits = jax.random.normal(jax.random.key(0), (3, 40)) * 3
    keys = jax.random.split(jax.random.key(1), 400)
    draws = lambda **kw: np.asarray(jax.vmap(lambda k: sample(logits, k, 1.0, **kw))(keys))  # [400, 3]
    order = np.argsort(-np.asarray(logits), axis=-1)
    top4 = draws(top_k=4)
    for row in range(3):
        assert set(top4[:, row]) <= set(order[row, :4]) and len(set(top4[:, row])) > 1
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    nucleus = draws(top_p=0.5)
    for row in range(3):
        ranked = probs[row, order[row]]
        size = int(np.searchsorted(np.cumsum(ranked), 0.5) + 1)  # smallest set reaching 0.5
        assert set(nucleus[:, row]) <= set(order[row, :size])
    assert (draws(top_k=1) == order[:, 0]).all() and (draws(top_p=1e-6) == order[:, 0]).all()
    assert (np.asarray(sample(logits, keys[0])) == order[:, 0]).all()  # temperature 0: greedy
    assert len(set(draws()[:, 0])) > 4  # and unrestricted sampling does vary


def test_generate_rejects_bad_arguments(llama):
    cfg, params = llama
    with pytest.raises(mr.UserError, match="top_p"):
        mr.generate(cfg, params, PROMPTS, top_p=0.0)
    with pytest.raises(mr.UserError, match="at least one token"):
        mr.generate(cfg, params, [[1, 2], []])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 3-step byte-tokenized run with a checkpoint and a profile of its second step."""
    out = tmp_path_factory.mktemp("run")
    cfg = small_config(**{"model.vocab_size": 264, "train.steps": 3, "output_dir": str(out),
                          "log.profile_steps": (1, 2), "checkpoint.every": 0, "checkpoint.async_save": False})
    trainer = mr.Trainer(cfg, log=lambda *_: None)
    trainer.run()
    trainer.writer.close()
    return out, cfg, trainer


def test_profile_trace_is_written(trained_run):
    out, _, _ = trained_run
    traces = list((out / "profile").rglob("*.xplane.pb"))
    assert traces, f"no trace under {out / 'profile'}"


def test_profile_steps_are_validated():
    from maxtext_rocm import config as config_lib

    with pytest.raises(mr.ConfigError, match="log.profile_steps"):
        config_lib.validate(small_config(**{"log.profile_steps": (5, 2)}), 8)


def test_load_params_and_loss_match_the_trainer(trained_run):
    out, cfg, trainer = trained_run
    params = mr.load_params(out)  # the run's own config.json
    batch = {k: np.asarray(v) for k, v in trainer.data.batch(0).items()}
    got = float(mr.loss(cfg, params, batch))
    live = float(mr.loss(cfg, trainer.state.params, batch))
    assert np.isfinite(got) and got == pytest.approx(live, rel=1e-5)
    assert float(mr.loss(cfg, mr.init_params(cfg, seed=0), batch)) > got  # training lowered it


def test_cli_generates_from_a_run(trained_run):
    out, _, _ = trained_run
    result = subprocess.run(
        [sys.executable, "-m", "maxtext_rocm.generate", str(out), "--prompt", "def ", "--max-new-tokens", "5",
         "--temperature", "0.7", "--top-k", "5", "--seed", "3"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")
    assert "Warning" not in result.stderr


def test_cli_user_errors_exit_2(tmp_path, capsys):
    assert generate_main([str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "missing" in err and len(err.splitlines()) == 1


def _plot_module():
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts" / "plot_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_metrics_writes_a_png(tmp_path, capsys):
    runs = []
    for name, speed in (("a", 100.0), ("b", 150.0)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 5.0 / s, "tokens_per_s_per_device": speed, "mfu": None if s == 1 else 0.3}
                for s in range(1, 6)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(run))
    plot = _plot_module()
    png = tmp_path / "plots" / "m.png"
    assert plot.main([*runs, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert plot.main([str(tmp_path / "nope"), "--out", str(png)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_generation_stops_at_any_of_several_ids(llama):
    """A chat stops at its end-of-turn token or EOS: eos_id takes several ids, each row stops at the
    first of them it produces (kept), and an id it never produces changes nothing."""
    cfg, params = llama
    free = mr.generate(cfg, params, PROMPTS, max_new_tokens=NEW)
    stop = int(free[0][2])
    unused = next(i for i in range(cfg.model.vocab_size) if all(i not in row for row in free))
    stopped = mr.generate(cfg, params, PROMPTS, max_new_tokens=NEW, eos_id=[unused, stop])
    for row, got in zip(free, stopped):
        hits = np.flatnonzero(row == stop)
        np.testing.assert_array_equal(got, row[:hits[0] + 1] if len(hits) else row)
