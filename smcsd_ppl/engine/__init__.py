"""The engine: requests as objects, the schedule as a value, one core per pair, every SMC-SD call through it.

``pair``: the pair core (models, the one row store, text, checks); ``request``: what a
request is; ``scheduling``: what runs next; ``core``: one step of a pair's batch; ``worker``:
the process's torch thread; ``client``: the engine in this process (``Engine.run``: the one way
SMC-SD runs); ``process``: the engine in a process of its own.
"""
