"""WebDataset shards for dmltrain: build them from dataset layouts, stream class-balanced batches from them.

``layouts`` (official dataset indexes) and ``synthetic`` (generated classes) feed ``build``
(parallel checks, ``writer``: grouped tar shards, ``manifest``); ``sampler`` plans each
epoch's batches from the manifest alone, ``stream`` reads and decodes them (``transforms``)
on every rank; ``cli`` and ``bench`` are the ``dmltrain shards`` and ``dmltrain bench input``
commands. Importing this package imports nothing heavy.
"""
