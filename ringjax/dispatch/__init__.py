"""Which implementation and config a call gets: the registry, the calling modes, config
selection (autotuning) and the persistent config cache."""
