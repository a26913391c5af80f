"""Pure types and layout math: boxes, dtypes, layouts, topologies, placement. No I/O, no protobuf."""
