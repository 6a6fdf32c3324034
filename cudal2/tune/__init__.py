"""Tune: the optimize loop, a batch's pipeline, and its wiring over the GPUs of a machine or a cluster."""
