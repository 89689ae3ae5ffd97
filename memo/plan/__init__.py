"""MEMO's memory plan: the bi-level plan of one iteration (``bilevel``), solved with
:mod:`memo.dsa`, and its run-time half: one step recorded and the later ones served from the plan
(``runtime``), on the CPU by replaying the requests through the plan (``server``), on a GPU from
one arena (``cuda_arena`` and its native allocator, ``plan_allocator.c``)."""
