"""Fine-tuning: LoRA adapters and the DPO objective."""
