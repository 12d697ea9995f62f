"""Preset parameter counts against the published sizes, computed without allocating."""

import pytest

from maxtext_rocm import config as config_lib
from maxtext_rocm import count_params


@pytest.mark.parametrize("preset, published", [
    ("llama3_8b", 8.03e9),
    ("llama3_1_8b", 8.03e9),
    ("llama3_70b", 70.55e9),
    ("llama3_1_70b", 70.55e9),
    ("llama3_1_405b", 405.85e9),
])
def test_preset_parameter_counts(preset, published):
    assert count_params(config_lib.load(preset)) == pytest.approx(published, rel=0.005)


def test_count_matches_closed_form_and_tying():
    cfg = config_lib.load("tiny_llama")
    m = cfg.model
    per_layer = (m.d_model * m.n_heads * m.head_dim * 2 + m.d_model * m.n_kv_heads * m.head_dim * 2
                 + 3 * m.d_model * m.mlp_dim + 2 * m.d_model)
    untied = m.n_layers * per_layer + 2 * m.vocab_size * m.d_model + m.d_model
    assert count_params(cfg) == untied
    cfg.model.tie_embeddings = True
    assert count_params(cfg) == untied - m.vocab_size * m.d_model


def test_scan_and_unrolled_stacks_have_equal_size():
    cfg = config_lib.load("llama3_8b")
    cfg.model.scan_layers = False
    assert count_params(cfg) == count_params(config_lib.load("llama3_8b"))
