"""``python -m memo.options``: every configuration key with its type, default and description
(:mod:`memo.config.options`)."""

from memo.config.options import main

if __name__ == "__main__":
    main()
