"""`specgen serve`: the protocol (protocol.py) and the server (server.py); the client side of
`run` and `chat` is the CLI's (cli/remote.py)."""
