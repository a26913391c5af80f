"""Running rank tasks: local workers, progress, signals, throughput, and the Ray executor."""
