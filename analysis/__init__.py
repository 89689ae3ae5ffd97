"""Turning result rows into tables and figures.

* :mod:`analysis.rows`: load ``result.json`` and ``metrics.jsonl`` rows, derived columns, repeats;
* :mod:`analysis.tables`: the paper's tables, as numbers or for display;
* :mod:`analysis.figures`: matplotlib figures of the same;
* :mod:`analysis.report`: ``python -m analysis.report DIR``, all of it written as files.
"""
