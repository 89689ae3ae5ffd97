"""Dynamic storage allocation, apart from MEMO: buffers with lifetimes and sizes (``buffers``),
planners that give them offsets (``greedy``, exact ``search``, ``mip``, and ``solve`` choosing
among them), and a simulator of PyTorch's caching allocator on the same requests
(``caching_allocator``), the baseline a plan replaces."""
