"""Chat sessions: the conversation and its caches (session.py), save files (saves.py)."""
