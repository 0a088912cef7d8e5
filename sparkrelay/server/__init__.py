"""HTTP serving layer: protocol models, the async bridge to the engine thread, metrics and the
FastAPI app.

Imports flow one way: server/ may import engine/ and config.py; nothing below imports server/.
"""
