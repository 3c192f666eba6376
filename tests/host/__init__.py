"""Helpers for testing the node pack against a stub host (CI) and a real ComfyUI host (opt-in)."""
