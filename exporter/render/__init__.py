"""Rendering: every metric family, the exposition, the JSON documents, the status page."""
