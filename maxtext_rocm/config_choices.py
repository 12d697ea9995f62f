"""The values a config key may take, at the bottom of the import graph (config.py, its checks and
sharding.py read them; this module imports nothing). `maxtext_rocm.config` re-exports them."""

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")
REMAT_POLICIES = ("none", "full", "minimal", "save_dots")
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "blockwise", "pallas", "auto")
PRECISION_POLICIES = ("fp32", "bf16", "fp8")
FP8_FORMATS = ("auto", "ocp", "fnuz")
FP8_SCALINGS = ("delayed", "current")
SCHEDULES = ("cosine", "constant")
DATA_SOURCES = ("synthetic", "embedded", "files")
MODEL_FAMILIES = ("llama", "mixtral")
MOE_IMPLEMENTATIONS = ("auto", "dropless", "capacity", "dense")
CONTEXT_PARALLEL_MODES = ("auto", "all_gather", "ring")  # attention under mesh sequence > 1 (parallel/context.py)
PRECISION_VARIANTS = ("", "bf16", "fp32", "fp8")
NONFINITE_ACTIONS = ("skip", "stop")
