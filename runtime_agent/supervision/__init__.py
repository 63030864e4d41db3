"""Supervision: one owner task per engine, the pool of owners, re-adoption, restart policy."""
