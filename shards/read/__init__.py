"""Reading shards back as batches: the sampler's plan, byte-range reads of class groups, the loader's datasets.

``sampler`` plans each epoch's global P×K batches from the manifest alone, ``tar_index`` reads a class
group's samples by byte range, ``datasets`` builds a planned batch in the loader processes (decoding with
:mod:`shards.decode`), and ``stream`` is the API every rank uses (``TrainStream``, ``eval_batches``).
"""
