"""The applications over the engine: chat, batch generation, cluster, server, bench and info."""
