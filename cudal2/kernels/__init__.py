"""Kernels: a candidate, its rendering from a template, its compile, and the prebuilt set."""
