"""The model catalog: which model names the pools' servers serve, learnt from the servers.

``catalog.py`` holds the pure part (a pool's published list, and the questions serve, the
gateway and the workers ask of them); ``store.py`` keeps the lists in the compacted topic
``<prefix>.models``, written by the workers and followed by serve and the gateway.
"""
