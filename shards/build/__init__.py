"""Building shards: a dataset layout (or generated classes) in, grouped tar shards and their manifest out.

``layouts`` reads the official dataset indexes, ``table`` a CSV or Parquet list of one's own images,
``synthetic`` generates learnable classes, ``ingest`` checks
and re-encodes each image, ``writer`` packs a split into tar shards with each class's images contiguous,
``publish`` puts them in a folder or at a URL (manifest last), and ``builder`` runs it all in parallel,
resumably.
"""
