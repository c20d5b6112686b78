"""The stock GLM-5.3-Flash backbone: exact, readable PyTorch."""
