"""Planning as plain data: which source boxes each target rank needs. Pure: no I/O, no protobuf."""
