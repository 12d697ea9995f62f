"""The config schema (config/schema.py, config/declared.py): every key declared once, and the defaults, coercion, checks,
`train --help` and docs/configs.md's tables all read from that one declaration."""

import dataclasses
import re
from pathlib import Path

import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm import train
from maxtext_rocm.config import help as config_help
from maxtext_rocm.config import declared, schema

ROOT = Path(__file__).resolve().parents[1]


def _table_rows(text: str) -> dict[str, str]:
    """key -> its table row, from the key tables of a page."""
    rows = {}
    for line in text.splitlines():
        found = re.match(r"\| `([a-z0-9_.]+)` \|", line)
        if found:
            rows[found.group(1)] = line
    return rows


def test_docs_configs_tables_match_the_schema_key_by_key():
    page = (ROOT / "docs" / "configs.md").read_text()
    written = _table_rows(page.split(config_help.TABLES_BEGIN, 1)[1].split(config_help.TABLES_END, 1)[0])
    declared = _table_rows(config_help.markdown_tables())
    assert set(declared) == set(declared.keys())
    missing, extra = sorted(set(declared) - set(written)), sorted(set(written) - set(declared))
    differ = sorted(k for k in set(declared) & set(written) if declared[k] != written[k])
    assert not (missing or extra or differ), (
        f"docs/configs.md disagrees with the schema: missing {missing}, not declared {extra}, differing {differ}; "
        "run python -m maxtext_rocm.config.help --write docs/configs.md")
    assert config_help.with_tables(page) == page  # the group headings and texts too


def test_every_key_is_declared_with_a_line_of_documentation():
    with pytest.raises(ValueError, match="documentation"):
        schema.Key(1, " ")
    for dotted, spec in declared.keys().items():
        assert spec.doc.strip() and "\n" not in spec.doc, dotted
    for dotted, group in declared.SCHEMA.groups():
        assert group.doc.strip(), dotted
    # defaults() holds exactly the declared keys, each at its declared default
    defaults = dict(schema.leaves(config_lib.defaults()))
    assert set(defaults) == set(declared.keys())
    for dotted, spec in declared.keys().items():
        assert defaults[dotted] == spec.default, dotted


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "configs").glob("*.py")))
def test_every_preset_sets_only_declared_keys_with_their_types(preset):
    cfg = config_lib.load_preset(preset)
    every = declared.keys()
    for dotted, value in schema.leaves(cfg):
        if dotted.startswith(("model.rope_scaling.", "model.rope_yarn.")):
            continue  # the fields of a dict value
        assert dotted in every, dotted
        schema.check_value(dotted, every[dotted], value)


@pytest.mark.parametrize("override, key, expected", [
    ("model.tie_embeddings=yes", "model.tie_embeddings", True),
    ("optimizer.lr=1", "optimizer.lr", 1.0),  # an int widens to the declared float
    ("train.per_device_batch_size=0.5", "train.per_device_batch_size", 0.5),  # a count that takes a fraction
    ("train.per_device_batch_size=2.0", "train.per_device_batch_size", 2),
    ("lora.targets=q,v", "lora.targets", ("q", "v")),
    ("log.profile_steps=3,5", "log.profile_steps", (3, 5)),
    ("model.sliding_window=None", "model.sliding_window", None),  # nullable
    ("model.rope_scaling={'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
     "'original_max_position': 8192}", "model.rope_scaling.factor", 8.0),
])
def test_an_override_is_read_as_its_declared_type(override, key, expected):
    cfg = config_lib.load("tiny_llama", [f"--config.{override}"])
    node = cfg
    for part in key.split("."):
        node = node[part]
    assert node == expected and type(node) is type(expected)


@pytest.mark.parametrize("override, said", [
    ("optimizer.lr=abc", "config key 'optimizer.lr' takes a float, not 'abc'"),
    ("train.steps=1.5", "config key 'train.steps' takes an int, not '1.5'"),
    ("model.attention=flash", "model.attention='flash' is not valid; choose one of 'xla', 'cudnn'"),
    ("optimizer.b2=1", "optimizer.b2=1.0 is not valid; use a finite number >= 0 and < 1"),
    ("data.prefetch=0", "data.prefetch must be >= 1, got 0"),
    ("lora.targets=q,w", "lora.targets=('q', 'w') is not valid; use distinct names from q, k, v, o"),
])
def test_each_key_is_checked_against_its_declaration(override, said):
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.load("tiny_llama", [f"--config.{override}"])
    assert str(error.value).startswith(said), str(error.value)


def test_adding_a_key_is_one_declaration(monkeypatch):
    """A key added to its group's declaration has a default, an override type, a check, a --help
    line and a docs row, with nothing else edited."""
    train_group = declared.SCHEMA.keys["train"]
    grown = dataclasses.replace(train_group, keys={
        **train_group.keys, "label_noise": schema.Key(0.0, "a made-up key for this test", at_least=0, below=1)})
    monkeypatch.setattr(declared, "SCHEMA", dataclasses.replace(declared.SCHEMA,
                                                                keys={**declared.SCHEMA.keys, "train": grown}))
    cfg = config_lib.load("tiny_llama", ["--config.train.label_noise=0.25"])
    assert cfg.train.label_noise == 0.25 and config_lib.defaults().train.label_noise == 0.0
    with pytest.raises(config_lib.ConfigError, match=r"train.label_noise=1.0 is not valid; use a finite number >= 0 and < 1"):
        config_lib.load("tiny_llama", ["--config.train.label_noise=1"])
    assert "a made-up key for this test" in config_help.describe("train")
    assert "| `train.label_noise` | float | `0.0` | >= 0 and < 1 | a made-up key for this test |" in \
        config_help.markdown_tables()


def test_help_lists_the_groups_their_keys_and_one_key(capsys):
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, item in declared.SCHEMA.keys.items():
        assert re.search(rf"^  {re.escape(name)}\b" if isinstance(item, schema.Group) else name, out, re.M), name
    assert train.main(["--help", "pipeline"]) == 0
    out = capsys.readouterr().out
    for dotted, spec in declared.SCHEMA.keys["pipeline"].walk("pipeline."):
        assert f"--config.{dotted}=" in out and spec.doc in out
    assert train.main(["--help", "train.seq_len"]) == 0
    assert capsys.readouterr().out.startswith("  --config.train.seq_len=2048  (int: > 0)")


def test_help_on_a_name_it_does_not_know_is_one_sentence_and_exit_2(capsys):
    assert train.main(["--help", "steps"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'train.steps'?" in err[0], err
