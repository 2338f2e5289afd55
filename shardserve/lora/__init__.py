"""LoRA adapters as plain data: what a request names (request.py) and what an adapter folder
holds (peft_adapter.py). The model side lives in model/lora.py, the per-rank slots in
worker/lora_manager.py."""
