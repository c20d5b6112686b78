"""Caches, step metadata, sampling and the engine around the backbone."""
