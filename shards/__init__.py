"""WebDataset shards for dmltrain: build them from dataset layouts, stream class-balanced batches from them.

One subpackage per layer, each importing only those below it: ``storage`` (where shards live: a path or a
URL, ranged reads, the shard cache), ``build`` (layouts and generated classes into tar shards), ``read``
(the sampler's plan, byte-range reads, the loader's datasets, ``TrainStream``) and ``decode`` (augmentation
records, CPU and device decoding). ``manifest`` is the format both ends agree on, ``config`` the ``data``
section of a run config (shards owns it; :mod:`dmltrain.config` builds on it), and ``cli`` and ``bench`` are
the ``dmltrain shards`` and ``dmltrain bench input`` commands. Importing this package imports nothing heavy.
"""
