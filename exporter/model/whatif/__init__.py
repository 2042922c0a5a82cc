"""What-if simulators of a CPU offload tier, stepped by the model's Pipeline."""
