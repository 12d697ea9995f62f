"""Config loading, overrides and validation: every mistake is one sentence naming the key."""

import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm.config import ConfigError
from maxtext_rocm.trainer.preflight import check_run

from conftest import small_config


def test_preset_variant_and_overrides():
    cfg = config_lib.load("configs/llama3_8b.py:fp32",
                          ["--config.train.steps=7", "--config.optimizer.lr", "0.01",
                           "--config.model.scan_layers=false", "--config.mesh.ici.tensor=2"])
    assert cfg.precision.policy == "fp32"
    assert cfg.train.steps == 7 and cfg.optimizer.lr == 0.01
    assert cfg.model.scan_layers is False and cfg.mesh.ici.tensor == 2
    assert cfg.output_dir == "runs/llama3_8b"


def test_python_overrides_and_preset_name():
    cfg = config_lib.load("tiny_llama", overrides={"train.steps": 3, "optimizer.lr": 1, "output_dir": "x"})
    assert cfg.train.steps == 3 and cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.output_dir == "x"


def test_llama31_presets_carry_rope_scaling():
    cfg = config_lib.load("llama3_1_405b")
    assert cfg.model.rope_scaling.factor == 8.0 and cfg.model.n_layers == 126
    assert config_lib.load("llama3_8b").model.rope_scaling is None


def test_rope_scaling_from_command_line():
    cfg = config_lib.load("tiny_llama", ["--config.model.rope_scaling={'factor': 4.0, 'low_freq_factor': 1.0, "
                                         "'high_freq_factor': 4.0, 'original_max_position': 128}"])
    assert cfg.model.rope_scaling.original_max_position == 128


@pytest.mark.parametrize("args, expected", [
    (["--config.train.stpes=3"], "unknown config key 'train.stpes'; did you mean 'train.steps'"),
    (["--config.trian.steps=3"], "unknown config key 'trian'; did you mean 'train.steps'"),
    (["--config.train.steps=many"], "config key 'train.steps' takes an int, not 'many'"),
    (["--config.model.scan_layers=maybe"], "config key 'model.scan_layers' takes true or false"),
    (["--config.train.steps"], "has no value"),
    (["train.steps=3"], "unexpected argument 'train.steps=3'"),
    (["--config.model.remat=sometimes"], "model.remat='sometimes' is not valid; choose one of 'none', 'full'"),
    (["--config.model.n_kv_heads=3"], "model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    (["--config.precision.policy=fp16"], "precision.policy='fp16' is not valid"),
    (["--config.train.steps=0"], "train.steps must be positive"),
    (["--config.model.vocab_size=100"], "model.vocab_size=100 is smaller than the byte tokenizer's 259"),
    (["--config.mesh.ici.fsdp=-1", "--config.mesh.ici.data=-1"], "at most one axis per group may fill"),
    (["--config.model.rope_scaling={'factor': 8.0}"], "model.rope_scaling needs exactly the keys"),
])
def test_cli_mistakes_name_the_key(args, expected):
    with pytest.raises(ConfigError, match=None) as info:
        config_lib.load("configs/tiny_llama.py", args)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("key, meant", [
    ("optimizer.learning_rate", "optimizer.lr"),  # another trainer's name (key_hints.SYNONYMS)
    ("learning_rate", "optimizer.lr"),
    ("train.max_steps", "train.steps"),
    ("batch_size", "train.per_device_batch_size"),
    ("lora.target_modules", "lora.targets"),
    ("train.lr", "optimizer.lr"),  # the right name in another group
    ("model.seq_len", "train.seq_len"),
    ("optimiser.lr", "optimizer.lr"),  # a misspelt group, the rest of the key right
    ("optimizer.warmup", "optimizer.warmup_steps"),
])
def test_unknown_keys_suggest_the_key_meant(key, meant):
    with pytest.raises(ConfigError) as info:
        config_lib.load("tiny_llama", [f"--config.{key}=1"])
    unknown = "optimiser" if key.startswith("optimiser") else key  # the first part that does not exist
    assert str(info.value).startswith(f"unknown config key {unknown!r}; did you mean {meant!r}? ")
    assert "\n" not in str(info.value)


def test_every_synonym_names_a_key_that_exists():
    from maxtext_rocm.config import key_hints

    keys = set(key_hints.dotted_keys(config_lib.defaults()))
    assert {target for target in key_hints.SYNONYMS.values()} <= keys
    assert not set(key_hints.SYNONYMS) & {k.split(".")[-1] for k in keys}  # a synonym never shadows a real name


def test_a_key_under_a_value_is_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.steps.x'; 'train.steps' is a value"):
        config_lib.load("tiny_llama", ["--config.train.steps.x=1"])


@pytest.mark.parametrize("args, key, expected", [
    (["--config.lora.targets=q,v"], "lora.targets", ("q", "v")),
    (["--config.lora.targets= q , v "], "lora.targets", ("q", "v")),
    (["--config.lora.targets=q"], "lora.targets", ("q",)),
    (["--config.lora.targets=('q', 'v')"], "lora.targets", ("q", "v")),  # the literal form still taken
    (["--config.lora.targets", "['o']"], "lora.targets", ("o",)),
    (["--config.log.profile_steps=2,4"], "log.profile_steps", (2, 4)),  # items typed by the default's
    (["--config.log.profile_steps=(2, 4)"], "log.profile_steps", (2, 4)),
])
def test_list_valued_keys_take_comma_separated_items(args, key, expected):
    cfg = config_lib.load("tiny_llama", args)
    group, leaf = key.split(".")
    assert cfg[group][leaf] == expected


def test_list_valued_keys_take_comma_separated_items_from_python_too():
    assert config_lib.load("tiny_llama", overrides={"lora.targets": "q,v"}).lora.targets == ("q", "v")


@pytest.mark.parametrize("arg, expected", [
    ("--config.log.profile_steps=a,b", "config key 'log.profile_steps' takes whole numbers such as 0,0, not 'a,b'"),
    ("--config.lora.targets=q,,v", "config key 'lora.targets' has an empty item in 'q,,v'"),
    ("--config.lora.targets=q,x", "lora.targets=('q', 'x') is not valid"),
])
def test_bad_list_items_are_named(arg, expected):
    with pytest.raises(ConfigError) as info:
        config_lib.load("tiny_llama", [arg])
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_missing_preset_and_variant():
    with pytest.raises(ConfigError, match="config file 'configs/nope.py' does not exist"):
        config_lib.load("configs/nope.py")
    with pytest.raises(ConfigError, match="unknown variant 'fp9'"):
        config_lib.load("configs/tiny_llama.py:fp9")


def test_python_override_type_mismatch():
    with pytest.raises(ConfigError, match="config key 'train.steps' takes a int"):
        config_lib.load("tiny_llama", overrides={"train.steps": 2.5})


@pytest.mark.parametrize("overrides, devices, expected", [
    ({"mesh.ici.fsdp": 4}, 8, "mesh.ici sizes (fsdp=4) multiply to 4 but there are 8 devices per host"),
    ({"mesh.ici.fsdp": -1, "mesh.ici.tensor": 3}, 8, "multiply to 3, which does not divide the 8"),
    ({"mesh.ici.fsdp": 2, "mesh.ici.tensor": 4}, 8, "model.n_kv_heads=2 does not divide over the 4 devices of mesh tensor"),
    ({"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2, "model.mlp_dim": 129}, 8, "model.mlp_dim=129 does not divide"),
    ({"model.d_model": 60}, 8, "model.d_model=60 does not divide over the 8 devices of mesh fsdp"),
    ({"train.grad_accum": 3}, 8, "does not split into train.grad_accum=3 micro-batches"),
    ({"train.grad_accum": 2}, 8, "each micro-batch of 4 sequences does not divide over the 8 batch shards"),
    ({"mesh.ici.fsdp": 4, "mesh.ici.sequence": 2, "train.seq_len": 33}, 8, "train.seq_len=33 does not divide over mesh sequence=2"),
])
def test_mesh_and_batch_mistakes(overrides, devices, expected):
    cfg = small_config(**overrides)
    with pytest.raises(ConfigError) as info:
        check_run(cfg, device_count=devices)
    assert expected in str(info.value)


def test_valid_meshes_pass():
    for overrides in ({"mesh.ici.fsdp": 8}, {"mesh.ici.fsdp": 4, "mesh.ici.tensor": 2},
                      {"mesh.ici.data": 2, "mesh.ici.fsdp": -1, "mesh.ici.tensor": 2}):
        check_run(small_config(**overrides), device_count=8)
    shape = config_lib.mesh_shape(small_config(**{"mesh.ici.tensor": 2}).mesh, 8)
    assert shape["ici"]["fsdp"] == 4 and shape["dcn"] == {a: 1 for a in config_lib.MESH_AXES}


def test_a_preset_setting_another_trainers_name_gets_the_key_meant(tmp_path):
    preset = tmp_path / "mine.py"
    preset.write_text("from maxtext_rocm.config import defaults\n\n\ndef get_config(variant=''):\n"
                      "    cfg = defaults()\n    cfg.optimizer.learning_rate = 1e-3\n    return cfg\n")
    with pytest.raises(ConfigError, match=r"line 6 sets the unknown config key 'learning_rate' .*; "
                                          r"did you mean 'optimizer.lr'\?$"):
        config_lib.load(str(preset))
