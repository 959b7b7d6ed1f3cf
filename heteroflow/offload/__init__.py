"""Offload: device / CPU / SSD tiers for optimizer state, parameters and activations."""
