"""Expert parallelism over torch.distributed.

``group``: process group start, timeouts and the start-time consistency check; ``exchange``:
the MoE blocks' row exchange (all-to-all, or all-gather); ``control``: rank 0's per-forward
broadcast (control word, then the forward's inputs and cache layout) and the other ranks'
receiving side; ``leader``: rank 0's forward wrapper with per-rank timings; ``worker``: the
loop of a rank > 0; ``launch``: ``--ep N`` by spawning ranks or from a ``torchrun`` environment.
"""
