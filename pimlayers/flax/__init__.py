"""Flax front ends: ``pimlayers.flax.nnx`` and ``pimlayers.flax.linen`` (import the one you use)."""
