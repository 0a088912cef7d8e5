"""Paged KV pools (torch tensors); block accounting lives in engine/block_manager.py."""
