"""Fine-tuning: LoRA as a dot strategy beside a frozen base (lora.py), and the DPO objective (dpo.py)."""
