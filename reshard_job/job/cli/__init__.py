"""The Hydra entry point's helpers: one-line configuration errors, the sweep summary."""
