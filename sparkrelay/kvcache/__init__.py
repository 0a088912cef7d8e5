"""Paged KV pools (torch tensors); block accounting lives in scheduler/block_manager.py."""
