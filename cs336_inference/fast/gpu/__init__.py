"""GPU products (staff code): weight-only int4 (tinygemm) and int8 (Triton) for bf16 activations."""
