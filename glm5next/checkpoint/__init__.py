"""Reading and writing GLM-5.3-Flash checkpoints in the Hugging Face layout."""
