"""The OpenAI-compatible HTTP API served beside the tick loop (see ``server.py``)."""
