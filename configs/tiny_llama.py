"""A Llama small enough to train on a laptop CPU in about a minute, on the embedded corpus."""

from maxtext_rocm.config import apply_variant, defaults


def get_config(variant: str = ""):
    cfg = defaults()
    cfg.name = "tiny_llama"
    cfg.model.update(
        vocab_size=512,  # the byte tokenizer's 259 ids, rounded up so tensor parallelism divides it
        d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=768,
        rope_theta=10000.0,
        # Four layers: unrolled, they compile as fast as a scan and step ~20% faster on the CPU,
        # which pays for slicing stacked weights in and out of the loop.
        scan_layers=False,
        remat="none")
    cfg.data.source = "embedded"
    cfg.train.update(steps=250, per_device_batch_size=4, seq_len=256)
    cfg.optimizer.update(lr=2e-3, warmup_steps=25, weight_decay=0.01)
    cfg.log.every = 25
    return apply_variant(cfg, variant)
