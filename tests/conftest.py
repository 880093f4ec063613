"""Test setup: every test process sees 8 fake CPU devices (for the sharding tests).

The flag must be set before jax initialises its backends, hence at import time here.
"""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
