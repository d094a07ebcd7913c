"""Whole decode steps of fixed shapes (staff code): compiled, CUDA-graph, eager or native (one C call)."""
