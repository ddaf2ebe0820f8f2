"""From raw parallel text to the memory-mapped cache, and from the cache to batches.

``textio`` (the one strict UTF-8 line reader) -> ``sources`` (text dirs, parquet, datasets, hub)
-> ``cleaning`` -> ``tokenizer`` (the joint SentencePiece model and the special ids) -> ``cache``
(the prepared corpus) -> ``prepare`` (the whole step); ``batching`` and ``sampling`` feed training.
"""
