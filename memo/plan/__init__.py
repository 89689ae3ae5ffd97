"""Planning: decisions taken before training from profiled sizes and times."""
