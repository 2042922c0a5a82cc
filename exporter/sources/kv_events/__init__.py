"""The KV-event collector: publisher discovery, ZMQ receiver, source."""
