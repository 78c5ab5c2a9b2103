"""The engine: requests as objects, the schedule as a value, one core stepped by one driver.

``pair``: the pair core (models, the one row store, text, checks); ``request``: what a request
is; ``scheduling``: what runs next; ``core``: one step of a pair's batch; ``worker``: the
process's torch thread; ``client``: the engine in this process; ``run``: a caller-driven run.
"""
