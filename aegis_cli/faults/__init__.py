"""Fault injection, the self-test of every check: the ``--inject`` grammar (``spec``), seeded
positions and bits, faults applied to torch tensors (``tensor``, ``stored``) and packed for the
CUDA kernels. A fault is declared in one place and lands the same way on every backend."""
