"""The values a config key may take, at the bottom of the import graph (config.py, its checks and
sharding.py read them; this module imports nothing). `maxtext_rocm.config` re-exports them."""

# `stage` outermost: a pipeline moves only activations between stages, so it takes the slowest
# links (DCN) and leaves the fast ones to the axes with a collective in every layer.
MESH_AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")
REMAT_POLICIES = ("none", "full", "minimal", "save_dots")
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "blockwise", "pallas", "auto")
PRECISION_POLICIES = ("fp32", "bf16", "fp8")
FP8_FORMATS = ("auto", "ocp", "fnuz")
FP8_SCALINGS = ("delayed", "current")
SCHEDULES = ("cosine", "constant")
DATA_SOURCES = ("synthetic", "embedded", "files")
MODEL_FAMILIES = ("llama", "mixtral")
MOE_IMPLEMENTATIONS = ("auto", "dropless", "capacity", "dense")
PROJECTION_FUSIONS = ("auto", "on", "off")
CONTEXT_PARALLEL_MODES = ("auto", "all_gather", "ring")  # attention under mesh sequence > 1 (parallel/context.py)
PRECISION_VARIANTS = ("", "bf16", "fp32", "fp8")
NONFINITE_ACTIONS = ("skip", "stop")
PIPELINE_SCHEDULES = ("gpipe", "circular")  # circular: pipeline.repeats virtual stages per device
