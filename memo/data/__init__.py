"""Training data: the micro-batches a step trains on (``batches``: synthetic tokens, a text file's
bytes, or Megatron's indexed data), and data in Megatron's format, documents tokenized once into
an indexed ``.bin``/``.idx`` pair (``prepare``) that megatron-core's dataset builders read
(``corpus``)."""
