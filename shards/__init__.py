"""WebDataset shards for dmltrain: build them from dataset layouts, stream class-balanced batches from them.

``layouts`` (official dataset indexes) and ``synthetic`` (generated classes) feed ``build``
(parallel checks, ``writer``: grouped tar shards, ``manifest``). Reading them back:
``sampler`` plans each epoch's batches from the manifest alone (and checks the P×K batch
shape), ``tar_index`` reads a class group's samples by byte range, ``batch_decoding`` turns a
planned batch into an array (``augment`` draws each image's augmentation record,
``transforms`` applies it), and ``stream`` is the API every rank uses (``TrainStream``,
``eval_batches``). ``cli`` and ``bench`` are the ``dmltrain shards`` and ``dmltrain bench
input`` commands. Importing this package imports nothing heavy.
"""
