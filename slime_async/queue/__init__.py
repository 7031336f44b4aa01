"""The streaming trajectory buffer: wire schema, buffer process, producer and consumer clients."""
