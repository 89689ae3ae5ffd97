"""MEMO's activation runtime: what a layer keeps for its backward pass, where, and how it comes back."""
