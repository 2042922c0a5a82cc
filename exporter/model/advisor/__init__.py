"""The advisor: one action per engine, its reason, its text, with hysteresis."""
