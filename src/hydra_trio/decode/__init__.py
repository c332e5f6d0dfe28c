"""Decode requests: lifecycle (manager.py) and the bounded result store (store.py)."""
