"""Serving SMC-SD: requests that join and leave a running batch (``scheduler``), their tickets."""
