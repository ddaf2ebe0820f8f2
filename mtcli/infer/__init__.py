"""Using a trained model: load a run directory, search, translate, quantize, export.

``loading`` (a run directory -> model + tokenizer + config; ``averaging`` of checkpoints) ->
``ensemble`` (decode-time ensembles) -> ``search`` (greedy and beam search) -> ``translate``
(streamed, batched translation of lines and files). ``quantize`` makes an int8 copy for CPU
decoding; ``export`` writes a CTranslate2 model. Nothing here imports :mod:`mtcli.train`.
"""
