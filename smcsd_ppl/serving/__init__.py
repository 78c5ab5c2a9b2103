"""Serving SMC-SD over HTTP: the OpenAI-compatible app (``app``) over a running engine."""
