"""Model operations: the registry, serving from it, data contracts, the container image, capacity.

``registry`` (versions, aliases, promotion gate), ``ledger`` (the hash-chained history beside the
store), ``behaviour`` (the fixed evaluation suite), ``prompts`` (templates by content hash),
``tags`` (the registry's tag names).
"""
