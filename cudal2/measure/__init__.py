"""Measure: the GPU side; the environment, the baselines, verification and timing, in worker processes."""
