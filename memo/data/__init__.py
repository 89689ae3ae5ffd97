"""Training data in Megatron's format: documents tokenized once into an indexed ``.bin``/``.idx``
pair (:mod:`memo.data.prepare`), which megatron-core's dataset builders read."""
