"""Serving SMC-SD: requests that join and leave a running batch (``scheduler``), and an HTTP app.

``scheduler`` and ``ticket``: requests and their tickets; ``app``: the OpenAI-compatible server.
"""
