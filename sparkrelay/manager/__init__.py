"""The engine's owner: the loop that steps it (loop.py), the scheduler process it runs in
(process.py), the client the HTTP server talks to it through (client.py) and their typed messages
(messages.py). server/ keeps HTTP."""
