"""Drafters behind one batch-first protocol (base.py): chains from a draft model (model.py),
trees (tree.py: RSD-C, RSD-S, multi-draft), prompt lookup (lookup.py) and lookup-chain (lookup_chain.py)."""
