"""The training scripts (python -m train.llama3)."""
