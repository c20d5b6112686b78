"""The specialized decode executor (planned steps of at most 64 tokens)."""
