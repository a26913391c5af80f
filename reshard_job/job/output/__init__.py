"""The output directory: guards, lock, journal, manifest, per-node outputs."""
