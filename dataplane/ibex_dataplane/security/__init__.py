"""Credentials: API key format and hashing, the internal principal."""
