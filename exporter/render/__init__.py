"""Rendering: HTML, SVG and text from typed view values (pure)."""
