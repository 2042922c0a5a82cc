"""The model: pure derivations, what-if simulation and advice (no I/O, no clock)."""
