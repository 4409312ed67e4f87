"""`specgen serve`: the protocol (protocol.py), the client side of `run` (client.py), the server
(server.py)."""
