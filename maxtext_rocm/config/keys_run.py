"""The declared keys of a run: what it reads, how it steps, saves, fine-tunes, logs and starts up
(`optimizer`, `data`, `train`, `dpo`, `grpo`, `checkpoint`, `lora`, `eval`, `log`, `distributed`; the model's
groups: config/keys_model.py; the whole config: config/declared.py)."""

from __future__ import annotations

from maxtext_rocm.config.schema import Group, Key

POSITIVE = dict(above=0)
SEED = dict(at_least=0, below=2**63, valid="an integer >= 0 and < 2**63")  # numpy refuses negatives, jax past int64

OPTIMIZER = Group("AdamW with warmup and a decay schedule; no weight decay on norm scales.", {
    "lr": Key(3e-4, "the peak learning rate", at_least=0),
    "warmup_steps": Key(100, "steps of linear warmup from 0 to lr", at_least=0),
    "schedule": Key("cosine", "after warmup: cosine decay to lr x min_lr_ratio, or constant",
                    choices=("cosine", "constant")),
    "min_lr_ratio": Key(0.1, "where the cosine schedule ends, as a fraction of lr", at_least=0, at_most=1),
    "weight_decay": Key(0.1, "AdamW's decoupled weight decay", at_least=0),
    "clip_norm": Key(1.0, "the global gradient norm clipped to; 0: off", at_least=0),
    "b1": Key(0.9, "Adam's first-moment decay", at_least=0, below=1),
    "b2": Key(0.95, "Adam's second-moment decay", at_least=0, below=1),
    "eps": Key(1e-8, "Adam's epsilon", at_least=0),
}, page="configs.md")

CHAT_TEMPLATES = ("llama3", "qwen3")  # built into data/builtin_templates.py; data.chat_template may also be a file

DATA = Group("Where batches come from and how documents become rows.", {
    "source": Key("synthetic", "synthetic (random tokens), embedded (a small built-in corpus) or files",
                  choices=("synthetic", "embedded", "files")),
    "seed": Key(0, "the data order's seed", **SEED),
    "tokenizer": Key("byte", "byte, or a tokenizer.json, SentencePiece .model or tiktoken rank file"),
    "paths": Key("", "data.source=files: comma-separated files or globs of .jsonl, .parquet, .txt, .arrayrecord"),
    "eval_paths": Key("", "held-out files for train.eval_every, as data.paths"),
    "text_field": Key("text", "the JSON Lines field or Parquet column holding the text"),
    "format": Key("text", "what a JSON line holds: text, chat (messages), prompt_completion, preference "
                          "(prompt, chosen, rejected; for DPO) or prompt (a prompt and what its rewards read; "
                          "for GRPO)",
                  choices=("text", "chat", "prompt_completion", "preference", "prompt")),
    "chat_template": Key("", "the Jinja template chats render with: '' the tokenizer's own, a file, llama3 or qwen3"),
    "train_on_prompt": Key(False, "chat/prompt_completion: train every token, not only the assistant's"),
    "add_bos": Key(True, "a beginning-of-sequence token before each document, where the tokenizer has one"),
    "add_eos": Key(True, "an end-of-sequence token after each document, where the tokenizer has one"),
    # Its values are checked by data/packing.py:packing_mode, whose sentence also says what the
    # booleans of earlier versions became.
    "packing": Key("concat", "concat (rows filled to the last token), best_fit (documents whole, the rest "
                             "padding) or none (one document per row, truncated); preference pairs: "
                             "best_fit packs whole pairs, else one sequence per row",
                   valid="concat, best_fit or none"),
    # Its values are checked by data/buckets.py:parse (config/checks.py calls it).
    "buckets": Key("auto", "rows of one example (packing none, preference pairs) padded to the shortest of these "
                           "lengths, each batch from one, not to train.seq_len: auto (quarters of train.seq_len), "
                           "none, or ascending lengths '256,512'",
                   valid="'auto', 'none', or ascending row lengths such as '256,512,1024' (at most train.seq_len)"),
    "packing_window": Key(512, "best_fit: documents packed together (more: less padding, more memory)",
                          at_least=1),
    "epochs": Key(0, "passes over data.paths before the run stops with an error; 0: no limit", at_least=0,
                  valid="a number of passes >= 1, or 0 for no limit"),
    "prefetch": Key(4, "batches a background thread builds ahead of the step", at_least=1),
    "workers": Key(0, "processes that tokenize ahead of that thread (same batches whatever the number); "
                      "0 or 1: the thread tokenizes", at_least=0,
                   valid="a number of tokenizing processes >= 2, or 0 for the background thread alone"),
    "allow_changed": Key(False, "resume over data files that changed since the checkpoint, or with another "
                                "number of data-loading processes mid-epoch"),
}, page="data.md")

TRAIN = Group("The loop: steps, batch, sequence, objective, evaluation and what stops a run.", {
    "steps": Key(1000, "optimizer steps in the run", **POSITIVE),
    "per_device_batch_size": Key(4, "sequences per device per step; a fraction splits one sequence over mesh "
                                    "sequence", fractional=True, kind=int, above=0),
    "seq_len": Key(2048, "tokens per sequence", **POSITIVE),
    "grad_accum": Key(1, "micro-batches summed into each step's gradient", **POSITIVE),
    "seed": Key(0, "the parameters' initialisation seed", **SEED),
    "z_loss_weight": Key(0.0, "the weight of PaLM's z-loss on the log-partition; 0: off", at_least=0),
    "on_nonfinite": Key("skip", "a step whose loss or gradients are inf/NaN: skip drops its update and counts "
                                "it; stop saves the last good state and exits non-zero",
                        choices=("skip", "stop")),
    "max_skipped_steps": Key(5, "bad steps in a row, under skip, that stop the run (exit 3, last good state "
                                "saved)", at_least=1),
    "eval_every": Key(0, "steps between evaluations on the eval split; 0: off", at_least=0),
    "eval_steps": Key(10, "batches per evaluation", at_least=1),
    "compilation_cache": Key("auto", "JAX's persistent compilation cache: auto ($JAX_COMPILATION_CACHE_DIR, "
                                     "else output_dir/compilation_cache), off, or a directory"),
    "hang_timeout_s": Key(0.0, "no step finished for this long: every thread's stack to stderr and a file, "
                               "exit 4; 0: off", at_least=0),
    "startup_timeout_s": Key(0.0, "the watchdog's limit from launch to the end of the first step; 0: 10 x "
                                  "hang_timeout_s", at_least=0),
    "objective": Key("lm", "what the step minimises: lm (next-token cross-entropy), dpo (preference pairs "
                           "against a frozen reference) or grpo (rewards of sampled completions)",
                     choices=("lm", "dpo", "grpo")),
}, page="configs.md")

DPO = Group("Direct Preference Optimization (train.objective=dpo; TRL's sigmoid loss).", {
    "beta": Key(0.1, "how far the policy may move from the reference: rewards are beta x log-ratios", above=0),
    "label_smoothing": Key(0.0, "conservative DPO: the share of pairs assumed mislabelled; 0: plain DPO "
                                "(at 0.5 the loss prefers neither response)", at_least=0, below=0.5),
}, page="dpo.md")

GRPO = Group("Group Relative Policy Optimization (train.objective=grpo): completions sampled from the policy, "
             "scored by rewards, each against its group's mean.", {
                 "group_size": Key(8, "completions sampled per prompt; the batch holds whole groups", at_least=2),
                 "max_new_tokens": Key(256, "the longest completion; prompts may take train.seq_len less this",
                                       at_least=1),
                 "temperature": Key(1.0, "the sampler's temperature", above=0),
                 "top_p": Key(1.0, "the sampler's nucleus: the smallest set of tokens holding this probability",
                              above=0, at_most=1),
                 "top_k": Key(0, "the sampler's k most likely tokens; 0: all", at_least=0),
                 "sampler_weights": Key("gathered", "gathered: the sampler gathers the policy's weights over "
                                                    "fsdp and data once per step, in the compute dtype (a copy per "
                                                    "device); training: it decodes from the training layout, "
                                                    "gathering every layer's weights at every token",
                                        choices=("gathered", "training")),
                 "rewards": Key(("answer",), "reward functions: built-in answer, format or length, or "
                                             "module:function importable from the working directory"),
                 "reward_weights": Key((), "each reward's weight in the total, in the order of grpo.rewards; "
                                           "empty: every weight 1"),
                 "format_pattern": Key(r"<answer>.*</answer>", "the built-in format reward: 1 when the whole "
                                                               "completion (stripped) matches this regex, else 0"),
                 "scale_rewards": Key(True, "divide each advantage by its group's reward standard deviation "
                                            "(DeepSeekMath, TRL); false: mean-centred only (Dr. GRPO)"),
                 "epsilon": Key(0.2, "the clip range of the probability ratio: 1 - epsilon to 1 + epsilon", above=0,
                                below=1),
                 "beta": Key(0.0, "the KL penalty's weight against the starting policy; 0: no reference at all "
                                  "(no copy in memory, no pass over it)", at_least=0),
                 "normalization": Key("token", "token: the loss is a mean over every completion token of the "
                                               "batch (DAPO); sequence: over each completion's tokens, then over "
                                               "completions (GRPO's paper)", choices=("token", "sequence")),
                 "updates_per_batch": Key(1, "optimizer updates per batch of samples (mu), the sampling policy's "
                                             "log-probabilities kept for the ratio", at_least=1),
             }, page="grpo.md")

CHECKPOINT = Group("Saving and resuming through orbax.", {
    "enabled": Key(True, "save checkpoints at all"),
    "every": Key(1000, "steps between saves; 0 saves only at the end (and on preemption)", at_least=0),
    "keep": Key(3, "the newest checkpoints kept", at_least=1),
    "keep_period": Key(0, "also keep every keep_period-th step, if > 0", at_least=0),
    "async_save": Key(True, "write in the background while training goes on"),
    "resume": Key("auto", "auto (the newest complete checkpoint), never, a step, or a checkpoint path"),
    "load_params_from": Key("", "a run dir, checkpoint or params export to start from, with a fresh optimizer"),
    "local_dir": Key("", "a node-local directory (NVMe, /dev/shm, /tmp) for the frequent local tier; '' = off. "
                         "Each process saves its own shards there; a resume on the same nodes reads the newest "
                         "step every process holds, else the persistent tier"),
    "local_every": Key(100, "steps between local saves (with local_dir)", **POSITIVE),
    "local_keep": Key(2, "the newest local checkpoints each process keeps", at_least=1),
}, page="checkpoints.md")

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

LORA = Group("Low-rank adapters beside a frozen base (checkpoint.load_params_from, or train.seed's "
             "initialisation); only the adapters train.", {
                 "rank": Key(0, "the adapters' rank; 0: off (every parameter is trained)", at_least=0,
                             valid="the adapters' rank >= 1, or 0 for no LoRA"),
                 "alpha": Key(16.0, "the low-rank path is scaled by alpha / rank (PEFT's lora_alpha)", above=0),
                 "targets": Key(LORA_TARGETS, "the dense layers that get adapters: q, k, v, o (attention), gate, "
                                              "up, down (MLP)", choices=LORA_TARGETS),
                 "dropout": Key(0.0, "dropout on the adapters' input in training (PEFT's lora_dropout)",
                                at_least=0, below=1),
                 "allow_base_change": Key(False, "go on, with a warning, when a resume or reader finds another "
                                                 "base than the run recorded (refused otherwise)"),
             }, page="lora.md")

EVAL = Group("lm-evaluation-harness during training (pip install -e '.[eval]'): its tasks scored on the live "
             "parameters every eval.harness_every steps, beside train.eval_every's held-out loss.", {
                 "harness_tasks": Key((), "lm-eval task names, comma-separated (its own, or "
                                          "eval.harness_include_path's); empty: off"),
                 "harness_every": Key(0, "steps between harness evaluations; 0: off", at_least=0),
                 "harness_limit": Key(0.0, "at most this many documents per task (a fraction below 1: that share); "
                                           "0: every document", at_least=0),
                 "harness_include_path": Key("", "a folder of task YAML files to add to lm-eval's own"),
                 "harness_batch_size": Key(16, "rows per forward pass of the harness", at_least=1),
             }, page="evaluation.md")

LOG = Group("Metrics: stdout, TensorBoard, Weights & Biases, profiles.", {
    "every": Key(10, "steps between logged lines", **POSITIVE),
    "tensorboard": Key(True, "TensorBoard event files under output_dir/tensorboard"),
    "wandb_project": Key("", "a Weights & Biases project to log to ('' = off; pip install -e '.[wandb]')"),
    "wandb_run_name": Key("", "the W&B run's name; '' lets W&B name it"),
    "peak_tflops": Key(0.0, "the per-device peak for MFU; 0: the peak table's", at_least=0),
    "profile_steps": Key((0, 0), "(start, end): a jax.profiler trace of steps start..end-1 into "
                                 "output_dir/profile; (0, 0): off"),
}, page="logging.md")

DISTRIBUTED = Group("Multi-process start-up; unset keys are found from the environment (JAX_*, SLURM, Open MPI, "
                    "Kubernetes).", {
                        "coordinator": Key("", "HOST:PORT of process 0"),
                        "num_processes": Key(0, "processes in the run; 0: detect", at_least=0),
                        # its range (>= 0, or -1) is checked with num_processes (config/checks.py)
                        "process_id": Key(-1, "this process's index; -1: detect"),
                        "init_timeout_s": Key(300, "seconds for every process to meet before giving up (exit 2)",
                                              **POSITIVE),
                        "heartbeat_timeout_s": Key(100, "seconds a process may be silent before the others stop",
                                                   **POSITIVE),
                    }, page="multi-node.md")
