"""Fine-tuning: LoRA as a dot strategy beside a frozen base (lora.py)."""
