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
DATA_FORMATS = ("text", "chat", "prompt_completion", "preference")  # what a record of data.paths holds
CHAT_TEMPLATES = ("llama3",)  # built into data/chat_template.py; data.chat_template may also be a file
MODEL_FAMILIES = ("llama", "mixtral")
MOE_IMPLEMENTATIONS = ("auto", "dropless", "capacity", "dense")
PROJECTION_FUSIONS = ("auto", "on", "off")
CONTEXT_PARALLEL_MODES = ("auto", "all_gather", "ring")  # attention under mesh sequence > 1 (parallel/context.py)
PRECISION_VARIANTS = ("", "bf16", "fp32", "fp8")
NONFINITE_ACTIONS = ("skip", "stop")
OBJECTIVES = ("lm", "dpo")  # train.objective: next-token cross-entropy, or preference pairs (finetune/dpo.py)
# circular: pipeline.repeats virtual stages per device; gpipe_recompute: gpipe's order, a hand-written backward
# keeping one microbatch's layer residuals per stage (parallel/pipeline_recompute.py)
# 1f1b: each microbatch's backward as soon as its loss exists, the loss run inside the pipeline
# (parallel/pipeline_1f1b.py); interleaved with pipeline.repeats > 1 (pipeline_1f1b_order.py)
PIPELINE_SCHEDULES = ("gpipe", "circular", "gpipe_recompute", "1f1b")
VIRTUAL_STAGE_SCHEDULES = ("circular", "1f1b")  # those that run pipeline.repeats chunks per device
# When a stage's ZeRO-3 weights are gathered (pipeline.weight_gather) and their gradient
# reduce-scattered (pipeline.gradient_reduce): in each iteration of the pipeline loop, or once.
PIPELINE_WEIGHT_GATHERS = ("per_iteration", "once")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the dense layers LoRA can adapt

# The range of every number that is not a count (counts are checked one by one in
# config/checks.py): (low, low included, high, high included), None for no bound. Every float in a
# config must also be finite; config_checks._validate_numbers checks both, before anything else, and
# tests/test_config.py holds every float key of config.defaults() to an entry here.
NUMBER_RANGES = {
    "model.rope_theta": (0, False, None, False),
    "model.norm_eps": (0, False, None, False),
    "model.embed_init_std": (0, False, None, False),
    "model.moe_capacity_factor": (0, False, None, False),
    "model.moe_aux_loss_weight": (0, True, None, False),
    "model.moe_router_z_loss_weight": (0, True, None, False),
    "optimizer.lr": (0, True, None, False),
    "optimizer.min_lr_ratio": (0, True, 1, True),
    "optimizer.weight_decay": (0, True, None, False),
    "optimizer.clip_norm": (0, True, None, False),
    "optimizer.b1": (0, True, 1, False),
    "optimizer.b2": (0, True, 1, False),
    "optimizer.eps": (0, True, None, False),
    "train.per_device_batch_size": (0, False, None, False),
    "train.z_loss_weight": (0, True, None, False),
    "train.hang_timeout_s": (0, True, None, False),
    "train.startup_timeout_s": (0, True, None, False),
    "log.peak_tflops": (0, True, None, False),
    "dpo.beta": (0, False, None, False),
    "dpo.label_smoothing": (0, True, 0.5, False),  # at 0.5 the loss no longer prefers either response
    "lora.alpha": (0, False, None, False),
    "lora.dropout": (0, True, 1, False),
    # Seeds: numpy's generators refuse negative ones, jax.random.key anything past int64.
    "train.seed": (0, True, 2**63, False),
    "data.seed": (0, True, 2**63, False),
}
