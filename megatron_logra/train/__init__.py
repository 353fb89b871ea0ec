"""Training loops: LM pretraining/SFT with LoGRA (and dense AdamW for comparison)."""
