"""Where shards live and how their bytes are fetched: a local path or an fsspec URL.

``location`` names the place (path or URL, storage options, the time limit of every remote call),
``retries`` the counted retries of transient failures, ``remote_reads`` coalesced, read-ahead ranged GETs,
and ``shard_cache`` local copies of whole remote shards, kept only when their SHA-256 matches the manifest.
"""
