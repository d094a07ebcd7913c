"""Measurement (staff and practitioners): the decode, format, speculative, serving and GPU benchmarks,
the roofline measured on this machine, timing helpers and the kernels A/B between git revisions.

The scripts in scripts/ drive these; nothing in the model imports them.
"""
