"""The runtime wing: processes, ranks and what crosses between them (below model/, above packing/)."""
