"""Configuration: every key declared once (schema.py: how; keys_model.py, keys_run.py: the keys; declared.py: the whole), loading presets and overrides (loading.py), validation
(checks.py) with the values keys may take as named constants (choices.py) and the mesh's sizes (mesh_sizes.py), the
start-up refusal of sizes that cannot fit (memory_fit.py), and the comparison of configs across
processes (agreement.py).

`maxtext_rocm.config` is what callers import: `config.load(...)`, `config.defaults()`,
`config.validate(...)`, the error types.
"""

from maxtext_rocm.config.choices import (  # noqa: F401
    ATTENTION_IMPLEMENTATIONS, CONTEXT_PARALLEL_MODES, DATA_SOURCES, FP8_FORMATS, FP8_SCALINGS, MESH_AXES,
    MODEL_FAMILIES, MOE_FAMILIES, MOE_IMPLEMENTATIONS, NONFINITE_ACTIONS, PIPELINE_SCHEDULES, PRECISION_POLICIES,
    PRECISION_VARIANTS, REMAT_POLICIES, SCHEDULES)
from maxtext_rocm.config.checks import axis_sizes, global_batch_size, mesh_shape, validate  # noqa: F401
from maxtext_rocm.config.declared import defaults  # noqa: F401
from maxtext_rocm.config.loading import (  # noqa: F401
    _resolve_preset, apply_cli_overrides, apply_variant, load, load_preset, set_key)
from maxtext_rocm.errors import CheckpointError, ConfigError, UserError  # noqa: F401
