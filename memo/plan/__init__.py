"""MEMO's decisions before training: α, the fraction of tokens swapped (``alpha``), and the
bi-level memory plan of one iteration (``bilevel``), solved with :mod:`memo.dsa`."""
