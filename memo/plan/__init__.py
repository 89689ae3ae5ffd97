"""MEMO's memory plan before training: the bi-level plan of one iteration (``bilevel``), solved
with :mod:`memo.dsa`. (α, the fraction of tokens swapped, is :mod:`memo.swap.alpha`.)"""
