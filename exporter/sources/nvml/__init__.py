"""The NVML collector: library wrapper, poller thread, source."""
