"""The values config keys may take, as named constants for the code that reads them: each is read
from the key's declaration (config/keys_model.py, config/keys_run.py), where it is written once.
`maxtext_rocm.config` re-exports them."""

from maxtext_rocm.config import declared, keys_model, keys_run

_KEYS = declared.keys()


def _choices(dotted: str) -> tuple:
    return _KEYS[dotted].choices


MESH_AXES = keys_model.MESH_AXES
REMAT_POLICIES = _choices("model.remat")
ATTENTION_IMPLEMENTATIONS = _choices("model.attention")
PRECISION_POLICIES = _choices("precision.policy")
FP8_FORMATS = _choices("precision.fp8_format")
FP8_SCALINGS = _choices("precision.fp8_scaling")
SCHEDULES = _choices("optimizer.schedule")
DATA_SOURCES = _choices("data.source")
DATA_FORMATS = _choices("data.format")
CHAT_TEMPLATES = keys_run.CHAT_TEMPLATES
MODEL_FAMILIES = _choices("model.family")
DENSE_FAMILIES = keys_model.DENSE_FAMILIES
MOE_FAMILIES = keys_model.MOE_FAMILIES
feed_forward_dim = keys_model.feed_forward_dim
MOE_IMPLEMENTATIONS = _choices("model.moe_impl")
PROJECTION_FUSIONS = _choices("model.fuse_projections")
CONTEXT_PARALLEL_MODES = _choices("model.context_parallel")
PRECISION_VARIANTS = ("", "bf16", "fp32", "fp8")  # CONFIG.py:VARIANT sets precision.policy
NONFINITE_ACTIONS = _choices("train.on_nonfinite")
OBJECTIVES = _choices("train.objective")
PIPELINE_SCHEDULES = keys_model.PIPELINE_SCHEDULES
VIRTUAL_STAGE_SCHEDULES = keys_model.VIRTUAL_STAGE_SCHEDULES
PIPELINE_WEIGHT_GATHERS = keys_model.PIPELINE_WEIGHT_GATHERS
LORA_TARGETS = keys_run.LORA_TARGETS

# The range of every bounded number, (low, low included, high, high included) with None for no
# bound, as declared; tests/test_bad_numbers.py holds every float key to an entry here.
NUMBER_RANGES = {
    dotted: (spec.at_least if spec.at_least is not None else spec.above, spec.at_least is not None,
             spec.at_most if spec.at_most is not None else spec.below, spec.at_most is not None)
    for dotted, spec in _KEYS.items() if spec.bounded}
# GRPO's built-in reward functions (finetune/grpo/rewards.py); grpo.rewards may also name module:function.
BUILT_IN_REWARDS = ("answer", "format", "length")
