"""The jobs ``run.py`` runs, one per ``mode``, each inside :mod:`memo.modes.frame`: ``train``
(:mod:`memo.modes.train`), ``profile`` and ``plan`` (:mod:`memo.modes.profile`), ``fit``
(:mod:`memo.modes.fit`)."""
