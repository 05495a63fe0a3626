"""Training ``tiny-chat`` on CPU: the synthetic chat corpus, the autograd forward, the loop (``python -m engine.train``)."""
